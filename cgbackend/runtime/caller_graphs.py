"""Graphs whose outputs go to the caller without a copy (option ``handout_graphs``).

A region's graph writes its outputs into the same memory on every replay, so the executor gives the
caller copies of them (outputs.py): an output the caller keeps must never be overwritten by a later
replay (docs/design.md). On small models whose calls are bound by host time, those copies were the
largest part of what a call cost beyond reduce-overhead's (which copies nothing and raises when an
overwritten output is read); on large ones, the copy of a 32 MiB output was a kernel of its own.

A *caller graph* is a second capture of an inference entry's graph, in a memory pool of its own, so
that no other graph's temporaries lie in its outputs and replaying any other graph never touches
them. Its outputs go to the caller as aliases (``detach()``: a new tensor object on the same
storage). Before it is replayed again, :meth:`CallerGraph.free` checks that nobody holds them any
more: the use count of each output storage is back to what the runtime itself holds (every tensor
or view made from an output holds one), and so is the reference count of the storage's Python
object (what ``out.untyped_storage()`` returns; runtime/held.py). A call whose caller graphs
are all held replays the entry's own graph and copies its outputs, as with ``handout_graphs=0``; the
outputs kept by the caller are never written.

Only the last static region of a Dynamo graph qualifies (no static region reads its outputs, so no
graph was captured at their addresses), for inference entries that write no input, pad nothing,
return no view of an input and call no opaque module (runtime/region.py decides).
"""

from __future__ import annotations

from typing import Any

from ..fx_utils import iter_tensors
from .held import HeldStorages

__all__ = ["CallerGraph"]


class CallerGraph:
    """One caller graph of an entry: the graph, its static outputs, its pool, and each output
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
