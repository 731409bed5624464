"""What every replay of a region's entry does around the graph: the caller's inputs staged into
the entry's static buffers before it, the copy-backs and the pool's live mark after it, counted.
The full path (region.py), the fast path (fast.py) and a training forward (backward.py's
autograd.Function) each replay through the region's :class:`Replayer`."""

from __future__ import annotations

from typing import Any, Optional

from .caller_graphs import CallerGraph
from .entries import Entry, copy_all, is_static_address
from .inputs import fill_padding
from .layouts import compact_view, copy_into
from .spec import COPY, RegionCounts, RegionSpec

__all__ = ["Replayer"]


class Replayer:
    """Stages inputs and finishes replays for one region (its spec's input kinds, its counts)."""

    __slots__ = ("kinds", "counts", "counters")

    def __init__(self, spec: RegionSpec, counts: RegionCounts) -> None:
        self.kinds = spec.kinds
        self.counts = counts
        self.counters = counts.counters

    def stage(self, entry: Entry, ins: list, fresh: bool, static: Optional[list] = None) -> None:
        """Copy the caller's inputs into the entry's static buffers (``static``: those buffers in
        ``copy_pos`` order, when the caller has them at hand) and count the copies; nothing to copy
        for a ``fresh`` entry, whose capture just read these inputs."""
        counters = self.counters
        if not fresh:
            static_ins = entry.static_ins
            pad_dims = entry.pad_dims
            compact = entry.compact
            if not pad_dims:
                copy_all(static if static is not None else entry.copy_dst,
                         [ins[p] for p in entry.copy_pos] if not compact else
                         [compact_view(ins[p], compact[p]) if p in compact else ins[p] for p in entry.copy_pos])
            else:
                for pos in entry.copy_pos:
                    value = ins[pos]
                    dim = pad_dims.get(pos)
                    if dim is None:
                        copy_into(static_ins[pos], value, compact.get(pos, ()))
                    else:  # the actual rows as the prefix of the padded buffer, then copies of the last
                        fill_padding(static_ins[pos], value, dim, entry.pad_block[pos])
            counters.copies_made += len(entry.copy_pos)
            copy_kinds = entry.copy_kinds
            if copy_kinds is None:
                copy_kinds = entry.copy_kinds = tuple(self._copy_kind(ins[pos], pos) for pos in entry.copy_pos)
            by_kind = counters.copied_by_kind
            for kind in copy_kinds:
                by_kind[kind] += 1
        counters.copies_avoided += len(entry.in_place_pos)

    def _copy_kind(self, value: Any, pos: int) -> str:
        if is_static_address(value):
            return "param"
        return "user_input" if self.kinds[pos] == COPY else "eager_value"

    def finish(self, entry: Entry, ins: list, call: Any) -> None:
        """After the entry's graph replayed: inputs the region writes copied back to the caller's
        tensors, the graph marked live for this call (pool.py), the replay counted."""
        for pos in entry.copy_back_pos:
            ins[pos].copy_(entry.static_ins[pos])
        counters = self.counters
        counters.copy_backs += len(entry.copy_back_pos)
        entry.pool.acquire(entry.index)
        call.live.append((entry.pool, entry.index))
        self.counts.replays += 1
        counters.replays += 1

    def replay_caller(self, graph: CallerGraph) -> Any:
        """Replay a caller graph (runtime/caller_graphs.py); its outputs go to the caller as they are."""
        graph.graph.replay()
        counters = self.counters
        self.counts.replays += 1
        counters.replays += 1
        counters.handout_replays += 1
        return graph.outputs
