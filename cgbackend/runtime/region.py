"""One static region at runtime: warm up, capture, replay, or run eagerly with a counted reason.

A :class:`RegionRunner` is called with the region's inputs in order (their kinds: spec.py) and
decides per call: the fast path (fast.py), a held graph found by its key (graph_cache.py), an
eager warm-up call (warmup.py), a new capture (recorder.py), or an eager call with a counted
reason. Inference entries hold one graph. Training entries (a call with grad enabled where some
input requires grad) hold a forward graph replayed inside an autograd.Function and a backward graph
captured at the first backward (backward.py); the forward's saved activations live in the entry,
whose call slot stays busy until the backward pass is over (see calls.CallState).

The runner owns its collaborators and hands each what it reads, never itself: the region's spec
(immutable), code, state and counts (spec.py), the shared state, and the other collaborators it
works with (the fast path replays through the Replayer and picks CallerGraphs). They return
decisions (a key, an entry or why there is none, a synchronization seen), and the runner acts.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

from .backward import Backward, RegionFunction
from .backward_memory import BackwardMemory
from .caller_graphs import CallerGraphs
from .capture import clear_blas_workspaces
from .entries import Entry, Pad, TrainEntry
from .fast import FastPath
from .graph_cache import GraphCache
from .inputs import overlap
from .params import ParamAddresses
from .recorder import NoEntry, Recorder
from .replay import Replayer
from .shared import RuntimeShared
from .sharing import LayerSharing
from .spec import VALUE, RegionCode, RegionCounts, RegionSpec, RegionState
from ..common.reasons import EagerReason
from .tangents import relay_outputs
from .warmup import SyncHit, sync_location, warmup_call

__all__ = ["RegionRunner"]

log = logging.getLogger(__name__)


class RegionRunner:
    """Runs one static region. Called with the region's inputs in order; returns its outputs."""

    def __init__(self, spec: RegionSpec, code: RegionCode, shared: RuntimeShared,
                 on_sync: Optional[Callable[[SyncHit], bool]] = None,
                 sharing: Optional[LayerSharing] = None) -> None:
        self.spec = spec
        self.code = code
        """What the region runs (its FX module, or Inductor's code once compiled at warm-up)."""
        self.shared = shared
        self.config = shared.config
        self.name = spec.name
        self.on_sync = on_sync
        """Set by the executor: asked to split the region at an op that synchronized in warm-up
        (runtime/syncsplit.py); False when it cannot, and the region then runs eagerly."""
        self.state = RegionState(bucket_symbol=spec.bucket.symbol if spec.bucket is not None else None)
        """What other regions read of this one (through their spec's sources)."""
        self.counts = RegionCounts(spec.name, shared.counters, shared.progress)
        self.params = ParamAddresses(spec.param_pos)
        self.replayer = Replayer(spec, self.counts)
        sharing = sharing if sharing is not None else LayerSharing(shared.layer_copies, None)
        self.callers = CallerGraphs(spec, code, self.state, shared, self.counts, sharing)
        """Caller graphs of the inference entries (caller_graphs.py, option handout_graphs)."""
        self.fast = FastPath(spec, self.params, shared.params, self.replayer, self.callers, self.counts)
        """The inference fast path (fast.py)."""
        self.cache = GraphCache(spec, shared, self.counts, self.params, on_drop=self.fast.clear, sharing=sharing)
        """The held graphs by key, warm-up counts, eviction (graph_cache.py)."""
        self.recorder = Recorder(spec, code, self.state, shared, self.counts)
        """Captures of entries (recorder.py)."""
        self.backward = Backward(spec, code, shared, self.counts, self.replayer,
                                 BackwardMemory(spec.name, spec.recomputable, shared.counters))
        """Backward graphs of training entries (backward.py)."""
        # Immutable parts of the spec and the state's set, read on every call.
        self._rebased = self.state.rebased_ptrs
        self._kinds = spec.kinds
        self._written = spec.written
        self._overlap_pos = spec.overlap_pos
        self._caller_pos = spec.caller_pos
        self._bucket = spec.bucket
        self._hooks = spec.hooks

    def _eager(self, ins: list, reason: str) -> Any:
        self.counts.eager(reason)
        return self.code.fn(*ins)

    def disable(self, reason: str, detail: str) -> None:
        """The region runs eagerly for good from now on (the first reason stays)."""
        state = self.state
        if state.disabled is None:
            state.disabled = reason
            state.disabled_detail = detail
        self.fast.clear()

    def set_terminal(self, terminal: bool) -> None:
        """Whether no static region of the graph runs after this one (the executor decides)."""
        if self.state.terminal and not terminal:
            # A static region now reads its outputs, which its graphs may have released
            # (runtime/loose_outputs.py): those graphs go, and it captures again.
            self.cache.drop_released_outputs()
        self.state.terminal = terminal

    # ------------------------------------------------------------------ entry point

    def __call__(self, ins: list, call: Any) -> Any:
        if self._rebased:
            self._rebased.clear()
        if self.fast.remembered and not call.training and self.shared.params.volatile is None:
            out = self.fast.replay(ins, call)
            if out is not None:
                return out
        if self.state.disabled is not None:
            return self._eager(ins, self.state.disabled)
        grad_path = call.training and any(
            v.requires_grad for v, k in zip(ins, self._kinds) if k != VALUE)
        if self._written and overlap(ins, self._written, self._overlap_pos) is not None:
            # Copies of overlapping inputs would not see each other's writes (inputs.py).
            return self._fallback(ins, EagerReason.ALIASED_INPUTS)
        if grad_path and any(ins[p].is_inference() for p in self._caller_pos):
            # Autograd refuses to save an inference tensor (eagerly, on every call); its static
            # copy is a normal tensor and would be saved.
            return self._fallback(ins, EagerReason.INFERENCE_TENSOR)
        layouts = self.code.layouts
        if layouts is not None and layouts.broadcasting and not layouts.hold(ins):
            # A tensor that differs along a dim the compiled code reads with stride 0: no static
            # buffer in its layout can hold it (runtime/layouts.py).
            return self._fallback(ins, EagerReason.INPUT_LAYOUT)
        cache = self.cache
        pad = None
        if self._bucket is not None and not grad_path:
            actual = self._bucket.bindings(ins)
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
                made = self._recapture(key, entry, ins, call, pad)
                if type(made) is NoEntry:
                    return self._no_entry(made, ins, shape_key)
                if made is not None:
                    return self._run_entry(made, ins, call, True, pad)
            if pad is None and not grad_path:
                self.fast.note(entry, ins)
            return self._run_entry(entry, ins, call, False, pad)
        if (not grad_path and self.shared.watch_churn
                and cache.churn.note(shape_key if key is None else key, cache.sharing.copies, self.counts.replays)):
            return self._shapes_vary(ins)
        warm = cache.warm.get(shape_key, 0)
        if warm < self.config.warmup:
            return self._warm_up(ins, call, grad_path, shape_key, warm)
        if key is None:
            return self._eager(ins, EagerReason.PRODUCER_EAGER)
        if not cache.make_room():
            if self.config.strict:
                raise RuntimeError(
                    f"cgbackend: region {self.name} needs a new graph but holds {len(cache.entries)} in "
                    "use (max_graphs_per_region); strict=True forbids eager fallback")
            return self._eager(ins, EagerReason.CACHE_THRASH if cache.thrashing else EagerReason.GRAPH_LIMIT)
        made = self._capture(ins, grad_path, call, pad)
        if type(made) is NoEntry:
            return self._no_entry(made, ins, shape_key)
        if pad is not None:
            made.size = pad.padded[self._bucket.symbol]
        cache.entries[key] = made
        if pad is None and not grad_path:
            self.fast.note(made, ins)
        return self._run_entry(made, ins, call, True, pad)

    def _shapes_vary(self, ins: list) -> Any:
        """A call of a region whose signatures churn (churn.py): its code without a graph (compiled
        at its first warm-up call), counted; strict forbids it."""
        if self.config.strict:
            raise RuntimeError(f"cgbackend: region {self.name} sees a new input signature at nearly every call "
                               f"({self.cache.churn.varying}); strict=True forbids running it without a graph")
        if self.counts.eager_calls.get(EagerReason.SHAPES_VARY) is None:
            log.info("cgbackend: region %s: %s", self.name, self.cache.churn.varying)
        return self._eager(ins, EagerReason.SHAPES_VARY)

    def _warm_up(self, ins: list, call: Any, grad_path: bool, shape_key: tuple, warm: int) -> Any:
        cache = self.cache
        self.counts.eager(EagerReason.WARMUP)
        cache.note_warm(shape_key, warm + 1)
        try:
            # Watched for host synchronization (which would break a capture); a region compiled
            # lazily is compiled at its first warm-up call and runs that code (warmup.py).
            out, hit, again = warmup_call(self.code, ins, self.shared.sync_detector, self.config.strict)
            if again:  # the compiled code synchronized: one more (eager) warm-up finds the op
                cache.warm[shape_key] = max(cache.warm.get(shape_key, 1) - 1, 0)
            elif hit is not None:
                self._host_sync(hit)
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
                out = relay_outputs(out, self.spec.caller_only, self.shared.counters)
            return out
        except BaseException:
            cache.note_warm(shape_key, warm)  # only a call that returned counts as warm-up
            raise

    def _host_sync(self, hit: SyncHit) -> None:
        """A warm-up call synchronized with the host: split the region at that op if the executor
        can, else run it eagerly for good."""
        where = sync_location(hit.node)
        if self.config.strict:
            raise RuntimeError(f"cgbackend: region {self.name} synchronizes with the host{where}: {hit.detail}")
        if hit.node is not None and self.on_sync is not None and self.on_sync(hit):
            log.info("cgbackend: region %s synchronized with the host during warm-up%s (%s); it is split "
                     "there: that op runs eagerly, the rest is captured", self.name, where, hit.detail)
            self.disable(EagerReason.SPLIT_AT_SYNC, f"split{where}: {hit.detail}")
            return
        log.warning("cgbackend: region %s synchronized with the host during warm-up%s (%s); it runs "
                    "eagerly from now on", self.name, where, hit.detail)
        self.disable(EagerReason.HOST_SYNC_SEEN, hit.detail)

    def _capture(self, ins: list, grad_path: bool, call: Any, pad: Optional[Pad]) -> Union[Entry, NoEntry]:
        """A new entry for this call (recorder.py), given caller graphs where they apply."""
        made = self.recorder.capture(ins, grad_path, call, pad)
        if type(made) is Entry and pad is None and self.callers.applies(made):
            made.caller_graphs = []
        return made

    def _recapture(self, key: tuple, old: Entry, ins: list, call: Any,
                   pad: Optional[Pad]) -> Union[Entry, NoEntry, None]:
        """An inference graph that may not replay now: a graph captured after it (another region's,
        for a size this region pads to the same bucket) holds live outputs in memory it may use.
        Capture it again, after them, in place of the old one; bounded like evictions. None: not
        now (the old graph is in use, or the bound is reached)."""
        if isinstance(old, TrainEntry) or old.in_use() or not self.cache.may_recapture():
            return None
        made = self._capture(ins, False, call, pad)
        if type(made) is NoEntry:
            return made
        self.cache.replace(key, old, made)
        log.debug("cgbackend: %s recaptured a graph to replay after newer ones", self.name)
        return made

    def _no_entry(self, made: NoEntry, ins: list, shape_key: tuple) -> Any:
        """A capture made no entry: no CUDA (eager for good), or its attempt failed."""
        if made.reason == EagerReason.NO_CUDA:
            self.disable(made.reason, made.detail)
            return self._eager(ins, self.state.disabled)
        return self._after_failed_capture(ins, shape_key, made.detail)

    def _fallback(self, ins: list, reason: str) -> Any:
        if self.config.strict:
            raise RuntimeError(f"cgbackend: region {self.name} runs eagerly for this call "
                               f"({reason}: {EagerReason.DESCRIPTIONS[reason]}); strict=True forbids it")
        return self._eager(ins, reason)

    def _after_failed_capture(self, ins: list, shape_key: tuple, error: str) -> Any:
        """A capture attempt raised: run the call eagerly to tell whose error it was. If eager
        raises too, the error belongs to the call (its code or its inputs): it reaches the caller,
        and the region captures later, after another eager call of this signature returns (so
        failed attempts never outnumber good calls). Otherwise the capture itself failed: the
        region runs eagerly from now on (counted in capture_failures)."""
        try:
            out = self.code.fn(*ins)
        except Exception:
            self.counts.eager(EagerReason.CALL_RAISED)
            self.cache.note_warm(shape_key, max(self.config.warmup - 1, 0))
            log.info("cgbackend: capturing %s raised the call's own error (also raised eagerly): %s",
                     self.name, error)
            raise
        self.shared.counters.capture_failures.append({"region": self.name, "error": error})
        if self.config.strict:
            raise RuntimeError(f"cgbackend: capturing region {self.name} failed: {error}")
        log.warning("cgbackend: capturing region %s failed, it runs eagerly from now on: %s", self.name, error)
        self.disable(EagerReason.CAPTURE_FAILED, error)
        self.counts.eager(self.state.disabled)
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
            out = RegionFunction.apply((self.backward, entry, call, fresh), *tensors)
        else:
            out = self._replay(entry, ins, call, fresh, pad)
        if views is None:
            return out
        out = views.rebase(out, ins)
        self._rebased.update(out[i].data_ptr() for i in views.views)
        return out

    def _replay(self, entry: Entry, ins: list, call: Any, fresh: bool, pad: Optional[Pad]) -> Any:
        self.replayer.stage(entry, ins, fresh)
        if self._hooks is not None:
            self._hooks.before_forward()
        if entry.caller_graphs is not None and not fresh:
            caller = self.callers.pick(entry)
            if caller is not None:
                return self.replayer.replay_caller(caller)
        entry.graph.replay()
        self.replayer.finish(entry, ins, call)
        return entry.outputs if pad is None else self.cache.views(entry, pad)
