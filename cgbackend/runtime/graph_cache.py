"""A region's graph cache: which held graph a call may replay (its key), how bucketed calls pad,
and which graph goes when the cache is full.

Graphs are keyed on the inputs' shapes (so on the sizes a region depends on, and no other), strides,
dtypes, the addresses of what the graph reads in place (parameters, hand-offs) and the call slot;
or, for an inference call of a region with a bucket plan (passes/bucket.py), on the capture size
its symbolic size pads up to: inputs sized by it are copied as the prefix of a padded buffer (or
read in place when they are a slice of another padded graph's output), outputs are handed on as
views sliced to the actual size. A region holds at most ``max_graphs_per_region`` entries, least
recently used first out (``graph_cache``).
"""

from __future__ import annotations

import bisect
import collections
import logging
from typing import TYPE_CHECKING, Optional

import torch

from ..common.fx_utils import iter_tensors
from . import params as param_policy
from .capture import SimulatedGraph
from .entries import HANDOFF, EAGER, PARAM, VALUE, Entry, Pad, TrainEntry, freeze

if TYPE_CHECKING:
    from .region import RegionRunner

__all__ = ["GraphCache", "THRASH_EVICTIONS"]

log = logging.getLogger(__name__)

THRASH_EVICTIONS = 2
"""A region that has evicted this many times its bound of graphs stops evicting: capturing a graph
costs far more than an eager call, so a cache its signatures churn through only slows it down."""


