"""What a training entry's memory goes to once its backward graph exists: the saved activations
the capture's autograd graph held (freed, or loosened for a region that cannot compute its forward
again: saved.py), the static inputs that need no gradient, and the outputs that hold their incoming
gradient (given to the pool's last backward graph: tangents.py). pool.py says when each is safe;
backward.py's Backward asks for each at its captures and replays."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .capture import SimulatedGraph, first_line
from .entries import TrainEntry
from .inner import KEEP_GRAPH
from .loose_outputs import StorageWeakRef, loose_alias, loose_supported
from .saved import Loosening, loosening_supported, pool_ranges
from .stats import Counters
from .tangents import OwnerTransfer, owner_transfer_supported

__all__ = ["BackwardMemory"]

log = logging.getLogger(__name__)

LOOSENING = loosening_supported()


class BackwardMemory:
    """Releases the memory of one region's training entries (see the module docstring). Kept by the
    pools whose release waits (PoolState.releasable), which call :meth:`release_saved`."""

    def __init__(self, name: str, recomputable: bool, counters: Counters) -> None:
        self.name = name
        self.recomputable = recomputable
        """The region computes the same thing a second time (RegionSpec.recomputable): its saved
        activations are freed, not loosened."""
        self.counters = counters

    def settle(self, entry: TrainEntry) -> None:
        """After a backward of ``entry`` through its backward graph: its saved activations are to
        be freed once no capture can receive their blocks (pool.py, "Released memory"). The pool
        is sealed now; the release waits for the pool's other awaited backward graphs."""
        if entry.released or entry.bwd_graph is None or not (self.recomputable or self.loosens(entry)):
            return
        pool = entry.pool
        if any(e is entry for _, e in pool.releasable):
            return
        pool.sealed = True
        pool.releasable.append((self, entry))
        pool.release_ready()

    def release_inputs(self, entry: TrainEntry) -> list:
        """Before the last backward graph of a pool is captured, consuming the saved activations:
        the static inputs made in the pool that need no gradient are kept only as tensors on
        storages that do not own their memory. Once the capture's autograd graph has used what it
        saved of them, their blocks are free for that graph's later temporaries, as cudagraph trees
        frees its recording inputs after their last use. Each forward replay's staging copy writes
        them first; between the forward replay and the backward graph nothing but a backward on
        the forward computed again reads them, and it runs instead of the graph (backward.py, Backward.run).
        Only where a backward that keeps the graph can be told (KEEP_GRAPH). Returns what to
        count once the capture is over (count_released)."""
        if not entry.pooled_pos or KEEP_GRAPH is None or not loose_supported() or StorageWeakRef is None:
            return []
        pending = []
        for pos in entry.pooled_pos:  # none shares its storage with an output (recorder.py)
            buf = entry.static_ins[pos]
            storage = buf.untyped_storage()
            alias = loose_alias(buf)
            entry.static_ins[pos] = alias
            entry.copy_dst[entry.copy_pos.index(pos)] = alias
            pending.append((pos, StorageWeakRef(storage), storage.nbytes()))
            del buf, storage
        return pending

    def release_grad_outputs(self, entry: TrainEntry, grad_outs: list) -> Optional[OwnerTransfer]:
        """Before the last backward graph of a pool is captured: the outputs that take their
        incoming gradient in their own memory (recorder.py, ``grad_out_shared``), and those
        without a gradient that nothing but the caller's copy reads (``nondiff_loose``), are kept
        only as tensors on storages that do not own it, in ``entry.outputs``, in ``grad_outs``
        (the static gradient buffers) and, through ``.data``, in the captured forward's outputs.
        The owners of the gradient buffers go to the capture in the returned OwnerTransfer, which gives
        each to the compiled backward that frees it after its last read; the others go now, for
        the capture to reuse from its start (tangents.py says why that is safe)."""
        if (not (entry.grad_out_shared or entry.nondiff_loose) or not loose_supported()
                or not owner_transfer_supported()):
            return None
        transfer = OwnerTransfer()
        outputs = list(entry.outputs)
        slots = {pos: k for k, pos in enumerate(entry.diff_out) if pos in entry.grad_out_shared}
        for pos in sorted(entry.grad_out_shared | entry.nondiff_loose):
            alias = loose_alias(outputs[pos])
            try:
                entry.capture_outs[pos].data = alias
            except RuntimeError as exc:  # an output whose data cannot be swapped keeps its buffer
                log.debug("cgbackend: %s keeps the memory of output %d: %s", self.name, pos,
                          first_line(exc))
                continue
            transfer.add(pos, alias, outputs[pos], keep=pos in slots)
            outputs[pos] = alias
            if pos in slots:
                grad_outs[slots[pos]] = alias
        entry.outputs = tuple(outputs)
        return transfer

    def count_released(self, entry: TrainEntry, pending_in: list, transfer: Optional[OwnerTransfer]) -> None:
        """The released static inputs and gradient buffers whose memory went back to the pool:
        nothing else held them (the capture's autograd graph, which saved some inputs, is gone by
        now). One still held elsewhere stays allocated, and its alias reads it."""
        for pos, ref, nbytes in pending_in:
            if ref.expired():
                entry.released_in[pos] = nbytes
        if transfer is None:
            return
        entry.released_out = transfer.released()
        counters = self.counters
        counters.grad_outputs_released += len(entry.grad_out_shared.intersection(entry.released_out))
        counters.grad_outputs_released_in_capture += transfer.given
        log.debug("cgbackend: %s released %d output(s) (%d B); %d gradient buffer(s) at their last read "
                  "in the capture", self.name, len(entry.released_out),
                  sum(entry.released_out.values()), transfer.given)

    def loosens(self, entry: TrainEntry) -> bool:
        """Does ``entry`` release its saved activations by loosening them (saved.py): a region that
        cannot compute its forward again, with CUDA graphs, where torch has what it takes?"""
        return (not self.recomputable and LOOSENING and entry.saved is not None
                and not isinstance(entry.graph, SimulatedGraph))

    @staticmethod
    def loosening(entry: TrainEntry) -> Optional[Loosening]:
        """The loosening of ``entry``'s saved tensors made in its pool, or None where the allocator
        does not tell the pool's segments (the entry then keeps them, and is not asked again)."""
        pool = entry.pool
        ranges = pool_ranges(pool.handle, torch.device(pool.device))
        if ranges is None:
            entry.saved = None
            return None
        return Loosening(entry.saved, ranges)

    def release_saved(self, entry: TrainEntry, loosening: Optional[Loosening] = None) -> None:
        """Drop the capture's autograd graph (and with it the saved activations it held); for a
        region that cannot compute its forward again, keep the graph and loosen what it saved."""
        if self.recomputable:
            entry.capture_outs = None
        else:
            loosening = loosening or self.loosening(entry)
            if loosening is None:
                return
            loosening.rest()
            entry.saved_bytes = loosening.freed_bytes()
        entry.released = True
        counters = self.counters
        counters.saved_released += 1
        counters.saved_released_bytes += entry.saved_bytes
