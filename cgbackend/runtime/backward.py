"""The training side of a region: the autograd.Function that replays a training entry's forward
graph, and its backward: captured at the first backward in the entry's pool, replayed after, or
run as autograd through the captured forward (a parameter moved, the capture failed, the replay
order or a held gradient forbids the replay), each counted with its reason.

The static gradients a backward replay produces are given to autograd as fresh aliases; a
``.grad`` that keeps one is given its own memory before the next backward replay rewrites them
(runtime/static_grads.py), so ``.grad`` accumulates as eagerly.

Once its backward graph exists, an entry frees the saved activations the capture's autograd graph
held (runtime/backward_memory.py, ``settle``; pool.py says when that is safe): between steps only
its static buffers stay allocated. A backward that cannot replay its graph then runs autograd
through a recomputed forward (the region's code on the static inputs, which hold this call's values
until its backward is over). That takes a region that computes the same thing twice: no random op,
no global state, no input written in place, no opaque module call. Any other region keeps the
capture's autograd graph and loosens what it saved instead (saved.py): its blocks go to the backward
graph the same way, and the backwards that cannot replay the graph run through that autograd graph
on this forward replay's values. The static inputs that need no gradient go to the pool's last
backward graph too (backward_memory.py, ``release_inputs``), and a recomputable region's Inductor
code may donate saved tensors to its backward (inner.donating): a backward graph that writes over
what it reads replays once per forward, and a backward that keeps the graph (retain_graph=True), or
a later one through the same forward, runs on the forward computed again (or through the kept graph)
instead.

The backward side reads the region's spec, code and counters and replays through its Replayer;
the autograd.Function gets that side, never the runner.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Optional

import torch

from .backward_memory import BackwardMemory
from .capture import CaptureError, SimulatedGraph, first_line
from .entries import TrainEntry, fill_grads, reserved, static_buffer_like
from .held import HeldStorages, use_counts_supported
from .inner import KEEP_GRAPH, donating, no_donated_buffers
from .inputs import saved_modified_error
from .loose_grads import loosen_dropped, watch_given, weight_grads
from .params import ParamPolicy
from .reach import fake_output_reach, reached_inputs, unreached
from .replay import Replayer
from .shared import RuntimeShared
from .spec import RegionCode, RegionCounts, RegionSpec
from .static_grads import give_grads, reclaim_grads
from ..common.reasons import EagerReason
from .tangents import release_incoming

__all__ = ["Backward", "RegionFunction"]

log = logging.getLogger(__name__)


class Backward:
    """The training side of one region: the backward graphs of its training entries, and the
    forward replays of its autograd.Function (RegionFunction, which gets this object)."""

    def __init__(self, spec: RegionSpec, code: RegionCode, shared: RuntimeShared, counts: RegionCounts,
                 replayer: Replayer, memory: BackwardMemory) -> None:
        self.spec = spec
        self.code = code
        self.shared = shared
        self.counts = counts
        self.counters = counts.counters
        self.replayer = replayer
        self.memory = memory
        self.n_inputs = len(spec.kinds)
        self.hooks = spec.hooks

    def reach_of(self, entry: TrainEntry) -> tuple:
        """Which of ``entry``'s differentiable inputs each differentiable output reaches. An
        Inductor-compiled region's forward is one autograd node that reaches every input: there the
        FX module runs on fake tensors to build the graph eager autograd would walk."""
        lazy = self.code.lazy
        if lazy is not None and lazy.state == "compiled":
            found = fake_output_reach(lazy.module, entry.static_ins, entry.diff_in, entry.diff_out)
            if found is not None:
                return found[1]
        return reached_inputs(entry.autograd_outputs(), [entry.static_ins[p] for p in entry.diff_in])

    def capture(self, entry: TrainEntry, grads: tuple) -> None:
        """First backward of a training entry: capture its backward graph in the entry's pool."""
        shared = self.shared
        memory = self.memory
        fn = self.code.fn
        try:
            # An output only the caller reads takes its gradient in its own memory (recorder.py).
            grad_outs = [entry.outputs[i] if i in entry.grad_out_shared else static_buffer_like(entry.outputs[i])
                         for i in entry.diff_out]
            fill_grads(grad_outs, entry.diff_out, grads)
        except torch.OutOfMemoryError as exc:
            self._capture_failed(first_line(exc), entry)
            return
        entry.static_grad_outs = grad_outs
        shared.register_persistent(grad_outs, in_place=False)
        inputs = [entry.static_ins[p] for p in entry.diff_in]
        pool = entry.pool
        # The last backward graph its pool awaits may consume the capture's autograd graph: the
        # saved activations are freed as the backward uses them (as in an eager backward, instead of
        # all of them staying allocated next to all the gradients), and the graph reuses their
        # blocks in order. No other graph is captured in the pool after it (sealed), so no graph
        # can lie in them but this one. A simulated capture runs the backward, and its first replay
        # right after would need the graph again: it keeps it.
        # Inductor's code runs its backward once outside a capture first (AOT autograd compiles it
        # on first use), unless a warm-up call's backward already did.
        # A region that cannot compute its forward again keeps that autograd graph for the backwards
        # that cannot replay the graph, its saved tensors loosened as the capture reads them
        # (saved.py).
        prewarm = (getattr(fn, "needs_backward_prewarm", False)
                   and not getattr(fn, "backward_seen", False))
        recomputable = self.spec.recomputable
        consume = ((recomputable or memory.loosens(entry)) and pool.awaiting_backward == 1
                   and not isinstance(entry.graph, SimulatedGraph) and not prewarm)
        loosening = None
        if consume and not recomputable:
            loosening = memory.loosening(entry)
            consume = loosening is not None
        released_in = []
        transfer = None
        if consume:
            pool.sealed = True
            released_in = memory.release_inputs(entry)
            transfer = memory.release_grad_outputs(entry, grad_outs)

        def run() -> Any:
            during = (loosening.during(entry.autograd_outputs()) if loosening is not None
                      else contextlib.nullcontext())
            with no_donated_buffers(), during:
                grads_in = torch.autograd.grad(entry.autograd_outputs(), inputs, grad_outputs=grad_outs,
                                               retain_graph=not consume or loosening is not None,
                                               allow_unused=True)
            return tuple(grads_in)

        if prewarm:
            # Not in a capture. Code compiled with donated buffers may write into the saved tensors
            # it reads, and the backward graph replays right after its capture on this forward's:
            # its first backward runs on the forward computed again (only such regions donate).
            self.eager(entry, grads, recompute=donating(fn), count=False)
        # The incoming gradients are in the static buffers now: those relayed to this backward go
        # before the capture (tangents.py), which may then reuse their memory; a backward that runs
        # without the graph after all reads the buffers (Backward.run).
        release_incoming(grads)
        # Earlier backward graphs of the pool whose gradients nobody holds any more give their
        # blocks to this capture (loose_grads.py: FSDP2 drops each layer's as soon as it has them).
        loosen_dropped(pool, self.counters)
        device = entry.outputs[entry.diff_out[0]].device if entry.diff_out else None
        reserved_before = reserved(device, settle=not shared.capturer.simulate)
        start = time.perf_counter()
        try:
            with transfer if transfer is not None else contextlib.nullcontext():
                graph, static_grad_ins = shared.capturer.capture(
                    run, entry.pool, hooks=self.spec.hooks,
                    reads=[t for t in entry.static_ins if isinstance(t, torch.Tensor)], once=self.spec.collectives)
        except CaptureError as exc:
            if consume:  # the attempt may have used the autograd graph up
                memory.release_saved(entry, loosening)
                memory.count_released(entry, released_in, transfer)
            self._capture_failed(str(exc), entry)
            return
        elapsed = time.perf_counter() - start
        if consume:
            memory.release_saved(entry, loosening)
            memory.count_released(entry, released_in, transfer)
        entry.bwd_graph = graph
        entry.bwd_index = entry.pool.new_index()
        entry.pool.backward_settled()
        if isinstance(graph, SimulatedGraph):
            graph.attach(entry.pool, entry.bwd_index)
        entry.static_grad_ins = static_grad_ins
        entry.grad_ptrs = frozenset(g.data_ptr() for g in static_grad_ins if g is not None)
        entry.held = HeldStorages(static_grad_ins) if use_counts_supported() else None
        entry.weight_grads = weight_grads(entry.diff_in, self.spec.kinds, static_grad_ins)
        if entry.held is not None and entry.weight_grads:
            # Taken before any is given out (the entry's own references only), like entry.held's.
            entry.weights_held = HeldStorages([static_grad_ins[k] for k in entry.weight_grads])
            entry.weights_held.mark()
            pool.grad_owners.append(entry)
        shared.register_persistent([g for g in static_grad_ins if g is not None], in_place=False)
        shared.counters.bwd_graphs += 1
        shared.counters.grad_outputs_shared += len(entry.grad_out_shared)
        self.counts.captured(entry, elapsed, reserved(device) - reserved_before, forward=False)

    def _capture_failed(self, error: str, entry: TrainEntry) -> None:
        name = self.spec.name
        self.shared.counters.capture_failures.append({"region": name + " (backward)", "error": error})
        if self.shared.config.strict:
            raise RuntimeError(f"cgbackend: capturing the backward of {name} failed: {error}")
        log.warning("cgbackend: capturing the backward of %s failed; its backward runs eagerly "
                    "through the captured forward: %s", name, error)
        entry.bwd_failed = error
        entry.pool.backward_settled()

    def eager(self, entry: TrainEntry, grads: tuple, recompute: bool = False, count: bool = True) -> tuple:
        """Backward without the backward graph: autograd through the captured forward's graph, or
        through the forward computed again (``recompute``, or once that graph is released;
        counted in ``bwd_recomputes`` unless ``count`` is False)."""
        grad_outs = []
        for i in entry.diff_out:
            grad = grads[i]
            grad_outs.append(torch.zeros_like(entry.outputs[i]) if grad is None else grad)
        inputs = [entry.static_ins[p] for p in entry.diff_in]
        hooks = self.spec.hooks
        quiet = hooks.quiet_backward() if hooks is not None else contextlib.nullcontext()
        with no_donated_buffers(), quiet:
            if (recompute or entry.released) and self.spec.recomputable:
                # The captured forward's autograd graph is gone: run the region's code again on the
                # static inputs (still this call's values) and differentiate that.
                with torch.enable_grad():
                    outs = self.code.fn(*entry.static_ins)
                self.counters.bwd_recomputes += count
                return torch.autograd.grad([outs[i] for i in entry.diff_out], inputs, grad_outputs=grad_outs,
                                           allow_unused=True)
            return torch.autograd.grad(entry.autograd_outputs(), inputs, grad_outputs=grad_outs,
                                       retain_graph=True, allow_unused=True)

    @staticmethod
    def static_grads(entry: TrainEntry, grads: tuple) -> tuple:
        """``grads`` with the differentiable outputs' gradients read from the backward graph's
        buffers, which hold their values (copied there at the capture; nothing ran in them yet)."""
        out = list(grads)
        for k, pos in enumerate(entry.diff_out):
            out[pos] = entry.static_grad_outs[k]
        return tuple(out)

    def run(self, ctx: Any, grads: tuple) -> tuple:
        """The backward of one replayed forward (RegionFunction.backward after its checks): the
        gradients of the entry's differentiable inputs, by position."""
        entry = ctx.entry
        spec = self.spec
        counters = self.counters
        if entry.reach is None:  # which inputs each output reaches, from the forward's autograd graph
            entry.reach = self.reach_of(entry)
        if ctx.volatile:
            copied = ParamPolicy.refresh(entry.static_ins, ctx.volatile)
            counters.copies_made += copied
            counters.copied_by_kind["param"] += copied
        moved = (ParamPolicy.moved(entry.static_ins, entry.param_addrs)
                 if entry.param_addrs and not ParamPolicy.unmoved(entry.static_ins, entry.param_check) else None)
        ctx.backwards += 1
        # A backward that keeps the graph (retain_graph=True), or one after it through the same
        # forward: where the backward graph writes over what it reads (saved activations it
        # consumed, released or loosened, static inputs it was given, donated buffers), the graph
        # replays only for a lone backward; the others run on the forward computed again from the
        # static inputs, which nothing but that backward graph writes between forward replays, or
        # for a region that cannot compute it again, through the captured forward's autograd graph
        # on the saved tensors this forward replay wrote.
        # Not for opaque module calls: their backward may consume its own context (Transformer
        # Engine's does), so their captured forward runs backward once, at the capture; the graph
        # replays for a backward that keeps it, as TE's own graphs do.
        again = (spec.hooks is None
                 and (entry.released or entry.released_in or donating(self.code.fn) or self.memory.loosens(entry))
                 and (ctx.backwards > 1 or (KEEP_GRAPH is not None and KEEP_GRAPH())))
        if (ctx.backwards > 1 and ctx.replayed
                and (entry.released_in or (entry.released and not spec.recomputable))):
            # What that backward needs was overwritten by the backward graph's replay: eager autograd
            # raises here too (its saved tensors are freed by a backward that does not keep them).
            raise RuntimeError(
                f"cgbackend: trying to backward through graphed region {spec.name} a second time "
                "after its backward graph ran for this forward, reusing the memory of what the forward "
                "saved. Specify retain_graph=True in the first backward (a region with opaque module "
                "calls, such as Transformer Engine's, allows one backward per forward, as eagerly).")
        fresh = moved is None and entry.bwd_graph is None and entry.bwd_failed is None and not again
        if fresh:
            self.capture(entry, grads)
            if entry.static_grad_outs is not None:  # filled, and the relayed gradients dropped
                grads = self.static_grads(entry, grads)
        if again:
            reason = EagerReason.KEPT_GRAPH
        elif moved is not None:
            # An engine re-allocated a parameter since the forward was captured (FSDP2 without
            # cgbackend.distributed.track_fsdp): a graph would read the old address.
            log.debug("cgbackend: %s backward: parameter moved (%s)", spec.name, moved)
            reason = EagerReason.PARAM_MOVED
        elif entry.bwd_graph is None:
            reason = "backward_capture_failed"
        elif entry.pool.hazard(entry.bwd_index):
            reason = EagerReason.REPLAY_ORDER
        elif not reclaim_grads(entry, ctx.leaves, self.shared.handed, counters):
            reason = EagerReason.GRAD_HELD
        else:
            reason = None
        if reason is not None:
            self.counts.eager(reason)
            grads_in = self.eager(entry, grads, recompute=again)
        else:
            if not fresh:
                copied = fill_grads(entry.static_grad_outs, entry.diff_out, grads)
                counters.copies_made += copied
                counters.copied_by_kind["grad_output"] += copied
                release_incoming(grads)
            entry.bwd_graph.replay()
            ctx.replayed = True
            counters.replays += 1
            counters.bwd_replays += 1
            grads_in = give_grads(entry, ctx.leaves, self.shared.handed)
            if entry.loose_from >= 0:
                watch_given(entry, counters)
            self.memory.settle(entry)
        return grads_in


