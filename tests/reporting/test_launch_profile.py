"""Launch coverage weighted by measured launches (launch_profile.py, coverage.py) and the runtime
figure over the calls after warm-up."""

from __future__ import annotations

import collections
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import cgbackend
from cgbackend.reporting import launch_profile
from cgbackend.reporting.coverage import counting_supported
from cgbackend.reporting.launch_profile import LaunchProfiler, attribute, launch_calls, launch_kind
from cgbackend.models import demo_model
from cgbackend.reporting.schema import validate_report

needs_counting = pytest.mark.skipif(not counting_supported(),
                                    reason="torch without TorchDispatchMode.ignore_compile_internals")
_explain_module = sys.modules["cgbackend.reporting.explain"]


# ----------------------------------------------------------------------------- attribution, fake events

class _Event(SimpleNamespace):
    """A profiler FunctionEvent as far as attribute() reads one."""


def _tree(spec, parent=None, out=None, clock=None, with_parent=True):
    """Events from nested ``(name, [children])`` tuples, in start order, each inside its parent's
    time range (``with_parent``: ``cpu_parent`` set, else only ``time_range`` and ``thread``)."""
    out = [] if out is None else out
    clock = clock if clock is not None else [0]
    for name, children in spec:
        start = clock[0]
        clock[0] += 1
        event = _Event(name=name, thread=1, id=len(out) + 1, linked_correlation_id=0)
        if with_parent:
            event.cpu_parent = parent
        out.append(event)
        _tree(children, event, out, clock, with_parent)
        clock[0] += 1
        event.time_range = SimpleNamespace(start=start, end=clock[0])
    return out


_SPEC = [
    ("cgbackend.region#g0.S0", [
        ("aten::linear", [("aten::t", []), ("aten::matmul", [
            ("PythonDispatchMode", [("cgbackend.op#0", [("aten::mm", [("cudaLaunchKernel", [])])])])])]),
        ("cudaMemcpyAsync", []),  # in the region, outside every op range
    ]),
    ("cgbackend.region#g0.D1", [
        ("aten::where", [("aten::nonzero", [("cgbackend.op#1", [("aten::nonzero", [
            ("cudaLaunchKernel", []), ("cudaLaunchKernelExC_v11060", []), ("cudaMemcpyAsync", []),
            ("cudaStreamSynchronize", []), ("aten::cumsum", [("cuLaunchKernel", [])])])])])]),
        ("cgbackend.op#2", [("aten::empty_like", [])]),  # seen, launches nothing
    ]),
    ("cgbackend.op#3", [("aten::add", [("cudaMemsetAsync", []), ("cudaLaunchKernel", [])])]),
    ("cudaLaunchKernel", []),  # outside every range
    ("cudaGraphLaunch", []),  # a graph launch is no eager launch
]


@pytest.mark.parametrize("with_parent", [True, False], ids=["cpu_parent", "time_ranges"])
def test_attribute_launches_to_the_innermost_op_range(with_parent):
    events = _tree(_SPEC, with_parent=with_parent)
    assert hasattr(events[0], "cpu_parent") is with_parent
    got = attribute(events)
    # op 1 made 5 launches (2 kernels, an ExC kernel, a copy, a driver launch in a nested aten op)
    assert dict(got.ops) == {0: 1, 1: 4, 3: 2}
    assert got.ops_seen == {0, 1, 2, 3}
    assert dict(got.regions) == {"g0.S0": 1}
    assert got.outside == 1
    assert got.total == 1 + 4 + 2 + 1 + 1
    assert launch_calls(events) == {"kernels": 6, "copies": 3, "graph_launches": 1}


def test_attribute_follows_the_linked_op_of_a_parentless_launch():
    events = _tree([("cgbackend.op#0", [("aten::nonzero", [])]), ("cudaLaunchKernel", [])])
    launch, nonzero = events[2], events[1]
    launch.cpu_parent = None
    launch.linked_correlation_id = nonzero.id
    assert dict(attribute(events).ops) == {0: 1}
    launch.linked_correlation_id = 0
    got = attribute(events)
    assert not got.ops and got.outside == 1


