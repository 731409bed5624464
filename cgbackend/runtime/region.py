"""One static region at runtime: warm up, capture, replay, or run eagerly with a counted reason.

Inputs of a region, by kind (decided once from the partition):

* ``PARAM``: a parameter or buffer (static address). Read in place, never
  copied; its address is part of the graph's key, so a replaced parameter
  (``p.data = ...``) leads to a new capture, never to a stale replay.
* ``HANDOFF``: produced by another static region. The graph reads the
  producer's static output where it lies; the address is part of the key.
* ``EAGER``: produced by eager code. Usually copied into a static buffer of
  the graph; read in place when it is another graph's static output (an eager
  ``index_add_`` returns the static buffer it wrote into), address in the key.
* ``COPY``: passed by the caller: copied into a static buffer of the graph
  before each replay (written back afterwards if the region writes it in place).
* ``VALUE``: not a tensor (sizes, flags): part of the key.

Graphs are keyed on the inputs' shapes (so on the sizes a region depends on, and no other), or, for
an inference call of a region with a bucket plan (passes/bucket.py), on the capture size its
symbolic size pads up to: inputs sized by it are copied as the prefix of a padded buffer (or read
in place when they are a slice of another padded graph's output), outputs are handed on as views
sliced to the actual size. A region holds at most ``max_graphs_per_region`` entries, least
recently used first out (``graph_cache``).

Inference entries hold one graph. Training entries (a call with grad enabled
where some input requires grad) hold a forward graph replayed inside an
autograd.Function and a backward graph captured at the first backward; the
forward's saved activations live in the entry, whose call slot stays busy
until the backward pass is over (see executor.CallState).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import gc
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from ..config import Config
from ..fx_utils import iter_tensors
from .capture import CaptureError, Capturer, SimulatedGraph, first_line, non_overlapping
from .handout import HandoutGraph, handout_supported
from .params import ParamPolicy
from .inputs import InputViews, SavedTensors, fill_padding, overlap, overlap_candidates, saved_modified_error
from .outputs import _foreach_copy
from .pool import PoolSet, PoolState
from .reach import fake_output_reach, reached_inputs, unreached
from .stats import Counters, EagerReason
from .warmup import SyncDetector, cuda_sync_detector, warmup_call

if TYPE_CHECKING:
    from .inner import LazyInner
    from ..opaque import RegionHooks
    from ..passes.bucket import BucketPlan

__all__ = ["PARAM", "HANDOFF", "EAGER", "COPY", "VALUE", "QUEUE_CALLBACK", "RuntimeShared", "RegionRunner", "is_static_address"]

log = logging.getLogger(__name__)

PARAM, HANDOFF, EAGER, COPY, VALUE = "param", "handoff", "eager", "copy", "value"

_THRASH_EVICTIONS = 2
"""A region that has evicted this many times its bound of graphs stops evicting: capturing a graph
costs far more than an eager call, so a cache its signatures churn through only slows it down."""


def is_static_address(t: Any) -> bool:
    """Parameters and module buffers: Dynamo marks them with _dynamo_static_input_type."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None


class RuntimeShared:
    """What all runners of one backend instance share: pools, capturer, counters, config."""

    def __init__(self, config: Config) -> None:
        self.config = config
        simulate = config.simulate_graphs or not torch.cuda.is_available()
        self.pools = PoolSet(simulate=simulate)
        self.capturer = Capturer(simulate=config.simulate_graphs)
        self.counters = Counters()
        self.sync_detector: Optional[SyncDetector] = None if config.simulate_graphs else cuda_sync_detector()
        """What watches warm-up calls for host synchronization (runtime/warmup.py): CUDA's sync debug
        mode where CUDA graphs are captured; tests may set a stand-in for simulated graphs."""
        self.params = ParamPolicy()
        """How parameter inputs are keyed, checked and (for volatile ones) copied: runtime/params.py."""
        self.persistent_ptrs: set[int] = set()
        """data_ptr() of every static output of every graph: hand-off candidates."""
        self.persistent_storages: set[int] = set()
        """Storage base pointers of static outputs and static input buffers: outputs aliasing
        them are cloned before they reach the caller."""
        self.padded_full: dict[tuple, torch.Tensor] = {}
        """Static outputs of padded (bucketed) graphs by (data_ptr, full shape, stride, dtype): a
        bucketed consumer given the sliced view reads the full padded tensor in place."""
        self.watch: Optional[Callable[..., Any]] = None
        """Called instead of each region of each call when set: ``watch(graph, position, run_step,
        step, ins, call)`` runs ``run_step(step, ins, call)`` and returns its result. Set by explain
        (coverage.py, counting launches) and by the option profile (profile.py, timing regions)."""
        self.handout_storages: set[int] = set()
        """Storage base pointers of handout graphs' outputs (runtime/handout.py): outputs lying in
        them are handed to the caller as aliases, not copied."""
        self.handed: dict[int, tuple["RegionRunner", "_TrainEntry"]] = {}
        """Training entries whose static gradients were handed to autograd and may still be held
        (as .grad or elsewhere): live data of their backward graph until reclaimed."""

    def reclaim_handed(self) -> None:
        """Before any replay of a new call: give each .grad still aliasing a static gradient its
        own memory, and release the gradients nobody holds any more."""
        for runner, entry in list(self.handed.values()):
            runner.reclaim_grads(entry, entry.leaves)

    def register_persistent(self, values: Any, handoff: bool = True) -> None:
        for t in iter_tensors(values):
            if t.numel() == 0:
                continue
            if handoff:
                self.persistent_ptrs.add(t.data_ptr())
            self.persistent_storages.add(t.untyped_storage().data_ptr())


class _Entry:
    """Common part of inference and training entries."""

    __slots__ = ("pool", "static_ins", "copy_pos", "handoff_pos", "copy_back_pos",
                 "outputs", "index", "graph", "slot", "pad_dims", "views", "nbytes", "copy_kinds",
                 "param_addrs", "volatile_pos",
                 "pad_block", "input_views", "handouts")

    def __init__(self) -> None:
        self.graph = None
        self.handouts: Optional[list[HandoutGraph]] = None
        """Inference entries whose outputs may go to the caller without a copy: their handout
        graphs, captured when first needed (runtime/handout.py); None where that does not apply."""
        self.copy_kinds: Optional[tuple[str, ...]] = None
        """What each copied input is (copied_by_kind), found at the first replay: the isinstance
        check against nn.Parameter costs more than the copy of a small input."""
        self.index = -1
        self.pad_dims: dict[int, int] = {}
        """Bucketed entries: copied input position -> the padded dimension (copied as a prefix)."""
        self.pad_block: dict[int, int] = {}
        """Bucketed entries: copied input position -> entries of the padded dimension per row."""
        self.input_views: Optional[InputViews] = None
        """Outputs that alias a static input, rebuilt on the caller's tensors (inputs.py)."""
        self.views: Optional[dict] = None
        """Bucketed entries: actual sizes -> the static outputs sliced to them."""
        self.nbytes = 0
        """Growth of reserved memory while capturing this entry's graphs (the pool's share)."""
        self.param_addrs: tuple = ()
        """(pos, data_ptr, nbytes) of parameters read in place, at capture (runtime/params.py)."""
        self.volatile_pos: tuple = ()
        """Volatile parameters (FSDP2's): positions copied before every forward and backward replay."""

    def in_use(self) -> bool:
        return bool(self.pool.live.get(self.index))


class _Pad:
    """One padded call: the actual sizes of the region's symbols and the sizes it runs at."""

    __slots__ = ("actual", "padded")

    def __init__(self, actual: dict[str, int], padded: dict[str, int]) -> None:
        self.actual = actual
        self.padded = padded


