"""The inference fast path of a region: the entry replayed last is remembered with the parts of its
key, and the next call checks those parts one by one (same shapes, strides, dtypes, numbers,
parameter addresses and inference mode) instead of building the full key. A call that differs in
anything, or that the replay-order rule forbids now, takes the full path (``RegionRunner.__call__``).
It reads the region's spec and parameter addresses and replays through the region's Replayer; it
holds nothing of the runner.

One entry is remembered per address of the region's first parameter: the layers of a stack that
share the region (regional.py) call it in turn, each with its own parameters, and each finds its
own entry with one dictionary lookup.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .caller_graphs import CallerGraphs
from .entries import Entry, freeze
from .params import ParamAddresses, ParamPolicy
from .replay import Replayer
from .spec import COPY, PARAM, VALUE, RegionCounts, RegionSpec

__all__ = ["FastPath"]


class _Remembered:
    """The entry, the inference mode and key parts of the call that replayed it last, and its static
    input buffers."""

    __slots__ = ("entry", "inference", "tensors", "values", "params", "ptrs", "static", "offsets", "stores")

    def __init__(self, entry: Entry, inference: bool, tensors: tuple, values: tuple, params: tuple,
                 ptrs: Optional[list], static: list, offsets: tuple, stores: frozenset) -> None:
        self.entry = entry
        self.inference = inference
        self.tensors = tensors
        """(position, shape, stride, dtype) of each tensor input other than parameters."""
        self.values = values
        """(position, frozen value) of each number input."""
        self.params = params
        """The parameters' addresses (ParamAddresses.key)."""
        self.ptrs = ptrs
        """The same, aligned with the inputs, for PyTorch's C++ comparison (None without it)."""
        self.static = static
        """What the copied inputs are copied into, in entry.copy_pos order (entry.copy_dst)."""
        self.offsets = offsets
        """(position, storage offset, element size) of each input the region writes."""
        self.stores = stores
        """The storages of the inputs the region writes, by data_ptr()."""


def _shares_written(ins: list, fast: _Remembered, others: tuple) -> bool:
    """Does a copied input (``others``) lie in the storage of an input the region writes? The fast
    path's conservative form of inputs.overlap: one storage lookup per copied input, no spans. The
    written inputs are parameters (FastPath.ok) whose addresses the caller found unchanged; with
    the same storage offset and element size, each one's storage starts where it did when the entry
    was remembered, so their storages are the remembered ones (``fast.stores``)."""
    for pos, offset, size in fast.offsets:
        value = ins[pos]
        if value.storage_offset() != offset or value.element_size() != size:
            return True  # a view elsewhere in some storage: the full path decides
    stores = fast.stores
    for pos in others:
        value = ins[pos]
        if value.layout is not _STRIDED or value.untyped_storage().data_ptr() in stores:
            return True
    return False


_STRIDED = torch.strided


class FastPath:
    """The inference fast path of one region: what it remembers, and the replay it makes. It stages
    and finishes through the region's Replayer and picks caller graphs through its CallerGraphs."""

    def __init__(self, spec: RegionSpec, params: ParamAddresses, policy: ParamPolicy, replayer: Replayer,
                 callers: CallerGraphs, counts: RegionCounts) -> None:
        kinds, written = spec.kinds, spec.written
        self.kinds = kinds
        self.params = params
        self.policy = policy
        self.replayer = replayer
        self.callers = callers
        self.counts = counts
        self.counters = counts.counters
        self.param_pos = spec.param_pos
        self.other_pos = spec.other_pos
        self.written = written
        self.overlap_pos = spec.overlap_pos
        self.ok = (spec.hooks is None and spec.bucket is None
                   and all(k is PARAM or k is COPY or k is VALUE for k in kinds)
                   and all(kinds[p] is PARAM for p in written))
        """Inference calls may take the fast path: the region reads only parameters, the caller's
        tensors and numbers, pads nothing, and writes only inputs it reads in place (a static KV
        cache's buffers: nothing to copy back)."""
        self.remembered: dict[int, _Remembered] = {}
        """By the first parameter's address: the inference entry replayed last for it and what its
        key was made of (cleared when an entry is dropped)."""
        self._first = spec.param_pos[0] if spec.param_pos else None

    def clear(self) -> None:
        self.remembered = {}

    def _slot(self, ins: list) -> int:
        first = self._first
        return 0 if first is None else ins[first].data_ptr()

    def note(self, entry: Entry, ins: list) -> None:
        """Remember an inference entry this call replays (or captured), with the parts of its key
        (GraphCache.keys, just computed for it)."""
        if not self.ok or type(entry) is not Entry or entry.input_views is not None \
                or entry.pad_dims or self.policy.volatile is not None:
            self.remembered.pop(self._slot(ins), None)
            return
        kinds = self.kinds
        tensors = tuple((p, ins[p].shape, ins[p].stride(), ins[p].dtype) for p in self.other_pos
                        if kinds[p] is not VALUE)
        values = tuple((p, freeze(ins[p])) for p in self.other_pos if kinds[p] is VALUE)
        written = self.written
        offsets = tuple((p, ins[p].storage_offset(), ins[p].element_size()) for p in written)
        stores = frozenset(ins[p].untyped_storage().data_ptr() for p in written)
        params = self.params
        self.remembered[self._slot(ins)] = _Remembered(
            entry, torch.is_inference_mode_enabled(), tensors, values, params.key, params.aligned(),
            entry.copy_dst, offsets, stores)

    def replay(self, ins: list, call: Any) -> Any:
        """Replay the remembered entry if this call's key is its key; None otherwise. Its inputs are
        copied with one ``_foreach_copy_``; the parameter addresses take one C++ comparison on CUDA
        builds."""
        fast = self.remembered.get(self._slot(ins))
        if fast is None or torch.is_inference_mode_enabled() is not fast.inference:
            return None
        for pos, shape, stride, dtype in fast.tensors:
            value = ins[pos]
            if value.shape != shape or value.dtype != dtype or value.stride() != stride:
                return None
        for pos, frozen in fast.values:
            if freeze(ins[pos]) != frozen:
                return None
        if self.param_pos and not self.params.same(ins, fast.params, fast.ptrs):
            return None
        if self.written and _shares_written(ins, fast, self.overlap_pos):
            return None  # the full path tells a real overlap (run eagerly) from a shared storage
        entry = fast.entry
        pool = entry.pool
        if pool.live and pool.hazard(entry.index):
            return None
        self.replayer.stage(entry, ins, False, fast.static)
        counters = self.counters
        if entry.caller_graphs is not None:
            caller = self.callers.pick(entry)
            if caller is not None:
                counters.fast_replays += 1
                return self.replayer.replay_caller(caller)
        entry.graph.replay()
        pool.acquire(entry.index)
        call.live.append((pool, entry.index))
        self.counts.replays += 1
        counters.replays += 1
        counters.fast_replays += 1
        return entry.outputs
