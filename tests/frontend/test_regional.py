"""Regional compilation (cgbackend/frontend/regional.py): a stack of identical layers is traced, analysed and
compiled once and every layer captures its own graphs; results and gradients equal eager's; the
user's modules keep their own forward; compile time stays flat in depth."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.models.realsize import RealConfig, RealModel
from cgbackend.frontend.regional import find_layer_stacks
from layer_helpers import Chain as _Chain

SIM = dict(simulate_graphs=True, inner="eager")


def _moe(layers: int, experts: int = 4, dtype=torch.float64) -> RealModel:
    cfg = RealConfig(hidden=16, heads=2, kv_heads=1, head_dim=8, layers=layers, ffn=8, experts=experts, top_k=2,
                     max_pos=64)
    torch.manual_seed(0)
    return RealModel(cfg, return_routing=False).to(dtype)


class _Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _Indexed(nn.Module):
    """An MoE-like owner: each module of the list runs on its own input, none on another's output."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x):
        out = torch.zeros_like(x)
        for e in range(len(self.experts)):
            y = self.experts[e](x[e:e + 1])
            out[e:e + 1] += y
        for i, expert in enumerate(self.experts):
            out = out + expert(x)
        return out


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        for i, block in enumerate(self.inner):
            out = block(x)
            x = out * 1.0
        return x


@pytest.mark.parametrize("case, expected", [
    ("chain", ["layers"]), ("sequential", ["seq"]), ("mixed_shapes", []), ("too_few", []), ("nested", ["layers"]),
    ("inner_only", ["layers.0.inner", "layers.1.inner"]), ("experts", []),
])
def test_finds_the_outermost_stacks_of_identical_layers_run_one_after_another(case, expected):
    if case == "chain":
        model = _Chain(_Block() for _ in range(4))
    elif case == "sequential":
        model = nn.Module()
        model.seq = nn.Sequential(*(_Block() for _ in range(4)))
    elif case == "mixed_shapes":
        model = _Chain([_Block(8), _Block(8), _Block(16), _Block(8)])
    elif case == "too_few":
        model = _Chain(_Block() for _ in range(3))
    elif case == "nested":
        model = _Chain(_Outer() for _ in range(4))
    elif case == "inner_only":
        model = _Chain(_Outer() for _ in range(2))
    else:
        model = _Chain([_Indexed(6)])
    assert [s.path for s in find_layer_stacks(model, 4)] == expected
    assert find_layer_stacks(model, 0) == []


@pytest.mark.parametrize("training", [False, True], ids=["infer", "train"])
def test_layers_share_one_compiled_graph_and_match_eager(training):
    model = _moe(4)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch="auto", regional_min_layers=4, **SIM)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(2, 8, 16, generator=gen, dtype=torch.float64)
        if training:
            for m in (model, ref):
                m.zero_grad(set_to_none=True)
            compiled(x).pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if p.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, msg=f"step {step}: {name}")
        else:
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), ref(x))
    st = cgbackend.stats(compiled)
    # One trace for every layer (training: one more for the first layer, whose input does not
    # require grad), graphs captured per layer, no eager call but the warm-up.
    assert st["compiled_graphs"] == (2 if training else 1), st
    assert st["graphs_captured"] >= 4, st
    assert set(st["eager_calls"]) <= {"warmup", "replay_order_hazard"}, st["eager_calls"]
    if not training:
        assert st["graphs_captured"] == 4 and st["fast_replays"] > 0, st
    # The user's modules keep their own forward outside the compiled model's calls.
    for module in model.modules():
        assert "forward" not in module.__dict__ or type(module).__name__ == "LoopMoE"
    report = cgbackend.report(compiled)
    assert report.regional == [{"path": "layers", "layers": 4, "class": "Block", "key": report.regional[0]["key"],
                                "groups": [{"layers": [0, 1, 2, 3], "why": ""}], "with_model": False, "why": ""}]
    assert "regional compilation: layers.0-3 (4 x Block)" in report.to_text()


