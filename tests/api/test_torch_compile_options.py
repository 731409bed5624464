"""torch.compile(model, backend="cgbackend", options=..., mode=...): options map onto Config, each
torch.compile call gets its own counters, torch._dynamo.reset() clears them, and the counters are
mirrored into torch._dynamo.utils.counters["cgbackend"]."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend import Config


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Tanh()).double().eval()


def _run(compiled, model, n=3):
    with torch.no_grad():
        for i in range(n):
            x = torch.randn(4, 8, dtype=torch.float64) * (i + 1)
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)


def _compile_error(**kwargs) -> str:
    compiled = torch.compile(_mlp(), backend="cgbackend", **kwargs)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 8, dtype=torch.float64))
    # torch.compile is lazy: Dynamo compiles at the first call and wraps the backend's error.
    lines = [line for line in str(info.value).splitlines() if "cgbackend" in line
             and not line.startswith("backend=")]
    assert len(lines) == 1, str(info.value)
    return lines[0]


def test_options_take_effect():
    model = _mlp()
    compiled = torch.compile(model, backend="cgbackend", options={"warmup": 1, "simulate_graphs": True})
    assert cgbackend.find_backend(compiled).config == Config.from_options({"warmup": 1, "simulate_graphs": True})
    _run(compiled, model, n=3)
    stats = cgbackend.stats(compiled)
    # warmup=1: one eager call, the capture on the second, a replay on the third.
    assert stats["eager_calls"] == {"warmup": 1}
    assert (stats["graphs_captured"], stats["replays"]) == (1, 2)


def test_strict_option_takes_effect_without_cuda():
    """strict=True on a graph nothing can be captured of (CPU tensors) raises instead of running
    everything eagerly under eager_calls["no_cuda"]."""
    line = _compile_error(options={"warmup": 1, "strict": True})
    assert "strict=True" in line and "computes on cpu" in line and "strict=False" in line
    # Without strict the same model runs, every region call counted as no_cuda.
    model = _mlp()
    compiled = torch.compile(model, backend="cgbackend", options={"warmup": 1})
    _run(compiled, model, n=2)
    assert cgbackend.stats(compiled)["eager_calls"] == {"no_cuda": 2}


def test_unknown_option_fails_at_compile_with_the_valid_ones():
    line = _compile_error(options={"bogus": 1})
    assert "ConfigError" in line and "bogus" in line
    for name in Config.field_names():
        assert name in line


def test_mode_is_rejected_with_what_to_use_instead():
    line = _compile_error(mode="reduce-overhead")
    assert "mode='reduce-overhead'" in line and "options=" in line and "cgbackend.compile" in line


def test_two_models_compiled_by_name_keep_separate_counters():
    """Same class, same options: Dynamo would reuse the first model's compiled frame for the second
    (the backends compare equal) and count its calls there; each torch.compile call keeps its own."""
    m1, m2 = _mlp(), _mlp()
    c1 = torch.compile(m1, backend="cgbackend", options={"simulate_graphs": True, "warmup": 0})
    c2 = torch.compile(m2, backend="cgbackend", options={"simulate_graphs": True, "warmup": 0})
    _run(c1, m1, n=3)
    _run(c2, m2, n=1)
    b1, b2 = cgbackend.find_backend(c1), cgbackend.find_backend(c2)
    assert b1 is not b2
    # warmup=0: each call replays, the first right after its capture.
    assert (b1.stats()["graphs_captured"], b1.stats()["replays"]) == (1, 3)
    assert (b2.stats()["graphs_captured"], b2.stats()["replays"]) == (1, 1)
    assert b1.stats()["compiled_graphs"] == b2.stats()["compiled_graphs"] == 1
    # Without an argument: every model compiled by name, added up.
    total = cgbackend.stats()
    assert (total["compiled_graphs"], total["graphs_captured"], total["replays"]) == (2, 2, 4)


def test_find_backend_before_the_first_call_is_the_models_own():
    compiled = torch.compile(_mlp(), backend="cgbackend", options={"warmup": 2})
    instance = cgbackend.find_backend(compiled)
    assert instance.config.warmup == 2 and instance.stats()["compiled_graphs"] == 0
    compiled(torch.randn(2, 8, dtype=torch.float64))
    assert cgbackend.find_backend(compiled) is instance
    assert instance.stats()["compiled_graphs"] == 1


@pytest.mark.parametrize("how", ["by_name", "instance", "cgbackend_compile"])
@pytest.mark.parametrize("reset", ["torch.compiler.reset", "torch._dynamo.reset"])
def test_reset_clears_what_cgbackend_reports(how, reset):
    model = _mlp()
    if how == "by_name":
        compiled = torch.compile(model, backend="cgbackend", options={"simulate_graphs": True, "warmup": 0})
    elif how == "instance":
        compiled = torch.compile(model, backend=cgbackend.backend(simulate_graphs=True, warmup=0))
    else:
        compiled = cgbackend.compile(model, simulate_graphs=True, warmup=0)
    _run(compiled, model, n=2)
    assert cgbackend.stats(compiled)["compiled_graphs"] == 1
    assert cgbackend.report(compiled).summary["graphs"] == 1
    {"torch.compiler.reset": torch.compiler.reset, "torch._dynamo.reset": torch._dynamo.reset}[reset]()
    stats = cgbackend.stats(compiled)
    assert (stats["compiled_graphs"], stats["graphs_captured"], stats["replays"], stats["static_regions"]) == (0, 0, 0, 0)
    assert cgbackend.report(compiled).summary["graphs"] == 0
    # The model compiles again and counts from zero.
    _run(compiled, model, n=1)
    assert cgbackend.stats(compiled)["compiled_graphs"] == 1
    assert cgbackend.stats(compiled)["graphs_captured"] == 1


def test_counters_mirrored_into_dynamo_counters():
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = _mlp()
    compiled = torch.compile(model, backend="cgbackend", options={"simulate_graphs": True, "warmup": 1})
    _run(compiled, model, n=4)
    mirrored = counters["cgbackend"]
    stats = cgbackend.stats(compiled)
    assert mirrored["compiled_graphs"] == stats["compiled_graphs"] == 1
    assert mirrored["graphs_captured"] == stats["graphs_captured"] == 1
    assert mirrored["replays"] == stats["replays"] == 3
    assert mirrored["fast_replays"] == stats["fast_replays"] == 2  # the capturing call replays fully
    assert mirrored["eager_calls.warmup"] == 1
    assert mirrored["copies_made"] == stats["copies_made"] > 0
    # Deltas: after Dynamo's counters are cleared, only what happens next is counted.
    counters.clear()
    _run(compiled, model, n=1)
    assert counters["cgbackend"]["replays"] == 1 and "compiled_graphs" not in counters["cgbackend"]
    # A reset zeroes the instance's counters without pushing negative numbers.
    torch._dynamo.reset()
    _run(compiled, model, n=1)
    assert all(v >= 0 for v in counters["cgbackend"].values())
    assert counters["cgbackend"]["compiled_graphs"] == 1


def test_mirrored_counters_are_brought_in_when_read(monkeypatch):
    """Calls only check that the live counter is still Dynamo's; reads bring every instance's
    changes in (summed), whatever the read; a counter held across a clear stays as it was."""
    import collections
    import copy
    import json
    from cgbackend.runtime import mirror
    flushes = []
    real = mirror.CounterMirror.flush
    monkeypatch.setattr(mirror.CounterMirror, "flush", lambda self, t: flushes.append(1) or real(self, t))
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = _mlp()
    a = torch.compile(model, backend="cgbackend", options={"simulate_graphs": True, "warmup": 1})
    b = torch.compile(_mlp(), backend="cgbackend", options={"simulate_graphs": True, "warmup": 1})
    _run(a, model, n=2)
    flushes.clear()
    _run(a, model, n=5)
    assert flushes == []  # replayed calls walk no counters
    _run(b, model, n=3)
    live = counters["cgbackend"]
    assert isinstance(live, mirror.LiveCounter)
    total = cgbackend.stats(a)["replays"] + cgbackend.stats(b)["replays"]
    assert live["replays"] == total == 6 + 2
    for view in (dict(live), json.loads(json.dumps(live)), copy.deepcopy(live), live.copy(),
                 dict(live.items()), collections.Counter(live)):
        assert view["replays"] == total and view["compiled_graphs"] == 2, view
    assert dict(live.most_common())["replays"] == total and "replays" in live and "replays" in str(live)
    counters.clear()
    _run(a, model, n=2)
    assert live["replays"] == total  # held across the clear: as it was
    assert counters["cgbackend"]["replays"] == 2 and "compiled_graphs" not in counters["cgbackend"]


def _nonzero_then_eager(seen: list):
    @torch._dynamo.disable
    def look():
        cfg = torch._dynamo.config
        seen.append((cfg.capture_scalar_outputs, cfg.capture_dynamic_output_shape_ops))

    def f(x):
        rows = torch.nonzero(x[:, 0] > 0).squeeze(1)  # traced into the graph only with the settings on
        look()
        return x[rows].sum(0) * 2

    return f


def test_data_dependent_settings_on_only_while_dynamo_compiles():
    """cgbackend.compile traces data-dependent ops into the graph (the nonzero makes a dynamic
    region, not a graph break), but switches Dynamo's settings on only while Dynamo compiles a
    frame of its call (compile callbacks), not around every call: a call that compiles nothing
    sees them off, and they are off after it."""
    cfg = torch._dynamo.config
    seen: list = []
    f = _nonzero_then_eager(seen)
    compiled = cgbackend.compile(f, simulate_graphs=True, warmup=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randn(6, 3, generator=g)
        ref = f(x)
        torch.testing.assert_close(compiled(x), ref)
        assert seen[-1] == (False, False)  # seen by the compiled call
    assert not cfg.capture_scalar_outputs and not cfg.capture_dynamic_output_shape_ops
    report = cgbackend.report(compiled)
    # One break, at the disabled function; the nonzero is in the graph (a dynamic region).
    assert report.summary["dynamic_regions"] >= 1 and len(report.graph_breaks) == 1, report.to_text()
    assert "disable" in str(report.graph_breaks[0].get("reason")), report.graph_breaks
    assert cgbackend.stats(compiled)["trace_scope_missed"] == 0


def test_compile_without_callbacks_is_counted_and_switches_per_call(monkeypatch):
    """Dynamo runs start callbacks only for the outermost of overlapping compiles: a compile of a
    cgbackend call that started without them is traced as plain torch.compile traces (a graph break
    at the nonzero), counted, warned about, and that instance switches the settings around each
    call from then on (the next compile, for a new shape, traces the nonzero into the graph)."""
    from cgbackend.frontend.tracing import CompileScope as _CompileScope
    torch._dynamo.reset()  # clears Dynamo's callbacks; cgbackend registers them again
    monkeypatch.setattr(_CompileScope, "_started", classmethod(lambda cls, args: None))
    monkeypatch.setattr(_CompileScope, "_hooks", None, raising=False)
    seen: list = []
    f = _nonzero_then_eager(seen)
    compiled = cgbackend.compile(f, simulate_graphs=True, warmup=1, dynamic=False)
    import logging
    warnings: list = []
    keep = logging.Handler(level=logging.WARNING)
    keep.emit = warnings.append  # on cgbackend's logger itself: torch._logging stops propagation above it
    logger = logging.getLogger("cgbackend")
    logger.addHandler(keep)
    try:
        x = torch.randn(6, 3)
        torch.testing.assert_close(compiled(x), f(x))
    finally:
        logger.removeHandler(keep)
    instance = cgbackend.find_backend(compiled)
    missed = instance.shared.counters.trace_scope_missed
    assert missed == cgbackend.stats(compiled)["compiled_graphs"] >= 1 and instance.switch_per_call
    assert sum("traced without capture_scalar_outputs" in r.getMessage() for r in warnings) == 1
    report = cgbackend.report(compiled)
    assert len(report.graph_breaks) >= 1
    assert any("traced without capture_scalar_outputs" in n for n in report.notes), report.notes
    x = torch.randn(9, 3)  # a new shape: recompiled, with the settings switched around the call
    ref = f(x)
    torch.testing.assert_close(compiled(x), ref)
    assert seen[-1] == (True, True) and instance.shared.counters.trace_scope_missed == missed
    torch._dynamo.reset()
    monkeypatch.undo()
    torch._dynamo.reset()


def test_settings_switched_per_call_where_torch_has_no_compile_callbacks(monkeypatch):
    from cgbackend.frontend.tracing import CompileScope as _CompileScope
    monkeypatch.setattr(_CompileScope, "_hooks", (), raising=False)
    seen: list = []
    f = _nonzero_then_eager(seen)
    compiled = cgbackend.compile(f, simulate_graphs=True, warmup=1)
    for n in (5, 5):
        x = torch.randn(n, 3)
        ref = f(x)
        torch.testing.assert_close(compiled(x), ref)
        assert seen[-1] == (True, True)  # the old switch: on around the whole call
    assert cgbackend.report(compiled).summary["dynamic_regions"] >= 1
    assert not torch._dynamo.config.capture_scalar_outputs
