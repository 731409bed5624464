"""Per-region timing on request (option ``profile=True``): each region call of a compiled model's
forward, split into graph replays, captures (the call that captured a graph, with its replay) and
eager calls (warm-up, fallbacks, dynamic regions).

CUDA: a pair of CUDA events around the call on the current stream, read later (no sync in the
call path; pairs are resolved once their end event has completed, and all of them when a report
asks). CPU and simulated graphs: ``time.perf_counter`` around the call. Backward replays run
inside autograd and are not timed. Timing adds two event records per region call; leave it off
when measuring end-to-end speed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

__all__ = ["RegionTimer", "timing_text"]

_RESOLVE_EVERY = 512


class _Times:
    __slots__ = ("calls", "seconds")

    def __init__(self) -> None:
        self.calls = 0
        self.seconds = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "total_ms": round(1e3 * self.seconds, 4),
                "mean_ms": round(1e3 * self.seconds / self.calls, 4) if self.calls else None}


class RegionTimer:
    """A ``RuntimeShared.watch`` that times every region call, by graph and region."""

    def __init__(self) -> None:
        self.times: dict[tuple[int, int, str, str], _Times] = {}
        """(graph index, region position, region name, "replay" | "capture" | "eager") -> calls and
        seconds."""
        self._pending: list[tuple[tuple[int, int, str, str], Any, Any]] = []

    def __call__(self, graph: Any, position: int, run_step: Callable[..., Any], step: Any, ins: list,
                 call: Any) -> Any:
        region = graph.analysis.partition.regions[position]
        counts = step.runner.counts if step.runner is not None else None
        replays = counts.replays if counts is not None else 0
        graphs = counts.graphs if counts is not None else 0
        # A static region's simulated graphs run on the host: timed with perf_counter.
        device = _cuda_device(ins, counts is not None and graph.shared.capturer.simulate,
                              step.runner.spec.device if step.runner is not None else None)
        if device is not None:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = run_step(step, ins, call)
            end.record()
        else:
            t0 = time.perf_counter()
            out = run_step(step, ins, call)
            elapsed = time.perf_counter() - t0
        how = ("capture" if counts is not None and counts.graphs > graphs
               else "replay" if counts is not None and counts.replays > replays else "eager")
        key = (graph.index, position, region.name, how)
        if device is not None:
            self._pending.append((key, start, end))
            if len(self._pending) >= _RESOLVE_EVERY:
                self.resolve(wait=False)
        else:
            self._add(key, elapsed)
        return out

    def _add(self, key: tuple[int, int, str, str], seconds: float) -> None:
        entry = self.times.get(key)
        if entry is None:
            entry = self.times[key] = _Times()
        entry.calls += 1
        entry.seconds += seconds

    def resolve(self, wait: bool = True) -> None:
        """Fold finished CUDA event pairs into the totals (all of them when ``wait``)."""
        keep = []
        for key, start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                keep.append((key, start, end))
                continue
            self._add(key, start.elapsed_time(end) / 1e3)
        self._pending = keep

    def graph_timing(self, index: int) -> dict[str, dict[str, Any]]:
        """``{"S0": {"replay": {"calls", "total_ms", "mean_ms"}, "capture": {...}, "eager": {...}}}`` of
        one graph."""
        self.resolve()
        out: dict[str, dict[str, Any]] = {}
        for (graph, _, name, how), times in sorted(self.times.items()):
            if graph == index:
                out.setdefault(name, {})[how] = times.to_dict()
        return out


def _cuda_device(ins: list, simulate: bool, region_device: Optional[torch.device]) -> Optional[torch.device]:
    """The CUDA device a region call runs on (its first tensor input's, else the region's), or None:
    timed with perf_counter (CPU, simulated graphs)."""
    if not torch.cuda.is_available() or simulate:
        return None
    for value in ins:
        if isinstance(value, torch.Tensor):
            return value.device if value.is_cuda else None
    return region_device if region_device is not None and region_device.type == "cuda" else None


def timing_text(timing: dict[str, dict[str, Any]]) -> list[str]:
    """Lines of the text report for one graph's timing (profile=True)."""
    if not timing:
        return []
    lines = ["  time per region (profile=True; forward calls):"]
    for name, parts in timing.items():
        shown = ", ".join(f"{how} {t['calls']} x {t['mean_ms']:.3f} ms = {t['total_ms']:.3f} ms"
                          for how, t in parts.items())
        lines.append(f"{'':<4}{name}: {shown}")
    return lines
