"""passes.classify: each rule with a case that fires it and a close case that must not.

Each case is a tiny function traced by Dynamo (data-dependent ops kept in the graph); the
expected verdicts are given as data: (op name of the node, static?, rule).
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cgbackend import Config, ConfigError, Rule
from cgbackend.passes.pipeline import analyze
from cgbackend.common.fx_utils import compute_nodes, module_path, op_name
from cgbackend.passes import classify
from fx_helpers import trace

FILE = "test_classify.py"


def verdicts_by_op(gm, config=None, **kwargs):
    result = classify(gm, config or Config(), **kwargs)
    out: dict[str, list] = {}
    for node in compute_nodes(gm):
        out.setdefault(op_name(node), []).append(result.verdicts[node])
    return result, out


def the(verdicts, op):
    assert op in verdicts, f"no {op} node; ops: {sorted(verdicts)}"
    return verdicts[op]


def x84():
    return (torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),)


# ----------------------------------------------------------------------------- data-dependent shapes

# (id, fn, inputs, op of the producer)
PRODUCERS = [
    ("nonzero", lambda x: torch.nonzero(x > 0).float() * 2, x84, "nonzero"),
    ("argwhere", lambda x: torch.argwhere(x > 0).float() * 2, x84, "argwhere"),
    ("where_cond", lambda x: torch.where(x > 0)[0].float() * 2, x84, "where"),
    ("bool_mask_index", lambda x: x[x > 0] * 2, x84, "operator.getitem"),
    ("masked_select", lambda x: torch.masked_select(x, x > 0) * 2, x84, "masked_select"),
    ("unique", lambda x: torch.unique(x.round()) * 2, x84, "unique"),
    ("repeat_interleave_tensor_counts",
     lambda x, r: torch.repeat_interleave(x, r, dim=0) * 2,
     lambda: (torch.randn(8, 4), torch.tensor([1, 2, 0, 1, 1, 2, 0, 1])), "repeat_interleave"),
]


@pytest.mark.parametrize("fn, make_inputs, producer", [p[1:] for p in PRODUCERS], ids=[p[0] for p in PRODUCERS])
def test_data_dependent_shape_producer_and_consumer(fn, make_inputs, producer):
    gm = trace(fn, *make_inputs())
    _, v = verdicts_by_op(gm)
    (prod,) = the(v, producer)
    assert not prod.static
    assert prod.reason.rule == Rule.DATA_DEPENDENT_SHAPE
    assert prod.reason.op == producer
    assert prod.reason.source.startswith(FILE + ":")
    assert prod.reason.rule.is_root_cause
    (consumer,) = the(v, "operator.mul")
    assert not consumer.static
    assert consumer.reason.rule == Rule.DEPENDS_ON_DYNAMIC_SHAPE
    assert not consumer.reason.rule.is_root_cause


# Close cases that must stay static: same ops with a fixed output size.
STATIC_LOOKALIKES = [
    ("where_three_args", lambda x: torch.where(x > 0, x, -x) * 2, x84),
    ("long_index_gather", lambda x: x[torch.tensor([0, 2, 5])] * 2, x84),
    ("slice_index", lambda x: x[:, 1:3] * 2, x84),
    ("masked_fill", lambda x: x.masked_fill(x > 0, 0.0) * 2, x84),
    ("repeat_interleave_output_size",
     lambda x, r: torch.repeat_interleave(x, r, dim=0, output_size=9) * 2,
     lambda: (torch.randn(8, 4), torch.tensor([1, 2, 0, 1, 1, 2, 0, 2]))),
    ("repeat_interleave_int", lambda x: torch.repeat_interleave(x, 2, dim=0) * 2, x84),
    ("one_hot_fixed_classes", lambda i: F.one_hot(i, num_classes=4).sum(0) * 2,
     lambda: (torch.tensor([0, 3, 1, 1]),)),
]


@pytest.mark.parametrize("fn, make_inputs", [c[1:] for c in STATIC_LOOKALIKES], ids=[c[0] for c in STATIC_LOOKALIKES])
def test_fixed_size_lookalikes_are_static(fn, make_inputs):
    gm = trace(fn, *make_inputs())
    result, _ = verdicts_by_op(gm)
    dynamic = {op_name(n): v.reason.rule for n, v in result.verdicts.items() if not v.static}
    assert dynamic == {}


def test_shape_that_no_longer_depends_on_data_is_static_again():
    def fn(x):
        n = torch.nonzero(x > 0).float().sum()  # a scalar: its size is fixed
        return n + 1, x.cos()

    _, v = verdicts_by_op(trace(fn, *x84()))
    assert the(v, "nonzero")[0].reason.rule == Rule.DATA_DEPENDENT_SHAPE
    assert the(v, "Tensor.sum")[0].reason.rule == Rule.DEPENDS_ON_DYNAMIC_SHAPE
    assert the(v, "operator.add")[0].static
    assert the(v, "Tensor.cos")[0].static


def test_tensor_sized_from_data_dependent_length_is_dynamic():
    def fn(x):
        n = torch.nonzero(x > 0).shape[0]
        return torch.zeros(n, 2) + 1

    _, v = verdicts_by_op(trace(fn, *x84()))
    assert not the(v, "zeros")[0].static
    assert the(v, "zeros")[0].reason.rule == Rule.DEPENDS_ON_DYNAMIC_SHAPE


# ----------------------------------------------------------------------------- host syncs

def test_item_is_a_host_sync_and_its_users_follow():
    def fn(x):
        return x * x.sum().item()

    _, v = verdicts_by_op(trace(fn, *x84()))
    (item,) = the(v, "Tensor.item")
    assert not item.static
    assert item.reason.rule == Rule.HOST_SYNC
    assert item.reason.op == "Tensor.item"
    assert item.reason.source.startswith(FILE + ":")
    assert the(v, "Tensor.sum")[0].static
    (mul,) = the(v, "operator.mul")
    assert not mul.static
    assert not mul.reason.rule.is_root_cause


def test_without_item_the_same_computation_is_static():
    def fn(x):
        return x * x.sum()

    result, _ = verdicts_by_op(trace(fn, *x84()))
    assert all(v.static for v in result.verdicts.values())


def test_tolist_is_a_host_sync():
    def fn(x):
        counts = (x > 0).long().sum(0).tolist()
        return x + sum(counts)

    _, v = verdicts_by_op(trace(fn, *x84()))
    items = the(v, "Tensor.item")  # Dynamo spells tolist() as one item() per element
    assert len(items) == 4
    for item in items:
        assert not item.static
        assert item.reason.rule == Rule.HOST_SYNC
        assert item.reason.source.startswith(FILE + ":")
    assert the(v, "Tensor.sum")[0].static


def test_bincount_syncs_even_when_check_fixes_its_size():
    def fn(x):
        idx = (x.abs() * 3).long().flatten().clamp(max=3)
        counts = torch.bincount(idx, minlength=4)
        torch._check(counts.shape[0] == 4)
        return counts * 2

    _, v = verdicts_by_op(trace(fn, *x84()))
    (bc,) = the(v, "bincount")
    assert not bc.static
    assert bc.reason.rule == Rule.HOST_SYNC
    assert bc.reason.op == "bincount"
    # Its size is fixed by the check, so what follows is static (the last mul is `counts * 2`).
    assert [m.static for m in the(v, "operator.mul")] == [True, True]


def test_histogram_without_bincount_is_static():
    def fn(x):
        idx = (x.abs() * 3).long().flatten().clamp(max=3)
        return F.one_hot(idx, num_classes=4).sum(0) * 2

    result, _ = verdicts_by_op(trace(fn, *x84()))
    assert all(v.static for v in result.verdicts.values())


# ----------------------------------------------------------------------------- devices and host work

@pytest.mark.parametrize("to_host", [
    pytest.param(lambda h: h.cpu(), id="cpu()"),
    # A literal "cpu" names the host even on a CPU-only trace. (A torch.device("cpu") object does not:
    # Dynamo folds `x.to(w.device)` into the same constant, so that spelling is left out here.)
    pytest.param(lambda h: h.to("cpu"), id="to('cpu')"),
])
def test_move_to_host_is_a_device_move(to_host):
    """On a CPU-only trace (the ahead-of-time report) an explicit copy to the host is a device
    move, as it would be on a CUDA device."""
    def fn(x):
        h = x.sin()
        s = to_host(h)
        return s * 2, h.cos()

    _, v = verdicts_by_op(trace(fn, *x84()))
    (move,) = [vv for op, vs in v.items() for vv in vs if op in ("Tensor.cpu", "Tensor.to")]
    assert not move.static
    assert move.reason.rule == Rule.DEVICE_MOVE
    (mul,) = the(v, "operator.mul")
    assert not mul.static
    assert mul.reason.rule == Rule.CPU_TENSOR
    assert the(v, "Tensor.cos")[0].static
    assert the(v, "Tensor.sin")[0].static


@pytest.mark.parametrize("cast", [
    pytest.param(lambda s: s + 1, id="arith"),
    pytest.param(lambda s: s.double(), id="double()"),
    pytest.param(lambda s: s.to(torch.float64), id="to(float64)"),
    pytest.param(lambda s: s.to(dtype=torch.float64), id="to(dtype=float64)"),
])
def test_host_taint_follows_cpu_work(cast):
    """Everything computed from a .cpu() result is host work, also through a dtype cast."""
    def fn(x):
        s = x.sin().cpu()
        t = cast(s)
        return t.exp() * 2

    gm = trace(fn, *x84())
    _, v = verdicts_by_op(gm)
    for op in ("Tensor.exp", "operator.mul"):
        (verdict,) = the(v, op)
        assert not verdict.static, op
        assert verdict.reason.rule == Rule.CPU_TENSOR, op


def test_moving_host_work_back_to_the_compute_device_ends_the_taint():
    def fn(x):
        h = x.sin()
        s = h.cpu() * 2
        back = s.to(device=h.device, dtype=h.dtype)  # Dynamo folds h.device: .to(device=cpu, dtype=...)
        return (h + back).cos()

    _, v = verdicts_by_op(trace(fn, *x84()))
    (to,) = the(v, "Tensor.to")
    assert not to.static
    assert to.reason.rule == Rule.DEVICE_MOVE
    assert the(v, "operator.mul")[0].reason.rule == Rule.CPU_TENSOR
    assert the(v, "operator.add")[0].static
    assert the(v, "Tensor.cos")[0].static


def test_dtype_cast_and_no_op_move_on_device_are_static():
    def fn(x):
        return x.sin().to(torch.float64) * 2, x.float().cos(), x.contiguous().exp()

    result, _ = verdicts_by_op(trace(fn, *x84()))
    assert all(v.static for v in result.verdicts.values())


def test_compute_device_is_cpu_for_cpu_graph():
    result, _ = verdicts_by_op(trace(lambda x: x.sin(), *x84()))
    assert result.compute_device == "cpu"


# ----------------------------------------------------------------------------- cudagraph_unsafe tag

@torch.library.custom_op("cgtest_classify::unsafe_scale", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def unsafe_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@unsafe_scale.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("cgtest_classify::safe_scale", mutates_args=())
def safe_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@safe_scale.register_fake
def _(x):
    return torch.empty_like(x)


def test_cudagraph_unsafe_tag():
    _, v = verdicts_by_op(trace(lambda x: unsafe_scale(x.sin()).cos(), *x84()))
    (op,) = the(v, "cgtest_classify.unsafe_scale")
    assert not op.static
    assert op.reason.rule == Rule.UNSAFE_TAG
    assert op.reason.source.startswith(FILE + ":")
    assert the(v, "Tensor.sin")[0].static
    assert the(v, "Tensor.cos")[0].static  # the tag does not spread to users


def test_custom_op_without_tag_is_static():
    result, v = verdicts_by_op(trace(lambda x: safe_scale(x.sin()).cos(), *x84()))
    assert the(v, "cgtest_classify.safe_scale")[0].static
    assert all(x.static for x in result.verdicts.values())


# ----------------------------------------------------------------------------- options dynamic_ops / dynamic_modules

@pytest.mark.parametrize("fn, key, op", [
    pytest.param(lambda x: safe_scale(x.sin()).cos(), "cgtest_classify::safe_scale", "cgtest_classify.safe_scale",
                 id="custom_op"),
    pytest.param(lambda x: torch.sigmoid(x.sin()).cos(), "torch.sigmoid", "sigmoid", id="torch.sigmoid"),
    pytest.param(lambda x: x.sin().relu().cos(), "Tensor.relu", "Tensor.relu", id="Tensor.relu"),
    pytest.param(lambda x: F.relu(x.sin()).cos(), "torch.nn.functional.relu", "relu", id="F.relu"),
    # The public names of F.gelu / F.linear (implemented in torch._C._nn).
    pytest.param(lambda x: F.gelu(x.sin()).cos(), "torch.nn.functional.gelu", "gelu", id="F.gelu"),
    pytest.param(lambda x: F.linear(x.sin(), torch.ones(4, 4)).cos(), "torch.nn.functional.linear", "linear",
                 id="F.linear"),
])
def test_dynamic_ops_option(fn, key, op):
    gm = trace(fn, *x84())
    _, v = verdicts_by_op(gm, Config(dynamic_ops=(key,)))
    (marked,) = the(v, op)
    assert not marked.static
    assert marked.reason.rule == Rule.USER_MARKED
    assert marked.reason.op == op
    assert key in marked.reason.detail
    assert the(v, "Tensor.sin")[0].static and the(v, "Tensor.cos")[0].static
    # Without the option the same graph is fully static.
    result, _ = verdicts_by_op(gm, Config())
    assert all(x.static for x in result.verdicts.values())


def test_dynamic_ops_option_names_must_match_exactly():
    gm = trace(lambda x: torch.sigmoid(x).cos(), *x84())
    # Tensor.sigmoid exists but is not what the graph calls (torch.sigmoid).
    result, _ = verdicts_by_op(gm, Config(dynamic_ops=("Tensor.sigmoid",)))
    assert all(x.static for x in result.verdicts.values())
    # Names that resolve to no operator are rejected, not silently ignored.
    for typo in ("torch.sigmoi", "sigmoid"):
        with pytest.raises(ConfigError, match=typo):
            Config(dynamic_ops=(typo,))


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


class Stack(nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("patterns, expected", [
    (("layers.1*",), {(1, "linear"), (1, "Tensor.relu")}),
    (("layers.1.lin",), {(1, "linear")}),
    (("layers.*",), {(i, op) for i in range(3) for op in ("linear", "Tensor.relu")}),
    (("layers.[02]",), {(i, op) for i in (0, 2) for op in ("linear", "Tensor.relu")}),
    (("layers.2", "layers.0.lin"), {(0, "linear"), (2, "linear"), (2, "Tensor.relu")}),
    (("layer.1*",), set()),
    (("lin",), set()),  # patterns match whole module paths, not the last component
])
def test_dynamic_modules_option(patterns, expected):
    gm = trace(Stack(), torch.randn(2, 4))
    result = classify(gm, Config(dynamic_modules=patterns))
    dynamic = set()
    for node, verdict in result.verdicts.items():
        layer = int(module_path(node).split(".")[1])
        if not verdict.static:
            dynamic.add((layer, op_name(node)))
            assert verdict.reason.rule == Rule.USER_MARKED
            assert verdict.reason.module_path == module_path(node)
            assert any(repr(p) in verdict.reason.detail for p in patterns)
    assert dynamic == expected


def test_dynamic_modules_reason_points_at_module():
    gm = trace(Stack(), torch.randn(2, 4))
    result = classify(gm, Config(dynamic_modules=("layers.1*",)))
    reasons = {op_name(n): v.reason for n, v in result.verdicts.items() if not v.static}
    assert reasons["linear"].module_path == "layers.1.lin"
    assert reasons["Tensor.relu"].module_path == "layers.1"
    assert reasons["linear"].source.startswith(FILE + ":")


# ----------------------------------------------------------------------------- training: in-place on requires_grad

def _inplace_fn(x, w):
    h = w * 2
    h.add_(x)
    return h.sin()


def _inplace_input_fn(x, h):
    h.add_(x)  # h is a graph input (an activation from outside the compiled code)
    return h.sin()


def _activation(requires_grad=True):
    return torch.randn(8, 4, requires_grad=requires_grad) * 1  # non-leaf: in-place writes are legal


def test_inplace_on_a_graph_input_that_requires_grad_in_training():
    gm = trace(_inplace_input_fn, torch.randn(8, 4), _activation())
    result, v = verdicts_by_op(gm)
    assert result.training
    (add_,) = the(v, "Tensor.add_")
    assert not add_.static
    assert add_.reason.rule == Rule.INPLACE_ON_GRAD
    assert add_.reason.source.startswith(FILE + ":")
    assert the(v, "Tensor.sin")[0].static
    # The same graph for inference: the in-place write is fine.
    result, v = verdicts_by_op(gm, training=False)
    assert not result.training
    assert the(v, "Tensor.add_")[0].static


def test_inplace_on_an_intermediate_in_training_is_static():
    """ReLU(inplace=True) after a norm: the write happens inside one region's own autograd."""
    x, w = torch.randn(8, 4), torch.randn(8, 4, requires_grad=True)
    gm = trace(_inplace_fn, x, w)
    result, v = verdicts_by_op(gm)
    assert result.training
    assert all(verdict.static for verdicts in v.values() for verdict in verdicts)
    assert the(v, "Tensor.add_")[0].static


