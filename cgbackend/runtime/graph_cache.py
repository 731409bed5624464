"""A region's graph cache: which held graph a call may replay (its key), how bucketed calls pad,
and which graph goes when the cache is full.

Graphs are keyed on the inputs' shapes (so on the sizes a region depends on, and no other), strides,
dtypes, the addresses of what the graph reads in place (parameters, other graphs' outputs) and the
call slot; or, for an inference call of a region with a bucket plan (passes/bucket.py), on the
capture size its symbolic size pads up to: inputs sized by it are copied as the prefix of a padded
buffer (or read in place when they are a slice of another padded graph's output), outputs are
handed on as views sliced to the actual size. A region holds at most ``max_graphs_per_region``
entries, least recently used first out (``graph_cache``).

The cache reads the region's :class:`~cgbackend.runtime.spec.RegionSpec` (and through its sources
the producers' states), the shared state and the parameters' addresses; it tells whoever dropped
an entry through ``on_drop`` (the fast path forgets what it remembered).
"""

from __future__ import annotations

import bisect
import collections
import logging
from typing import Callable, Optional

import torch

from ..common.fx_utils import iter_tensors
from .capture import SimulatedGraph
from .churn import ShapeChurn
from .entries import Entry, Pad, TrainEntry, freeze
from .params import ParamAddresses
from .shared import RuntimeShared
from .sharing import LayerSharing
from .spec import EAGER, FROM_GRAPH, PARAM, VALUE, RegionCounts, RegionSpec

__all__ = ["GraphCache", "THRASH_EVICTIONS", "padded_source"]

log = logging.getLogger(__name__)

THRASH_EVICTIONS = 2
"""A region that has evicted this many times its bound of graphs stops evicting: capturing a graph
costs far more than an eager call, so a cache its signatures churn through only slows it down."""


def padded_source(padded_full: dict, value: torch.Tensor, dim: int,
                  size: int) -> tuple[tuple, Optional[torch.Tensor]]:
    """The padded shape of an input, and the full static tensor it is a slice of, if any
    (``padded_full``: RuntimeShared.padded_full)."""
    shape = list(value.shape)
    shape[dim] = size
    shape = tuple(shape)
    return shape, padded_full.get((value.data_ptr(), shape, value.stride(), value.dtype))


