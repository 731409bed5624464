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
return no view of an input and call no opaque module (:meth:`CallerGraphs.applies`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from ..common.fx_utils import iter_tensors
from .capture import CaptureError, SimulatedGraph
from .entries import Entry, reserved
from .held import HeldStorages, use_counts_supported
from .shared import RuntimeShared
from .sharing import LayerSharing
from .spec import RegionCode, RegionCounts, RegionSpec, RegionState

__all__ = ["CallerGraph", "CallerGraphs"]

log = logging.getLogger(__name__)


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


class CallerGraphs:
    """The caller graphs of one region's inference entries: whether an entry gets any, which one a
    call replays, and their capture (counted; a failure is recorded once, and the region then
    copies its outputs)."""

    def __init__(self, spec: RegionSpec, code: RegionCode, state: RegionState, shared: RuntimeShared,
                 counts: RegionCounts, sharing: Optional[LayerSharing] = None) -> None:
        self.spec = spec
        self.sharing = sharing if sharing is not None else LayerSharing(shared.layer_copies, None)
        """How many layers share the region's graph (sharing.py)."""
        self.code = code
        self.state = state
        self.shared = shared
        self.counts = counts
        self.failed: Optional[str] = None
        """The error of a failed caller-graph capture: the region captures no more of them."""

    def applies(self, entry: Entry) -> bool:
        """May ``entry``'s outputs go to the caller from caller graphs (module docstring)?"""
        shared = self.shared
        # Not for layers of a stack (regional.py): each would hold its own caller graphs and their
        # memory, to save one copy of a layer's output that the next layer reads anyway.
        return (self.state.terminal and shared.config.handout_graphs > 0 and self.sharing.copies == 1
                and use_counts_supported()
                and type(entry) is Entry and self.spec.hooks is None and entry.input_views is None
                and not entry.pad_dims and not entry.copy_back_pos and not entry.volatile_pos
                and any(t.numel() for t in iter_tensors(entry.outputs)))

    def pick(self, entry: Entry) -> Optional[CallerGraph]:
        """A caller graph of ``entry`` whose earlier outputs nobody holds (captured now if all are
        held and the option allows one more), or None: the entry's own graph runs, outputs copied."""
        graphs = entry.caller_graphs
        for caller in graphs:
            if caller.free():
                return caller
        if len(graphs) >= self.shared.config.handout_graphs or self.failed is not None:
            return None
        return self._capture(entry)

    def _capture(self, entry: Entry) -> Optional[CallerGraph]:
        """Capture ``entry``'s region again, from its static inputs (staged for this call), in a
        pool of its own. A failure is recorded once; the region then copies its outputs."""
        shared = self.shared
        name = self.spec.name
        pool = shared.pools.private(entry.pool.device)
        static_ins = entry.static_ins
        fn = self.code.fn
        device = torch.device(entry.pool.device)
        reserved_before = reserved(device, settle=not shared.capturer.simulate)
        start = time.perf_counter()
        try:
            graph, outputs = shared.capturer.capture(
                lambda: fn(*static_ins), pool, restore=[t for t in static_ins if isinstance(t, torch.Tensor)],
                once=self.spec.collectives)
        except CaptureError as exc:
            self.failed = str(exc)
            shared.counters.handout_failures.append({"region": name, "error": str(exc)})
            if shared.config.strict:
                raise RuntimeError(f"cgbackend: capturing a caller graph of region {name} failed: {exc}")
            log.warning("cgbackend: capturing a caller graph of %s failed; its outputs are copied: %s",
                        name, exc)
            return None
        elapsed = time.perf_counter() - start
        if isinstance(graph, SimulatedGraph):
            graph.attach(pool, pool.new_index())
        caller = CallerGraph(graph, outputs, pool)
        entry.caller_graphs.append(caller)
        shared.caller_storages |= caller.storages()
        shared.counters.handout_graphs += 1
        self.counts.capture_cost(entry, elapsed, reserved(device) - reserved_before)
        log.log(logging.INFO if elapsed > 1.0 else logging.DEBUG, "cgbackend: captured caller graph %d of %s in %.3f s",
                len(entry.caller_graphs), name, elapsed)
        return caller
