"""Whether anything outside the runtime holds some tensors' storages, read from the storages' use
counts: the outputs of caller graphs (runtime/caller_graphs.py) before they are replayed again,
and the static gradients a backward replay gave to autograd before the next one rewrites them
(runtime/static_grads.py)."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from ..common.fx_utils import iter_tensors

__all__ = ["HeldStorages", "use_counts_supported"]

_use_count: Optional[Callable[[int], int]] = getattr(torch._C, "_storage_Use_Count", None)
"""Feature-tested private API (torch 2.11 and 2.13; cudagraph trees uses it): the strong references
to a storage, by its ``_cdata``."""


def use_counts_supported() -> bool:
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
