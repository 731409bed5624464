"""The training side of a region: the autograd.Function that replays a training entry's forward
graph, and its backward: captured at the first backward in the entry's pool, replayed after, or
run as autograd through the captured forward (a parameter moved, the capture failed, the replay
order or a held gradient forbids the replay), each counted with its reason.

The static gradients a backward replay produces are handed to autograd as fresh aliases; a
``.grad`` that keeps one is given its own memory before the next backward replay rewrites them
(``reclaim_grads``), so ``.grad`` accumulates as eagerly. Whether anything still holds them is
read from their storages' use counts (handout.HeldStorages): a few calls, however many parameters
(a MoE layer's experts are hundreds of gradients on a few storages).

Once its backward graph exists, an entry frees the saved activations the capture's autograd graph
held (``settle``; pool.py says when that is safe): between steps only its static buffers stay
allocated. A backward that cannot replay its graph then runs autograd through a recomputed
forward (the region's code on the static inputs, which hold this call's values until its backward
is over). That takes a region that computes the same thing twice: no random op, no global state,
no input written in place, no opaque module call. Any other region keeps the capture's autograd
graph and loosens what it saved instead (saved.py): its blocks go to the backward graph the same
way, and the backwards that cannot replay the graph run through that autograd graph on this
forward replay's values. The static inputs that need no gradient go to the pool's last backward
graph too (``release_inputs``), and a recomputable region's Inductor code may donate saved tensors
to its backward (inner.donating): a backward graph that writes over what it reads replays once per
forward, and a backward that keeps the graph (retain_graph=True), or a later one through the same
forward, runs on the forward computed again (or through the kept graph) instead."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch

from .capture import CaptureError, SimulatedGraph, first_line
from .entries import TrainEntry, fill_grads, reserved, static_buffer_like
from .handout import HeldStorages, handout_supported
from .inner import KEEP_GRAPH, donating, no_donated_buffers
from .inputs import saved_modified_error
from .loose_outputs import StorageWeakRef, loose_alias, loose_supported
from .params import ParamPolicy
from .reach import unreached
from .saved import Loosening, loosening_supported, pool_ranges
from .stats import EagerReason
from .tangents import QUEUE_CALLBACK, Handover, handover_supported, release_incoming

if TYPE_CHECKING:
    from .region import RegionRunner

__all__ = ["Backward", "RegionFunction", "QUEUE_CALLBACK"]

log = logging.getLogger(__name__)


LOOSENING = loosening_supported()


class Backward:
    """The backward graphs of one region's training entries (RegionRunner.backward)."""

    def __init__(self, runner: "RegionRunner") -> None:
        self.runner = runner

    def capture(self, entry: TrainEntry, grads: tuple) -> None:
        """First backward of a training entry: capture its backward graph in the entry's pool."""
        runner = self.runner
        shared = runner.shared
        try:
            # An output only the caller reads takes its gradient in its own memory (recorder.py).
            grad_outs = [entry.outputs[i] if i in entry.grad_out_shared else static_buffer_like(entry.outputs[i])
                         for i in entry.diff_out]
            fill_grads(grad_outs, entry.diff_out, grads)
        except torch.OutOfMemoryError as exc:
            self._capture_failed(first_line(exc), entry)
            return
        entry.static_grad_outs = grad_outs
        shared.register_persistent(grad_outs, handoff=False)
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
        prewarm = (getattr(runner.fn, "needs_backward_prewarm", False)
                   and not getattr(runner.fn, "backward_seen", False))
        consume = ((runner.recomputable or self.loosens(entry)) and pool.awaiting_backward == 1
                   and not isinstance(entry.graph, SimulatedGraph) and not prewarm)
        loosening = None
        if consume and not runner.recomputable:
            loosening = self.loosening(entry)
            consume = loosening is not None
        released_in = []
        handover = None
        if consume:
            pool.sealed = True
            released_in = self.release_inputs(entry)
            handover = self.release_grad_outputs(entry, grad_outs)

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
            self.eager(entry, grads, recompute=donating(runner.fn), count=False)
        # The incoming gradients are in the static buffers now: those relayed to this backward go
        # before the capture (tangents.py), which may then reuse their memory; a backward that runs
        # without the graph after all reads the buffers (Backward.run).
        release_incoming(grads)
        device = entry.outputs[entry.diff_out[0]].device if entry.diff_out else None
        reserved_before = reserved(device, settle=not shared.capturer.simulate)
        start = time.perf_counter()
        try:
            with handover if handover is not None else contextlib.nullcontext():
                graph, static_grad_ins = shared.capturer.capture(
                    run, entry.pool, hooks=runner.hooks,
                    reads=[t for t in entry.static_ins if isinstance(t, torch.Tensor)], once=runner.collectives)
        except CaptureError as exc:
            if consume:  # the attempt may have used the autograd graph up
                self.release_saved(entry, loosening)
                self.count_released(entry, released_in, handover)
            self._capture_failed(str(exc), entry)
            return
        elapsed = time.perf_counter() - start
        if consume:
            self.release_saved(entry, loosening)
            self.count_released(entry, released_in, handover)
        entry.bwd_graph = graph
        entry.bwd_index = entry.pool.new_index()
        entry.pool.backward_settled()
        if isinstance(graph, SimulatedGraph):
            graph.attach(entry.pool, entry.bwd_index)
        entry.static_grad_ins = static_grad_ins
        entry.grad_ptrs = frozenset(g.data_ptr() for g in static_grad_ins if g is not None)
        entry.held = HeldStorages(static_grad_ins) if handout_supported() else None
        shared.register_persistent([g for g in static_grad_ins if g is not None], handoff=False)
        shared.counters.bwd_graphs += 1
        shared.counters.grad_outputs_shared += len(entry.grad_out_shared)
        runner.recorder.count_capture(entry, elapsed, reserved(device) - reserved_before, forward=False)

    def reclaim_grads(self, entry: TrainEntry, leaves: list[torch.Tensor]) -> bool:
        """Before a backward replay rewrites the static gradients: may it?

        The last backward handed out aliases of them (autograd's AccumulateGrad keeps such an alias
        as ``param.grad`` instead of copying it). A ``.grad`` still aliasing one gets its own copy
        now; if anything else still holds one (``torch.autograd.grad`` results, a saved ``.grad``),
        return False: this backward must not overwrite it. The leaves are looked at only when the
        storages are held (a training loop that sets ``.grad`` to None between steps never does)."""
        if not entry.handed:
            return True
        shared = self.runner.shared
        if not entry.held.free():
            for leaf in leaves:
                grad = leaf.grad
                if grad is not None and grad.data_ptr() in entry.grad_ptrs:
                    leaf.grad = grad.clone()
                    counters = shared.counters
                    counters.copies_made += 1
                    counters.copied_by_kind["grad_reclaimed"] += 1
                del grad
            if not entry.held.free():
                return False
        entry.handed = False
        entry.leaves = []
        if shared.handed.pop(id(entry), None) is not None:
            entry.pool.release(entry.bwd_index)
        return True

    def hand_out(self, entry: TrainEntry, leaves: list[torch.Tensor]) -> tuple:
        """Fresh aliases of the static gradients for autograd (which may keep them as ``.grad``
        without a copy); whether any is still held is read from the storages' counts
        (``entry.held``, whose baseline is taken before the first aliases exist)."""
        if entry.held is None:
            # No use counts to tell whether an alias is still held: hand out the buffers
            # themselves, which autograd copies because we hold them.
            return entry.static_grad_ins
        entry.held.mark_once()
        out = tuple(None if g is None else g.detach() for g in entry.static_grad_ins)
        entry.handed = True
        entry.leaves = leaves
        shared = self.runner.shared
        if id(entry) not in shared.handed:
            # Until reclaimed, the gradients are live data of the backward graph: the replay-order
            # rule then keeps graphs captured before it from running over them.
            shared.handed[id(entry)] = (self, entry)
            entry.pool.acquire(entry.bwd_index)
        return out

    def _capture_failed(self, error: str, entry: TrainEntry) -> None:
        runner = self.runner
        runner.shared.counters.capture_failures.append({"region": runner.name + " (backward)", "error": error})
        if runner.config.strict:
            raise RuntimeError(f"cgbackend: capturing the backward of {runner.name} failed: {error}")
        log.warning("cgbackend: capturing the backward of %s failed; its backward runs eagerly "
                    "through the captured forward: %s", runner.name, error)
        entry.bwd_failed = error
        entry.pool.backward_settled()

    def settle(self, entry: TrainEntry) -> None:
        """After a backward of ``entry`` through its backward graph: its saved activations are to
        be freed once no capture can receive their blocks (pool.py, "Released memory"). The pool
        is sealed now; the release waits for the pool's other awaited backward graphs."""
        if entry.released or entry.bwd_graph is None or not (self.runner.recomputable or self.loosens(entry)):
            return
        pool = entry.pool
        if any(e is entry for _, e in pool.releasable):
            return
        pool.sealed = True
        pool.releasable.append((self, entry))
        pool.release_ready()

    def release_inputs(self, entry: TrainEntry) -> list:
        """Before the last backward graph of a pool is captured, consuming the saved activations:
        the static inputs made in the pool that need no gradient are kept only as tensors on
        storages that do not own their memory. Once the capture's autograd graph has used what it
        saved of them, their blocks are free for that graph's later temporaries, as cudagraph trees
        frees its recording inputs after their last use. Each forward replay's staging copy writes
        them first; between the forward replay and the backward graph nothing but a backward on
        the forward computed again reads them, and it runs instead of the graph (Backward.run).
        Only where a backward that keeps the graph can be told (KEEP_GRAPH). Returns what to
        count once the capture is over (count_released)."""
        if not entry.pooled_pos or KEEP_GRAPH is None or not loose_supported() or StorageWeakRef is None:
            return []
        pending = []
        for pos in entry.pooled_pos:  # none shares its storage with an output (recorder.py)
            buf = entry.static_ins[pos]
            storage = buf.untyped_storage()
            alias = loose_alias(buf)
            entry.static_ins[pos] = alias
            entry.copy_dst[entry.copy_pos.index(pos)] = alias
            pending.append((pos, StorageWeakRef(storage), storage.nbytes()))
            del buf, storage
        return pending

    def release_grad_outputs(self, entry: TrainEntry, grad_outs: list) -> Optional[Handover]:
        """Before the last backward graph of a pool is captured: the outputs that take their
        incoming gradient in their own memory (recorder.py, ``grad_out_shared``), and those
        without a gradient that nothing but the caller's copy reads (``nondiff_loose``), are kept
        only as tensors on storages that do not own it, in ``entry.outputs``, in ``grad_outs``
        (the static gradient buffers) and, through ``.data``, in the captured forward's outputs.
        The owners of the gradient buffers go to the capture in the returned Handover, which gives
        each to the compiled backward that frees it after its last read; the others go now, for
        the capture to reuse from its start (tangents.py says why that is safe)."""
        if (not (entry.grad_out_shared or entry.nondiff_loose) or not loose_supported()
                or not handover_supported()):
            return None
        handover = Handover()
        outputs = list(entry.outputs)
        slots = {pos: k for k, pos in enumerate(entry.diff_out) if pos in entry.grad_out_shared}
        for pos in sorted(entry.grad_out_shared | entry.nondiff_loose):
            alias = loose_alias(outputs[pos])
            try:
                entry.capture_outs[pos].data = alias
            except RuntimeError as exc:  # an output whose data cannot be swapped keeps its buffer
                log.debug("cgbackend: %s keeps the memory of output %d: %s", self.runner.name, pos,
                          first_line(exc))
                continue
            handover.add(pos, alias, outputs[pos], keep=pos in slots)
            outputs[pos] = alias
            if pos in slots:
                grad_outs[slots[pos]] = alias
        entry.outputs = tuple(outputs)
        return handover

    def count_released(self, entry: TrainEntry, pending_in: list, handover: Optional[Handover]) -> None:
        """The released static inputs and gradient buffers whose memory went back to the pool:
        nothing else held them (the capture's autograd graph, which saved some inputs, is gone by
        now). One still held elsewhere stays allocated, and its alias reads it."""
        for pos, ref, nbytes in pending_in:
            if ref.expired():
                entry.released_in[pos] = nbytes
        if handover is None:
            return
        entry.released_out = handover.released()
        counters = self.runner.shared.counters
        counters.grad_outputs_released += len(entry.grad_out_shared.intersection(entry.released_out))
        counters.grad_outputs_released_in_capture += handover.given
        log.debug("cgbackend: %s released %d output(s) (%d B); %d gradient buffer(s) at their last read "
                  "in the capture", self.runner.name, len(entry.released_out),
                  sum(entry.released_out.values()), handover.given)

    def loosens(self, entry: TrainEntry) -> bool:
        """Does ``entry`` release its saved activations by loosening them (saved.py): a region that
        cannot compute its forward again, with CUDA graphs, where torch has what it takes?"""
        return (not self.runner.recomputable and LOOSENING and entry.saved is not None
                and not isinstance(entry.graph, SimulatedGraph))

    @staticmethod
    def loosening(entry: TrainEntry) -> Optional[Loosening]:
        """The loosening of ``entry``'s saved tensors made in its pool, or None where the allocator
        does not tell the pool's segments (the entry then keeps them, and is not asked again)."""
        pool = entry.pool
        ranges = pool_ranges(pool.handle, torch.device(pool.device))
        if ranges is None:
            entry.saved = None
            return None
        return Loosening(entry.saved, ranges)

    def release_saved(self, entry: TrainEntry, loosening: Optional[Loosening] = None) -> None:
        """Drop the capture's autograd graph (and with it the saved activations it held); for a
        region that cannot compute its forward again, keep the graph and loosen what it saved."""
        if self.runner.recomputable:
            entry.capture_outs = None
        else:
            loosening = loosening or self.loosening(entry)
            if loosening is None:
                return
            loosening.rest()
            entry.saved_bytes = loosening.freed_bytes()
        entry.released = True
        counters = self.runner.shared.counters
        counters.saved_released += 1
        counters.saved_released_bytes += entry.saved_bytes

    def eager(self, entry: TrainEntry, grads: tuple, recompute: bool = False, count: bool = True) -> tuple:
        """Backward without the backward graph: autograd through the captured forward's graph, or
        through the forward computed again (``recompute``, or once that graph is released;
        counted in ``bwd_recomputes`` unless ``count`` is False)."""
        grad_outs = []
        for i in entry.diff_out:
            grad = grads[i]
            grad_outs.append(torch.zeros_like(entry.outputs[i]) if grad is None else grad)
        inputs = [entry.static_ins[p] for p in entry.diff_in]
        hooks = self.runner.hooks
        quiet = hooks.quiet_backward() if hooks is not None else contextlib.nullcontext()
        with no_donated_buffers(), quiet:
            if (recompute or entry.released) and self.runner.recomputable:
                # The captured forward's autograd graph is gone: run the region's code again on the
                # static inputs (still this call's values) and differentiate that.
                with torch.enable_grad():
                    outs = self.runner.fn(*entry.static_ins)
                self.runner.shared.counters.bwd_recomputes += count
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
        runner, entry = self.runner, ctx.entry
        counters = runner.shared.counters
        if entry.reach is None:  # which inputs each output reaches, from the forward's autograd graph
            entry.reach = runner.reach_of(entry)
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
        again = (runner.hooks is None
                 and (entry.released or entry.released_in or donating(runner.fn) or self.loosens(entry))
                 and (ctx.backwards > 1 or (KEEP_GRAPH is not None and KEEP_GRAPH())))
        if (ctx.backwards > 1 and ctx.replayed
                and (entry.released_in or (entry.released and not runner.recomputable))):
            # What that backward needs was overwritten by the backward graph's replay: eager autograd
            # raises here too (its saved tensors are freed by a backward that does not keep them).
            raise RuntimeError(
                f"cgbackend: trying to backward through graphed region {runner.name} a second time "
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
            log.debug("cgbackend: %s backward: parameter moved (%s)", runner.name, moved)
            reason = EagerReason.PARAM_MOVED
        elif entry.bwd_graph is None:
            reason = "backward_capture_failed"
        elif entry.pool.hazard(entry.bwd_index):
            reason = EagerReason.REPLAY_ORDER
        elif not self.reclaim_grads(entry, ctx.leaves):
            reason = EagerReason.GRAD_HELD
        else:
            reason = None
        if reason is not None:
            runner.count_eager(reason)
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
            grads_in = self.hand_out(entry, ctx.leaves)
            self.settle(entry)
        return grads_in


class RegionFunction(torch.autograd.Function):
    """Forward: replay the entry's forward graph. Backward: replay (or capture) its backward graph."""

    @staticmethod
    def forward(ctx: Any, info: tuple, *tensors: torch.Tensor) -> Any:
        runner, entry, call, fresh = info
        ins = list(tensors)
        full = [None] * len(runner.kinds)
        for p, t in zip(entry.tensor_pos, ins):
            full[p] = t
        runner.stage_inputs(entry, full, fresh)
        ctx.hook_token = runner.hooks.before_forward() if runner.hooks is not None else None
        entry.graph.replay()
        runner.after_replay(entry, full, call)
        ctx.versions = [(full[p], full[p]._version) for p in entry.saved_pos]
        runner.shared.counters.fwd_replays += 1
        ctx.runner, ctx.entry, ctx.call = runner, entry, call
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
        grads_in = runner.backward.run(ctx, grads)
        if runner.hooks is not None:
            runner.hooks.after_backward(ctx.hook_token)
        by_pos = dict(zip(entry.diff_in, grads_in))
        # Inputs only outputs without a gradient reach: None, as eager autograd leaves them (the
        # graph computed zeros for them).
        for i in unreached(entry.reach, [grads[k] for k in entry.diff_out]):
            by_pos[entry.diff_in[i]] = None
        return (None,) + tuple(by_pos.get(p) for p in entry.tensor_pos)