class _TrainEntry(_Entry):
    __slots__ = ("bwd_graph", "bwd_index", "capture_outs", "diff_in", "diff_out", "static_grad_outs",
                 "static_grad_ins", "tensor_pos", "nondiff_out", "bwd_failed", "handed", "grad_ptrs",
                 "leaves", "reach", "saved_modified", "saved_pos")

    def in_use(self) -> bool:
        live = self.pool.live
        return bool(live.get(self.index) or (self.bwd_graph is not None and live.get(self.bwd_index))
                    or self.handed)

    def autograd_outputs(self) -> list:
        """Outputs carrying the forward's autograd graph: capture-time ones for CUDA graphs (their
        saved tensors are the buffers every replay rewrites), the latest run for simulated graphs."""
        graph = self.graph
        outs = graph.last if hasattr(graph, "last") else self.capture_outs
        return [outs[i] for i in self.diff_out]


class _Fast:
    """What :meth:`RegionRunner._replay_fast` checks and uses: the entry, the inference mode and
    key parts of the call that replayed it last, and its static input buffers."""

    __slots__ = ("entry", "inference", "tensors", "values", "params", "static")

    def __init__(self, entry: _Entry, inference: bool, tensors: tuple, values: tuple, params: tuple,
                 static: list) -> None:
        self.entry = entry
        self.inference = inference
        self.tensors = tensors
        """(position, shape, stride, dtype) of each tensor input other than parameters."""
        self.values = values
        """(position, frozen value) of each number input."""
        self.params = params
        """The parameters' addresses (RegionRunner._param_key)."""
        self.static = static
        """The static buffers of the copied inputs, in entry.copy_pos order."""


def _shares_written(ins: list, written: tuple, others: tuple) -> bool:
    """Does a copied input (``others``) lie in the storage of an input the region writes? The fast
    path's conservative form of inputs.overlap: one storage lookup per position, no spans."""
    stores = {ins[p].untyped_storage().data_ptr() for p in written}
    for pos in others:
        value = ins[pos]
        if value.layout is not torch.strided or value.untyped_storage().data_ptr() in stores:
            return True
    return False


def _copy_all(dst: list, src: list) -> None:
    """Copy each of ``src`` into ``dst``: one ``_foreach_copy_`` (one kernel launch for all of them
    on CUDA, where a ``copy_`` between same-typed device tensors is a ``cudaMemcpyAsync`` that took
    longer to issue on the H100 host: 11 against 7 us), or ``copy_`` each where torch lacks it or
    grad mode is on (``copy_`` records autograd history the way it always did)."""
    if _foreach_copy is not None and dst and not torch.is_grad_enabled():
        _foreach_copy(dst, src)
        return
    for d, v in zip(dst, src):
        d.copy_(v)


_ptrs_equal: Optional[Callable[[list, list, Sequence[int]], bool]] = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)
"""PyTorch's C++ check that tensors[i].data_ptr() == ptrs[i] at the given positions, all three
arguments lists (CUDA builds; feature-tested: absent on CPU-only builds, where the key reads each
address in Python)."""