def test_tally_weighs_each_op_by_its_attributed_launches():
    from cgbackend.reporting.coverage import LaunchCounter
    from cgbackend.reporting.launch_profile import Attribution
    counter = LaunchCounter(ranges=True)
    counter.ops = [("g0.S0", True, None, "mm"), ("g0.D1", False, None, "nonzero"),
                   ("g0.D1", False, None, "empty_like"), (None, False, "m.py:3 in f", "add"),
                   (None, False, "m.py:3 in f", "mul")]
    counter.codes = {"m.py:3 in f": "y = x + 1"}
    counter.static_regions = {"g0.S0": True, "g0.D1": False}
    plain = counter.tally()
    assert (plain.total, plain.static, plain.dynamic, plain.uncompiled) == (5, 1, 2, 2)
    # ops 0-3 seen (op 2 launched nothing), op 4 not seen: one launch; S0 made a copy outside its ops
    seen = Attribution(total=10, ops=collections.Counter({0: 1, 1: 4, 3: 2}), ops_seen={0, 1, 2, 3},
                       regions=collections.Counter({"g0.S0": 1}), outside=1)
    t = counter.tally(seen)
    assert (t.static, t.dynamic, t.uncompiled, t.total) == (2, 4, 2 + 1 + 1, 10)
    assert dict(t.by_region) == {"g0.S0": 2, "g0.D1": 4}
    assert t.sources["m.py:3 in f"][:2] == [3, "y = x + 1"]
    assert dict(t.sources["m.py:3 in f"][2]) == {"add": 1, "mul": 1}  # op counts, not launches
    assert t.sources["?"][0] == 1


@pytest.mark.parametrize("name,kind", [
    ("cudaLaunchKernel", "kernel"), ("cudaLaunchKernelExC", "kernel"), ("cuLaunchKernelEx", "kernel"),
    ("cudaLaunchKernelExC_v11060", "kernel"), ("cudaMemcpyAsync", "copy"), ("cudaMemsetAsync", "copy"),
    ("cudaGraphLaunch", "graph"), ("cudaStreamSynchronize", None), ("aten::mm", None),
    ("cudaEventRecord", None)])
def test_launch_kind(name, kind):
    assert launch_kind(name) == kind


# ----------------------------------------------------------------------------- explain, profiled on CPU

def _leaf(event) -> bool:
    """Stand-in for a CUDA launch on a CPU profile: an aten op that calls no other op."""
    return event.name.startswith("aten::") and not event.cpu_children


def _cpu_profiler(monkeypatch):
    monkeypatch.setattr(_explain_module, "launch_profiler",
                        lambda analyses, args, kwargs: LaunchProfiler([ProfilerActivity.CPU], _leaf, cuda=False))


def _leaves_of(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if _leaf(e))


@needs_counting
def test_explain_weighs_ops_by_profiled_launches(monkeypatch):
    """The profiled path end to end on CPU, with leaf aten ops standing in for CUDA launches: the
    eager call's figure is what the profiler alone counts for a plain eager call, each counted op
    weighs its own leaves, and the figures add up."""
    model, x = demo_model("moe")
    off = {"static_dispatch": "off"}  # the dispatch as written: dynamic regions to weigh
    with torch.no_grad():
        plain = cgbackend.explain(model, x, options=off)
        _cpu_profiler(monkeypatch)
        weighted = cgbackend.explain(model, x, options=off)
        alone = _leaves_of(lambda: model(x))
    p, w = plain.summary["launches"], weighted.summary["launches"]
    assert p["weights"] == "one per op" and w["weights"] == "profiled"
    assert p["eager_call"] == p["dispatched_ops"]["eager_call"] == w["dispatched_ops"]["eager_call"]
    assert w["eager_call"] == alone > p["eager_call"]
    assert w["in_graphs"] + w["in_dynamic_regions"] + w["uncompiled"] == w["with_cgbackend"]
    assert sum(w["by_region"].values()) == w["in_graphs"] + w["in_dynamic_regions"]
    assert w["in_dynamic_regions"] > p["in_dynamic_regions"]  # dispatch ops make several leaves each
    assert weighted.summary["launch_coverage"] == round(w["in_graphs"] / w["with_cgbackend"], 4)
    assert "launches per op measured by torch.profiler" in weighted.to_text()
    assert "one launch per dispatched op" in plain.to_text()
    assert validate_report(weighted) == [] and validate_report(plain) == []


@needs_counting
def test_explain_weighs_uncompiled_code_by_source(monkeypatch):
    from test_coverage_hints import _hit_model, _line_of
    model, x = _hit_model()
    _cpu_profiler(monkeypatch)
    with torch.no_grad():
        report = cgbackend.explain(model, x, options={"static_dispatch": "off"})
    launches = report.summary["launches"]
    assert launches["weights"] == "profiled" and launches["uncompiled"] > 0
    sources = {src["source"]: src for src in launches["uncompiled_sources"]}
    assert sum(src["launches"] for src in sources.values()) == launches["uncompiled"]
    where = sources[_line_of("WHERE")]
    assert where["ops"].get("nonzero") == 4 and where["launches"] > 4  # op counts stay counts


@needs_counting
def test_profiler_failure_falls_back_to_one_per_op(monkeypatch):
    def broken(activities=None):
        raise RuntimeError("profiler already running")
    monkeypatch.setattr(launch_profile, "_profile", broken)
    _cpu_profiler(monkeypatch)
    model, x = demo_model("moe")
    with torch.no_grad():
        report = cgbackend.explain(model, x, options={"static_dispatch": "off"})
    launches = report.summary["launches"]
    assert launches["weights"] == "one per op"
    assert launches["eager_call"] == launches["dispatched_ops"]["eager_call"]
    assert any(n.startswith("launch coverage weighs one launch per dispatched op: the profiler did not start "
                            "(RuntimeError: profiler already running)") for n in report.notes)
    assert 0.2 < report.summary["launch_coverage"] < 0.8


