"""Launch coverage: of the kernel launches one call through cgbackend makes, the share that runs
inside CUDA graphs (the rest run in dynamic regions or in code Dynamo left uncompiled).

``static_op_fraction`` counts the ops Dynamo traced; it says nothing about code Dynamo left
uncompiled (after a graph break that skipped the rest of a frame, every op there runs eagerly,
outside any graph). Launch coverage counts what runs:

* **measured** (``cgbackend.explain``): the model runs once eagerly under a
  ``TorchDispatchMode`` that counts dispatched device ops (aten ops that are not views or
  allocations), then once more through the compiled graphs with the same counter, which knows
  the region each op ran in (``RuntimeShared.watch``). Ops in static regions would run inside
  graphs; ops outside every compiled graph ran in uncompiled code and are attributed to the
  innermost source line of the user's code. Each op weighs: on CUDA tensors, the launches it
  really made (kernel launches, memcpy, memset), measured by ``torch.profiler`` around both calls
  (launch_profile.py; ``launches.weights`` is "profiled"); on CPU tensors, or where the profiler
  fails (a note says why), one launch per op ("one per op"). The eager call's launches are
  reported beside the figure: they differ from the compiled call's where the graphs run another
  form (static dispatch), so they are never its denominator.
* **runtime** (``cgbackend.report(compiled)``): from the counters, each region's calls (graph
  replays of static regions versus eager calls of any region) weighted by its estimated kernels
  per call (passes/launch_estimate.py), over the calls after warm-up: the eager warm-up calls before capture
  are left out (the capture call counts with the replays: its graph is replayed right after
  capture). Code outside the compiled graphs is not seen at runtime; when Dynamo broke a graph the
  figure is marked an upper bound.

The counter needs ``TorchDispatchMode.ignore_compile_internals`` (torch >= 2.9): without it a
dispatch mode stops Dynamo from running compiled code, and the measurement is skipped with a note.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .launch_profile import OP_RANGE, REGION_RANGE, Attribution, LaunchProfiler, op_range
from ..common.reasons import EagerReason
from ..common.user_code import frame_source, user_frame

__all__ = ["LaunchCounter", "Launches", "Tally", "counting_supported", "launches_op", "measure_launches",
           "runtime_launches"]

_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted",
    "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "resize_", "set_",
    "_assert_async", "_assert_scalar", "_functional_assert_async", "record_stream", "is_same_size",
    "_has_same_storage_numel", "is_pinned",
})
"""aten ops that allocate or read metadata only (no kernel); views are recognized by schema."""

_MAX_SOURCES = 12

_MAX_SEQUENCE = 2000
"""Entries of the measured call's sequence kept (a deep model's call runs thousands of regions)."""


def counting_supported() -> bool:
    """Whether a dispatch mode can watch compiled code run (``ignore_compile_internals``)."""
    return hasattr(TorchDispatchMode, "ignore_compile_internals")


_launch_cache: dict[Any, bool] = {}


def launches_op(func: Any) -> bool:
    """Does this aten op launch device work? Views (an alias in the result that is not a write),
    allocations, metadata reads and profiler ranges do not; everything else counts: one launch
    each on CPU tensors, its measured launches on CUDA (launch_profile.py)."""
    known = _launch_cache.get(func)
    if known is not None:
        return known
    schema = getattr(func, "_schema", None)
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    result = True
    if name in _NO_KERNEL or getattr(func, "namespace", "") == "profiler":  # profiler ranges
        result = False
    elif schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                    for r in schema.returns):
        result = False
    _launch_cache[func] = result
    return result


def _user_frame() -> tuple[str, str]:
    """``(source, code)`` of the innermost frame outside torch and cgbackend."""
    frame, _ = user_frame(sys._getframe(2))
    return frame_source(frame) if frame is not None else ("?", "")


class LaunchCounter(TorchDispatchMode):
    """Counts launching aten ops by where they ran: a static region, a dynamic region, or code
    outside every compiled graph (by source line). Also the ``RuntimeShared.watch`` of the
    backend under measurement, which tells it the region each op runs in.

    ``ranges``: run each counted op inside a profiler range ``cgbackend.op#<n>`` (``n`` its index
    in ``ops``) and each region inside ``cgbackend.region#<id>``, so a profiler running around the
    call can tell each op's device launches (launch_profile.py)."""

    def __init__(self, ranges: bool = False) -> None:
        super().__init__()
        self.ranges = ranges
        self.ops: list[tuple[Optional[str], bool, Optional[str], str]] = []
        """One entry per counted op: (region id or None, region is static, source or None, op)."""
        self.codes: dict[str, str] = {}
        """Uncompiled code: source -> its line of code."""
        self.regions_seen = 0
        self.sequence: list[dict[str, Any]] = []
        """The call in execution order (the HTML page draws it): ``{"kind": "region", "id"}`` per
        region run, ``{"kind": "uncompiled", "source", "ops"}`` per stretch of uncompiled code."""
        self.static_regions: dict[str, bool] = {}
        """Region id -> is static, for every region that ran."""
        self._region: Optional[tuple[str, bool]] = None

    @property
    def total(self) -> int:
        return len(self.ops)

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while Dynamo compiles, on while compiled code runs (torch >= 2.9); without this,
        # Dynamo runs nothing compiled under a dispatch mode.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if not launches_op(func):
            return func(*args, **(kwargs or {}))
        region = self._region
        name = func.overloadpacket.__name__
        if region is not None:
            self.ops.append((region[0], region[1], None, name))
        else:
            source, code = _user_frame()
            self.codes.setdefault(source, code)
            self.ops.append((None, False, source, name))
            last = self.sequence[-1] if self.sequence else None
            if last is not None and last["kind"] == "uncompiled" and last["source"] == source:
                last["ops"] += 1
            elif len(self.sequence) < _MAX_SEQUENCE:
                self.sequence.append({"kind": "uncompiled", "source": source, "ops": 1})
        if not self.ranges:
            return func(*args, **(kwargs or {}))
        with op_range(f"{OP_RANGE}{len(self.ops) - 1}"):
            return func(*args, **(kwargs or {}))

    def __call__(self, graph: Any, position: int, run_step: Callable[..., Any], step: Any, ins: list,
                 call: Any) -> Any:
        region = graph.analysis.partition.regions[position]
        previous = self._region
        self._region = (f"g{graph.index}.{region.name}", region.is_static)
        self.static_regions[self._region[0]] = region.is_static
        self.regions_seen += 1
        if len(self.sequence) < _MAX_SEQUENCE:
            self.sequence.append({"kind": "region", "id": self._region[0]})
        try:
            if not self.ranges:
                return run_step(step, ins, call)
            with op_range(f"{REGION_RANGE}{self._region[0]}"):
                return run_step(step, ins, call)
        finally:
            self._region = previous

    def tally(self, profile: Optional[Attribution] = None) -> "Tally":
        """Launches by where they ran: one per counted op, or with ``profile`` (the attribution of
        a profiler run around the same call) each op's measured launches (an op whose range the
        profiler did not record counts one), plus launches outside every op range: in a region's
        range they count for that region, outside every range as uncompiled code of unknown source."""
        t = Tally()
        for index, (region, static, source, name) in enumerate(self.ops):
            if profile is None or index not in profile.ops_seen:
                n = 1
            else:
                n = profile.ops.get(index, 0)
            t.add(region, static, source, name, n, self.codes)
        if profile is not None:
            for region, n in profile.regions.items():
                t.add(region, self.static_regions.get(region, False), None, None, n, self.codes)
            if profile.outside:
                t.add(None, False, "?", None, profile.outside, self.codes)
        return t


