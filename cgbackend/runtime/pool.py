"""Graph memory pools and the replay-order rule that keeps graphs from overwriting live data.

All graphs of a backend instance on one device share one pool (a fresh one
once it is sealed, below). A training forward that starts while ``k`` earlier
forwards still wait for their backward uses call slot ``k``: graphs of its own,
captured in the same pool after the earlier ones, so the layers of a deep model
(or micro-batches kept for one backward) share temporaries as eager's do, and
the rule below keeps each graph's live data from the others.

The rule. cgbackend never frees a graph's static inputs, saved activations or
outputs, except the last region's inference outputs, which are copied for the
caller before any other replay (runtime/loose_outputs.py), and the static
inputs a pool's last backward graph receives (runtime/backward_memory.py,
``BackwardMemory.release_inputs``: captured last, into a sealed pool, no other graph
can hold them). So the only memory
two graphs of a pool share is what a graph captured earlier no longer needs
between replays (its temporaries, with its cuBLAS workspace: capture.py; those
released outputs), which a graph captured later may have received for
anything it keeps.
Replaying graph ``g`` is therefore safe unless a graph captured after ``g`` (a
higher capture index) holds data that is still needed.
``PoolState.live`` counts the graphs whose outputs are still needed (replayed
in the current inference call, or in a training forward whose backward has not
finished); :meth:`PoolState.hazard` applies the rule before every replay.

Released memory. A training entry's saved activations are needed only between
its forward replay and its backward replay. Once every training forward of a
pool has its backward graph, nothing will be captured in that pool again (it
is *sealed*: new captures of the slot go to a fresh pool), and the entries free
their saved activations (runtime/backward_memory.py, ``BackwardMemory.settle``): the blocks
stay reserved in the pool, which no allocation outside a capture into it ever
receives, and the graphs go on writing and reading them at their addresses.
A region that cannot compute its forward again keeps its capture's autograd
graph on tensors that no longer own those blocks (runtime/saved.py).
Between steps the allocator then counts as allocated what eager holds, plus the
static buffers; cudagraph trees does the same with its pool's dead tensors.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import weakref
from typing import Any, Iterator

import torch

__all__ = ["PoolState", "PoolSet", "POOL_ROUTING"]

_begin = getattr(torch._C, "_cuda_beginAllocateCurrentThreadToPool", None)
_end = getattr(torch._C, "_cuda_endAllocateToPool", None)
_release = getattr(torch._C, "_cuda_releasePool", None)
POOL_ROUTING = _begin is not None and _end is not None and _release is not None
"""Can tensors be allocated in a graph pool outside a capture (the caching allocator's routing,
private: feature-tested; torch.cuda.use_mem_pool uses it)?"""


@dataclasses.dataclass
class PoolState:
    device: str
    slot: int
    handle: Any = None
    """torch.cuda.graph_pool_handle(), or None for simulated graphs."""
    next_index: int = 0
    live: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    graphs: list = dataclasses.field(default_factory=list)
    """Simulated graphs of this pool (they model what replays may do to each other's memory)."""
    sealed: bool = False
    """No graph is captured in this pool any more but the backward graphs still awaited: a
    training entry asked to release its saved activations (PoolSet.get then makes a new pool)."""
    awaiting_backward: int = 0
    """Training entries of this pool whose backward graph is neither captured nor failed yet: their
    capture could receive released blocks, so nothing is released while any is awaited."""
    releasable: list = dataclasses.field(default_factory=list)
    """Training entries waiting for ``awaiting_backward`` to reach 0 to release their saved
    activations, with the backward side that releases them."""

    grad_owners: list = dataclasses.field(default_factory=list)
    """Training entries of this pool whose backward graph owns the gradients it writes, until
    they are loosened (runtime/loose_grads.py)."""
    given_loose: dict = dataclasses.field(default_factory=dict)
    """Loosened entries whose gradients are given out, by id: (the first capture index that may
    lie in their memory, a check that says whether someone still holds them)."""

    routed: bool = False
    """This pool's use count holds one reference of ours (``allocating``), dropped when it goes."""

    def allocating(self) -> Any:
        """Route this thread's allocations into the pool (outside a capture): the tensors made
        are pool blocks, which once freed only a capture into this pool can receive."""
        if self.handle is None or not POOL_ROUTING:
            return contextlib.nullcontext()
        return self._routed()

    @contextlib.contextmanager
    def _routed(self) -> Iterator[None]:
        device = torch.device(self.device).index
        device = torch.cuda.current_device() if device is None else device
        _begin(device, self.handle)  # the allocator takes a reference on the pool for each begin
        try:
            yield
        finally:
            _end(device, self.handle)
            if self.routed:
                _release(device, self.handle)
            else:
                # One reference kept while this PoolState lives: the pool may have no graph yet,
                # and a pool whose references all went may not be taken again.
                self.routed = True
                weakref.finalize(self, _release, device, self.handle).atexit = False

    def new_index(self) -> int:
        self.next_index += 1
        return self.next_index - 1

    def acquire(self, index: int) -> None:
        self.live[index] += 1

    def release(self, index: int) -> None:
        left = self.live[index] - 1
        if left > 0:
            self.live[index] = left
        else:
            self.live.pop(index, None)

    def backward_settled(self) -> None:
        """A training entry's backward graph was captured, or failed to be, or the entry went."""
        self.awaiting_backward -= 1
        self.release_ready()

    def release_ready(self) -> None:
        """Free the saved activations of the releasable entries once no backward graph is awaited
        here (so no capture will be made in this pool again)."""
        if self.awaiting_backward or not self.releasable:
            return
        for side, entry in self.releasable:
            side.release_saved(entry)
        self.releasable.clear()

    def hazard(self, index: int) -> bool:
        """Would replaying the graph with capture index ``index`` risk clobbering live data: data a
        graph captured after it still needs, or gradients given out whose blocks it may have
        received (runtime/loose_grads.py)?"""
        if any(other > index for other in self.live):
            return True
        given = self.given_loose
        if given:
            for key, (start, held) in list(given.items()):
                if start <= index:
                    if held():
                        return True
                    del given[key]
        return False


class PoolSet:
    """The pools of one backend instance, by (device, slot)."""

    def __init__(self, simulate: bool) -> None:
        self._simulate = simulate
        self._pools: dict[tuple[str, int], PoolState] = {}

    def private(self, device: str) -> PoolState:
        """A pool of its own for one graph (a caller graph, runtime/caller_graphs.py): it shares memory
        with no other graph, so no replay-order rule applies to it. Not kept here: it lives as long
        as its graph."""
        handle = None
        if not self._simulate:
            with torch.cuda.device(torch.device(device)):
                handle = torch.cuda.graph_pool_handle()
        return PoolState(device=device, slot=-1, handle=handle)

    def get(self, device: torch.device, slot: int) -> PoolState:
        """The pool new graphs of ``slot`` are captured in: a fresh one once the last was sealed."""
        key = (str(device), slot)
        pool = self._pools.get(key)
        if pool is None or pool.sealed:
            handle = None
            if not self._simulate:
                with torch.cuda.device(device):
                    handle = torch.cuda.graph_pool_handle()
            pool = PoolState(device=str(device), slot=slot, handle=handle)
            self._pools[key] = pool
        return pool