class RegionRunner:
    """Runs one static region. Called with the region's inputs in order; returns its outputs."""

    def __init__(self, name: str, fn: Callable[..., Any], kinds: list[str],
                 producers: list[Optional["RegionRunner"]], mutated: set[int],
                 shared: RuntimeShared, bucket: Optional["BucketPlan"] = None,
                 device: Optional[torch.device] = None, hooks: Optional["RegionHooks"] = None) -> None:
        self.name = name
        self.fn = fn
        self.kinds = kinds
        self._param_pos = tuple(p for p, k in enumerate(kinds) if k is PARAM)
        self._other_pos = tuple(p for p, k in enumerate(kinds) if k is not PARAM)
        """Parameter inputs stay parameters (a split may turn a hand-off into an eager value only):
        the per-call key reads them in one pass (a MoE region has hundreds)."""
        self._param_idx = list(self._param_pos)
        self._param_ptrs: Optional[list] = None
        self._param_key: tuple = ()
        """The parameters' addresses at the latest call, aligned with the inputs (None elsewhere), and
        the key part they made: where PyTorch's C++ comparison exists (CUDA builds, the one
        cudagraph trees uses), an unchanged set is one call instead of one data_ptr() each."""
        self.producers = producers
        self.mutated = mutated
        self.shared = shared
        self.config = shared.config
        self.bucket = bucket if shared.config.capture_sizes else None
        """How inference calls pad a symbolic size up to a capture size (passes/bucket.py)."""
        self.device = device
        """Where the region computes (for regions whose inputs are all numbers)."""
        self.hooks = hooks
        """What the region's opaque module calls need around captures and replays (opaque.py)."""
        self.entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        """Held graphs by key, least recently used first."""
        self.warm: dict[tuple, int] = {}
        self.disabled: Optional[str] = None
        """Set when the region runs eagerly for good (capture failed, no CUDA, capture off)."""
        self.disabled_detail: str = ""
        self.n_graphs = 0
        """Graphs captured so far (a training entry's backward counts too), evicted ones included."""
        self.evicted = 0
        self.recaptured = 0
        """Graphs captured again because a newer graph's live outputs blocked their replay."""
        self.thrashing: Optional[str] = None
        """Set when the region stopped evicting (its signatures churn through the cache)."""
        self.replays = 0
        self.eager_calls: dict[str, int] = {}
        self.capture_time_s = 0.0
        self.lazy_inner: Optional["LazyInner"] = None
        """The region's pending Inductor compile (inner.py), done before its last warm-up call."""
        self.on_sync: Optional[Callable[["RegionRunner", Any], bool]] = None
        """Set by the executor: asked to split the region at an op that synchronized in warm-up
        (runtime/syncsplit.py); False when it cannot, and the region then runs eagerly."""
        self.caller_pos = tuple(p for p, k in enumerate(kinds) if k not in (VALUE, PARAM))
        self.written = tuple(sorted(mutated))
        self.overlap_pos = overlap_candidates(kinds, self.written, PARAM, VALUE) if mutated else ()
        self.rebased_ptrs: set[int] = set()
        """data_ptr() of the outputs this region's latest call rebuilt on a caller's tensor
        (inputs.InputViews): a consumer copies them like eager values."""
        self._failure: Optional[str] = None
        """The error of the latest failed capture attempt, until the call decides whose it was."""
        self._fast_ok = (hooks is None and self.bucket is None
                         and all(k is PARAM or k is COPY or k is VALUE for k in kinds)
                         and all(kinds[p] is PARAM for p in mutated))
        """Inference calls may take the fast path (:meth:`_replay_fast`): the region reads only
        parameters, the caller's tensors and numbers, pads nothing, and writes only inputs it reads
        in place (a static KV cache's buffers: nothing to copy back)."""
        self._fast: Optional[_Fast] = None
        """The inference entry replayed last and what its key was made of, checked field by field
        on the next call instead of building the key (cleared when an entry is dropped)."""
        self.terminal = False
        """No static region of the graph runs after this one (set by the executor): its inference
        entries may hand their outputs out without a copy (runtime/handout.py)."""
        self._handout_failed: Optional[str] = None

    # ------------------------------------------------------------------ helpers

    def reach_of(self, entry: "_TrainEntry") -> tuple:
        """Which of ``entry``'s differentiable inputs each differentiable output reaches. An
        Inductor-compiled region's forward is one autograd node that reaches every input: there the
        FX module runs on fake tensors to build the graph eager autograd would walk."""
        lazy = self.lazy_inner
        if lazy is not None and lazy.state == "compiled":
            found = fake_output_reach(lazy.module, entry.static_ins, entry.diff_in, entry.diff_out)
            if found is not None:
                return found[1]
        return reached_inputs(entry.autograd_outputs(), [entry.static_ins[p] for p in entry.diff_in])

    def _count_eager(self, reason: str) -> None:
        self.eager_calls[reason] = self.eager_calls.get(reason, 0) + 1
        self.shared.counters.eager_calls[reason] += 1

    def _eager(self, ins: list, reason: str) -> Any:
        self._count_eager(reason)
        return self.fn(*ins)

    def _warmup_call(self, ins: list, shape_key: tuple = (), last: bool = False) -> Any:
        """Eager call that also watches for host synchronization, which would break a capture;
        the last one of a region compiled lazily runs the compiled code (runtime/warmup.py)."""
        return warmup_call(self, ins, shape_key, last)

    def disable(self, reason: str, detail: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            self.disabled_detail = detail
        self._fast = None

    def _keys(self, ins: list, grad_path: bool, slot: int) -> tuple[Optional[tuple], tuple]:
        """(full key: slot, shapes and addresses, or None if a hand-off came from eager code;
        shape key: what warm-up counts, the same for every slot).

        Parameters enter by address only: Dynamo guards their shape, stride, dtype, device and
        requires_grad (a change recompiles the graph), but not their address."""
        shape_parts: list = [grad_path, torch.is_inference_mode_enabled()]
        if self.hooks is not None:
            shape_parts.append(self.hooks.key())
        addr_parts: list = []
        missing_handoff = False
        kinds = self.kinds
        for pos in self._other_pos:
            value = ins[pos]
            if kinds[pos] is VALUE:
                shape_parts.append(_freeze(value))
            elif self._tensor_key(pos, value, grad_path, shape_parts, addr_parts):
                missing_handoff = True
        shape_key = tuple(shape_parts)
        if missing_handoff:
            return None, shape_key
        policy = self.shared.params
        if policy.volatile is None:
            params = self._param_addresses(ins)
        else:
            params = tuple(policy.key(ins[p]) for p in self._param_pos)
        return (slot,) + shape_key + tuple(addr_parts) + params, shape_key

    def _param_addresses(self, ins: list) -> tuple:
        """The parameters' part of the key (ParamPolicy.key without volatile parameters: the address)."""
        last, is_list = self._param_ptrs, isinstance(ins, list)  # the C++ check takes lists only
        if (last is not None and is_list and len(last) == len(ins)
                and _ptrs_equal(ins, last, self._param_idx)):
            return self._param_key
        ptrs = [ins[p].data_ptr() for p in self._param_pos]
        if _ptrs_equal is not None and is_list:
            aligned: list = [None] * len(ins)
            for p, ptr in zip(self._param_pos, ptrs):
                aligned[p] = ptr
            self._param_ptrs = aligned
        self._param_key = tuple(ptrs)
        return self._param_key

    def _tensor_key(self, pos: int, value: torch.Tensor, grad_path: bool, shape_parts: list,
                    addr_parts: list) -> bool:
        """Key parts of one tensor input read as it is; True if it should have been handed over by
        a graph but came from eager code."""
        shape_parts.append((value.shape, value.stride(), value.dtype,
                            value.requires_grad if grad_path else None))
        if value.numel() == 0:
            return False  # nothing to read: any empty tensor of that shape will do
        kind = self.kinds[pos]
        if kind is HANDOFF:
            producer = self.producers[pos]
            ptr = value.data_ptr()
            if producer is not None and (producer.disabled is not None or ptr in producer.rebased_ptrs):
                # Producer eager for good, or the value is a view of a caller's tensor: copy it
                # like any eager value.
                addr_parts.append(None)
                return False
            addr_parts.append(ptr)
            return ptr not in self.shared.persistent_ptrs
        if kind is EAGER:
            ptr = value.data_ptr()
            addr_parts.append(ptr if ptr in self.shared.persistent_ptrs else None)
        return False

    # ------------------------------------------------------------------ bucketing

    def _padding(self, ins: list) -> Optional[_Pad]:
        """The sizes this inference call runs at, or None above the largest capture size."""
        plan = self.bucket
        actual = plan.bindings(ins)
        sizes = self.config.capture_sizes
        i = bisect.bisect_left(sizes, actual[plan.symbol])
        if i == len(sizes):
            return None
        padded = dict(actual)
        padded[plan.symbol] = sizes[i]
        return _Pad(actual, padded)

    def _padded_full(self, value: torch.Tensor, dim: int, size: int) -> tuple[tuple, Optional[torch.Tensor]]:
        """The padded shape of an input, and the full static tensor it is a slice of (if any)."""
        shape = list(value.shape)
        shape[dim] = size
        shape = tuple(shape)
        return shape, self.shared.padded_full.get((value.data_ptr(), shape, value.stride(), value.dtype))

    def _padded_keys(self, ins: list, pad: _Pad, slot: int) -> tuple[Optional[tuple], tuple]:
        """Like _keys for a padded call: the padded sizes stand for every input sized by them; an
        input that is the slice of another padded graph's output is read in place (its address)."""
        plan = self.bucket
        shape_parts: list = ["pad", tuple(pad.padded.items()), torch.is_inference_mode_enabled()]
        if self.hooks is not None:
            shape_parts.append(self.hooks.key())
        addr_parts: list = []
        missing_handoff = False
        for pos, value in enumerate(ins):
            kind = self.kinds[pos]
            if kind is PARAM:
                addr_parts.append(self.shared.params.key(value))
                continue
            if kind is VALUE:
                if pos not in plan.value_inputs:
                    shape_parts.append(_freeze(value))
                continue
            spec = plan.pad_inputs.get(pos)
            if spec is None:
                missing_handoff |= self._tensor_key(pos, value, False, shape_parts, addr_parts)
                continue
            dim, size = spec
            shape, full = self._padded_full(value, dim, size(pad.padded))
            shape_parts.append((shape, value.dtype))  # its other sizes may be exact symbols
            if full is not None:
                addr_parts.append(full.data_ptr())
                continue
            producer = self.producers[pos]
            if kind is HANDOFF and producer is not None and producer.bucket is not None \
                    and producer.bucket.symbol == plan.symbol and producer.disabled is None:
                missing_handoff = True  # the producer ran eagerly this call (warming up)
            addr_parts.append(None)
        shape_key = tuple(shape_parts)
        if missing_handoff:
            return None, shape_key
        return (slot,) + shape_key + tuple(addr_parts), shape_key

    def _views(self, entry: _Entry, pad: _Pad) -> tuple:
        """The entry's static outputs sliced to this call's actual sizes (cached per size)."""
        key = tuple(pad.actual.values())
        views = entry.views.get(key)
        if views is None:
            outs = list(entry.outputs)
            for i, (dim, size) in self.bucket.outputs.items():
                outs[i] = outs[i].narrow(dim, 0, size(pad.actual))
            views = entry.views[key] = tuple(outs)
        return views

    # ------------------------------------------------------------------ graph cache

    def _make_room(self) -> bool:
        """Room for one more graph: below the bound, or after evicting the least recently used
        graph that no call still needs (graph_cache="lru")."""
        bound = self.config.max_graphs_per_region
        if len(self.entries) < bound:
            return True
        if self.config.graph_cache != "lru":
            return False
        if self.evicted >= _THRASH_EVICTIONS * bound:
            if self.thrashing is None:
                self.thrashing = (f"evicted {self.evicted} graphs (more than {_THRASH_EVICTIONS} x "
                                  f"max_graphs_per_region={bound}): its signatures churn; it keeps the "
                                  "graphs it holds and runs new signatures eagerly")
                log.warning("cgbackend: region %s %s", self.name, self.thrashing)
            return False
        for key, entry in self.entries.items():
            if not entry.in_use():
                self._evict(key, entry)
                return True
        return False

    def _evict(self, key: tuple, entry: _Entry) -> None:
        """Drop a graph and its static buffers: their memory goes back to the pool, where the next
        capture finds it. Capture indices only grow, so the replay-order rule still holds."""
        del self.entries[key]
        self._release(entry)
        self.evicted += 1
        self.shared.counters.graphs_evicted += 1
        log.info("cgbackend: %s evicted its least recently used graph (%d held, bound %d)", self.name,
                 len(self.entries), self.config.max_graphs_per_region)

    def release_entry(self, entry: _Entry) -> None:
        """Drop one entry's graphs and buffers (the caller synchronized; cgbackend.distributed)."""
        self._release(entry, sync=False)

    def _release(self, entry: _Entry, sync: bool = True) -> None:
        self._fast = None
        if sync and torch.cuda.is_available() and not self.shared.capturer.simulate:
            torch.cuda.synchronize()  # no replay of it may still be running
        for graph in (entry.graph, getattr(entry, "bwd_graph", None)):
            if isinstance(graph, SimulatedGraph) and graph in entry.pool.graphs:
                entry.pool.graphs.remove(graph)
        if entry.views is not None:
            for t in iter_tensors(entry.outputs):
                self.shared.padded_full.pop((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), None)
        if entry.handouts:
            for handout in entry.handouts:
                self.shared.handout_storages -= handout.storages()
        entry.graph = entry.outputs = entry.static_ins = entry.views = entry.handouts = None
        if isinstance(entry, _TrainEntry):
            entry.bwd_graph = entry.capture_outs = entry.static_grad_outs = entry.static_grad_ins = None
        self.shared.counters.pool_bytes_held -= entry.nbytes

    def _recapture(self, key: tuple, old: _Entry, ins: list, call: Any, pad: Optional[_Pad]) -> Optional[_Entry]:
        """An inference graph that may not replay now: a graph captured after it (another region's,
        for a size this region pads to the same bucket) holds live outputs in memory it may use.
        Capture it again, after them, in place of the old one; bounded like evictions. None: not
        now (the old graph is in use, the bound is reached, or the capture failed)."""
        if isinstance(old, _TrainEntry) or old.in_use():
            return None
        if self.recaptured >= _THRASH_EVICTIONS * self.config.max_graphs_per_region:
            return None
        fresh = self._capture(ins, False, call, pad)
        if fresh is None:
            return None
        self._release(old)
        self.entries[key] = fresh
        self.recaptured += 1
        self.shared.counters.graphs_recaptured += 1
        log.debug("cgbackend: %s recaptured a graph to replay after newer ones", self.name)
        return fresh

    def _note_warm(self, shape_key: tuple, count: int) -> None:
        warm = self.warm
        warm[shape_key] = count
        if len(warm) > 4 * self.config.max_graphs_per_region:
            del warm[next(iter(warm))]  # oldest signature seen: forget its warm-up count

    # ------------------------------------------------------------------ entry point

    def __call__(self, ins: list, call: Any) -> Any:
        if self.rebased_ptrs:
            self.rebased_ptrs = set()
        fast = self._fast
        if fast is not None and not call.training and self.shared.params.volatile is None:
            out = self._replay_fast(fast, ins, call)
            if out is not None:
                return out
        if self.disabled is not None:
            return self._eager(ins, self.disabled)
        grad_path = call.training and any(
            v.requires_grad for v, k in zip(ins, self.kinds) if k != VALUE)
        if self.written and overlap(ins, self.written, self.overlap_pos) is not None:
            # Copies of overlapping inputs would not see each other's writes (inputs.py).
            return self._fallback(ins, EagerReason.ALIASED_INPUTS)
        if grad_path and any(ins[p].is_inference() for p in self.caller_pos):
            # Autograd refuses to save an inference tensor (eagerly, on every call); its static
            # copy is a normal tensor and would be saved.
            return self._fallback(ins, EagerReason.INFERENCE_TENSOR)
        pad = self._padding(ins) if self.bucket is not None and not grad_path else None
        if pad is None:
            key, shape_key = self._keys(ins, grad_path, call.slot)
        else:
            key, shape_key = self._padded_keys(ins, pad, call.slot)
        entry = self.entries.get(key) if key is not None else None
        if entry is not None:
            self.entries.move_to_end(key)
            if entry.pool.hazard(entry.index) and not grad_path:
                fresh_entry = self._recapture(key, entry, ins, call, pad)
                if fresh_entry is not None:
                    return self._run_entry(fresh_entry, ins, call, True, pad)
                if self._failure is not None:
                    return self._after_failed_capture(ins, shape_key)
                if self.disabled is not None:
                    return self._eager(ins, self.disabled)
            if pad is None and not grad_path:
                self._note_fast(entry, ins)
            return self._run_entry(entry, ins, call, False, pad)
        warm = self.warm.get(shape_key, 0)
        if warm < self.config.warmup:
            self._count_eager(EagerReason.WARMUP)
            self._note_warm(shape_key, warm + 1)
            try:
                return self._warmup_call(ins, shape_key, warm + 1 == self.config.warmup)
            except BaseException:
                self._note_warm(shape_key, warm)  # only a call that returned counts as warm-up
                raise
        if key is None:
            return self._eager(ins, EagerReason.PRODUCER_EAGER)
        if not self._make_room():
            if self.config.strict:
                raise RuntimeError(
                    f"cgbackend: region {self.name} needs a new graph but holds {len(self.entries)} in "
                    "use (max_graphs_per_region); strict=True forbids eager fallback")
            return self._eager(ins, EagerReason.CACHE_THRASH if self.thrashing else EagerReason.GRAPH_LIMIT)
        entry = self._capture(ins, grad_path, call, pad)
        if entry is None:
            if self._failure is not None:
                return self._after_failed_capture(ins, shape_key)
            return self._eager(ins, self.disabled or EagerReason.CAPTURE_FAILED)
        self.entries[key] = entry
        if pad is None and not grad_path:
            self._note_fast(entry, ins)
        return self._run_entry(entry, ins, call, True, pad)

    def _fallback(self, ins: list, reason: str) -> Any:
        if self.config.strict:
            raise RuntimeError(f"cgbackend: region {self.name} runs eagerly for this call "
                               f"({reason}: {EagerReason.DESCRIPTIONS[reason]}); strict=True forbids it")
        return self._eager(ins, reason)

    def _after_failed_capture(self, ins: list, shape_key: tuple) -> Any:
        """A capture attempt raised: run the call eagerly to tell whose error it was. If eager
        raises too, the error belongs to the call (its code or its inputs): it reaches the caller,
        and the region captures later, after another eager call of this signature returns (so
        failed attempts never outnumber good calls). Otherwise the capture itself failed: the
        region runs eagerly from now on (counted in capture_failures)."""
        error, self._failure = self._failure, None
        try:
            out = self.fn(*ins)
        except Exception:
            self._count_eager(EagerReason.CALL_RAISED)
            self._note_warm(shape_key, max(self.config.warmup - 1, 0))
            log.info("cgbackend: capturing %s raised the call's own error (also raised eagerly): %s",
                     self.name, error)
            raise
        self._capture_failed(error)
        self._count_eager(self.disabled or EagerReason.CAPTURE_FAILED)
        return out

    def _note_fast(self, entry: _Entry, ins: list) -> None:
        """Remember an inference entry this call replays (or captured), with the parts of its key
        (:meth:`_keys`, just computed for it), for :meth:`_replay_fast`."""
        if not self._fast_ok or type(entry) is not _Entry or entry.input_views is not None \
                or entry.pad_dims or self.shared.params.volatile is not None:
            self._fast = None
            return
        kinds = self.kinds
        tensors = tuple((p, ins[p].shape, ins[p].stride(), ins[p].dtype) for p in self._other_pos
                        if kinds[p] is not VALUE)
        values = tuple((p, _freeze(ins[p])) for p in self._other_pos if kinds[p] is VALUE)
        self._fast = _Fast(entry, torch.is_inference_mode_enabled(), tensors, values, self._param_key,
                           [entry.static_ins[p] for p in entry.copy_pos])

    def _replay_fast(self, fast: "_Fast", ins: list, call: Any) -> Any:
        """An inference call whose key is the remembered entry's: the same shapes, strides and
        dtypes, numbers, parameter addresses (one C++ comparison on CUDA builds) and inference
        mode; its inputs copied with one ``_foreach_copy_``. None when anything differs, or when
        the replay-order rule forbids it now: the call then takes the full path (:meth:`__call__`)."""
        if torch.is_inference_mode_enabled() is not fast.inference:
            return None
        for pos, shape, stride, dtype in fast.tensors:
            value = ins[pos]
            if value.shape != shape or value.dtype != dtype or value.stride() != stride:
                return None
        for pos, frozen in fast.values:
            if _freeze(ins[pos]) != frozen:
                return None
        if self._param_pos:
            params = self._param_addresses(ins)
            if params is not fast.params and params != fast.params:
                return None
        if self.written and _shares_written(ins, self.written, self.overlap_pos):
            return None  # the full path tells a real overlap (run eagerly) from a shared storage
        entry = fast.entry
        pool = entry.pool
        if pool.live and pool.hazard(entry.index):
            return None
        self._stage_inputs(entry, ins, False, fast.static)
        counters = self.shared.counters
        if entry.handouts is not None:
            handout = self._handout(entry)
            if handout is not None:
                counters.fast_replays += 1
                return self._replay_handout(handout)
        entry.graph.replay()
        pool.acquire(entry.index)
        call.live.append((pool, entry.index))
        self.replays += 1
        counters.replays += 1
        counters.fast_replays += 1
        return entry.outputs

    def _run_entry(self, entry: _Entry, ins: list, call: Any, fresh: bool,
                   pad: Optional[_Pad] = None) -> Any:
        pool = entry.pool
        if pool.hazard(entry.index):
            if self.config.strict:
                raise RuntimeError(
                    f"cgbackend: replaying region {self.name} now could overwrite memory that a newer "
                    "graph still needs; strict=True forbids eager fallback")
            return self._eager(ins, EagerReason.REPLAY_ORDER)
        views = entry.input_views
        if views is not None and not views.usable(ins):
            return self._fallback(ins, EagerReason.INPUT_VIEW)
        if isinstance(entry, _TrainEntry):
            tensors = [ins[p] for p in entry.tensor_pos]
            out = _RegionFunction.apply((self, entry, call, fresh), *tensors)
        else:
            out = self._replay(entry, ins, call, fresh, pad)
        if views is None:
            return out
        out = views.rebase(out, ins)
        self.rebased_ptrs = {out[i].data_ptr() for i in views.views}
        return out

    # ------------------------------------------------------------------ inference

    def _stage_inputs(self, entry: _Entry, ins: list, fresh: bool, static: Optional[list] = None) -> None:
        """Copy the caller's inputs into the entry's static buffers (``static``: those buffers in
        ``copy_pos`` order, when the caller has them at hand) and count the copies."""
        counters = self.shared.counters
        if not fresh:
            static_ins = entry.static_ins
            pad_dims = entry.pad_dims
            if not pad_dims:
                _copy_all(static if static is not None else [static_ins[p] for p in entry.copy_pos],
                          [ins[p] for p in entry.copy_pos])
            else:
                for pos in entry.copy_pos:
                    value = ins[pos]
                    dim = pad_dims.get(pos)
                    if dim is None:
                        static_ins[pos].copy_(value)
                    else:  # the actual rows as the prefix of the padded buffer, then copies of the last
                        fill_padding(static_ins[pos], value, dim, entry.pad_block[pos])
            counters.copies_made += len(entry.copy_pos)
            copy_kinds = entry.copy_kinds
            if copy_kinds is None:
                copy_kinds = entry.copy_kinds = tuple(self._copy_kind(ins[pos], pos) for pos in entry.copy_pos)
            by_kind = counters.copied_by_kind
            for kind in copy_kinds:
                by_kind[kind] += 1
        counters.copies_avoided += len(entry.handoff_pos)

    def _copy_kind(self, value: torch.Tensor, pos: int) -> str:
        if is_static_address(value):
            return "param"
        return "user_input" if self.kinds[pos] == COPY else "eager_value"

    def _replay(self, entry: _Entry, ins: list, call: Any, fresh: bool, pad: Optional[_Pad]) -> Any:
        self._stage_inputs(entry, ins, fresh)
        if self.hooks is not None:
            self.hooks.before_forward()
        if entry.handouts is not None and not fresh:
            handout = self._handout(entry)
            if handout is not None:
                return self._replay_handout(handout)
        entry.graph.replay()
        self._after_replay(entry, ins, call)
        return entry.outputs if pad is None else self._views(entry, pad)

    # ------------------------------------------------------------------ handout graphs

    def _handout(self, entry: _Entry) -> Optional[HandoutGraph]:
        """A handout graph of ``entry`` whose earlier outputs nobody holds (captured now if all are
        held and the option allows one more), or None: the entry's own graph runs, outputs copied."""
        handouts = entry.handouts
        for handout in handouts:
            if handout.free():
                return handout
        if len(handouts) >= self.config.handout_graphs or self._handout_failed is not None:
            return None
        return self._capture_handout(entry)

    def _replay_handout(self, handout: HandoutGraph) -> Any:
        handout.graph.replay()
        counters = self.shared.counters
        self.replays += 1
        counters.replays += 1
        counters.handout_replays += 1
        return handout.outputs

    def _capture_handout(self, entry: _Entry) -> Optional[HandoutGraph]:
        """Capture ``entry``'s region again, from its static inputs (staged for this call), in a
        pool of its own. A failure is recorded once; the region then copies its outputs."""
        pool = self.shared.pools.private(entry.pool.device)
        static_ins = entry.static_ins
        fn = self.fn
        device = torch.device(entry.pool.device)
        reserved_before = _reserved(device)
        start = time.perf_counter()
        try:
            graph, outputs = self.shared.capturer.capture(
                lambda: fn(*static_ins), pool, restore=[t for t in static_ins if isinstance(t, torch.Tensor)])
        except CaptureError as exc:
            self._handout_failed = str(exc)
            self.shared.counters.handout_failures.append({"region": self.name, "error": str(exc)})
            if self.config.strict:
                raise RuntimeError(f"cgbackend: capturing a handout graph of region {self.name} failed: {exc}")
            log.warning("cgbackend: capturing a handout graph of %s failed; its outputs are copied: %s",
                        self.name, exc)
            return None
        elapsed = time.perf_counter() - start
        if isinstance(graph, SimulatedGraph):
            graph.attach(pool, pool.new_index())
        handout = HandoutGraph(graph, outputs, pool)
        entry.handouts.append(handout)
        self.shared.handout_storages |= handout.storages()
        self.shared.counters.handout_graphs += 1
        self._count_memory(entry, elapsed, _reserved(device) - reserved_before)
        log.log(logging.INFO if elapsed > 1.0 else logging.DEBUG, "cgbackend: captured handout graph %d of %s in %.3f s",
                len(entry.handouts), self.name, elapsed)
        return handout

    def _hands_out(self, entry: _Entry) -> bool:
        """May ``entry``'s outputs go to the caller from handout graphs (runtime/handout.py)?"""
        return (self.terminal and self.config.handout_graphs > 0 and handout_supported()
                and type(entry) is _Entry and self.hooks is None and entry.input_views is None
                and not entry.pad_dims and not entry.copy_back_pos and not entry.volatile_pos
                and any(t.numel() for t in iter_tensors(entry.outputs)))

    def _after_replay(self, entry: _Entry, ins: list, call: Any) -> None:
        for pos in entry.copy_back_pos:
            ins[pos].copy_(entry.static_ins[pos])
        counters = self.shared.counters
        counters.copy_backs += len(entry.copy_back_pos)
        entry.pool.acquire(entry.index)
        call.live.append((entry.pool, entry.index))
        self.replays += 1
        counters.replays += 1

    # ------------------------------------------------------------------ capture

    def _prepare_static_inputs(self, ins: list, grad_path: bool, entry: _Entry,
                               pad: Optional[_Pad] = None) -> None:
        static_ins: list = []
        copy_pos, handoff_pos, volatile_pos = [], [], []
        persistent = self.shared.persistent_ptrs
        plan = self.bucket if pad is not None else None
        for pos, value in enumerate(ins):
            kind = self.kinds[pos]
            if plan is not None and pos in plan.value_inputs:
                static_ins.append(plan.value_inputs[pos](pad.padded))
                continue
            if plan is not None and pos in plan.pad_inputs:
                dim, size = plan.pad_inputs[pos]
                shape, full = self._padded_full(value, dim, size(pad.padded))
                if full is not None:
                    static_ins.append(full)
                    handoff_pos.append(pos)
                    continue
                # Padding rows are copies of the last real row (inputs.fill_padding): the region is
                # row-independent, so they compute what that row computed, and no value an eager
                # call would not see (an index out of range) reaches the graph.
                buf = torch.zeros(shape, dtype=value.dtype, device=value.device)
                block = size(pad.actual) // pad.actual[plan.symbol]
                fill_padding(buf, value, dim, block)
                static_ins.append(buf)
                copy_pos.append(pos)
                entry.pad_dims[pos] = dim
                entry.pad_block[pos] = block
                continue
            volatile = kind == PARAM and self.shared.params.is_volatile(value)
            if volatile:
                volatile_pos.append(pos)  # read from a static copy, refreshed before each replay
            elif kind == VALUE or (kind == PARAM and not (grad_path and value.requires_grad)):
                static_ins.append(value)
                continue
            elif kind == PARAM:
                # A leaf alias (same storage): the capture then builds its own autograd nodes on the
                # capture stream instead of reusing the parameter's AccumulateGrad node, which was
                # made on the default stream and would tie that stream to the capture.
                # Still a Parameter: code that checks (torch.compile'd helpers guard on the type,
                # and would recompile inside the capture) sees what it saw in the warm-up.
                static_ins.append(torch.nn.Parameter(value.detach(), requires_grad=True)
                                  if isinstance(value, torch.nn.Parameter) else value.detach().requires_grad_(True))
                continue
            if value.numel() == 0 and not volatile:
                empty = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
                static_ins.append(empty.requires_grad_(True) if grad_path and value.requires_grad else empty)
                continue
            producer = self.producers[pos]
            handoff = kind == EAGER or (kind == HANDOFF and producer is not None and producer.disabled is None)
            if handoff and not volatile and value.data_ptr() in persistent:
                alias = value.detach()
                if grad_path and value.requires_grad:
                    alias.requires_grad_(True)
                static_ins.append(alias)
                handoff_pos.append(pos)
                continue
            buf = _static_buffer_like(value)
            with torch.no_grad():
                buf.copy_(value)
            if grad_path and value.requires_grad:
                buf.requires_grad_(True)
            static_ins.append(buf)
            copy_pos.append(pos)
        self.shared.register_persistent([static_ins[p] for p in copy_pos], handoff=False)
        entry.static_ins = static_ins
        entry.copy_pos = tuple(copy_pos)
        entry.handoff_pos = tuple(handoff_pos)
        entry.copy_back_pos = tuple(p for p in copy_pos if p in self.mutated)
        entry.volatile_pos = tuple(volatile_pos)
        entry.param_addrs = ParamPolicy.record(
            static_ins, [p for p, k in enumerate(self.kinds) if k == PARAM and p not in entry.volatile_pos])

    def _capture(self, ins: list, grad_path: bool, call: Any, pad: Optional[_Pad] = None) -> Optional[_Entry]:
        device = next((v.device for v, k in zip(ins, self.kinds) if k != VALUE), self.device)
        if device is None or (device.type != "cuda" and not self.shared.capturer.simulate):
            self.disable(EagerReason.NO_CUDA, f"inputs on {device}")
            return None
        pool = self.shared.pools.get(device, call.slot)
        entry: _Entry = _TrainEntry() if grad_path else _Entry()
        entry.pool = pool
        try:
            self._prepare_static_inputs(ins, grad_path, entry, pad)
        except torch.OutOfMemoryError as exc:  # the static buffers are part of what capturing costs
            self._failed_attempt(first_line(exc))
            return None
        static_ins = entry.static_ins
        fn = self.fn
        saved_storages: set[int] = set()
        if grad_path:
            entry.saved_modified = None

            def run() -> Any:
                # Hooks that skip autograd's version check (the static buffers are rewritten between
                # replays on purpose) but remember what it would have checked (inputs.py).
                saved = SavedTensors()
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    out = fn(*static_ins)
                modified, storages = saved.finish()
                if modified is not None:
                    entry.saved_modified = modified
                saved_storages.update(storages)
                return out
        else:
            def run() -> Any:
                return fn(*static_ins)
        reserved_before = _reserved(device)
        start = time.perf_counter()
        try:
            graph, outputs = self.shared.capturer.capture(
                run, pool, restore=[t for t in static_ins if isinstance(t, torch.Tensor)], hooks=self.hooks)
        except CaptureError as exc:
            self._failed_attempt(str(exc))
            return None
        elapsed = time.perf_counter() - start
        entry.graph = graph
        entry.index = pool.new_index()
        entry.slot = call.slot
        if isinstance(graph, SimulatedGraph):
            graph.attach(pool, entry.index)
        self._count_capture(entry, elapsed, _reserved(device) - reserved_before, forward=grad_path)
        if grad_path:
            self._finish_train_entry(entry, outputs)
            # Inputs read from the caller's memory whose static tensor the forward saved: their
            # versions are checked again at backward (_RegionFunction).
            entry.saved_pos = tuple(
                p for p in self._caller_memory(entry) if isinstance(static_ins[p], torch.Tensor)
                and static_ins[p].numel() and static_ins[p].untyped_storage().data_ptr() in saved_storages)
        else:
            entry.outputs = outputs
            self._register_outputs(entry)
            if pad is None and self._hands_out(entry):
                entry.handouts = []
        if pad is not None:
            entry.views = {}
            full = self.shared.padded_full
            for i in self.bucket.outputs:
                t = entry.outputs[i]
                full[(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)] = t
        log.debug("cgbackend: captured %s (%s, slot %d) in %.3f s", self.name,
                  "forward" if grad_path else "inference", call.slot, elapsed)
        return entry

    def _finish_train_entry(self, entry: _TrainEntry, outputs: Any) -> None:
        outs = list(outputs)
        entry.capture_outs = outs
        entry.tensor_pos = tuple(p for p, k in enumerate(self.kinds) if k != VALUE)
        entry.diff_in = tuple(p for p in entry.tensor_pos
                              if isinstance(entry.static_ins[p], torch.Tensor) and entry.static_ins[p].requires_grad)
        entry.diff_out = tuple(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad)
        entry.nondiff_out = tuple(i for i, o in enumerate(outs)
                                  if isinstance(o, torch.Tensor) and not o.requires_grad)
        entry.outputs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)
        entry.bwd_graph = None
        entry.bwd_index = -1
        entry.bwd_failed = None
        entry.static_grad_outs = None
        entry.static_grad_ins = None
        entry.handed = []
        entry.grad_ptrs = frozenset()
        entry.leaves = []
        entry.reach = None
        self._register_outputs(entry, skip=entry.diff_out)

    def _caller_memory(self, entry: _Entry) -> list[int]:
        """Positions whose static tensor stands for a caller's memory: copies and parameters."""
        return list(entry.copy_pos) + [p for p, k in enumerate(self.kinds) if k is PARAM]

    def _register_outputs(self, entry: _Entry, skip: tuple = ()) -> None:
        """Static outputs become hand-off candidates, except views of a static input: those are
        rebuilt on the caller's tensor after each replay (inputs.InputViews)."""
        views = InputViews.find(entry.outputs, entry.static_ins, self._caller_memory(entry), skip)
        entry.input_views = views
        outs = entry.outputs if views is None else [
            o for i, o in enumerate(entry.outputs) if i not in views.views]
        self.shared.register_persistent(outs)

    def _count_capture(self, entry: _Entry, elapsed: float, pool_growth: int, forward: bool) -> None:
        counters = self.shared.counters
        counters.graphs_captured += 1
        if forward:
            counters.fwd_graphs += 1
        self._count_memory(entry, elapsed, pool_growth)
        self.n_graphs += 1
        if elapsed > 1.0:
            log.info("cgbackend: capturing %s took %.2f s", self.name, elapsed)

    def _count_memory(self, entry: _Entry, elapsed: float, pool_growth: int) -> None:
        """A capture's time and the reserved memory it added, for ``entry``'s graphs."""
        counters = self.shared.counters
        counters.capture_time_s += elapsed
        growth = max(pool_growth, 0)
        counters.pool_bytes += growth
        counters.pool_bytes_held += growth
        entry.nbytes += growth
        self.capture_time_s += elapsed

    def _failed_attempt(self, error: str) -> None:
        self._failure = error
        if torch.cuda.is_available() and not self.shared.capturer.simulate:
            # Hand back what the failed attempt held and cached (its pool's blocks): the eager
            # calls need it, and after an out-of-memory error they may need all of it.
            gc.collect()
            torch.cuda.empty_cache()

    def _capture_failed(self, error: str) -> None:
        self.shared.counters.capture_failures.append({"region": self.name, "error": error})
        if self.config.strict:
            raise RuntimeError(f"cgbackend: capturing region {self.name} failed: {error}")
        log.warning("cgbackend: capturing region %s failed, it runs eagerly from now on: %s",
                    self.name, error)
        self.disable(EagerReason.CAPTURE_FAILED, error)

    # ------------------------------------------------------------------ training backward

    def capture_backward(self, entry: _TrainEntry, grads: tuple) -> None:
        """First backward of a training entry: capture its backward graph in the entry's pool."""
        try:
            grad_outs = [_static_buffer_like(entry.outputs[i]) for i in entry.diff_out]
            _fill_grads(grad_outs, entry.diff_out, grads)
        except torch.OutOfMemoryError as exc:
            self._backward_capture_failed(first_line(exc), entry)
            return
        entry.static_grad_outs = grad_outs
        self.shared.register_persistent(grad_outs, handoff=False)
        inputs = [entry.static_ins[p] for p in entry.diff_in]

        def run() -> Any:
            with no_donated_buffers():
                grads_in = torch.autograd.grad(entry.autograd_outputs(), inputs, grad_outputs=grad_outs,
                                               retain_graph=True, allow_unused=True)
            return tuple(grads_in)

        if getattr(self.fn, "needs_backward_prewarm", False):
            # Inductor compiles the keep-graph variant of its backward on first use: not in a capture.
            self.eager_backward(entry, grads)
        device = entry.outputs[entry.diff_out[0]].device if entry.diff_out else None
        reserved_before = _reserved(device)
        start = time.perf_counter()
        try:
            graph, static_grad_ins = self.shared.capturer.capture(
                run, entry.pool, hooks=self.hooks,
                reads=[t for t in entry.static_ins if isinstance(t, torch.Tensor)])
        except CaptureError as exc:
            self._backward_capture_failed(str(exc), entry)
            return
        elapsed = time.perf_counter() - start
        entry.bwd_graph = graph
        entry.bwd_index = entry.pool.new_index()
        if isinstance(graph, SimulatedGraph):
            graph.attach(entry.pool, entry.bwd_index)
        entry.static_grad_ins = static_grad_ins
        entry.grad_ptrs = frozenset(g.data_ptr() for g in static_grad_ins if g is not None)
        self.shared.register_persistent([g for g in static_grad_ins if g is not None], handoff=False)
        counters = self.shared.counters
        counters.bwd_graphs += 1
        self._count_capture(entry, elapsed, _reserved(device) - reserved_before, forward=False)

    def reclaim_grads(self, entry: _TrainEntry, leaves: list[torch.Tensor]) -> bool:
        """Before a backward replay rewrites the static gradients: may it?

        The last backward handed out aliases of them (autograd's AccumulateGrad keeps such an alias
        as ``param.grad`` instead of copying it). A ``.grad`` still aliasing one gets its own copy
        now; if anything else still holds one (``torch.autograd.grad`` results, a saved ``.grad``),
        return False: this backward must not overwrite it."""
        if not entry.handed:
            return True
        alive = [t for t in (ref() for ref in entry.handed) if t is not None]
        if alive:
            held = {id(t) for t in alive}
            del alive
            for leaf in leaves:
                grad = leaf.grad
                if grad is not None and id(grad) in held:
                    leaf.grad = grad.clone()
                    counters = self.shared.counters
                    counters.copies_made += 1
                    counters.copied_by_kind["grad_reclaimed"] += 1
                del grad
            if any(ref() is not None for ref in entry.handed):
                return False
        entry.handed = []
        entry.leaves = []
        if self.shared.handed.pop(id(entry), None) is not None:
            entry.pool.release(entry.bwd_index)
        return True

    def hand_out(self, entry: _TrainEntry, leaves: list[torch.Tensor]) -> tuple:
        """Fresh aliases of the static gradients for autograd (which may keep them as ``.grad``
        without a copy); remembered weakly, with the ``.grad`` that end up aliasing them."""
        if QUEUE_CALLBACK is None:
            # Without the hook nobody could tell which .grad keeps an alias: hand out the buffers
            # themselves, which autograd copies because we hold them.
            return entry.static_grad_ins
        out = tuple(None if g is None else g.detach() for g in entry.static_grad_ins)
        entry.handed = [weakref.ref(t) for t in out if t is not None]
        entry.leaves = leaves
        if id(entry) not in self.shared.handed:
            # Until reclaimed, the gradients are live data of the backward graph: the replay-order
            # rule then keeps graphs captured before it from running over them.
            self.shared.handed[id(entry)] = (self, entry)
            entry.pool.acquire(entry.bwd_index)

        def record_grads() -> None:
            for leaf in leaves:
                grad = leaf.grad
                if grad is not None and grad.data_ptr() in entry.grad_ptrs:
                    entry.handed.append(weakref.ref(grad))

        QUEUE_CALLBACK(record_grads)
        return out

    def _backward_capture_failed(self, error: str, entry: _TrainEntry) -> None:
        self.shared.counters.capture_failures.append({"region": self.name + " (backward)", "error": error})
        if self.config.strict:
            raise RuntimeError(f"cgbackend: capturing the backward of {self.name} failed: {error}")
        log.warning("cgbackend: capturing the backward of %s failed; its backward runs eagerly "
                    "through the captured forward: %s", self.name, error)
        entry.bwd_failed = error

    def eager_backward(self, entry: _TrainEntry, grads: tuple) -> tuple:
        """Backward without the backward graph: autograd through the captured forward's graph."""
        grad_outs = []
        for i in entry.diff_out:
            grad = grads[i]
            grad_outs.append(torch.zeros_like(entry.outputs[i]) if grad is None else grad)
        inputs = [entry.static_ins[p] for p in entry.diff_in]
        quiet = self.hooks.quiet_backward() if self.hooks is not None else contextlib.nullcontext()
        with no_donated_buffers(), quiet:
            return torch.autograd.grad(entry.autograd_outputs(), inputs, grad_outputs=grad_outs,
                                       retain_graph=True, allow_unused=True)