class GraphCache:
    """The entries of one region by key, least recently used first, and the warm-up counts of the
    signatures not captured yet."""

    def __init__(self, runner: "RegionRunner") -> None:
        self.runner = runner
        kinds = runner.kinds
        self.param_pos = tuple(p for p, k in enumerate(kinds) if k is PARAM)
        self.other_pos = tuple(p for p, k in enumerate(kinds) if k is not PARAM)
        """Parameter inputs stay parameters (a split may turn a hand-off into an eager value only):
        the per-call key reads them in one pass (a MoE region has hundreds)."""
        self._param_idx = list(self.param_pos)
        self._param_ptrs: Optional[list] = None
        self.param_key: tuple = ()
        """The parameters' addresses at the latest call, aligned with the inputs (None elsewhere), and
        the key part they made: where PyTorch's C++ comparison exists (CUDA builds, the one
        cudagraph trees uses), an unchanged set is one call instead of one data_ptr() each."""
        self.entries: collections.OrderedDict[tuple, Entry] = collections.OrderedDict()
        """Held graphs by key, least recently used first."""
        self.warm: dict[tuple, int] = {}
        self.evicted = 0
        self.recaptured = 0
        """Graphs captured again because a newer graph's live outputs blocked their replay."""
        self.thrashing: Optional[str] = None
        """Set when the region stopped evicting (its signatures churn through the cache)."""

    # ------------------------------------------------------------------ keys

    def keys(self, ins: list, grad_path: bool, slot: int) -> tuple[Optional[tuple], tuple]:
        """(full key: slot, shapes and addresses, or None if a hand-off came from eager code;
        shape key: what warm-up counts, the same for every slot).

        Parameters enter by address only: Dynamo guards their shape, stride, dtype, device and
        requires_grad (a change recompiles the graph), but not their address."""
        runner = self.runner
        shape_parts: list = [grad_path, torch.is_inference_mode_enabled()]
        if runner.hooks is not None:
            shape_parts.append(runner.hooks.key())
        addr_parts: list = []
        missing_handoff = False
        kinds = runner.kinds
        for pos in self.other_pos:
            value = ins[pos]
            if kinds[pos] is VALUE:
                shape_parts.append(freeze(value))
            elif self.tensor_key(pos, value, grad_path, shape_parts, addr_parts):
                missing_handoff = True
        shape_key = tuple(shape_parts)
        if missing_handoff:
            return None, shape_key
        policy = runner.shared.params
        if policy.volatile is None:
            params = self.param_addresses(ins)
        else:
            params = tuple(policy.key(ins[p]) for p in self.param_pos)
        return (slot,) + shape_key + tuple(addr_parts) + params, shape_key

    def param_addresses(self, ins: list) -> tuple:
        """The parameters' part of the key (ParamPolicy.key without volatile parameters: the address)."""
        last, is_list = self._param_ptrs, isinstance(ins, list)  # the C++ check takes lists only
        if (last is not None and is_list and len(last) == len(ins)
                and param_policy.ptrs_equal(ins, last, self._param_idx)):
            return self.param_key
        ptrs = [ins[p].data_ptr() for p in self.param_pos]
        if param_policy.ptrs_equal is not None and is_list:
            aligned: list = [None] * len(ins)
            for p, ptr in zip(self.param_pos, ptrs):
                aligned[p] = ptr
            self._param_ptrs = aligned
        self.param_key = tuple(ptrs)
        return self.param_key

    def aligned_ptrs(self) -> Optional[list]:
        """The latest call's parameter addresses aligned with its inputs, for the C++ comparison
        (None where PyTorch lacks it)."""
        return self._param_ptrs

    def same_params(self, ins: list, params: tuple, ptrs: Optional[list]) -> bool:
        """Are ``ins``' parameters at the addresses ``params`` (``ptrs``: the same, aligned)?"""
        if ptrs is not None and isinstance(ins, list) and len(ptrs) == len(ins):
            return param_policy.ptrs_equal(ins, ptrs, self._param_idx)
        found = self.param_addresses(ins)
        return found is params or found == params

    def tensor_key(self, pos: int, value: torch.Tensor, grad_path: bool, shape_parts: list,
                   addr_parts: list) -> bool:
        """Key parts of one tensor input read as it is; True if it should have been handed over by
        a graph but came from eager code."""
        shape_parts.append((value.shape, value.stride(), value.dtype,
                            value.requires_grad if grad_path else None))
        if value.numel() == 0:
            return False  # nothing to read: any empty tensor of that shape will do
        runner = self.runner
        kind = runner.kinds[pos]
        if kind is HANDOFF:
            producer = runner.producers[pos]
            ptr = value.data_ptr()
            if producer is not None and (producer.disabled is not None or ptr in producer.rebased_ptrs):
                # Producer eager for good, or the value is a view of a caller's tensor: copy it
                # like any eager value.
                addr_parts.append(None)
                return False
            addr_parts.append(ptr)
            return ptr not in runner.shared.persistent_ptrs
        if kind is EAGER:
            ptr = value.data_ptr()
            addr_parts.append(ptr if ptr in runner.shared.persistent_ptrs else None)
        return False

    # ------------------------------------------------------------------ bucketing

    def above_limit(self, actual: dict) -> bool:
        """Is this inference call's bucketed size (``actual``: its size bindings) above
        ``max_capture_size``, when one is set?"""
        limit = self.runner.config.max_capture_size
        return bool(limit) and actual[self.runner.bucket.symbol] > limit

    def padding(self, actual: dict) -> Optional[Pad]:
        """The sizes an inference call with size bindings ``actual`` (``BucketPlan.bindings``) runs
        at, or None above the largest capture size."""
        runner = self.runner
        plan = runner.bucket
        sizes = runner.config.capture_sizes
        i = bisect.bisect_left(sizes, actual[plan.symbol])
        if i == len(sizes):
            return None
        padded = dict(actual)
        padded[plan.symbol] = sizes[i]
        return Pad(actual, padded)

    def padded_full(self, value: torch.Tensor, dim: int, size: int) -> tuple[tuple, Optional[torch.Tensor]]:
        """The padded shape of an input, and the full static tensor it is a slice of (if any)."""
        shape = list(value.shape)
        shape[dim] = size
        shape = tuple(shape)
        return shape, self.runner.shared.padded_full.get((value.data_ptr(), shape, value.stride(), value.dtype))

    def padded_keys(self, ins: list, pad: Pad, slot: int) -> tuple[Optional[tuple], tuple]:
        """Like keys() for a padded call: the padded sizes stand for every input sized by them; an
        input that is the slice of another padded graph's output is read in place (its address)."""
        runner = self.runner
        plan = runner.bucket
        shape_parts: list = ["pad", tuple(pad.padded.items()), torch.is_inference_mode_enabled()]
        if runner.hooks is not None:
            shape_parts.append(runner.hooks.key())
        addr_parts: list = []
        missing_handoff = False
        for pos, value in enumerate(ins):
            kind = runner.kinds[pos]
            if kind is PARAM:
                addr_parts.append(runner.shared.params.key(value))
                continue
            if kind is VALUE:
                if pos not in plan.value_inputs:
                    shape_parts.append(freeze(value))
                continue
            spec = plan.pad_inputs.get(pos)
            if spec is None:
                missing_handoff |= self.tensor_key(pos, value, False, shape_parts, addr_parts)
                continue
            dim, size = spec
            shape, full = self.padded_full(value, dim, size(pad.padded))
            shape_parts.append((shape, value.dtype))  # its other sizes may be exact symbols
            if full is not None:
                addr_parts.append(full.data_ptr())
                continue
            producer = runner.producers[pos]
            if kind is HANDOFF and producer is not None and producer.bucket is not None \
                    and producer.bucket.symbol == plan.symbol and producer.disabled is None:
                missing_handoff = True  # the producer ran eagerly this call (warming up)
            addr_parts.append(None)
        shape_key = tuple(shape_parts)
        if missing_handoff:
            return None, shape_key
        return (slot,) + shape_key + tuple(addr_parts), shape_key

    def views(self, entry: Entry, pad: Pad) -> tuple:
        """The entry's static outputs sliced to this call's actual sizes (cached per size)."""
        key = tuple(pad.actual.values())
        views = entry.views.get(key)
        if views is None:
            outs = list(entry.outputs)
            for i, (dim, size) in self.runner.bucket.outputs.items():
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
        """max_graphs_per_region for each layer sharing the region (regional.py)."""
        runner = self.runner
        return runner.config.max_graphs_per_region * runner.shared.layer_copies

    def make_room(self) -> bool:
        """Room for one more graph: below the bound, or after evicting the least recently used
        graph that no call still needs (graph_cache="lru")."""
        config = self.runner.config
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
                log.warning("cgbackend: region %s %s", self.runner.name, self.thrashing)
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
        runner = self.runner
        runner.shared.counters.graphs_evicted += 1
        log.info("cgbackend: %s evicted its least recently used graph (%d held, bound %d)", runner.name,
                 len(self.entries), self.bound())

    def replace(self, key: tuple, old: Entry, fresh: Entry) -> None:
        """``fresh``, captured again after newer graphs, takes ``old``'s place (counted)."""
        self.release(old)
        fresh.size = old.size
        self.entries[key] = fresh
        self.recaptured += 1
        self.runner.shared.counters.graphs_recaptured += 1

    def release(self, entry: Entry, sync: bool = True) -> None:
        """Drop one entry's graphs and buffers (``sync``: wait until no replay of it runs)."""
        runner = self.runner
        shared = runner.shared
        runner.fast.clear()
        if sync and torch.cuda.is_available() and not shared.capturer.simulate:
            torch.cuda.synchronize()  # no replay of it may still be running
        for graph in (entry.graph, getattr(entry, "bwd_graph", None)):
            if isinstance(graph, SimulatedGraph) and graph in entry.pool.graphs:
                entry.pool.graphs.remove(graph)
        if entry.views is not None:
            for t in iter_tensors(entry.outputs):
                shared.padded_full.pop((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), None)
        if entry.handouts:
            for handout in entry.handouts:
                shared.handout_storages -= handout.storages()
        entry.graph = entry.outputs = entry.static_ins = entry.views = entry.handouts = None
        if isinstance(entry, TrainEntry):
            pool = entry.pool
            pool.releasable = [(side, e) for side, e in pool.releasable if e is not entry]
            if entry.bwd_graph is None and entry.bwd_failed is None:
                pool.backward_settled()  # its backward graph is awaited no more
            entry.bwd_graph = entry.capture_outs = entry.static_grad_outs = entry.static_grad_ins = None
        shared.counters.pool_bytes_held -= entry.nbytes