class Tally:
    """Launches of one counted call by where they ran (LaunchCounter.tally)."""

    def __init__(self) -> None:
        self.total = self.static = self.dynamic = self.uncompiled = 0
        self.by_region: collections.Counter = collections.Counter()
        """``"g0.S0"`` -> launches."""
        self.sources: dict[str, list] = {}
        """Uncompiled code: source -> [launches, code, Counter of ops]."""

    def add(self, region: Optional[str], static: bool, source: Optional[str], op: Optional[str], n: int,
            codes: dict[str, str]) -> None:
        self.total += n
        if region is not None:
            self.by_region[region] += n
            if static:
                self.static += n
            else:
                self.dynamic += n
            return
        self.uncompiled += n
        entry = self.sources.get(source)
        if entry is None:
            entry = self.sources[source] = [0, codes.get(source, ""), collections.Counter()]
        entry[0] += n
        if op is not None:
            entry[2][op] += 1


class Launches:
    """What one measurement found; ``to_summary()`` gives the report's summary fields.

    ``eager`` and ``counter``: the LaunchCounters of the eager call and of the compiled call;
    ``profiles``: the profiler's attributions of the same two calls (launch_profile.py), or None
    (one launch per counted op)."""

    def __init__(self, eager: LaunchCounter, counter: LaunchCounter,
                 profiles: Optional[tuple[Attribution, Attribution]] = None) -> None:
        self.eager_counter = eager
        self.counter = counter
        self.profiles = profiles
        self.eager = profiles[0].total if profiles is not None else eager.total
        self.tally = counter.tally(profiles[1] if profiles is not None else None)

    def coverage(self) -> float:
        """Of the launches the call through cgbackend made, the share inside graphs (static regions);
        the rest ran in dynamic regions or uncompiled code. Both counts come from that one call, so
        the figure and the counts the report gives beside it agree by construction (an eager call's
        launches differ where the graphs run another form, and are given apart, figures.py)."""
        total = self.tally.total
        return round(self.tally.static / total, 4) if total > 0 else 0.0

    def to_summary(self) -> dict[str, Any]:
        c = self.tally
        sources = sorted(c.sources.items(), key=lambda kv: -kv[1][0])
        return {
            "launch_coverage": self.coverage(),
            "launches": {
                "basis": "measured",
                "weights": "profiled" if self.profiles is not None else "one per op",
                "eager_call": self.eager,
                "with_cgbackend": c.total,
                "in_graphs": c.static,
                "in_dynamic_regions": c.dynamic,
                "uncompiled": c.uncompiled,
                "dispatched_ops": {"eager_call": self.eager_counter.total, "with_cgbackend": self.counter.total},
                "by_region": dict(c.by_region),
                "uncompiled_sources": [
                    {"source": source, "code": code, "launches": n, "ops": dict(ops.most_common(4))}
                    for source, (n, code, ops) in sources[:_MAX_SOURCES]],
                "upper_bound": False,
                "sequence": list(self.counter.sequence),
            },
        }