class RegionFunction(torch.autograd.Function):
    """Forward: replay the entry's forward graph. Backward: replay (or capture) its backward graph."""

    @staticmethod
    def forward(ctx: Any, info: tuple, *tensors: torch.Tensor) -> Any:
        side, entry, call, fresh = info
        ins = list(tensors)
        full = [None] * side.n_inputs
        for p, t in zip(entry.tensor_pos, ins):
            full[p] = t
        side.replayer.stage(entry, full, fresh)
        ctx.hook_token = side.hooks.before_forward() if side.hooks is not None else None
        entry.graph.replay()
        side.replayer.finish(entry, full, call)
        ctx.versions = [(full[p], full[p]._version) for p in entry.saved_pos]
        side.counters.fwd_replays += 1
        ctx.side, ctx.entry, ctx.call = side, entry, call
        ctx.generation = call.generation
        ctx.leaves = [t for t in tensors if t.requires_grad and t.is_leaf]
        ctx.backwards = 0
        ctx.replayed = False
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
        side, entry, call = ctx.side, ctx.entry, ctx.call
        if entry.saved_modified is not None:
            raise saved_modified_error(entry.saved_modified, side.spec.name)
        for t, version in ctx.versions:
            if t._version != version:
                raise saved_modified_error(
                    f"an input of shape {tuple(t.shape)}@{t.dtype} saved by the region was written in "
                    f"place between forward and backward (version {t._version}; expected {version})",
                    side.spec.name)
        if torch.is_grad_enabled():  # the engine runs backward in grad mode only for create_graph
            raise RuntimeError(
                f"cgbackend: backward with create_graph=True (double backward) through graphed region "
                f"{side.spec.name} is not supported: its backward replays a graph, which records no "
                "autograd history to differentiate again. Compute higher-order gradients without "
                "cgbackend for this model.")
        if not call.still_valid(ctx.generation):
            raise RuntimeError(
                f"cgbackend: backward through graphed region {side.spec.name} after its memory was reused "
                "by a later forward (a second backward over a retained graph). Run backward before the "
                "next forward of the model, or compile without CUDA graphs for this pattern.")
        call.on_backward()
        grads_in = side.run(ctx, grads)
        if side.hooks is not None:
            side.hooks.after_backward(ctx.hook_token)
        by_pos = dict(zip(entry.diff_in, grads_in))
        # Inputs only outputs without a gradient reach: None, as eager autograd leaves them (the
        # graph computed zeros for them).
        for i in unreached(entry.reach, [grads[k] for k in entry.diff_out]):
            by_pos[entry.diff_in[i]] = None
        return (None,) + tuple(by_pos.get(p) for p in entry.tensor_pos)