def test_cpu_tensors_get_no_profiler():
    model, x = demo_model("dense")
    assert _explain_module.launch_profiler([], (x,), {}) is None


# ----------------------------------------------------------------------------- runtime, after warm-up

@pytest.mark.parametrize("warmup", [1, 3])
def test_runtime_coverage_after_warmup_static_dispatch(warmup):
    """static_dispatch="auto": one graph, nothing dynamic; the warm-up calls are left out, so every
    call after them ran in graphs (on main the warm-up calls counted against it: 0.5 after 6)."""
    model, x = demo_model("moe")
    compiled = cgbackend.compile(model, simulate_graphs=True, static_dispatch="auto", warmup=warmup)
    with torch.no_grad():
        for _ in range(6):  # masked dense: equal to the loop within float32 rounding
            torch.testing.assert_close(compiled(x), model(x))
    stats = cgbackend.stats(compiled)
    assert stats["eager_calls"] == {"warmup": warmup} and stats["replays"] == 6 - warmup
    report = cgbackend.report(compiled)
    launches = report.summary["launches"]
    assert report.summary["dynamic_regions"] == 0
    assert report.summary["launch_coverage"] == 1.0
    assert (launches["calls"], launches["warmup_calls"]) == (6 - warmup, warmup)
    assert launches["weights"] == "estimated kernels"
    assert launches["in_graphs"] == launches["with_cgbackend"] > 0
    assert f"(estimated per region call) of the {6 - warmup} calls after warm-up ran in graph replays" in report.to_text()
    assert validate_report(report) == []


def test_runtime_coverage_counts_dynamic_regions_after_warmup():
    model, x = demo_model("moe")
    compiled = cgbackend.compile(model, simulate_graphs=True, static_dispatch="off")  # warmup=3
    with torch.no_grad():
        for _ in range(6):
            compiled(x)
    report = cgbackend.report(compiled)
    launches = report.summary["launches"]
    est = {r.id: (r.kind, r.est_kernels) for r in report.regions()}
    static = sum(k for kind, k in est.values() if kind == "static")
    dynamic = sum(k for kind, k in est.values() if kind == "dynamic")
    assert dynamic > 0
    assert (launches["in_graphs"], launches["with_cgbackend"]) == (3 * static, 3 * (static + dynamic))
    assert report.summary["launch_coverage"] == round(static / (static + dynamic), 4) < 1.0


def test_runtime_coverage_before_any_call_after_warmup():
    model, x = demo_model("dense")
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=2)
    with torch.no_grad():
        compiled(x)
    report = cgbackend.report(compiled)
    assert report.summary["launch_coverage"] is None
    assert report.summary["launches"]["warmup_calls"] == 1
    assert "launch coverage: no call after warm-up yet (1 warm-up call left out)" in report.to_text()


# ----------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@needs_counting
@pytest.mark.parametrize("options", [{}, {"static_dispatch": "auto"}], ids=["default", "static_dispatch_auto"])
def test_cuda_explain_coverage_matches_the_profiler(options):
    """explain's launch coverage on CUDA tensors is within 0.05 of the profiler's: one eager call's
    launch API calls versus those a compiled call makes outside graph replays (as
    benchmarks/launch_coverage.py measures it)."""
    from cgbackend.reporting.launch_profile import count_launch_calls
    model, x = demo_model("moe", device="cuda")
    with torch.no_grad():
        report = cgbackend.explain(model, x, options=options)
        compiled = cgbackend.compile(model, **options)
        for _ in range(6):
            compiled(x)
        eager = count_launch_calls(lambda: model(x))
        graphed = count_launch_calls(lambda: compiled(x))
    launches = report.summary["launches"]
    assert launches["weights"] == "profiled", report.notes
    eager_total = eager["kernels"] + eager["copies"]
    measured = 1 - (graphed["kernels"] + graphed["copies"]) / eager_total
    # explain's eager call (under its counter) launches what a plain eager call does
    assert abs(launches["eager_call"] - eager_total) <= max(2, eager_total // 50), (launches, eager)
    assert launches["in_graphs"] + launches["in_dynamic_regions"] + launches["uncompiled"] == launches["with_cgbackend"]
    assert abs(report.summary["launch_coverage"] - measured) <= 0.05, (report.summary["launch_coverage"], measured,
                                                                       launches, eager, graphed)
    assert graphed["graph_launches"] >= 1
    if options:
        assert report.summary["launch_coverage"] >= 0.95
    else:  # the dispatch's ops (nonzero, index, index_add_, ...) launch several kernels and copies each
        assert launches["eager_call"] > launches["dispatched_ops"]["eager_call"]
