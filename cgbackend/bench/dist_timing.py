"""How bench-dist times its contenders and reads their memory (pure procedures, given callables).

:func:`time_alternating`: ``TIMING_ROUNDS`` blocks; in each block every contender runs its share of
the timed steps, the contender that starts a block rotating from block to block, so a drift of the
machine's pace (clocks, a neighbour's load) shows in every contender alike. Each step is timed on
its own between ``before`` (ranks aligned and the device idle) and ``after`` (the device idle).

:func:`isolated_peaks`: each contender's memory is read with no other contender resident: the one
kept from the timing phase (``keep``) after the others are freed, then every other one built afresh,
measured and freed in turn.

:func:`slowest_steps` and :func:`summary` turn every rank's step times into the job's: a step
takes as long as its slowest rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional, Sequence

from .measure import percentile
from .timing import TIMING_ROUNDS, block_share

__all__ = ["block_order", "time_alternating", "isolated_peaks", "slowest_steps", "summary"]


def block_order(names: Sequence[str], block: int) -> list[str]:
    """The contenders' order in ``block``: ``names`` rotated by the block's index."""
    k = block % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def time_alternating(names: Sequence[str], step: Callable[[str], None], iters: int, *,
                     before: Callable[[], None] = lambda: None, after: Callable[[], None] = lambda: None,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """``iters`` timed steps of each contender (``step(name)``) in alternating blocks; the
    milliseconds of each step, in order, per contender. ``before`` and ``after`` run around each
    step; only ``after`` is inside the timed span."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for block in range(TIMING_ROUNDS):
        for name in block_order(names, block):
            for _ in range(block_share(iters, block)):
                before()
                start = clock()
                step(name)
                after()
                times[name].append((clock() - start) * 1e3)
    return times


def isolated_peaks(names: Sequence[str], *, keep: Optional[str], live: dict[str, Any],
                   build: Callable[[str], Any], measure: Callable[[str, Any], dict],
                   free: Callable[[Any], None]) -> dict[str, dict]:
    """``measure(name, contender)`` for every name with no other contender alive. ``live`` (name ->
    contender, emptied here) holds the contenders of the timing phase: ``keep``'s is measured as
    it is, the others are freed first; every other name is built with ``build``. ``free`` releases
    what a contender holds (its graphs, caches); the references here are dropped after it."""
    kept = live.pop(keep, None) if keep is not None else None
    for name in list(live):
        free(live.pop(name))
    out: dict[str, dict] = {}
    order = ([keep] if kept is not None else []) + [n for n in names if n != keep or kept is None]
    for name in order:
        contender = kept if name == keep and kept is not None else build(name)
        kept = None
        try:
            out[name] = measure(name, contender)
        finally:
            free(contender)
            contender = None
    return out


def slowest_steps(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Step by step, the slowest rank's time."""
    return [max(ts) for ts in zip(*per_rank)]


def summary(times: Sequence[float]) -> dict[str, Optional[float]]:
    """median, p10 and p90 of step times (ms)."""
    if not times:
        return {"median_ms": None, "p10_ms": None, "p90_ms": None}
    return {"median_ms": round(statistics.median(times), 4), "p10_ms": round(percentile(times, 0.10), 4),
            "p90_ms": round(percentile(times, 0.90), 4)}
