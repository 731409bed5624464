"""Launch coverage: which of an eager call's kernel launches run inside CUDA graphs.

``static_op_fraction`` counts the ops Dynamo traced; it says nothing about code Dynamo left
uncompiled (after a graph break that skipped the rest of a frame, every op there runs eagerly,
outside any graph). Launch coverage counts what runs:

* **measured** (``cgbackend.explain``): the model runs once eagerly under a
  ``TorchDispatchMode`` that counts dispatched device ops (aten ops that are not views or
  allocations; CPU tensors count the same way), then once more through the compiled graphs with
  the same counter, which knows the region each op ran in (``RuntimeShared.watch``). Ops in
  static regions would run inside graphs; ops outside every compiled graph ran in uncompiled
  code and are attributed to the innermost source line of the user's code.
* **runtime** (``cgbackend.report(compiled)``): from the counters, each region's calls (graph
  replays of static regions versus eager calls of any region) weighted by its estimated kernels
  per call (passes/cost.py). Code outside the compiled graphs is not seen at runtime; when Dynamo
  broke a graph the figure is marked an upper bound.

The counter needs ``TorchDispatchMode.ignore_compile_internals`` (torch >= 2.9): without it a
dispatch mode stops Dynamo from running compiled code, and the measurement is skipped with a note.
"""

from __future__ import annotations

import collections
import linecache
import os
import sys
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCounter", "Launches", "counting_supported", "launches_op", "measure_launches",
           "runtime_launches", "launch_text"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

_NO_KERNEL = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted",
    "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "resize_", "set_",
    "_assert_async", "_assert_scalar", "_functional_assert_async", "record_stream", "is_same_size",
    "_has_same_storage_numel", "is_pinned",
})
"""aten ops that allocate or read metadata only (no kernel); views are recognized by schema."""

_MAX_SOURCES = 12


def counting_supported() -> bool:
    """Whether a dispatch mode can watch compiled code run (``ignore_compile_internals``)."""
    return hasattr(TorchDispatchMode, "ignore_compile_internals")


_launch_cache: dict[Any, bool] = {}


def launches_op(func: Any) -> bool:
    """Does this aten op launch device work? Views (an alias in the result that is not a write),
    allocations and metadata reads do not; everything else counts one launch (an estimate of
    kernels, not CUDA's own count: a few ops launch several)."""
    known = _launch_cache.get(func)
    if known is not None:
        return known
    schema = getattr(func, "_schema", None)
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    result = True
    if name in _NO_KERNEL:
        result = False
    elif schema is not None and any(r.alias_info is not None and not r.alias_info.is_write
                                    for r in schema.returns):
        result = False
    _launch_cache[func] = result
    return result


def _user_frame() -> tuple[str, str]:
    """``(source, code)`` of the innermost frame outside torch and cgbackend."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_TORCH_DIR) or filename.startswith(_OWN_DIR)
                or filename.startswith("<")):
            base = filename.replace("\\", "/").rsplit("/", 1)[-1]
            code = linecache.getline(filename, frame.f_lineno).strip()
            return f"{base}:{frame.f_lineno} in {_function_name(frame.f_code.co_name)}", code
        frame = frame.f_back
    return "?", ""


def _function_name(name: str) -> str:
    """The user's function behind Dynamo's resume functions (``torch_dynamo_resume_in_f_at_12``)."""
    prefix = "torch_dynamo_resume_in_"
    if name.startswith(prefix) and "_at_" in name:
        return name[len(prefix):].rsplit("_at_", 1)[0]
    return name


class LaunchCounter(TorchDispatchMode):
    """Counts launching aten ops by where they ran: a static region, a dynamic region, or code
    outside every compiled graph (by source line). Also the ``RuntimeShared.watch`` of the
    backend under measurement, which tells it the region each op runs in."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.static = 0
        self.dynamic = 0
        self.uncompiled = 0
        self.by_region: collections.Counter = collections.Counter()
        """``"g0.S0"`` -> launches."""
        self.sources: dict[str, list] = {}
        """Uncompiled code: source -> [launches, code, Counter of ops]."""
        self.regions_seen = 0
        self._region: Optional[tuple[str, bool]] = None

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while Dynamo compiles, on while compiled code runs (torch >= 2.9); without this,
        # Dynamo runs nothing compiled under a dispatch mode.
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if launches_op(func):
            self.total += 1
            region = self._region
            if region is not None:
                self.by_region[region[0]] += 1
                if region[1]:
                    self.static += 1
                else:
                    self.dynamic += 1
            else:
                self.uncompiled += 1
                source, code = _user_frame()
                entry = self.sources.get(source)
                if entry is None:
                    entry = self.sources[source] = [0, code, collections.Counter()]
                entry[0] += 1
                entry[2][func.overloadpacket.__name__] += 1
        return out

    def __call__(self, graph: Any, position: int, run_step: Callable[..., Any], step: Any, ins: list,
                 call: Any) -> Any:
        region = graph.analysis.partition.regions[position]
        previous = self._region
        self._region = (f"g{graph.index}.{region.name}", region.is_static)
        self.regions_seen += 1
        try:
            return run_step(step, ins, call)
        finally:
            self._region = previous