def measure_launches(eager_call: Callable[[], Any], compiled_call: Callable[[], Any], shared: Any,
                     reset: Callable[[], Any] = lambda: None,
                     profiler: Optional[LaunchProfiler] = None) -> tuple[Optional[Launches], Optional[str]]:
    """Run ``eager_call`` and ``compiled_call`` (the compiled model, already traced, of the backend
    whose RuntimeShared is ``shared``) under launch counters, each after ``reset()`` (not counted).
    With ``profiler`` (CUDA tensors) each call also runs under it and each op weighs its measured
    launches; if the profiler fails, one launch per op, with a note.
    Returns (launches, a note or None), or (None, why the measurement was skipped)."""
    if not counting_supported():
        return None, ("launch coverage not measured: this torch has no "
                      "TorchDispatchMode.ignore_compile_internals (torch >= 2.9)")
    ranges = profiler is not None
    reset()
    eager = LaunchCounter(ranges=ranges)
    eager_profile, why = _run_counted(eager, eager_call, profiler)
    reset()
    counter = LaunchCounter(ranges=ranges)
    shared.watch = counter
    try:
        compiled_profile, why_compiled = _run_counted(counter, compiled_call, profiler)
    finally:
        shared.watch = None
    why = why or why_compiled
    if eager_profile is None or compiled_profile is None:
        note = (f"launch coverage weighs one launch per dispatched op: {why}"
                if profiler is not None else None)
        return Launches(eager, counter), note
    return Launches(eager, counter, (eager_profile, compiled_profile)), None


def _run_counted(counter: LaunchCounter, fn: Callable[[], Any],
                 profiler: Optional[LaunchProfiler]) -> tuple[Optional[Attribution], Optional[str]]:
    if profiler is None:
        with counter:
            fn()
        return None, None

    def counted() -> None:
        with counter:
            fn()

    return profiler.run(counted)


def runtime_launches(graphs: list, compiled: list, broke: bool) -> dict[str, Any]:
    """Summary fields from runtime counters over the calls after warm-up: ``graphs`` are
    GraphReports (est_kernels per region), ``compiled`` the CompiledGraphs they describe (calls,
    per-region replays and eager calls by reason). A static region's warm-up calls are left out;
    a dynamic region runs eagerly in every call, so its calls are the graph's calls less its
    warm-up calls (the most any of its static regions made: they warm up in the same calls)."""
    in_graphs = eager = 0
    calls = warmups = 0
    by_region: dict[str, int] = {}
    for report, graph in zip(graphs, compiled):
        runners = {r.name.split(".", 1)[-1]: r for r in graph.runners}  # "g0.S0" -> "S0"
        warm = max((r.counts.eager_calls.get(EagerReason.WARMUP, 0) for r in graph.runners), default=0)
        calls += max(graph.calls - warm, 0)
        warmups += warm
        for region in report.regions:
            runner = runners.get(region.id.split(".", 1)[-1])
            if runner is not None:
                replayed = runner.counts.replays * region.est_kernels
                ran = sum(n for reason, n in runner.counts.eager_calls.items()
                          if reason != EagerReason.WARMUP) * region.est_kernels
            else:
                replayed, ran = 0, max(graph.calls - warm, 0) * region.est_kernels
            in_graphs += replayed
            eager += ran
            by_region[region.id] = replayed + ran
    total = in_graphs + eager
    return {
        "launch_coverage": round(in_graphs / total, 4) if total else None,
        "launches": {"basis": "runtime", "weights": "estimated kernels", "eager_call": None,
                     "with_cgbackend": total, "in_graphs": in_graphs,
                     "in_dynamic_regions": eager, "uncompiled": None, "by_region": by_region,
                     "uncompiled_sources": [], "upper_bound": bool(broke),
                     "calls": calls, "warmup_calls": warmups},
    }
