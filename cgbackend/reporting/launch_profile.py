"""Device launches of dispatched ops, measured with ``torch.profiler``.

coverage.py counts the aten ops a call dispatches; on CUDA an op is not one launch: ``nonzero``,
a boolean-mask ``index``, ``index_put_`` with ``accumulate``, ``topk``, ``sort`` or ``cumsum``
launch several kernels and copies each, a matmul or a pointwise op about one. So on CUDA tensors
the launch counter runs each counted op inside a profiler range named ``cgbackend.op#<n>`` (and
each region of a compiled call inside ``cgbackend.region#<id>``) while ``torch.profiler`` records
CPU and CUDA activity; every CUDA launch API call (kernel launches, memcpy, memset: the events a
profiler trace shows on the host side) then belongs to the innermost such range around it, which
gives each dispatched op its measured launches (``attribute``).

Ranges, not op names: the profiler also records the composite ops the dispatch mode never sees
(``aten::linear`` around the ``aten::mm`` it dispatches, ``aten::where`` around ``aten::nonzero``),
so the outermost aten event is often not the op that was counted; the range around the counted
op is.

The event tree comes from ``FunctionEvent.cpu_parent`` (torch 2.11 and 2.13); a launch event the
profiler left without a parent is placed through ``linked_correlation_id`` (the op it was linked
to, where this torch has it), and events without ``cpu_parent`` at all are nested by their time
ranges per thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Callable, Iterable, Optional

import torch

__all__ = ["OP_RANGE", "REGION_RANGE", "Attribution", "LaunchProfiler", "attribute", "count_launch_calls",
           "launch_kind", "op_range"]

log = logging.getLogger(__name__)

OP_RANGE = "cgbackend.op#"
REGION_RANGE = "cgbackend.region#"

_KERNEL = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cuLaunchCooperativeKernel")
_COPY = ("cudaMemcpy", "cudaMemset", "cuMemcpy", "cuMemset")
_GRAPH = ("cudaGraphLaunch", "cuGraphLaunch")


def launch_kind(name: str) -> Optional[str]:
    """"kernel", "copy" or "graph" for a CUDA launch API call's event name (``cudaLaunchKernel``,
    ``cudaLaunchKernelExC``, ``cuLaunchKernel(Ex)``, ``cudaMemcpyAsync``, ``cudaMemsetAsync``,
    ``cudaGraphLaunch``, with any version suffix), else None."""
    if name.startswith(_KERNEL):
        return "kernel"
    if name.startswith(_COPY):
        return "copy"
    if name.startswith(_GRAPH):
        return "graph"
    return None


def is_device_launch(event: Any) -> bool:
    """A kernel launch or a copy/memset (not a graph launch): what an eager call pays per op."""
    return launch_kind(getattr(event, "name", "")) in ("kernel", "copy")


def launch_calls(events: Iterable[Any]) -> dict[str, int]:
    """``{"kernels", "copies", "graph_launches"}`` among profiler events."""
    counts = collections.Counter(launch_kind(getattr(e, "name", "")) for e in events)
    return {"kernels": counts["kernel"], "copies": counts["copy"], "graph_launches": counts["graph"]}


def _profile(activities: Optional[list] = None) -> Any:
    from torch.profiler import ProfilerActivity, profile
    if activities is None:
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return profile(activities=activities)


def count_launch_calls(fn: Callable[[], Any]) -> dict[str, int]:
    """Profile one ``fn()`` on CUDA and count its launch API calls (``launch_calls``): what
    benchmarks/launch_coverage.py and the GPU tests compare explain's figure with."""
    torch.cuda.synchronize()
    with _profile() as prof:
        fn()
        torch.cuda.synchronize()
    return launch_calls(prof.events())


@dataclasses.dataclass
class Attribution:
    """Launches of one profiled call, by the range they ran in."""

    total: int = 0
    """Every launch event of the call."""
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """op index (``cgbackend.op#<n>``) -> launches inside its range."""
    ops_seen: set = dataclasses.field(default_factory=set)
    """Op indices whose range the profiler recorded (launches or not)."""
    regions: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """region id -> launches inside its range but outside every op range."""
    outside: int = 0
    """Launches outside every range."""


def _range_key(name: str) -> Optional[tuple[str, Any]]:
    if name.startswith(OP_RANGE):
        try:
            return "op", int(name[len(OP_RANGE):])
        except ValueError:
            return None
    if name.startswith(REGION_RANGE):
        return "region", name[len(REGION_RANGE):]
    return None