class Launches:
    """What one measurement found; ``to_summary()`` gives the report's summary fields."""

    def __init__(self, eager: int, counter: LaunchCounter) -> None:
        self.eager = eager
        self.counter = counter

    def coverage(self) -> float:
        """1 - (launches still outside graphs per call) / (an eager call's launches): what runs in
        dynamic regions or uncompiled code counts against it; constants made once per compiled graph
        (passes/constants.py) are launched by no call and count for it."""
        if self.eager <= 0:
            return 0.0
        outside = self.counter.dynamic + self.counter.uncompiled
        return round(max(0.0, min(1.0 - outside / self.eager, 1.0)), 4)

    def to_summary(self) -> dict[str, Any]:
        c = self.counter
        sources = sorted(c.sources.items(), key=lambda kv: -kv[1][0])
        return {
            "launch_coverage": self.coverage(),
            "launches": {
                "basis": "measured",
                "eager_call": self.eager,
                "with_cgbackend": c.total,
                "in_graphs": c.static,
                "in_dynamic_regions": c.dynamic,
                "uncompiled": c.uncompiled,
                "by_region": dict(c.by_region),
                "uncompiled_sources": [
                    {"source": source, "code": code, "launches": n, "ops": dict(ops.most_common(4))}
                    for source, (n, code, ops) in sources[:_MAX_SOURCES]],
                "upper_bound": False,
            },
        }


def count_eager(fn: Callable[[], Any]) -> int:
    counter = LaunchCounter()
    with counter:
        fn()
    return counter.total


def measure_launches(eager_call: Callable[[], Any], compiled_call: Callable[[], Any], shared: Any,
                     reset: Callable[[], Any] = lambda: None) -> tuple[Optional[Launches], Optional[str]]:
    """Run ``eager_call`` and ``compiled_call`` (the compiled model, already traced, of the backend
    whose RuntimeShared is ``shared``) under launch counters, each after ``reset()`` (not counted).
    Returns (launches, None) or (None, why the measurement was skipped)."""
    if not counting_supported():
        return None, ("launch coverage not measured: this torch has no "
                      "TorchDispatchMode.ignore_compile_internals (torch >= 2.9)")
    reset()
    eager = count_eager(eager_call)
    reset()
    counter = LaunchCounter()
    shared.watch = counter
    try:
        with counter:
            compiled_call()
    finally:
        shared.watch = None
    return Launches(eager, counter), None


def runtime_launches(graphs: list, compiled: list, broke: bool) -> dict[str, Any]:
    """Summary fields from runtime counters: ``graphs`` are GraphReports (est_kernels per region),
    ``compiled`` the CompiledGraphs they describe (calls, per-region replays and eager calls)."""
    in_graphs = eager = 0
    by_region: dict[str, int] = {}
    for report, graph in zip(graphs, compiled):
        runners = {r.name.rsplit(".", 1)[-1]: r for r in graph.runners}
        for region in report.regions:
            name = region.id.split(".")[-1]
            runner = runners.get(name)
            if runner is not None:
                replayed = runner.replays * region.est_kernels
                ran = sum(runner.eager_calls.values()) * region.est_kernels
            else:
                replayed, ran = 0, graph.calls * region.est_kernels
            in_graphs += replayed
            eager += ran
            by_region[region.id] = replayed + ran
    total = in_graphs + eager
    return {
        "launch_coverage": round(in_graphs / total, 4) if total else None,
        "launches": {"basis": "runtime", "eager_call": None, "with_cgbackend": total, "in_graphs": in_graphs,
                     "in_dynamic_regions": eager, "uncompiled": None, "by_region": by_region,
                     "uncompiled_sources": [], "upper_bound": bool(broke)},
    }


def launch_text(summary: dict[str, Any]) -> list[str]:
    """The report's ``launch coverage`` lines."""
    cov = summary.get("launch_coverage")
    info = summary.get("launches")
    if info is None:
        return []
    if cov is None:
        return ["  launch coverage: not measured"]
    if info["basis"] == "measured":
        lines = [f"  launch coverage: {cov:.3f} (measured: {info['in_graphs']} of the {info['eager_call']} "
                 f"launches of an eager call run inside graphs; {info['in_dynamic_regions']} in dynamic "
                 f"regions, {info['uncompiled']} in uncompiled code)"]
        for src in info["uncompiled_sources"][:6]:
            ops = ", ".join(f"{op} x{n}" for op, n in src["ops"].items())
            lines.append(f"{'':<4}uncompiled: {src['launches']} launches at {src['source']} ({ops})")
            if src["code"]:
                lines.append(f"{'':<8}`{src['code']}`")
        return lines
    bound = ("; an upper bound: Dynamo broke the graph, and launches outside compiled graphs are not "
             "seen at runtime (cgbackend.explain measures them)") if info["upper_bound"] else ""
    return [f"  launch coverage: {cov:.3f} (runtime: {info['in_graphs']} of {info['with_cgbackend']} "
            f"estimated launches ran in graph replays{bound})"]
