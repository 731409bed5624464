"""One profiler range per region and call (torch.profiler.record_function), named by the region's
report id and role, on warm-up (eager), capture and replay calls alike."""

from __future__ import annotations

import collections

import torch
from torch.profiler import ProfilerActivity, profile

import cgbackend
from cgbackend.models import build_model, make_inputs


def _ranges(prof) -> collections.Counter:
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("cgbackend "))


def test_one_range_per_region_and_call_named_by_id_and_role():
    model = build_model("moe", size="tiny").eval()
    # The dispatch as written: static and dynamic regions, a range each.
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="off")
    batches = make_inputs("moe", model, n=4)
    with torch.no_grad():
        compiled(batches[0])  # compile outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x in batches[1:]:
                torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    report = cgbackend.report(compiled)
    expected = {f"cgbackend {r.id} {r.role}" for r in report.regions()}
    counts = _ranges(prof)
    assert set(counts) == expected, (counts, expected)
    assert all(n == 3 for n in counts.values()), counts  # one per region per call
    stats = cgbackend.stats(compiled)
    assert stats["graphs_captured"] == 3 and stats["replays"] > 0  # the ranges covered replays too
    assert any(name.endswith(" moe_dispatch") for name in counts) and any(".S0 " in n for n in counts)


def test_one_range_per_region_in_a_single_profiled_call():
    model = build_model("dense", size="tiny").eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=0)
    x = make_inputs("dense", model, n=1)[0]
    with torch.no_grad():
        compiled(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(x)
        compiled(x)  # after the profile: the plain path again
    assert sum(_ranges(prof).values()) == len(cgbackend.report(compiled).regions())
