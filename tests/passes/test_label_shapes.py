"""passes.label (roles of nodes and regions) and passes.shapes (backed / unbacked symbols), on the
reference models and on tiny modules named the way real models name things."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from cgbackend import Config
from cgbackend.passes.pipeline import analyze
from cgbackend.common.fx_utils import callee_name, compute_nodes, module_path, op_name
from cgbackend.models import build_model, make_inputs
from fx_helpers import trace


def analyze_model(name: str, config: Config | None = None, **compile_kwargs):
    model = build_model(name, size="tiny").eval()
    (x,) = make_inputs(name, model, n=1)
    # The dispatch as written (static_dispatch off): these tests look at its dynamic regions.
    return analyze(trace(model, x, **compile_kwargs), config or Config(static_dispatch="off"))


@pytest.fixture(scope="module")
def moe():
    return analyze_model("moe")


@pytest.fixture(scope="module")
def moe_sort():
    return analyze_model("moe_sort")


@pytest.fixture(scope="module")
def dense():
    return analyze_model("dense")


def ops(analysis):
    return [n for n in compute_nodes(analysis.gm) if n.op.startswith("call_")]


def role(analysis, node) -> str:
    return analysis.labels.node_roles[node]


def region(analysis, node):
    return analysis.partition.region_of[node]


# ----------------------------------------------------------------------------- roles on the MoE model

def test_attention_nodes_are_static_attention(moe):
    nodes = [n for n in ops(moe) if "attn" in module_path(n)]
    assert len(nodes) >= 2 * 14  # qkv, split, views, transposes, sdpa, proj per layer
    for n in nodes:
        assert role(moe, n) == "attention", n.name
        assert region(moe, n).is_static, n.name
    assert sum(callee_name(n) == "scaled_dot_product_attention" for n in nodes) == 2


def test_norm_nodes_are_static_norm(moe):
    nodes = [n for n in ops(moe) if re.search(r"(norm1|norm2|norm_f)$", module_path(n))]
    assert sorted(module_path(n) for n in nodes) == sorted(
        ["layers.0.norm1", "layers.0.norm2", "layers.1.norm1", "layers.1.norm2", "norm_f"])
    for n in nodes:
        assert role(moe, n) == "norm", n.name
        assert region(moe, n).is_static


def test_router_nodes_are_static_router(moe):
    nodes = [n for n in ops(moe) if module_path(n).endswith("ffn.gate")]
    assert [module_path(n) for n in nodes] == ["layers.0.ffn.gate", "layers.1.ffn.gate"]
    for n in nodes:
        assert op_name(n) == "linear"
        assert role(moe, n) == "router"
        assert region(moe, n).is_static


def test_router_postprocessing_is_static_preprocess(moe):
    # softmax / topk / one_hot of the router run in the static region before the dispatch.
    for op in ("softmax", "topk", "one_hot"):
        nodes = [n for n in ops(moe) if callee_name(n) == op]
        assert len(nodes) == 2, op
        for n in nodes:
            assert role(moe, n) == "preprocess", (op, n.name)
            assert region(moe, n).is_static


def test_dispatch_where_nodes_are_dynamic_moe_dispatch(moe):
    wheres = [n for n in ops(moe) if callee_name(n) == "where"]
    assert len(wheres) == 2 * 4  # one per expert per layer
    dispatch_regions = {region(moe, n).index for n in wheres}
    assert len(dispatch_regions) == 2  # one eager step per layer
    for n in wheres:
        assert not region(moe, n).is_static
        assert role(moe, n) == "moe_dispatch"
        assert moe.labels.region_roles[region(moe, n).index] == "moe_dispatch"
    for index in dispatch_regions:
        composition = moe.labels.region_role_ops[index]
        assert set(composition) == {"moe_dispatch", "experts"}


def test_expert_linears_have_role_experts(moe):
    linears = [n for n in ops(moe) if op_name(n) == "linear" and ".experts." in module_path(n)]
    assert len(linears) == 2 * 4 * 3  # layers x experts x (w1, w2, w3)
    for n in linears:
        assert re.fullmatch(r"layers\.\d\.ffn\.experts\.\d\.w[123]", module_path(n))
        assert role(moe, n) == "experts"
        assert not region(moe, n).is_static  # their row count comes from the dispatch


def test_region_roles_of_moe(moe):
    """A region's role is what more than half of its ops do, else "mixed": the static region before
    each dispatch holds a layer's attention and its router's post-processing in near equal parts."""
    roles = [(r.kind, moe.labels.region_roles[r.index]) for r in moe.partition.regions]
    assert roles[:4] == [("static", "mixed"), ("dynamic", "moe_dispatch"),
                         ("static", "mixed"), ("dynamic", "moe_dispatch")]
    assert roles[4][0] == "static"
    first = moe.labels.region_role_ops[moe.partition.regions[0].index]
    assert first["attention"] >= 10 and first["preprocess"] >= 10
    assert 2 * max(first.values()) <= sum(first.values())


@pytest.mark.parametrize("composition, expected", [
    ({"attention": 2, "preprocess": 158, "experts": 60}, "preprocess"),
    ({"attention": 84, "experts": 60, "norm": 56, "router": 14}, "mixed"),
    ({"attention": 30, "mlp": 8, "norm": 5, "embedding": 2, "other": 6}, "attention"),
    ({"attention": 5, "mlp": 5}, "mixed"),  # half is not most
])
def test_region_role_is_what_most_of_its_ops_do(composition, expected):
    from cgbackend.passes.label import region_role
    from cgbackend.passes.partition import Region
    nodes = [object() for _ in range(sum(composition.values()))]
    roles = dict(zip(nodes, (r for r, n in composition.items() for _ in range(n))))
    region = Region(index=0, kind="static", nodes=nodes)
    assert region_role(region, roles) == (expected, composition)


def test_embedding_nodes(moe):
    nodes = [n for n in ops(moe) if callee_name(n) == "embedding"]
    assert [module_path(n) for n in nodes] == ["tok_emb", "pos_emb"]
    assert all(role(moe, n) == "embedding" and region(moe, n).is_static for n in nodes)


def test_sorted_dispatch_is_moe_dispatch(moe_sort):
    (bc0, bc1) = [n for n in ops(moe_sort) if callee_name(n) == "bincount"]
    for n in (bc0, bc1):
        assert not region(moe_sort, n).is_static
        assert role(moe_sort, n) == "moe_dispatch"
        assert moe_sort.labels.region_roles[region(moe_sort, n).index] == "moe_dispatch"
    for n in ops(moe_sort):
        if module_path(n).endswith("ffn.gate"):
            assert role(moe_sort, n) == "router" and region(moe_sort, n).is_static


def test_dense_model_roles(dense):
    assert [r.kind for r in dense.partition.regions] == ["static"]
    mlp = [n for n in ops(dense) if re.fullmatch(r"layers\.\d\.ffn\.fc[12]", module_path(n))]
    assert len(mlp) == 4
    assert all(role(dense, n) == "mlp" for n in mlp)
    assert dense.labels.region_roles[0] == "attention"
    comp = dense.labels.region_role_ops[0]
    assert comp["attention"] > 0 and comp["mlp"] > 0 and comp["norm"] == 5 and comp["embedding"] == 2
    assert sum(comp.values()) == len(dense.partition.regions[0].nodes)


# ----------------------------------------------------------------------------- roles from names

class Leaf(nn.Module):
    def forward(self, x):
        return x.sin() * 2


class Wrap(nn.Module):
    """Holds ``child`` under ``attr`` and calls it, so the attribute appears in the module stack."""

    def __init__(self, attr: str, child: nn.Module) -> None:
        super().__init__()
        self.attr = attr
        setattr(self, attr, child)

    def forward(self, x):
        return getattr(self, self.attr)(x)


class MixtralSparseMoeBlock(Leaf):
    pass


class TopKGate(Leaf):
    pass


class LlamaRMSNorm(Leaf):
    pass


class GPT2MLP(Leaf):
    pass


class Qwen3MoeAttention(Leaf):
    pass


class Qwen3MoeDecoderLayer(Leaf):
    pass


class Qwen3MoeSparseMoeBlock(Leaf):
    pass


class Qwen3MoeExperts(Leaf):
    pass


class Indexed(nn.ModuleList):
    """A ModuleList that calls its element ``index`` (numeric path components, like layers.0)."""

    def __init__(self, index: int, child: nn.Module) -> None:
        super().__init__([nn.Identity() for _ in range(index)] + [child])
        self.index = index

    def forward(self, x):
        return self[self.index](x)


def nested(path: str, leaf: nn.Module) -> nn.Module:
    """A module whose only op runs in ``leaf`` at module path ``path`` (e.g. "layers.0.self_attn")."""
    parts = path.split(".")
    module = leaf
    i = len(parts) - 1
    while i >= 0:
        if parts[i].isdigit():
            module = Wrap(parts[i - 1], Indexed(int(parts[i]), module))
            i -= 2
        else:
            module = Wrap(parts[i], module)
            i -= 1
    return module


@pytest.mark.parametrize("path, leaf_cls, expected", [
    ("self_attn", Leaf, "attention"),
    ("attention", Leaf, "attention"),
    ("router", Leaf, "router"),
    ("gate", Leaf, "router"),
    ("experts", Leaf, "experts"),
    ("shared_experts", Leaf, "experts"),
    ("mlp", Leaf, "mlp"),
    ("ffn", Leaf, "mlp"),
    ("feed_forward", Leaf, "mlp"),
    ("ln_f", Leaf, "norm"),
    ("input_layernorm", Leaf, "norm"),
    ("wte", Leaf, "embedding"),
    ("block", MixtralSparseMoeBlock, "preprocess"),  # class name says MoE; static part -> preprocess
    ("ffn", MixtralSparseMoeBlock, "preprocess"),  # the MoE class wins over the "ffn" attribute
    ("foo", TopKGate, "router"),
    ("foo", LlamaRMSNorm, "norm"),
    ("foo", GPT2MLP, "mlp"),
    ("foo", Leaf, "other"),
    ("mlp.gate_proj", Leaf, "mlp"),  # gate_proj is not a router: the enclosing mlp decides
    ("moe.experts.3", Leaf, "experts"),
    ("moe.gate", Leaf, "router"),
    ("layers.0.self_attn.q_proj", Leaf, "attention"),
    # a class name says what the module is at its end, not in its model family's prefix
    ("self_attn", Qwen3MoeAttention, "attention"),
    ("layers.0", Qwen3MoeDecoderLayer, "other"),
    ("mlp", Qwen3MoeSparseMoeBlock, "preprocess"),
    ("mlp.experts", Qwen3MoeExperts, "experts"),
])
def test_role_from_module_names(path, leaf_cls, expected):
    analysis = analyze(trace(nested(path, leaf_cls()), torch.randn(3)), Config(min_region_ops=1))
    nodes = ops(analysis)
    assert [op_name(n) for n in nodes] == ["Tensor.sin", "operator.mul"]
    assert {module_path(n) for n in nodes} == {path}
    assert [role(analysis, n) for n in nodes] == [expected, expected]


def test_moe_module_nodes_in_a_dynamic_region_are_moe_dispatch():
    class SparseMoE(nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0).float() * 2

    analysis = analyze(trace(nested("layers.0.moe", SparseMoE()), torch.randn(8)), Config(min_region_ops=1))
    for n in ops(analysis):
        expected = "preprocess" if region(analysis, n).is_static else "moe_dispatch"
        assert role(analysis, n) == expected, n.name
    kinds_roles = [(r.kind, analysis.labels.region_roles[r.index]) for r in analysis.partition.regions]
    assert kinds_roles == [("static", "preprocess"), ("dynamic", "moe_dispatch")]


# ----------------------------------------------------------------------------- shapes

def test_static_shapes_have_no_symbols():
    analysis = analyze(trace(lambda x: (x @ x.t()).softmax(-1), torch.randn(8, 4)), Config())
    (rs,) = analysis.shapes.regions.values()
    assert rs.input_symbols == {} and rs.output_symbols == {}
    assert not rs.is_symbolic
    assert rs.inputs == [("l_x_", "[8, 4]@float32")]
    assert [spec for _, spec in rs.outputs] == ["[8, 8]@float32"]


def test_dynamic_batch_gives_backed_symbols():
    analysis = analyze(trace(lambda x: (x @ x.t()).softmax(-1) * 2, torch.randn(8, 4), dynamic=True),
                       Config(min_region_ops=1))
    (rs,) = analysis.shapes.regions.values()
    assert rs.input_symbols and set(rs.input_symbols.values()) == {"backed"}
    assert set(rs.output_symbols.values()) == {"backed"}
    assert all(re.fullmatch(r"s\d+", name) for name in rs.symbols)


def test_mark_dynamic_dim_gives_one_backed_symbol():
    x = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(x, 0)
    analysis = analyze(trace(lambda x: x.sin() * 2, x), Config(min_region_ops=1))
    (rs,) = analysis.shapes.regions.values()
    (name, spec) = [i for i in rs.inputs if i[1].startswith("[")][0]
    assert re.fullmatch(r"\[s\d+, 4\]@float32", spec)
    assert list(rs.input_symbols.values()) == ["backed"]


def test_unbacked_symbol_on_the_dynamic_region_output():
    def fn(x):
        h = x.sin()
        return torch.nonzero(h > 0) * 2, h.cos()

    analysis = analyze(trace(fn, torch.randn(8, 4)), Config(min_region_ops=1))
    static, dynamic = analysis.partition.regions
    assert (static.kind, dynamic.kind) == ("static", "dynamic")
    out_syms = analysis.shapes.regions[dynamic.index].output_symbols
    assert out_syms and set(out_syms.values()) == {"unbacked"}
    assert all(re.fullmatch(r"u\d+", s) for s in out_syms)
    assert re.fullmatch(r"\[u\d+, 2\]@int64", analysis.shapes.regions[dynamic.index].outputs[0][1])
    assert analysis.shapes.regions[static.index].symbols == {}


def test_dynamic_true_mixes_backed_inputs_and_unbacked_outputs():
    def fn(x):
        h = x.sin()
        return torch.nonzero(h > 0) * 2, h.cos()

    analysis = analyze(trace(fn, torch.randn(8, 4), dynamic=True), Config(min_region_ops=1))
    static, dynamic = analysis.partition.regions
    sd = analysis.shapes.regions[dynamic.index]
    assert set(sd.input_symbols.values()) == {"backed"}
    assert "unbacked" in sd.output_symbols.values()
    assert set(analysis.shapes.regions[static.index].symbols.values()) == {"backed"}


def test_static_regions_never_see_unbacked_symbols(moe, moe_sort):
    for analysis in (moe, moe_sort):
        for r in analysis.partition.static_regions():
            assert "unbacked" not in analysis.shapes.regions[r.index].symbols.values(), r.name


def test_moe_dispatch_regions_report_unbacked_symbols(moe):
    """The token count of each expert is read from device data: the dispatch regions' values are
    sized by unbacked symbols (u0, u1, ...), and the region's shape record says so."""
    dispatch = moe.partition.dynamic_regions()
    assert len(dispatch) == 2
    for r in dispatch:
        syms = moe.shapes.regions[r.index].symbols
        assert any(kind == "unbacked" and re.fullmatch(r"u\d+", name) for name, kind in syms.items()), \
            (r.name, syms)


def test_moe_with_dynamic_batch_has_backed_symbols_in_static_regions():
    analysis = analyze_model("moe", dynamic=True)
    static = analysis.partition.static_regions()
    assert static
    for r in static:
        for kind in analysis.shapes.regions[r.index].symbols.values():
            assert kind == "backed"
    # The token embedding input (batch, seq) is symbolic in the first region that reads it.
    first_with_idx = next(r for r in static if any(n == "l_idx_" for n, _ in analysis.shapes.regions[r.index].inputs))
    spec = dict(analysis.shapes.regions[first_with_idx.index].inputs)["l_idx_"]
    assert re.fullmatch(r"\[s\d+, s\d+\]@int64", spec)
