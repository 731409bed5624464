"""Opaque module calls (cgbackend/integrations/opaque.py) on CPU, with a stand-in for Transformer Engine.

``ToyTE`` behaves like a TE module as Dynamo sees it: its forward is ``torch.compiler.disable``d
(a graph break under plain torch.compile), it runs its own autograd.Function, and it updates hidden
state in place (a running amax, like TE's FP8 amax history) that is no input of any graph. The
``ToyFamily`` registers it the way cgbackend/integrations/te.py registers TE's modules, with hooks that record
what the runner asks of them. The real thing is in test_cuda_te.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.integrations import opaque

SIM = dict(simulate_graphs=True, warmup=1)
MODE = {"scale": 1.0}
"""Global state the toy modules read (like TE's FP8 autocast state): part of the graph key."""


class _ToyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, amax):
        if x.numel():
            with torch.no_grad():
                amax.copy_(torch.maximum(amax, x.detach().abs().amax()))
        ctx.save_for_backward(x, weight)
        return torch.tanh(x @ weight.t()) * MODE["scale"]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        y = torch.tanh(x @ weight.t())
        g = grad * MODE["scale"] * (1 - y * y)
        return g @ weight, g.t() @ x, None


class ToyTE(nn.Module):
    def __init__(self, n_in: int, n_out: int, extra_output: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.out_features = n_out
        self.extra_output = extra_output
        self.amax = torch.zeros(())  # hidden state, not a buffer: invisible to Dynamo

    @torch.compiler.disable
    def forward(self, x, is_first_microbatch=None):
        return _ToyFn.apply(x, self.weight, self.amax)


class ToyHooks(opaque.RegionHooks):
    log: list = []

    def __init__(self, modules):
        self.modules = modules

    def key(self):
        return (MODE["scale"],)

    @contextlib.contextmanager
    def capturing(self):
        ToyHooks.log.append("capture")
        yield

    def before_forward(self):
        ToyHooks.log.append("forward")
        return len(ToyHooks.log)

    def after_backward(self, token):
        ToyHooks.log.append(("backward", token))


class ToyFamily(opaque.Family):
    name = "toy"

    def kind(self, module):
        return "toy.ToyTE" if isinstance(module, ToyTE) else None

    def unsupported(self, module):
        return "extra_output=True: several outputs" if module.extra_output else None

    def fake(self, module, args, kwargs):
        x = args[0]
        out = x.new_empty((*x.shape[:-1], module.out_features))
        return opaque.fake_requires_grad(out, args, list(module.parameters()))

    def kernels(self, module):
        return 6

    def role(self, module):
        return "mlp"

    def hooks(self, modules):
        return ToyHooks(modules)


@pytest.fixture(autouse=True)
def toy_family():
    family = ToyFamily()
    opaque.register_family(family)
    ToyHooks.log.clear()
    MODE["scale"] = 1.0
    yield family
    opaque.unregister_family(family)


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = ToyTE(d, 2 * d)
        self.down = ToyTE(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))) * 0.5)


class Net(nn.Module):
    def __init__(self, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.skipped = ToyTE(d, d, extra_output=True)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class ToyMoE(nn.Module):
    """Dropless MoE whose experts are toy TE modules: expert calls get data-dependent row counts."""

    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(ToyTE(d, d) for _ in range(experts))
        self.proj = ToyTE(d, d)

    def forward(self, x):
        h = self.norm(x)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, idx, expert(h[idx]))
        return x + self.proj(out)


def _inputs(n, shape=(8, 16), seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_(requires_grad) for _ in range(n)]


def test_dynamo_breaks_at_toy_modules_without_install():
    model = Net()
    report = cgbackend.explain(model, _inputs(1)[0], options={"opaque_modules": False})
    assert report.summary["graph_breaks"] >= 1
    assert report.opaque_modules == {}


def test_install_makes_each_module_one_node_and_report_lists_them():
    model = Net()
    report = cgbackend.explain(model, _inputs(1)[0])
    assert report.summary["graph_breaks"] == 0 and report.summary["graphs"] == 1
    wrapped = {w["module"] for w in report.opaque_modules["wrapped"]}
    assert wrapped == {"blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"}
    assert report.opaque_modules["skipped"] == [
        {"module": "skipped", "kind": "toy.ToyTE", "reason": "extra_output=True: several outputs"}]
    calls = [c for r in report.regions() for c in r.opaque]
    assert len(calls) == 4 and all(c["graphed"] for c in calls)
    assert report.summary["opaque_calls_graphed"] == 4 and report.summary["opaque_calls_eager"] == 0
    static = [r for r in report.regions() if r.kind == "static"]
    assert len(static) == 1 and static[0].est_kernels >= 4 * 6
    text = report.to_text()
    assert "opaque call blocks.0.up (toy.ToyTE): inside this region's CUDA graphs" in text
    assert "left to Dynamo (graph break, runs eagerly): skipped (toy.ToyTE): extra_output=True" in text
    # Eager calls of the model itself are unchanged by the wrapping, and it can be undone.
    x = _inputs(1)[0]
    ref = copy.deepcopy(model)
    opaque.uninstall(ref)
    assert torch.equal(model(x), ref(x))
    assert opaque.uninstall(model) == 4
    assert "forward" not in model.blocks[0].up.__dict__


