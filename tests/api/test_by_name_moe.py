"""By name, Dynamo breaks the graph at an MoE dispatch loop's data-dependent ops: the loop runs
eagerly and each expert's code sees a new signature (its token count, its parameters) at nearly
every call. The regions there stop capturing per signature before their cache thrashes
(runtime/churn.py), and the instance says once which loop stayed outside the graphs and what
cgbackend.compile does instead (reporting/left_out.py); explain --by-name shows the same."""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.runtime.churn import VARY_CALLS, ShapeChurn


class Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, d: int = 32, f: int = 64, experts: int = 4, top_k: int = 1) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, f) for _ in range(experts))
        self.top_k, self.num_experts = top_k, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, self.num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            k, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, k, None])
        return out


class Net(nn.Module):
    def __init__(self, layers: int = 2, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.layers = nn.ModuleList(MoE(d) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


def _loop_line() -> int:
    lines, start = inspect.getsourcelines(MoE.forward)
    return start + next(i for i, line in enumerate(lines) if line.strip().startswith("for e in hit"))


def _moe_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, cgbackend.MoELoopOutsideGraphWarning)]


def test_by_name_moe_loop_stops_capturing_before_thrashing_and_warns_once():
    """Bucketing off and two graphs per layer: before, the expert regions captured 48 graphs for 49
    replays and thrashed; now they run without a graph, counted, and results equal eager."""
    torch.manual_seed(0)
    model = Net().eval()
    compiled = torch.compile(model, backend="cgbackend",
                             options={"simulate_graphs": True, "capture_sizes": (), "max_graphs_per_region": 2})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for i in range(30):
            x = torch.randn(40 + 9 * i, 32, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    st = cgbackend.stats(compiled)
    assert st["eager_calls"].get("graph_cache_thrashing", 0) == 0 and st["graphs_evicted"] == 0
    assert st["eager_calls"]["shapes_vary_every_call"] > 100
    assert st["graphs_captured"] < 10
    report = cgbackend.report(compiled)
    varying = [r for g in report.graphs for r in (g.runtime or {}).get("regions", {}).values() if r["shapes_vary"]]
    assert varying and "shapes vary at every call" in str(report)
    moe = _moe_warnings(caught)
    assert len(moe) == 1, moe
    assert f"test_by_name_moe.py:{_loop_line()} in forward" in moe[0] and "cgbackend.compile(model)" in moe[0]
    assert any(f"test_by_name_moe.py:{_loop_line()}" in n for n in report.notes)


def test_cgbackend_compile_rewrites_the_loop_and_does_not_warn():
    torch.manual_seed(0)
    model = Net().eval()
    compiled = cgbackend.compile(model, simulate_graphs=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for i in range(4):
            x = torch.randn(40, 32, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert not _moe_warnings(caught)
    assert cgbackend.stats(compiled)["eager_calls"].get("shapes_vary_every_call", 0) == 0


def test_explain_by_name_names_the_loop_left_outside():
    torch.manual_seed(0)
    model = Net().eval()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        report = cgbackend.explain(model, (torch.randn(40, 32),), by_name=True, count_launches=False)
    assert not _moe_warnings(caught)  # explain reports, it does not warn
    assert any(f"test_by_name_moe.py:{_loop_line()} in forward" in n and "cgbackend.compile(model)" in n
               for n in report.notes), report.notes
    assert f"test_by_name_moe.py:{_loop_line()}" in str(report)


def test_layers_sharing_a_graph_over_capture_sizes_are_not_churn():
    """48 layers share a region's graph, 22 capture sizes: each size's first call brings 48 new
    signatures (warm-up and captures), the next ones replay: never taken for churn."""
    churn, replays, layers, seen = ShapeChurn(), 0, 48, 0
    for size in range(22):
        for call in range(4):
            for layer in range(layers):
                seen = max(seen, layer + 1)  # runtime/sharing.py: the layers seen so far
                if call == 0 or (call == 1 and layer < 3):
                    assert not churn.note((size, layer), seen, replays)
                else:
                    replays += 1
    assert churn.varying is None


def test_a_new_size_every_call_is_churn():
    churn = ShapeChurn()
    verdicts = [churn.note((n,), 1, 0) for n in range(VARY_CALLS + 4)]
    assert verdicts.index(True) == VARY_CALLS - 1 and churn.varying


def test_cgbackend_compile_keeps_capturing_sizes_that_come_back():
    """Only by name do regions stop capturing at churn: ``cgbackend.compile`` with the loop as written
    (static dispatch off) over random batch sizes (1 to 40) keeps capturing the experts' token counts, which
    come back, and replays them (a served MoE stopped capturing after 32 calls when every instance
    watched churn)."""
    torch.manual_seed(0)
    model = Net().eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, static_dispatch="off", capture_sizes=())
    rng = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for i in range(60):
            n = int(torch.randint(1, 41, (1,), generator=rng))
            x = torch.randn(n, 32, generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    st = cgbackend.stats(compiled)
    assert st["eager_calls"].get("shapes_vary_every_call", 0) == 0, st["eager_calls"]
    assert st["replays"] > 0 and st["graphs_captured"] > 0
