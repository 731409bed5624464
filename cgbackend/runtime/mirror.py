"""cgbackend's counters mirrored into ``torch._dynamo.utils.counters["cgbackend"]``.

Dynamo's counters are where PyTorch users (and tools that print them) look; cgbackend adds its own
there, summed over all backend instances: the numbers of ``cgbackend.stats()`` (``replays``,
``graphs_captured``, ...), eager calls as ``eager_calls.<reason>``, copies as
``copied_by_kind.<kind>`` and ``capture_failures`` as a count. Added as deltas, so
``torch._dynamo.utils.counters.clear()`` starts them from zero like Dynamo's own.

Brought in when read. ``counters["cgbackend"]`` is a :class:`LiveCounter`: a ``collections.Counter``
that, before any read, adds what every registered instance counted since it last looked. So a
replayed call pays one identity check (:meth:`CounterMirror.begin`: is our counter still the one in
Dynamo's counters?) instead of a comparison of every counter (4 to 9 us a call on an H100 host).
``counters.clear()`` drops the live counter; the next call or compile of an instance notices,
forgets what was counted before (as a clear means) and installs a new one. A graphed backward's
counts are there at the next read; one that runs between a clear and the instance's next call is
forgotten with what came before.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import operator
import weakref
from typing import Any, Optional

from .stats import Counters

__all__ = ["CounterMirror", "KEY", "LiveCounter"]

KEY = "cgbackend"

# Numbers only: counters kept as lists or Counters (failures, fallbacks by reason) are not scalars.
_SCALARS = tuple(f.name for f in dataclasses.fields(Counters)
                 if type(f.default) is int)
_read_scalars = operator.attrgetter(*_SCALARS)
_ZERO = Counters()
"""Counters as a fresh instance holds them (all zero): the baseline of a mirror that added nothing."""


class LiveCounter(collections.Counter):
    """``counters["cgbackend"]``: brings in the registered mirrors' changes before every read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mirrors: "weakref.WeakSet[CounterMirror]" = weakref.WeakSet()

    def _sync(self) -> None:
        if _installed() is self:  # a counter Dynamo no longer holds (cleared) stays as it was
            for mirror in list(self._mirrors):
                mirror.flush(self)

    def __getitem__(self, key: Any) -> Any:
        self._sync()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._sync()
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self._sync()
        return super().__iter__()

    def __len__(self) -> int:
        self._sync()
        return super().__len__()

    def __repr__(self) -> str:
        self._sync()
        return super().__repr__()

    def __eq__(self, other: object) -> bool:
        self._sync()
        return super().__eq__(other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> Any:
        return collections.Counter, (self.copy(),)

    def get(self, key: Any, default: Any = None) -> Any:
        self._sync()
        return super().get(key, default)

    def keys(self) -> Any:
        self._sync()
        return super().keys()

    def values(self) -> Any:
        self._sync()
        return super().values()

    def items(self) -> Any:
        self._sync()
        return super().items()

    def copy(self) -> "collections.Counter":
        self._sync()
        return collections.Counter(dict(super().items()))

    def most_common(self, n: Optional[int] = None) -> list:
        self._sync()
        return super().most_common(n)

    def total(self) -> int:
        self._sync()
        return sum(super().values())

    def elements(self) -> Any:
        self._sync()
        return super().elements()

    def _plain(self) -> "collections.Counter":
        return self.copy()

    def __add__(self, other: Any) -> Any:
        return self._plain() + other

    def __sub__(self, other: Any) -> Any:
        return self._plain() - other

    def __or__(self, other: Any) -> Any:
        return self._plain() | other

    def __and__(self, other: Any) -> Any:
        return self._plain() & other

    def __pos__(self) -> Any:
        return +self._plain()

    def __neg__(self) -> Any:
        return -self._plain()


class CounterMirror:
    """What one Counters object has added to Dynamo's counters so far, and the live counter it is
    registered with."""

    __slots__ = ("_counters", "_scalars", "_eager", "_copied", "_failures", "_live", "__weakref__")

    def __init__(self, counters: Optional[Counters] = None) -> None:
        self._counters = counters
        self._live: Optional[LiveCounter] = None
        self._baseline(_ZERO)

    def _baseline(self, counters: Counters) -> None:
        """Count from ``counters``' values on: what they hold now is taken as added already."""
        self._scalars: tuple = _read_scalars(counters)
        self._eager: dict[str, int] = dict(counters.eager_calls)
        self._copied: dict[str, int] = dict(counters.copied_by_kind)
        self._failures = len(counters.capture_failures)

    def reset(self) -> None:
        """The counters are about to go back to zero (``CGBackend.reset``): what they counted so
        far is added first, and nothing of it is added twice."""
        live = self._live
        if live is not None and _installed() is live:
            self.flush(live)
        self._baseline(_ZERO)

    def begin(self, counters: Counters) -> None:
        """Before an instance counts anything (a call, a compile): if Dynamo's counters were cleared
        since, what was counted before is not added; install a live counter and register."""
        live = _installed()
        if live is not None and live is self._live:
            return
        self._counters = counters
        if self._live is not None:  # ours was cleared away (or replaced): start from now
            self._baseline(counters)
        if not isinstance(live, LiveCounter):
            table = _dynamo_counters()
            if table is None:
                return
            fresh = LiveCounter()
            if live:
                dict.update(fresh, live)  # keep whatever was put there before us
            table[KEY] = fresh
            live = fresh
        live._mirrors.add(self)
        self._live = live

    def push(self, counters: Counters) -> None:
        """Add now what changed (a compile, ``cgbackend.stats()``), rather than at the next read."""
        self.begin(counters)
        if self._live is not None:
            self.flush(self._live)

    def flush(self, target: LiveCounter) -> None:
        """Add to ``target`` (with dict operations: it syncs on reads) what changed since last time."""
        counters = self._counters
        if counters is None:
            return
        scalars = _read_scalars(counters)
        eager = counters.eager_calls
        copied = counters.copied_by_kind
        failures = len(counters.capture_failures)
        if scalars != self._scalars:
            for name, now, before in zip(_SCALARS, scalars, self._scalars):
                if now != before:
                    _add(target, name, now - before)
            self._scalars = scalars
        if eager != self._eager:
            self._eager = _add_map(target, "eager_calls.", eager, self._eager)
        if copied != self._copied:
            self._copied = _add_map(target, "copied_by_kind.", copied, self._copied)
        if failures != self._failures:
            _add(target, "capture_failures", failures - self._failures)
            self._failures = failures


def _add(target: dict, key: str, delta: int) -> None:
    dict.__setitem__(target, key, dict.get(target, key, 0) + delta)


def _add_map(target: dict, prefix: str, now: dict, before: dict) -> dict:
    """Add the per-key changes of a Counter of counts to ``target``; returns a copy of ``now``."""
    for key, value in now.items():
        delta = value - before.get(key, 0)
        if delta:
            _add(target, prefix + key, delta)
    return dict(now)


@functools.lru_cache(maxsize=1)
def _dynamo_counters() -> Any:
    """torch._dynamo.utils.counters (a defaultdict of Counters, cleared in place), or None."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without Dynamo
        return None
    return counters if isinstance(counters, collections.defaultdict) else None


def _installed() -> Any:
    """What Dynamo's counters hold for cgbackend now (None: nothing; never creates an entry)."""
    table = _dynamo_counters()
    return table.get(KEY) if table is not None else None
