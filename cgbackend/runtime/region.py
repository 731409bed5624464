"""One static region at runtime: warm up, capture, replay, or run eagerly with a counted reason.

A :class:`RegionRunner` is called with the region's inputs in order (their kinds: entries.py) and
decides per call: the fast path (fast.py), a held graph found by its key (graph_cache.py), an
eager warm-up call (warmup.py), a new capture (recorder.py), or an eager call with a counted
reason. Inference entries hold one graph. Training entries (a call with grad enabled where some
input requires grad) hold a forward graph replayed inside an autograd.Function and a backward graph
captured at the first backward (backward.py); the forward's saved activations live in the entry,
whose call slot stays busy until the backward pass is over (see executor.CallState).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .backward import Backward, RegionFunction
from .capture import clear_blas_workspaces
from .entries import COPY, PARAM, VALUE, Entry, Pad, RuntimeShared, TrainEntry, copy_all, is_static_address
from .fast import FastPath
from .graph_cache import THRASH_EVICTIONS, GraphCache
from .handout import HandoutGraph
from .inputs import fill_padding, overlap, overlap_candidates
from .layouts import AdaptedCall, InputLayouts, compact_view, copy_into
from .reach import fake_output_reach, reached_inputs
from .recorder import Recorder
from .sharing import LayerSharing
from .stats import EagerReason
from .tangents import relay_outputs
from .warmup import warmup_call

if TYPE_CHECKING:
    from ..opaque import RegionHooks
    from ..passes.bucket import BucketPlan
    from .inner import LazyInner

__all__ = ["RegionRunner"]

log = logging.getLogger(__name__)


class RegionRunner:
    """Runs one static region. Called with the region's inputs in order; returns its outputs."""

    def __init__(self, name: str, fn: Callable[..., Any], kinds: list[str],
                 producers: list[Optional["RegionRunner"]], mutated: set[int],
                 shared: RuntimeShared, bucket: Optional["BucketPlan"] = None,
                 device: Optional[torch.device] = None, hooks: Optional["RegionHooks"] = None,
                 sharing: Optional[LayerSharing] = None) -> None:
        self.name = name
        self.fn = fn
        self.kinds = kinds
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
        self.sharing = sharing if sharing is not None else LayerSharing(shared.layer_copies, None)
        """How many layers share the region's graph (sharing.py): scales its bound on graphs."""
        self.disabled: Optional[str] = None
        """Set when the region runs eagerly for good (capture failed, no CUDA, capture off)."""
        self.disabled_detail: str = ""
        self.n_graphs = 0
        """Graphs captured so far (a training entry's backward counts too), evicted ones included."""
        self.replays = 0
        self.eager_calls: dict[str, int] = {}
        self.capture_time_s = 0.0
        self.lazy_inner: Optional["LazyInner"] = None
        """The region's pending Inductor compile (inner.py), done at its first warm-up call."""
        self.on_sync: Optional[Callable[["RegionRunner", Any], bool]] = None
        """Set by the executor: asked to split the region at an op that synchronized in warm-up
        (runtime/syncsplit.py); False when it cannot, and the region then runs eagerly."""
        self.caller_pos = tuple(p for p, k in enumerate(kinds) if k not in (VALUE, PARAM))
        self.written = tuple(sorted(mutated))
        self.overlap_pos = overlap_candidates(kinds, self.written, PARAM, VALUE) if mutated else ()
        self.rebased_ptrs: set[int] = set()
        """data_ptr() of the outputs this region's latest call rebuilt on a caller's tensor
        (inputs.InputViews): a consumer copies them like eager values."""
        self.terminal = False
        """No static region of the graph runs after this one (set by the executor): its inference
        entries may hand their outputs out without a copy (runtime/handout.py)."""
        self.cache = GraphCache(self)
        """The held graphs by key, warm-up counts, eviction (graph_cache.py)."""
        self.fast = FastPath(self)
        """The inference fast path (fast.py)."""
        self.recorder = Recorder(self)
        """Captures of entries and handout graphs (recorder.py)."""
        self.backward = Backward(self)
        """Backward graphs of training entries (backward.py)."""
        self.caller_only: frozenset[int] = frozenset()
        """Positions of the outputs only the caller reads (set by the executor: in the Dynamo graph
        their one user is its output node, so they reach the caller as copies and no graph or eager
        op reads the static buffer). A training entry's backward may take its incoming gradient into
        such an output's memory (recorder.py, ``grad_out_shared``)."""
        self.recomputable = False
        """Running the region's code again on the same inputs gives the same outputs and changes
        nothing else (set by the executor): its training entries may free their saved activations
        and recompute them in a backward that cannot replay (backward.py)."""
        self.collectives = False
        """The region holds collectives (passes/collectives.py; set by the executor): every call
        must issue them exactly once, on every path, so its simulated captures stand for their
        first replay as CUDA captures do (capture.py)."""

    # ------------------------------------------------------------------ what others read

    @property
    def entries(self) -> dict:
        return self.cache.entries

    @property
    def warm(self) -> dict:
        return self.cache.warm

    @property
    def evicted(self) -> int:
        return self.cache.evicted

    @property
    def recaptured(self) -> int:
        return self.cache.recaptured

    @property
    def thrashing(self) -> Optional[str]:
        return self.cache.thrashing

    def release_entry(self, entry: Entry) -> None:
        """Drop one entry's graphs and buffers (the caller synchronized; cgbackend.distributed)."""
        self.cache.release(entry, sync=False)

    def reach_of(self, entry: TrainEntry) -> tuple:
        """Which of ``entry``'s differentiable inputs each differentiable output reaches. An
        Inductor-compiled region's forward is one autograd node that reaches every input: there the
        FX module runs on fake tensors to build the graph eager autograd would walk."""
        lazy = self.lazy_inner
        if lazy is not None and lazy.state == "compiled":
            found = fake_output_reach(lazy.module, entry.static_ins, entry.diff_in, entry.diff_out)
            if found is not None:
                return found[1]
        return reached_inputs(entry.autograd_outputs(), [entry.static_ins[p] for p in entry.diff_in])

    @property
    def layouts(self) -> Optional[InputLayouts]:
        """The layouts the region's compiled code reads its copied inputs in (runtime/layouts.py);
        None while it runs its FX module, which reads any layout."""
        fn = self.fn
        return fn.layouts if type(fn) is AdaptedCall else None

    def count_eager(self, reason: str) -> None:
        self.eager_calls[reason] = self.eager_calls.get(reason, 0) + 1
        self.shared.counters.eager_calls[reason] += 1

    def _eager(self, ins: list, reason: str) -> Any:
        self.count_eager(reason)
        return self.fn(*ins)

    def disable(self, reason: str, detail: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            self.disabled_detail = detail
        self.fast.clear()

    # ------------------------------------------------------------------ entry point

    def __call__(self, ins: list, call: Any) -> Any:
        if self.rebased_ptrs:
            self.rebased_ptrs = set()
        if self.fast.remembered and not call.training and self.shared.params.volatile is None:
            out = self.fast.replay(ins, call)
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
        layouts = self.layouts
        if layouts is not None and layouts.broadcasting and not layouts.hold(ins):
            # A tensor that differs along a dim the compiled code reads with stride 0: no static
            # buffer in its layout can hold it (runtime/layouts.py).
            return self._fallback(ins, EagerReason.INPUT_LAYOUT)
        cache = self.cache
        pad = None
        if self.bucket is not None and not grad_path:
            actual = self.bucket.bindings(ins)
            if cache.above_limit(actual):
                return self._eager(ins, EagerReason.ABOVE_MAX_CAPTURE)  # by design, also under strict
            pad = cache.padding(actual)
        if pad is None:
            key, shape_key = cache.keys(ins, grad_path, call.slot)
        else:
            key, shape_key = cache.padded_keys(ins, pad, call.slot)
        entry = cache.entries.get(key) if key is not None else None
        if entry is not None:
            cache.entries.move_to_end(key)
            if entry.pool.hazard(entry.index) and not grad_path:
                fresh_entry = self._recapture(key, entry, ins, call, pad)
                if fresh_entry is not None:
                    return self._run_entry(fresh_entry, ins, call, True, pad)
                if self.recorder.failure is not None:
                    return self._after_failed_capture(ins, shape_key)
                if self.disabled is not None:
                    return self._eager(ins, self.disabled)
            if pad is None and not grad_path:
                self.fast.note(entry, ins)
            return self._run_entry(entry, ins, call, False, pad)
        warm = cache.warm.get(shape_key, 0)
        if warm < self.config.warmup:
            self.count_eager(EagerReason.WARMUP)
            cache.note_warm(shape_key, warm + 1)
            try:
                # Watched for host synchronization (which would break a capture); a region compiled
                # lazily is compiled at its first warm-up call and runs that code (warmup.py).
                out = warmup_call(self, ins, shape_key)
                if grad_path and not self.shared.capturer.simulate:
                    # This forward's cuBLAS workspace (32 MiB on Hopper) would stay allocated
                    # through its backward, which runs on autograd's thread with a workspace of its
                    # own: dropped, its block is free for that backward (a training step's peak),
                    # as cudagraph trees drops them around its warm-up runs. The next product
                    # allocates one again.
                    clear_blas_workspaces()
                if grad_path:
                    # The outputs only the caller reads pass their incoming gradients on without
                    # autograd's buffers holding them: the compiled backward frees each after its
                    # last read (tangents.py).
                    out = relay_outputs(out, self.caller_only, self.shared.counters)
                return out
            except BaseException:
                cache.note_warm(shape_key, warm)  # only a call that returned counts as warm-up
                raise
        if key is None:
            return self._eager(ins, EagerReason.PRODUCER_EAGER)
        if not cache.make_room():
            if self.config.strict:
                raise RuntimeError(
                    f"cgbackend: region {self.name} needs a new graph but holds {len(cache.entries)} in "
                    "use (max_graphs_per_region); strict=True forbids eager fallback")
            return self._eager(ins, EagerReason.CACHE_THRASH if cache.thrashing else EagerReason.GRAPH_LIMIT)
        entry = self.recorder.capture(ins, grad_path, call, pad)
        if entry is None:
            if self.recorder.failure is not None:
                return self._after_failed_capture(ins, shape_key)
            return self._eager(ins, self.disabled or EagerReason.CAPTURE_FAILED)
        if pad is not None:
            entry.size = pad.padded[self.bucket.symbol]
        cache.entries[key] = entry
        if pad is None and not grad_path:
            self.fast.note(entry, ins)
        return self._run_entry(entry, ins, call, True, pad)

    def _recapture(self, key: tuple, old: Entry, ins: list, call: Any, pad: Optional[Pad]) -> Optional[Entry]:
        """An inference graph that may not replay now: a graph captured after it (another region's,
        for a size this region pads to the same bucket) holds live outputs in memory it may use.
        Capture it again, after them, in place of the old one; bounded like evictions. None: not
        now (the old graph is in use, the bound is reached, or the capture failed)."""
        if isinstance(old, TrainEntry) or old.in_use():
            return None
        if self.cache.recaptured >= THRASH_EVICTIONS * self.cache.bound():
            return None
        fresh = self.recorder.capture(ins, False, call, pad)
        if fresh is None:
            return None
        self.cache.replace(key, old, fresh)
        log.debug("cgbackend: %s recaptured a graph to replay after newer ones", self.name)
        return fresh

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
        error, self.recorder.failure = self.recorder.failure, None
        try:
            out = self.fn(*ins)
        except Exception:
            self.count_eager(EagerReason.CALL_RAISED)
            self.cache.note_warm(shape_key, max(self.config.warmup - 1, 0))
            log.info("cgbackend: capturing %s raised the call's own error (also raised eagerly): %s",
                     self.name, error)
            raise
        self.recorder.capture_failed(error)
        self.count_eager(self.disabled or EagerReason.CAPTURE_FAILED)
        return out

    # ------------------------------------------------------------------ replay

    def _run_entry(self, entry: Entry, ins: list, call: Any, fresh: bool, pad: Optional[Pad] = None) -> Any:
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
        if isinstance(entry, TrainEntry):
            tensors = [ins[p] for p in entry.tensor_pos]
            out = RegionFunction.apply((self, entry, call, fresh), *tensors)
        else:
            out = self._replay(entry, ins, call, fresh, pad)
        if views is None:
            return out
        out = views.rebase(out, ins)
        self.rebased_ptrs = {out[i].data_ptr() for i in views.views}
        return out

    def stage_inputs(self, entry: Entry, ins: list, fresh: bool, static: Optional[list] = None) -> None:
        """Copy the caller's inputs into the entry's static buffers (``static``: those buffers in
        ``copy_pos`` order, when the caller has them at hand) and count the copies."""
        counters = self.shared.counters
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
        counters.copies_avoided += len(entry.handoff_pos)

    def _copy_kind(self, value: torch.Tensor, pos: int) -> str:
        if is_static_address(value):
            return "param"
        return "user_input" if self.kinds[pos] == COPY else "eager_value"

    def _replay(self, entry: Entry, ins: list, call: Any, fresh: bool, pad: Optional[Pad]) -> Any:
        self.stage_inputs(entry, ins, fresh)
        if self.hooks is not None:
            self.hooks.before_forward()
        if entry.handouts is not None and not fresh:
            handout = self.recorder.handout(entry)
            if handout is not None:
                return self.replay_handout(handout)
        entry.graph.replay()
        self.after_replay(entry, ins, call)
        return entry.outputs if pad is None else self.cache.views(entry, pad)

    def replay_handout(self, handout: HandoutGraph) -> Any:
        handout.graph.replay()
        counters = self.shared.counters
        self.replays += 1
        counters.replays += 1
        counters.handout_replays += 1
        return handout.outputs

    def after_replay(self, entry: Entry, ins: list, call: Any) -> None:
        for pos in entry.copy_back_pos:
            ins[pos].copy_(entry.static_ins[pos])
        counters = self.shared.counters
        counters.copy_backs += len(entry.copy_back_pos)
        entry.pool.acquire(entry.index)
        call.live.append((entry.pool, entry.index))
        self.replays += 1
        counters.replays += 1
