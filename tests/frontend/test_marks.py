"""cgbackend.mark_dynamic: on a module class, on one module instance, on a custom op (by object,
by packet, by "ns::name"); the marked code runs eagerly with a USER_MARKED reason."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend import Config, Rule
from cgbackend.passes.pipeline import analyze
from cgbackend.common.fx_utils import compute_nodes, module_path, op_name
from cgbackend.frontend.marks import marked_module_reason, marked_op_reason, unmark_op
from fx_helpers import trace


def run(fn, *args, config=None):
    return analyze(trace(fn, *args), config or Config(min_region_ops=1))


def kinds(analysis) -> list[str]:
    return [r.kind for r in analysis.partition.regions]


def dynamic_paths(analysis) -> set[str]:
    return {module_path(n) for n, v in analysis.classification.verdicts.items() if not v.static}


# Module-level classes, so that models made of them can be pickled.

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


class Net(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum(-1)


@torch.library.custom_op("cgtest_marks::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@scale.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def unmark():
    """Op marks are process-wide: forget every mark a test makes."""
    yield
    for name in ("cgtest_marks::scale", "Tensor.sin"):
        unmark_op(name)
    assert marked_op_reason("cgtest_marks::scale") is None and marked_op_reason("Tensor.sin") is None


# ----------------------------------------------------------------------------- module classes

def test_mark_class_makes_every_instance_dynamic():
    @cgbackend.mark_dynamic
    class Marked(Block):
        pass

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = nn.Linear(4, 4)
            self.a = Marked()
            self.b = Marked()
            self.post = nn.Linear(4, 4)

        def forward(self, x):
            return self.post(self.b(self.a(self.pre(x).tanh())))

    analysis = run(Model(), torch.randn(2, 4))
    assert kinds(analysis) == ["static", "dynamic", "static"]
    assert dynamic_paths(analysis) == {"a", "a.lin", "b", "b.lin"}
    for node, verdict in analysis.classification.verdicts.items():
        if not verdict.static:
            assert verdict.reason.rule == Rule.USER_MARKED
            assert "marked dynamic by the user" in verdict.reason.detail
            assert "Marked" in verdict.reason.detail
            assert verdict.reason.module_path == module_path(node)


def test_mark_class_with_reason_decorator_factory():
    @cgbackend.mark_dynamic(reason="talks to the host")
    class Chatty(Block):
        pass

    assert marked_module_reason(Chatty) == "talks to the host"
    assert marked_module_reason(Block) is None  # the base class is untouched
    analysis = run(nn.Sequential(nn.Linear(4, 4), Chatty(), nn.Linear(4, 4)), torch.randn(2, 4))
    reasons = [v.reason for v in analysis.classification.verdicts.values() if not v.static]
    assert reasons and all(r.rule == Rule.USER_MARKED and "talks to the host" in r.detail for r in reasons)
    assert {r.module_path for r in reasons} == {"1", "1.lin"}


def test_mark_class_returns_the_class():
    class Plain(Block):
        pass

    assert cgbackend.mark_dynamic(Plain) is Plain


# ----------------------------------------------------------------------------- module instances

def test_mark_instance_marks_only_that_instance():
    net = Net()
    returned = cgbackend.mark_dynamic(net.blocks[1], reason="instance one")
    assert returned is net.blocks[1]
    analysis = run(net, torch.randn(2, 4))
    assert kinds(analysis) == ["static", "dynamic", "static"]
    assert dynamic_paths(analysis) == {"blocks.1", "blocks.1.lin"}
    for verdict in analysis.classification.verdicts.values():
        if not verdict.static:
            assert verdict.reason.rule == Rule.USER_MARKED and "instance one" in verdict.reason.detail
    # Another model made of the same class is not affected.
    torch._dynamo.reset()
    other = run(Net(), torch.randn(2, 4))
    assert kinds(other) == ["static"]


def test_marked_instance_keeps_its_identity():
    net = Net()
    block = net.blocks[2]
    state = {k: v.clone() for k, v in block.state_dict().items()}
    cgbackend.mark_dynamic(block)
    assert isinstance(block, Block)
    assert type(block).__name__ == "Block" and type(block).__qualname__ == "Block"
    assert marked_module_reason(type(block)) is not None
    assert marked_module_reason(Block) is None
    assert marked_module_reason(type(net.blocks[0])) is None
    assert all(torch.equal(v, state[k]) for k, v in block.state_dict().items())


def test_model_with_marked_instance_can_be_deep_copied_and_saved():
    net = Net()
    cgbackend.mark_dynamic(net.blocks[1])
    clone = copy.deepcopy(net)
    assert marked_module_reason(type(clone.blocks[1])) is not None
    buffer = io.BytesIO()
    torch.save(net, buffer)  # whole-model checkpoints must keep working after a mark
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(2, 4)
    assert torch.equal(loaded(x), net(x))


def test_unmarked_model_can_be_saved():
    buffer = io.BytesIO()
    torch.save(Net(), buffer)  # control for the test above
    assert buffer.tell() > 0


def test_marked_instance_runs_like_eager():
    net = Net().eval()
    cgbackend.mark_dynamic(net.blocks[0])
    compiled = cgbackend.compile(net)
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(compiled(x), net(x))
    stats = cgbackend.stats(compiled)
    assert stats["dynamic_regions"] == 1 and stats["static_regions"] == 1


# ----------------------------------------------------------------------------- operators

@pytest.mark.parametrize("target", [
    pytest.param(lambda: scale, id="custom_op_object"),
    pytest.param(lambda: torch.ops.cgtest_marks.scale, id="op_packet"),
    pytest.param(lambda: torch.ops.cgtest_marks.scale.default, id="op_overload"),
    pytest.param(lambda: "cgtest_marks::scale", id="name_string"),
])
def test_mark_custom_op(unmark, target):
    fn = lambda x: scale(x.sin()).cos()  # noqa: E731
    assert kinds(run(fn, torch.randn(3))) == ["static"]
    torch._dynamo.reset()
    obj = target()
    assert cgbackend.mark_dynamic(obj, reason="calls a host library") is obj
    analysis = run(fn, torch.randn(3))
    assert kinds(analysis) == ["static", "dynamic", "static"]
    (node,) = [n for n in compute_nodes(analysis.gm) if not analysis.classification.verdicts[n].static]
    reason = analysis.classification.verdicts[node].reason
    assert (reason.rule, reason.op) == (Rule.USER_MARKED, "cgtest_marks.scale")
    assert "calls a host library" in reason.detail
    assert reason.source.startswith("test_marks.py:")


def test_unmark_op_restores_static(unmark):
    cgbackend.mark_dynamic("cgtest_marks::scale")
    unmark_op(scale)
    assert kinds(run(lambda x: scale(x.sin()).cos(), torch.randn(3))) == ["static"]


def test_mark_by_dynamic_ops_style_name(unmark):
    """A string mark takes the names the option dynamic_ops takes ("Tensor.sin", "torch.cos")."""
    cgbackend.mark_dynamic("Tensor.sin")
    analysis = run(lambda x: x.sin().cos() * 2, torch.randn(3))
    dynamic = {op_name(n): v.reason.rule for n, v in analysis.classification.verdicts.items() if not v.static}
    assert dynamic == {"Tensor.sin": Rule.USER_MARKED}
    assert kinds(analysis) == ["dynamic", "static"]


def test_marked_op_runs_like_eager(unmark):
    cgbackend.mark_dynamic(scale)
    fn = lambda x: scale(x.sin()).cos() + 1  # noqa: E731
    compiled = cgbackend.compile(fn, min_region_ops=1)
    for seed in range(2):
        x = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(compiled(x), fn(x))
    assert cgbackend.stats(compiled)["dynamic_regions"] == 1


@pytest.mark.parametrize("bad", [42, 1.5, None.__class__, object()])
def test_mark_rejects_other_things(bad):
    with pytest.raises(TypeError):
        cgbackend.mark_dynamic(bad)