def test_inplace_traced_without_grad_is_static():
    x, w = torch.randn(8, 4), torch.randn(8, 4, requires_grad=True)
    with torch.no_grad():
        gm = trace(_inplace_fn, x, w)
        result, v = verdicts_by_op(gm)
    assert not result.training
    assert all(x.static for x in result.verdicts.values())


def test_inplace_forced_training():
    gm = trace(_inplace_input_fn, torch.randn(8, 4), _activation())
    _, v = verdicts_by_op(gm, training=True)
    assert the(v, "Tensor.add_")[0].reason.rule == Rule.INPLACE_ON_GRAD


def test_inplace_on_tensor_without_grad_in_training_is_static():
    def fn(x, w):
        z = x * 2  # does not require grad
        z.add_(1)
        return z * w

    gm = trace(fn, torch.randn(8, 4), torch.randn(8, 4, requires_grad=True))
    result, v = verdicts_by_op(gm)
    assert result.training
    assert the(v, "Tensor.add_")[0].static


# ----------------------------------------------------------------------------- plain ops are static

class PlainOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, idx):
        h = self.norm(self.lin(self.emb(idx)))
        p = torch.softmax(h, dim=-1)
        vals, ind = torch.topk(p, 2, dim=-1)
        order = torch.argsort(vals[..., 0], dim=-1)
        q = h.view(2, 4, 2, 4).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        g = torch.gather(h, 2, ind)
        return att.sum() + g.cumsum(-1).sum() + order.float().sum() + ind.float().sum()