def test_inference_replays_match_eager_and_hidden_state_advances():
    model = Net().eval()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for i, x in enumerate(_inputs(6, seed=1)):
            x = x * (1 + i)  # growing inputs: the hidden amax must follow
            assert torch.equal(compiled(x), ref(x))
    for m, r in zip(model.blocks.modules(), ref.blocks.modules()):
        if isinstance(m, ToyTE):
            assert torch.equal(m.amax, r.amax) and m.amax > 0
    st = cgbackend.stats(compiled)
    assert st["static_regions"] == 1 and st["graphs_captured"] == 1
    assert st["replays"] == 5 and st["eager_calls"] == {"warmup": 1}
    assert ToyHooks.log.count("capture") == 1 and ToyHooks.log.count("forward") == 5


def test_training_grads_match_eager_and_hooks_pair_forward_with_backward():
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    opaque.uninstall(ref)
    compiled = cgbackend.compile(model, **SIM)
    xs = _inputs(5, seed=2)
    for x in xs:
        out = compiled(x)
        out.pow(2).mean().backward()
        expected = ref(x)
        expected.pow(2).mean().backward()
        assert torch.allclose(out, expected, atol=1e-6)
    for (name, p), (_, q) in zip(model.blocks.named_parameters(), ref.blocks.named_parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    st = cgbackend.stats(compiled)
    assert st["fwd_graphs"] == 1 and st["bwd_graphs"] == 1
    # The capturing call replays too (a capture computes nothing), its backward likewise.
    assert st["fwd_replays"] == 4 and st["bwd_replays"] == 4
    forwards = [i + 1 for i, e in enumerate(ToyHooks.log) if e == "forward"]
    backwards = [e[1] for e in ToyHooks.log if isinstance(e, tuple)]
    assert len(forwards) == 4 and backwards == forwards  # each backward gets its own forward's token


def test_toy_params_only_inputs_still_train():
    """The first region's only trainable tensors are the toy module's hidden parameters (passed
    to the opaque call as ``_cg_params``): it must still take the training path."""
    model = nn.Sequential(ToyTE(16, 16))
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    for x in _inputs(4, seed=3):
        compiled(x).sum().backward()
        ref(x).sum().backward()
    assert torch.allclose(model[0].weight.grad, ref[0].weight.grad, atol=1e-5)
    assert cgbackend.stats(compiled)["bwd_graphs"] == 1


def test_state_outside_the_graph_is_part_of_the_key():
    model = Net().eval()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for scale in (1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 1.0):
            MODE["scale"] = scale
            x = _inputs(1, seed=int(scale * 10))[0]
            assert torch.equal(compiled(x), ref(x))
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == 2  # one per scale; back to 1.0 replays the first graph
    assert st["eager_calls"] == {"warmup": 2}


def test_moe_expert_calls_stay_eager_with_reason_and_match():
    torch.manual_seed(0)
    model = ToyMoE()
    ref = copy.deepcopy(model)
    opaque.uninstall(ref)
    x0 = _inputs(1, seed=4)[0]
    report = cgbackend.explain(model, x0)
    experts = [c for r in report.regions() for c in r.opaque if c["module"].startswith("experts")]
    assert len(experts) == 4 and not any(c["graphed"] for c in experts)
    assert all("data-dependent size" in (c["why"] or "") for c in experts)
    proj = [c for r in report.regions() for c in r.opaque if c["module"] == "proj"]
    assert proj and proj[0]["graphed"]
    compiled = cgbackend.compile(model, **SIM)
    for x in _inputs(5, seed=5):
        out = compiled(x)
        out.pow(2).sum().backward()
        expected = ref(x)
        expected.pow(2).sum().backward()
        assert torch.allclose(out, expected, atol=1e-5)
    checked = 0
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), name  # the router learns nothing via argmax
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, atol=1e-4), name
            checked += 1
    assert checked == 7  # norm (2), experts (4), proj
    assert cgbackend.stats(compiled)["replays"] > 0


def test_source_line_of_an_opaque_call_is_the_users():
    model = ToyMoE()
    report = cgbackend.explain(model, _inputs(1)[0])
    sources = [x["source"] for r in report.regions() for x in r.reasons if "expert" in x.get("module_path", "")]
    assert sources and all("test_opaque.py" in s for s in sources)