def _queue_callback() -> Optional[Callable[[Callable[[], None]], None]]:
    """The autograd engine's end-of-backward-pass hook (semi-private; feature-tested)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    return getattr(engine, "queue_callback", None)


QUEUE_CALLBACK = _queue_callback()


def _static_buffer_like(value: torch.Tensor) -> torch.Tensor:
    """A buffer to copy ``value`` into before each replay: same strides where they are a valid
    layout to write, dense otherwise (expanded inputs); the graph is keyed by the input strides."""
    if non_overlapping(value):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    return torch.empty(value.size(), dtype=value.dtype, device=value.device)


def _fill_grads(bufs: list[torch.Tensor], positions: tuple[int, ...], grads: tuple) -> int:
    """Incoming gradients into the backward graph's static buffers (zeros for None); returns how
    many were copied."""
    copied = 0
    for buf, i in zip(bufs, positions):
        if grads[i] is None:
            buf.zero_()
        else:
            buf.copy_(grads[i])
            copied += 1
    return copied


def _freeze(value: Any) -> Any:
    """Non-tensor inputs become part of a dict key: lists (of sizes) as tuples."""
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def no_donated_buffers():
    """Donated buffers let AOT autograd's backward reuse saved tensors' memory, which forbids
    retain_graph=True; cgbackend keeps the captured forward's autograd graph to capture the backward
    (and to run it eagerly if that capture fails). Read at compile time and at backward time."""
    return torch._functorch.config.patch(donated_buffer=False)


def _reserved(device: Optional[torch.device]) -> int:
    if device is None or device.type != "cuda":
        return 0
    return torch.cuda.memory_reserved(device)


class _RegionFunction(torch.autograd.Function):
    """Forward: replay the entry's forward graph. Backward: replay (or capture) its backward graph."""

    @staticmethod
    def forward(ctx: Any, info: tuple, *tensors: torch.Tensor) -> Any:
        runner, entry, call, fresh = info
        ins = list(tensors)
        full = [None] * len(runner.kinds)
        for p, t in zip(entry.tensor_pos, ins):
            full[p] = t
        runner._stage_inputs(entry, full, fresh)
        ctx.hook_token = runner.hooks.before_forward() if runner.hooks is not None else None
        entry.graph.replay()
        runner._after_replay(entry, full, call)
        ctx.versions = [(full[p], full[p]._version) for p in entry.saved_pos]
        counters = runner.shared.counters
        counters.fwd_replays += 1
        ctx.runner, ctx.entry, ctx.call = runner, entry, call
        ctx.generation = call.generation
        ctx.leaves = [t for t in tensors if t.requires_grad and t.is_leaf]
        # Volatile parameters (FSDP2's) by position: copied into the entry again before backward.
        ctx.volatile = [(p, full[p]) for p in entry.volatile_pos]
        call.add_token()
        ctx.set_materialize_grads(False)
        # Fresh aliases each call: autograd attaches this call's history to the returned objects,
        # never to the static buffers themselves.
        outs = tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in entry.outputs)
        if entry.nondiff_out:
            ctx.mark_non_differentiable(*(outs[i] for i in entry.nondiff_out))
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:
        runner, entry, call = ctx.runner, ctx.entry, ctx.call
        if entry.saved_modified is not None:
            raise saved_modified_error(entry.saved_modified, runner.name)
        for t, version in ctx.versions:
            if t._version != version:
                raise saved_modified_error(
                    f"an input of shape {tuple(t.shape)}@{t.dtype} saved by the region was written in "
                    f"place between forward and backward (version {t._version}; expected {version})",
                    runner.name)
        if torch.is_grad_enabled():  # the engine runs backward in grad mode only for create_graph
            raise RuntimeError(
                f"cgbackend: backward with create_graph=True (double backward) through graphed region "
                f"{runner.name} is not supported: its backward replays a graph, which records no "
                "autograd history to differentiate again. Compute higher-order gradients without "
                "cgbackend for this model.")
        if not call.still_valid(ctx.generation):
            raise RuntimeError(
                f"cgbackend: backward through graphed region {runner.name} after its memory was reused "
                "by a later forward (a second backward over a retained graph). Run backward before the "
                "next forward of the model, or compile without CUDA graphs for this pattern.")
        call.on_backward()
        counters = runner.shared.counters
        if entry.reach is None:  # which inputs each output reaches, from the forward's autograd graph
            entry.reach = runner.reach_of(entry)
        if ctx.volatile:
            copied = ParamPolicy.refresh(entry.static_ins, ctx.volatile)
            counters.copies_made += copied
            counters.copied_by_kind["param"] += copied
        moved = ParamPolicy.moved(entry.static_ins, entry.param_addrs) if entry.param_addrs else None
        if moved is None and entry.bwd_graph is None and entry.bwd_failed is None:
            runner.capture_backward(entry, grads)
            fresh = True
        else:
            fresh = False
        if moved is not None:
            # An engine re-allocated a parameter since the forward was captured (FSDP2 without
            # cgbackend.distributed.track_fsdp): a graph would read the old address.
            log.debug("cgbackend: %s backward: parameter moved (%s)", runner.name, moved)
            reason = EagerReason.PARAM_MOVED
        elif entry.bwd_graph is None:
            reason = "backward_capture_failed"
        elif entry.pool.hazard(entry.bwd_index):
            reason = EagerReason.REPLAY_ORDER
        elif not runner.reclaim_grads(entry, ctx.leaves):
            reason = EagerReason.GRAD_HELD
        else:
            reason = None
        if reason is not None:
            runner._count_eager(reason)
            grads_in = runner.eager_backward(entry, grads)
        else:
            if not fresh:
                copied = _fill_grads(entry.static_grad_outs, entry.diff_out, grads)
                counters.copies_made += copied
                counters.copied_by_kind["grad_output"] += copied
            entry.bwd_graph.replay()
            counters.replays += 1
            counters.bwd_replays += 1
            grads_in = runner.hand_out(entry, ctx.leaves)
        if runner.hooks is not None:
            runner.hooks.after_backward(ctx.hook_token)
        by_pos = dict(zip(entry.diff_in, grads_in))
        # Inputs only outputs without a gradient reach: None, as eager autograd leaves them (the
        # graph computed zeros for them).
        for i in unreached(entry.reach, [grads[k] for k in entry.diff_out]):
            by_pos[entry.diff_in[i]] = None
        return (None,) + tuple(by_pos.get(p) for p in entry.tensor_pos)