def test_plain_model_ops_are_static():
    gm = trace(PlainOps(), torch.randint(0, 16, (2, 4)))
    result, v = verdicts_by_op(gm)
    for op in ("linear", "layer_norm", "softmax", "topk", "embedding", "scaled_dot_product_attention",
               "argsort", "gather"):
        assert op in v, op
    dynamic = {op_name(n): v.reason.rule for n, v in result.verdicts.items() if not v.static}
    assert dynamic == {}


def test_placeholders_and_output_are_not_classified():
    gm = trace(lambda x: x.sin(), *x84())
    result = classify(gm, Config())
    kinds = {n.op for n in result.verdicts}
    assert "placeholder" not in kinds and "output" not in kinds
    assert [op_name(n) for n in result.verdicts] == ["Tensor.sin"]


def test_analysis_reason_of_matches_the_verdict():
    gm = trace(lambda x: torch.nonzero(x.sin() > 0) * 2, *x84())
    analysis = analyze(gm, Config(min_region_ops=1))
    for node, verdict in analysis.classification.verdicts.items():
        if not verdict.static:
            assert analysis.reason_of(node) == verdict.reason
            assert verdict.reason.node == node.name
    assert sorted(r.rule for r in (analysis.reason_of(n) for n in analysis.classification.dynamic_nodes())
                  if r.rule.is_root_cause) == [Rule.DATA_DEPENDENT_SHAPE]
