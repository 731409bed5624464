"""Outputs handed to the caller without a copy (option ``handout_graphs``).

A region's graph writes its outputs into the same memory on every replay, so the executor gives the
caller copies of them (outputs.py): an output the caller keeps must never be overwritten by a later
replay (docs/design.md). On small models whose calls are bound by host time, those copies were the
largest part of what a call cost beyond reduce-overhead's (which copies nothing and raises when an
overwritten output is read); on large ones, the copy of a 32 MiB output was a kernel of its own.

A *handout graph* is a second capture of an inference entry's graph, in a memory pool of its own, so
that no other graph's temporaries lie in its outputs and replaying any other graph never touches
them. Its outputs go to the caller as aliases (``detach()``: a new tensor object on the same
storage). Before it is replayed again, :meth:`HandoutGraph.free` checks that nobody holds them any
more: the use count of each output storage is back to what the runtime itself holds (every tensor
or view made from an output holds one), and so is the reference count of the storage's Python
object (what ``out.untyped_storage()`` returns). A call whose handout graphs
are all held replays the entry's own graph and copies its outputs, as without handout graphs; the
outputs kept by the caller are never written.

Only the last static region of a Dynamo graph qualifies (no static region reads its outputs, so no
graph was captured at their addresses), for inference entries that write no input, pad nothing,
return no view of an input and call no opaque module (runtime/region.py decides).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from ..common.fx_utils import iter_tensors

__all__ = ["HandoutGraph", "HeldStorages", "handout_supported"]

_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)
"""Feature-tested private API (torch 2.11 and 2.13; cudagraph trees uses it): the strong references
to a storage, by its ``_cdata``."""


def handout_supported() -> bool:
    return _use_count is not None


class HeldStorages:
    """Whether anything outside the runtime holds the storages of some tensors: each storage's use
    count (every tensor or view on it holds one) and its Python object's reference count, against
    the counts of :meth:`mark` (taken while nothing was handed out). A few calls per check, however
    many tensors share the storages."""

    __slots__ = ("_storages", "_base")

    def __init__(self, tensors: Any) -> None:
        storages: dict[int, Any] = {}
        for t in iter_tensors(tensors):
            if t.numel():
                storages.setdefault(t.untyped_storage()._cdata, t.untyped_storage())
        self._storages = tuple(storages.values())
        """Each storage's Python object, kept: a caller holding only ``out.untyped_storage()`` (the
        same object) adds no reference to the storage, only to this object."""
        del storages
        self._base: Optional[list] = None

    def _now(self) -> list:
        """(use count, Python reference count) of each storage, read the same way every time."""
        counts = []
        for storage in self._storages:
            counts.append((_use_count(storage._cdata), sys.getrefcount(storage)))
        return counts

    def mark(self) -> None:
        """Take the counts of the runtime's own references (nothing handed out now)."""
        self._base = self._now()

    def mark_once(self) -> None:
        if self._base is None:
            self.mark()

    def free(self) -> bool:
        """Nobody outside the runtime holds any of the storages (True before :meth:`mark` only if
        there are none)."""
        return self._now() == self._base if self._base is not None else not self._storages


class HandoutGraph:
    """One handout graph of an entry: the graph, its static outputs, its pool, and each output
    storage's use count when nothing but the runtime held it."""

    __slots__ = ("graph", "outputs", "pool", "held")

    def __init__(self, graph: Any, outputs: Any, pool: Any) -> None:
        self.graph = graph
        self.outputs = outputs
        self.pool = pool
        self.held = HeldStorages(outputs)
        self.held.mark()

    def free(self) -> bool:
        """Nobody outside the runtime holds any of the outputs' storages: replaying is safe."""
        return self.held.free()

    def storages(self) -> set[int]:
        """Data pointers of the output storages (the executor hands these out as aliases)."""
        return {t.untyped_storage().data_ptr() for t in iter_tensors(self.outputs) if t.numel()}
