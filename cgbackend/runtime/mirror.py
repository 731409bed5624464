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
_read_scalars = operator.attrgetter(*_SCALARS)


class CounterMirror:
    """What one Counters object last pushed into Dynamo's counters."""

    __slots__ = ("_scalars", "_eager", "_copied", "_failures")

    def __init__(self) -> None:
        self._scalars: tuple = (0,) * len(_SCALARS)
        self._eager: dict[str, int] = {}
        self._copied: dict[str, int] = {}
        self._failures = 0

    def reset(self) -> None:
        """The counters went back to zero (``CGBackend.reset``): nothing of them is pushed twice."""
        self.__init__()

    def push(self, counters: Counters) -> None:
        scalars = _read_scalars(counters)
        eager = counters.eager_calls
        copied = counters.copied_by_kind
        failures = len(counters.capture_failures)
        if scalars == self._scalars and eager == self._eager and copied == self._copied \
                and failures == self._failures:
            return
        target = _target()
        if target is None:
            return
        for name, now, before in zip(_SCALARS, scalars, self._scalars):
            if now != before:
                target[name] += now - before
        self._scalars = scalars
        for prefix, now_map, before_map in (("eager_calls.", eager, self._eager),
                                            ("copied_by_kind.", copied, self._copied)):
            for key, value in now_map.items():
                delta = value - before_map.get(key, 0)
                if delta:
                    target[prefix + key] += delta
        self._eager = dict(eager)
        self._copied = dict(copied)
        if failures != self._failures:
            target["capture_failures"] += failures - self._failures
            self._failures = failures


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