def test_below_the_threshold_the_model_is_one_graph():
    model = _moe(3)
    compiled = cgbackend.compile(model, static_dispatch="auto", **SIM)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 8, 16, dtype=torch.float64)
            torch.testing.assert_close(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    assert st["compiled_graphs"] == 1 and st["graphs_captured"] == 1, st
    assert cgbackend.report(compiled).regional == []


def _first_call_seconds(layers: int) -> tuple[float, dict]:
    torch._dynamo.reset()
    model = _moe(layers, experts=8, dtype=torch.float32).eval()
    compiled = cgbackend.compile(model, static_dispatch="auto", **SIM)
    x = torch.randn(2, 8, 16)
    # CPU time of this process, not wall time: the suite's other workers share the cores.
    start = time.process_time()
    with torch.no_grad():
        compiled(x)
    return time.process_time() - start, cgbackend.stats(compiled)


def test_compile_time_is_flat_in_depth():
    """A 6-layer and a 24-layer model: one trace each, and about the same time to the first result
    (the deeper one adds only its layers' warm-up calls and captures)."""
    shallow, st6 = _first_call_seconds(6)
    deep, st24 = _first_call_seconds(24)
    assert st6["compiled_graphs"] == st24["compiled_graphs"] == 1
    assert deep <= 1.5 * shallow, (shallow, deep)


def test_steady_calls_never_enter_dynamos_frame_conversion():
    """Once compiled, a layer's call goes from the model's frame to the shared compiled layer without
    Dynamo converting a frame on the way: a frame it has to look at on every call (and skip) costs
    more host time than the layer's graph launch."""
    import cProfile
    import pstats
    model = _moe(6, experts=4, dtype=torch.float32).eval()
    compiled = cgbackend.compile(model, static_dispatch="auto", **SIM)
    x = torch.randn(2, 8, 16)
    with torch.no_grad():
        for _ in range(5):
            compiled(x)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3):
            compiled(x)
        profile.disable()
    entered = [f"{name}:{line}" for (path, line, name) in pstats.Stats(profile).stats
               if path.replace("\\", "/").endswith("_dynamo/convert_frame.py")]
    assert cgbackend.stats(compiled)["fast_replays"] > 0
    assert cgbackend.report(compiled).regional and entered == [], entered


def test_the_owners_loop_is_not_traced_and_other_compiles_of_its_class_stay_whole():
    """The owner's forward, whose loop calls each layer through a graph break, runs as it is from the
    first call (Dynamo would trace it up to the loop, give the frame up and mark the class's code
    to be skipped); another model of the same class, compiled after and before, is still traced
    whole, as one graph, and keeps its compiled code across the regional model's calls."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()

    def chain():
        torch.manual_seed(0)
        return _Chain([_Block() for _ in range(6)])

    def whole_compile():
        other = chain()
        graphs = []
        fn = torch.compile(other, backend=lambda gm, inputs: graphs.append(gm) or gm.forward)
        return other, fn, graphs

    first, first_fn, first_graphs = whole_compile()
    x = torch.randn(2, 8)
    with torch.no_grad():
        first_fn(x)
        model = chain()
        compiled = cgbackend.compile(model, regional_min_layers=6, **SIM)
        frames = dict(counters["frames"])
        for _ in range(2):
            torch.testing.assert_close(compiled(x), model(x))
        new_frames = {k: counters["frames"][k] - frames.get(k, 0) for k in ("total", "ok")}
        assert new_frames == {"total": 1, "ok": 1}, new_frames  # the shared layer only
        second, second_fn, second_graphs = whole_compile()
        torch.testing.assert_close(second_fn(x), second(x))
        torch.testing.assert_close(first_fn(x), first(x))
    # Each plain compile is one graph with all six layers; the first was not recompiled.
    for graphs in (first_graphs, second_graphs):
        assert len(graphs) == 1, len(graphs)
        assert sum(n.target is torch.tanh for n in graphs[0].graph.nodes) == 6
    assert cgbackend.report(compiled).regional
