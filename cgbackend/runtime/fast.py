"""The inference fast path of a region: the entry replayed last is remembered with the parts of its
key, and the next call checks those parts one by one (same shapes, strides, dtypes, numbers,
parameter addresses and inference mode) instead of building the full key. A call that differs in
anything, or that the replay-order rule forbids now, takes the full path (``RegionRunner.__call__``).

One entry is remembered per address of the region's first parameter: the layers of a stack that
share the region (regional.py) call it in turn, each with its own parameters, and each finds its
own entry with one dictionary lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from .entries import COPY, PARAM, VALUE, Entry, freeze

if TYPE_CHECKING:
    from .region import RegionRunner

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
        """The parameters' addresses (GraphCache.param_key)."""
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
    def __init__(self, runner: "RegionRunner") -> None:
        self.runner = runner
        kinds, mutated = runner.kinds, runner.mutated
        self.ok = (runner.hooks is None and runner.bucket is None
                   and all(k is PARAM or k is COPY or k is VALUE for k in kinds)
                   and all(kinds[p] is PARAM for p in mutated))
        """Inference calls may take the fast path: the region reads only parameters, the caller's
        tensors and numbers, pads nothing, and writes only inputs it reads in place (a static KV
        cache's buffers: nothing to copy back)."""
        self.remembered: dict[int, _Remembered] = {}
        """By the first parameter's address: the inference entry replayed last for it and what its
        key was made of (cleared when an entry is dropped)."""
        self._first = runner.cache.param_pos[0] if runner.cache.param_pos else None

    def clear(self) -> None:
        self.remembered = {}

    def _slot(self, ins: list) -> int:
        first = self._first
        return 0 if first is None else ins[first].data_ptr()

    def note(self, entry: Entry, ins: list) -> None:
        """Remember an inference entry this call replays (or captured), with the parts of its key
        (GraphCache.keys, just computed for it)."""
        runner = self.runner
        if not self.ok or type(entry) is not Entry or entry.input_views is not None \
                or entry.pad_dims or runner.shared.params.volatile is not None:
            self.remembered.pop(self._slot(ins), None)
            return
        kinds = runner.kinds
        cache = runner.cache
        tensors = tuple((p, ins[p].shape, ins[p].stride(), ins[p].dtype) for p in cache.other_pos
                        if kinds[p] is not VALUE)
        values = tuple((p, freeze(ins[p])) for p in cache.other_pos if kinds[p] is VALUE)
        written = runner.written
        offsets = tuple((p, ins[p].storage_offset(), ins[p].element_size()) for p in written)
        stores = frozenset(ins[p].untyped_storage().data_ptr() for p in written)
        self.remembered[self._slot(ins)] = _Remembered(
            entry, torch.is_inference_mode_enabled(), tensors, values, cache.param_key, cache.aligned_ptrs(),
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
        runner = self.runner
        cache = runner.cache
        if cache.param_pos and not cache.same_params(ins, fast.params, fast.ptrs):
            return None
        if runner.written and _shares_written(ins, fast, runner.overlap_pos):
            return None  # the full path tells a real overlap (run eagerly) from a shared storage
        entry = fast.entry
        pool = entry.pool
        if pool.live and pool.hazard(entry.index):
            return None
        runner.stage_inputs(entry, ins, False, fast.static)
        counters = runner.shared.counters
        if entry.caller_graphs is not None:
            caller = runner.recorder.caller_graph(entry)
            if caller is not None:
                counters.fast_replays += 1
                return runner.replay_caller_graph(caller)
        entry.graph.replay()
        pool.acquire(entry.index)
        call.live.append((pool, entry.index))
        runner.replays += 1
        counters.replays += 1
        counters.fast_replays += 1
        return entry.outputs
