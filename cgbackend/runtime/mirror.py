"""cgbackend's counters mirrored into ``torch._dynamo.utils.counters["cgbackend"]``.

Dynamo's counters are where PyTorch users (and tools that print them) look; cgbackend adds its own
there, summed over all backend instances: the numbers of ``cgbackend.stats()`` (``replays``,
``graphs_captured``, ...), eager calls as ``eager_calls.<reason>``, copies as
``copied_by_kind.<kind>`` and ``capture_failures`` as a count. Pushed as deltas, so
``torch._dynamo.utils.counters.clear()`` starts them from zero like Dynamo's own.

Pushed at the end of each compiled graph's call and at each compile, by comparing with what was
pushed last: one tuple of attribute reads when nothing changed. A graphed backward's counts arrive
with the next push (the next call, ``cgbackend.stats()``).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
from typing import Any

from .stats import Counters

__all__ = ["CounterMirror", "KEY"]

KEY = "cgbackend"

# Numbers only: counters kept as lists or Counters (failures, fallbacks by reason) are not scalars.
_SCALARS = tuple(f.name for f in dataclasses.fields(Counters)
                 if type(f.default) is int)
_HOT = ("graph_calls", "replays", "fast_replays", "copies_made", "copies_avoided", "output_clones",
        "output_views", "copy_backs")
"""What a replayed call changes: compared one by one on every push. The others (captures,
compiles, fallbacks...) are compared as one tuple, and walked only when that tuple changed."""
_COLD = tuple(name for name in _SCALARS if name not in _HOT)
_read_hot = operator.attrgetter(*_HOT)
_read_cold = operator.attrgetter(*_COLD)


class CounterMirror:
    """What one Counters object last pushed into Dynamo's counters."""

    __slots__ = ("_hot", "_cold", "_eager", "_copied", "_failures")

    def __init__(self) -> None:
        self._hot: tuple = (0,) * len(_HOT)
        self._cold: tuple = (0,) * len(_COLD)
        self._eager: dict[str, int] = {}
        self._copied: dict[str, int] = {}
        self._failures = 0

    def reset(self) -> None:
        """The counters went back to zero (``CGBackend.reset``): nothing of them is pushed twice."""
        self.__init__()

    def push(self, counters: Counters) -> None:
        hot = _read_hot(counters)
        cold = _read_cold(counters)
        eager = counters.eager_calls
        copied = counters.copied_by_kind
        failures = len(counters.capture_failures)
        if hot == self._hot and cold == self._cold and eager == self._eager and copied == self._copied \
                and failures == self._failures:
            return
        target = _target()
        if target is None:
            return
        for name, now, before in zip(_HOT, hot, self._hot):
            if now != before:
                target[name] += now - before
        self._hot = hot
        if cold != self._cold:
            for name, now, before in zip(_COLD, cold, self._cold):
                if now != before:
                    target[name] += now - before
            self._cold = cold
        if eager != self._eager:
            self._eager = _push_map(target, "eager_calls.", eager, self._eager)
        if copied != self._copied:
            self._copied = _push_map(target, "copied_by_kind.", copied, self._copied)
        if failures != self._failures:
            target["capture_failures"] += failures - self._failures
            self._failures = failures


def _push_map(target: Any, prefix: str, now: dict, before: dict) -> dict:
    """Add the per-key changes of a Counter of counts to ``target``; returns a copy of ``now``."""
    for key, value in now.items():
        delta = value - before.get(key, 0)
        if delta:
            target[prefix + key] += delta
    return dict(now)


@functools.lru_cache(maxsize=1)
def _dynamo_counters() -> Any:
    """torch._dynamo.utils.counters (a defaultdict of Counters, cleared in place), or None."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without Dynamo
        return None
    return counters if isinstance(counters, collections.defaultdict) else None


def _target() -> Any:
    """Dynamo's Counter for cgbackend, looked up each time: counters.clear() drops it."""
    counters = _dynamo_counters()
    return counters[KEY] if counters is not None else None