def _interval_parents(events: list) -> dict[int, Any]:
    """id(event) -> its innermost enclosing event on the same thread, by time ranges (for events
    without ``cpu_parent``)."""
    parents: dict[int, Any] = {}
    by_thread: dict[Any, list] = collections.defaultdict(list)
    for e in events:
        by_thread[getattr(e, "thread", 0)].append(e)
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list = []
        for e in thread_events:
            while stack and not (e.time_range.start >= stack[-1].time_range.start
                                 and e.time_range.end <= stack[-1].time_range.end):
                stack.pop()
            if stack:
                parents[id(e)] = stack[-1]
            stack.append(e)
    return parents


def attribute(events: Iterable[Any], is_launch: Callable[[Any], bool] = is_device_launch) -> Attribution:
    """Each launch event (``is_launch``) to the innermost op range around it, else the innermost
    region range, else outside. ``events`` are profiler FunctionEvents or anything with ``name``,
    ``cpu_parent`` (or ``time_range`` and ``thread``) and optionally ``id`` /
    ``linked_correlation_id``."""
    events = list(events)
    result = Attribution()
    for e in events:
        key = _range_key(getattr(e, "name", ""))
        if key is not None and key[0] == "op":
            result.ops_seen.add(key[1])
    with_parent = all(hasattr(e, "cpu_parent") for e in events)
    fallback = {} if with_parent else _interval_parents(events)
    by_id: Optional[dict] = None

    def parent(e: Any) -> Any:
        return e.cpu_parent if with_parent else fallback.get(id(e))

    for e in events:
        if not is_launch(e):
            continue
        result.total += 1
        up = parent(e)
        if up is None and getattr(e, "linked_correlation_id", 0):
            if by_id is None:  # the op the launch was linked to (same correlation id)
                by_id = {}
                for other in events:
                    if not is_launch(other) and getattr(other, "id", None) is not None:
                        by_id.setdefault(other.id, other)
            up = by_id.get(e.linked_correlation_id)
        region = None
        while up is not None:
            key = _range_key(getattr(up, "name", ""))
            if key is not None and key[0] == "op":
                result.ops[key[1]] += 1
                break
            if key is not None and region is None:
                region = key[1]
            up = parent(up)
        else:
            if region is not None:
                result.regions[region] += 1
            else:
                result.outside += 1
    return result


def op_range(name: str) -> Any:
    """A profiler range that dispatches no op where this torch allows (``_RecordFunctionFast``),
    so a dispatch mode around it sees nothing; else ``record_function`` (coverage.py ignores the
    ``profiler::`` ops it dispatches)."""
    fast = getattr(getattr(torch._C, "_profiler", None), "_RecordFunctionFast", None)
    if fast is not None:
        return fast(name)
    return torch.autograd.profiler.record_function(name)


class LaunchProfiler:
    """Runs a call under ``torch.profiler`` and attributes its launches (``attribute``).

    ``activities`` default to CPU and CUDA; ``is_launch`` to CUDA's launch API calls. ``cuda``:
    synchronize around the call so every launch of it falls inside the profile. Tests on CPU pass
    CPU activities and a predicate of their own."""

    def __init__(self, activities: Optional[list] = None, is_launch: Callable[[Any], bool] = is_device_launch,
                 cuda: bool = True) -> None:
        self.activities = activities
        self.is_launch = is_launch
        self.cuda = cuda

    def run(self, fn: Callable[[], Any]) -> tuple[Optional[Attribution], Optional[str]]:
        """Call ``fn()`` once (its errors propagate) and return (attribution, None), or (None, why
        the profiler could not measure it): a profiler that fails to start or to stop never
        stops the call from running."""
        sync = self.cuda and torch.cuda.is_available()
        try:
            prof = _profile(self.activities)
            if sync:
                torch.cuda.synchronize()
            prof.__enter__()
        except Exception as exc:
            fn()
            return None, f"the profiler did not start ({type(exc).__name__}: {_first_line(exc)})"
        try:
            fn()
            if sync:
                torch.cuda.synchronize()
        except BaseException:
            try:
                prof.__exit__(None, None, None)
            except Exception:  # the call's own error is the one to report
                log.debug("cgbackend: stopping the profiler after a failed call failed too", exc_info=True)
            raise
        try:
            prof.__exit__(None, None, None)
            return attribute(prof.events(), self.is_launch), None
        except Exception as exc:
            return None, f"the profiler's events could not be read ({type(exc).__name__}: {_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""