class GraphCache:
    """The entries of one region by key, least recently used first, and the warm-up counts of the
    signatures not captured yet."""

    def __init__(self, spec: RegionSpec, shared: RuntimeShared, counts: RegionCounts, params: ParamAddresses,
                 on_drop: Callable[[], None], sharing: Optional[LayerSharing] = None) -> None:
        self.spec = spec
        self.sharing = sharing if sharing is not None else LayerSharing(shared.layer_copies, None)
        """How many layers share the region's graph (sharing.py): scales the bound on graphs."""
        self.shared = shared
        self.counts = counts
        self.params = params
        self.on_drop = on_drop
        """Called when an entry goes (the fast path forgets the entries it remembered)."""
        self.entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        """Held graphs by key, least recently used first."""
        self.warm: dict[tuple, int] = {}
        self.evicted = 0
        self.recaptured = 0
        """Graphs captured again because a newer graph's live outputs blocked their replay."""
        self.thrashing: Optional[str] = None
        """Set when the region stopped evicting (its signatures churn through the cache)."""
        self.churn = ShapeChurn()
        """Whether the region's shapes change at every call, so it stops capturing (churn.py)."""

    # ------------------------------------------------------------------ keys

    def keys(self, ins: list, grad_path: bool, slot: int) -> tuple[Optional[tuple], tuple]:
        """(full key: slot, shapes and addresses, or None if an input a graph produces came from
        eager code; shape key: what warm-up counts, the same for every slot).

        Parameters enter by address only: Dynamo guards their shape, stride, dtype, device and
        requires_grad (a change recompiles the graph), but not their address."""
        spec = self.spec
        shape_parts: list = [grad_path, torch.is_inference_mode_enabled()]
        if spec.hooks is not None:
            shape_parts.append(spec.hooks.key())
        addr_parts: list = []
        producer_eager = False
        kinds = spec.kinds
        for pos in spec.other_pos:
            value = ins[pos]
            if kinds[pos] is VALUE:
                shape_parts.append(freeze(value))
            elif self.tensor_key(pos, value, grad_path, shape_parts, addr_parts):
                producer_eager = True
        # Which parameters, not only where: an engine may put another layer's parameters at the
        # same addresses (FSDP2's gathers in a pool of their own: cgbackend.distributed), and an
        # entry keeps the ones it was captured with (its backward checks and recomputes read them).
        # The first one's object stands for the layer (a layer's parameter objects stay the same).
        layer = id(ins[spec.param_pos[0]]) if spec.param_pos else None
        if grad_path:
            # Training warms up each layer sharing the graph on its own: all of them then capture
            # in the same step, in call order, so the k-th forward of a step is the k-th layer in
            # every later step (its call slot, part of the key). Counted together, the first
            # layers warmed up while the later ones captured, and the slots shifted by those
            # warm-up calls in the next step: every layer captured a second time.
            shape_parts.append(layer)
        shape_key = tuple(shape_parts)
        if producer_eager:
            return None, shape_key
        policy = self.shared.params
        if policy.volatile is None:
            params = self.params.addresses(ins)
        else:
            params = tuple(policy.key(ins[p]) for p in spec.param_pos)
        return (slot,) + shape_key + tuple(addr_parts) + params + (layer,), shape_key

    def tensor_key(self, pos: int, value: torch.Tensor, grad_path: bool, shape_parts: list,
                   addr_parts: list) -> bool:
        """Key parts of one tensor input read as it is; True if a graph should have produced it but
        eager code did."""
        shape_parts.append((value.shape, value.stride(), value.dtype,
                            value.requires_grad if grad_path else None))
        if value.numel() == 0:
            return False  # nothing to read: any empty tensor of that shape will do
        spec = self.spec
        kind = spec.kinds[pos]
        if kind is FROM_GRAPH:
            producer = spec.sources[pos].state
            if producer is not None:
                ptr = value.data_ptr()
                if producer.disabled is not None or ptr in producer.rebased_ptrs:
                    # Producer eager for good, or the value is a view of a caller's tensor: copy it
                    # like any eager value.
                    addr_parts.append(None)
                    return False
                addr_parts.append(ptr)
                return ptr not in self.shared.persistent_ptrs
            kind = EAGER  # eager code computes it since its region was split
        if kind is EAGER:
            ptr = value.data_ptr()
            addr_parts.append(ptr if ptr in self.shared.persistent_ptrs else None)
        return False

    # ------------------------------------------------------------------ bucketing

    def above_limit(self, actual: dict) -> bool:
        """Is this inference call's bucketed size (``actual``: its size bindings) above
        ``max_capture_size``, when one is set?"""
        limit = self.shared.config.max_capture_size
        return bool(limit) and actual[self.spec.bucket.symbol] > limit

    def padding(self, actual: dict) -> Optional[Pad]:
        """The sizes an inference call with size bindings ``actual`` (``BucketPlan.bindings``) runs
        at, or None above the largest capture size."""
        plan = self.spec.bucket
        sizes = self.shared.config.capture_sizes
        i = bisect.bisect_left(sizes, actual[plan.symbol])
        if i == len(sizes):
            return None
        padded = dict(actual)
        padded[plan.symbol] = sizes[i]
        return Pad(actual, padded)

    def padded_keys(self, ins: list, pad: Pad, slot: int) -> tuple[Optional[tuple], tuple]:
        """Like keys() for a padded call: the padded sizes stand for every input sized by them; an
        input that is the slice of another padded graph's output is read in place (its address)."""
        spec = self.spec
        plan = spec.bucket
        shared = self.shared
        shape_parts: list = ["pad", tuple(pad.padded.items()), torch.is_inference_mode_enabled()]
        if spec.hooks is not None:
            shape_parts.append(spec.hooks.key())
        addr_parts: list = []
        producer_eager = False
        for pos, value in enumerate(ins):
            kind = spec.kinds[pos]
            if kind is PARAM:
                addr_parts.append(shared.params.key(value))
                continue
            if kind is VALUE:
                if pos not in plan.value_inputs:
                    shape_parts.append(freeze(value))
                continue
            spec_in = plan.pad_inputs.get(pos)
            if spec_in is None:
                producer_eager |= self.tensor_key(pos, value, False, shape_parts, addr_parts)
                continue
            dim, size = spec_in
            shape, full = padded_source(shared.padded_full, value, dim, size(pad.padded))
            shape_parts.append((shape, value.dtype))  # its other sizes may be exact symbols
            if full is not None:
                addr_parts.append(full.data_ptr())
                continue
            producer = spec.sources[pos].state if kind is FROM_GRAPH else None
            if producer is not None and producer.bucket_symbol == plan.symbol and producer.disabled is None:
                producer_eager = True  # the producer ran eagerly this call (warming up)
            addr_parts.append(None)
        shape_key = tuple(shape_parts)
        if producer_eager:
            return None, shape_key
        layer = id(ins[self.spec.param_pos[0]]) if self.spec.param_pos else None  # which parameters (keys())
        return (slot,) + shape_key + tuple(addr_parts) + (layer,), shape_key

    def views(self, entry: Entry, pad: Pad) -> tuple:
        """The entry's static outputs sliced to this call's actual sizes (cached per size)."""
        key = tuple(pad.actual.values())
        views = entry.views.get(key)
        if views is None:
            outs = list(entry.outputs)
            for i, (dim, size) in self.spec.bucket.outputs.items():
                outs[i] = outs[i].narrow(dim, 0, size(pad.actual))
            views = entry.views[key] = tuple(outs)
        return views

    # ------------------------------------------------------------------ room

    def note_warm(self, shape_key: tuple, count: int) -> None:
        warm = self.warm
        warm[shape_key] = count
        if len(warm) > 4 * self.bound():
            del warm[next(iter(warm))]  # oldest signature seen: forget its warm-up count

    def bound(self) -> int:
        """max_graphs_per_region for each layer sharing the region (sharing.py)."""
        return self.shared.config.max_graphs_per_region * self.sharing.copies

    def make_room(self) -> bool:
        """Room for one more graph: below the bound, or after evicting the least recently used
        graph that no call still needs (graph_cache="lru")."""
        config = self.shared.config
        bound = self.bound()
        if len(self.entries) < bound:
            return True
        if config.graph_cache != "lru":
            return False
        if self.evicted >= THRASH_EVICTIONS * bound:
            if self.thrashing is None:
                self.thrashing = (f"evicted {self.evicted} graphs (more than {THRASH_EVICTIONS} x "
                                  f"max_graphs_per_region={bound}): its signatures churn; it keeps the "
                                  "graphs it holds and runs new signatures eagerly")
                log.warning("cgbackend: region %s %s", self.spec.name, self.thrashing)
            return False
        for key, entry in self.entries.items():
            if not entry.in_use():
                self.evict(key, entry)
                return True
        return False

    def evict(self, key: tuple, entry: Entry) -> None:
        """Drop a graph and its static buffers: their memory goes back to the pool, where the next
        capture finds it. Capture indices only grow, so the replay-order rule still holds."""
        del self.entries[key]
        self.release(entry)
        self.evicted += 1
        self.shared.counters.graphs_evicted += 1
        log.info("cgbackend: %s evicted its least recently used graph (%d held, bound %d)", self.spec.name,
                 len(self.entries), self.bound())

    def may_recapture(self) -> bool:
        """Below the bound of graphs captured again after newer ones (as evictions)?"""
        return self.recaptured < THRASH_EVICTIONS * self.bound()

    def replace(self, key: tuple, old: Entry, fresh: Entry) -> None:
        """``fresh``, captured again after newer graphs, takes ``old``'s place (counted)."""
        self.release(old)
        fresh.size = old.size
        self.entries[key] = fresh
        self.recaptured += 1
        self.shared.counters.graphs_recaptured += 1

    def drop_released_outputs(self) -> None:
        """Drop the entries whose static outputs were released (runtime/loose_outputs.py): a static
        region now reads the region's outputs, so those graphs go, and it captures again."""
        for key, entry in [(k, e) for k, e in self.entries.items() if e.out_released]:
            del self.entries[key]
            self.release(entry)

    def release(self, entry: Entry, sync: bool = True) -> None:
        """Drop one entry's graphs and buffers (``sync``: wait until no replay of it runs)."""
        shared = self.shared
        self.on_drop()
        if sync and torch.cuda.is_available() and not shared.capturer.simulate:
            torch.cuda.synchronize()  # no replay of it may still be running
        for graph in (entry.graph, getattr(entry, "bwd_graph", None)):
            if isinstance(graph, SimulatedGraph) and graph in entry.pool.graphs:
                entry.pool.graphs.remove(graph)
        if entry.views is not None:
            for t in iter_tensors(entry.outputs):
                shared.padded_full.pop((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), None)
        if entry.caller_graphs:
            for caller in entry.caller_graphs:
                shared.caller_storages -= caller.storages()
        entry.graph = entry.outputs = entry.static_ins = entry.views = entry.caller_graphs = None
        if isinstance(entry, TrainEntry):
            pool = entry.pool
            pool.releasable = [(side, e) for side, e in pool.releasable if e is not entry]
            if entry.bwd_graph is None and entry.bwd_failed is None:
                pool.backward_settled()  # its backward graph is awaited no more
            entry.bwd_graph = entry.capture_outs = entry.static_grad_outs = entry.static_grad_ins = None
        shared.counters.pool_bytes_held -= entry.nbytes
