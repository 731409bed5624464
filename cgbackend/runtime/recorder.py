"""Capturing a region's graphs: the static input buffers of a new entry, the capture of its forward
(inference or training) graph in the call slot's pool, and what a capture costs (time, pool
memory), counted. The recorder reads the region's spec, code and state; it returns the entry, or a
:class:`NoEntry` saying why there is none: the region has no CUDA device (RegionRunner then runs
it eagerly for good), or the attempt failed (RegionRunner asks eager whose error it was)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import logging
import time
from typing import Any, Optional, Union

import torch

from ..common.fx_utils import iter_tensors
from .capture import CaptureError, SimulatedGraph, first_line, non_overlapping
from .entries import Entry, Pad, TrainEntry, reserved
from .graph_cache import padded_source
from .inputs import InputViews, fill_padding
from .layouts import compact_view, copy_into, describe_inputs, input_buffer
from .loose_outputs import release_outputs, releases_outputs
from .params import ParamPolicy
from .saved import SavedTensors
from .shared import RuntimeShared
from .spec import EAGER, FROM_GRAPH, PARAM, VALUE, RegionCode, RegionCounts, RegionSpec, RegionState
from ..common.reasons import EagerReason

__all__ = ["NoEntry", "Recorder"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class NoEntry:
    """Why a capture made no entry: ``reason`` NO_CUDA (the region cannot be captured: it runs
    eagerly for good) or CAPTURE_FAILED (this attempt raised; ``detail`` is its error)."""

    reason: str
    detail: str


class Recorder:
    """Captures the graphs of one region."""

    def __init__(self, spec: RegionSpec, code: RegionCode, state: RegionState, shared: RuntimeShared,
                 counts: RegionCounts) -> None:
        self.spec = spec
        self.code = code
        self.state = state
        self.shared = shared
        self.counts = counts

    # ------------------------------------------------------------------ forward and inference graphs

    def prepare_static_inputs(self, ins: list, grad_path: bool, entry: Entry, pad: Optional[Pad] = None) -> None:
        spec = self.spec
        shared = self.shared
        static_ins: list = []
        copy_pos, in_place_pos, volatile_pos = [], [], []
        persistent = shared.persistent_ptrs
        plan = spec.bucket if pad is not None else None
        layouts = self.code.layouts
        for pos, value in enumerate(ins):
            kind = spec.kinds[pos]
            if plan is not None and pos in plan.value_inputs:
                static_ins.append(plan.value_inputs[pos](pad.padded))
                continue
            if plan is not None and pos in plan.pad_inputs:
                dim, size = plan.pad_inputs[pos]
                shape, full = padded_source(shared.padded_full, value, dim, size(pad.padded))
                if full is not None:
                    static_ins.append(full)
                    in_place_pos.append(pos)
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
            volatile = kind == PARAM and shared.params.is_volatile(value)
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
            # An eager value, or a graph's output while its producer captures (or eager code computes
            # it since its region was split): read in place where it is a static output.
            producer = spec.sources[pos].state if kind == FROM_GRAPH else None
            in_place = kind == EAGER or (kind == FROM_GRAPH and (producer is None or producer.disabled is None))
            if in_place and not volatile and value.data_ptr() in persistent:
                alias = value.detach()
                if grad_path and value.requires_grad:
                    alias.requires_grad_(True)
                static_ins.append(alias)
                in_place_pos.append(pos)
                continue
            # In the layout the compiled code reads (runtime/layouts.py): the staging copy converts.
            # A training forward's input that needs no gradient is made in the graph pool: its
            # block may go to its backward graph once the forward has read it (Backward.capture).
            pooled = grad_path and not value.requires_grad and not volatile
            with entry.pool.allocating() if pooled else contextlib.nullcontext():
                buf, dims = input_buffer(value, layouts.layout(pos) if layouts is not None else None)
            with torch.no_grad():
                copy_into(buf, value, dims)
            if dims:
                entry.compact[pos] = dims
            elif pooled and entry.pool.routed:
                entry.pooled_pos.append(pos)
            if grad_path and value.requires_grad:
                buf.requires_grad_(True)
            static_ins.append(buf)
            copy_pos.append(pos)
        shared.register_persistent([static_ins[p] for p in copy_pos], in_place=False)
        entry.static_ins = static_ins
        entry.copy_pos = tuple(copy_pos)
        entry.copy_dst = [compact_view(static_ins[p].detach(), entry.compact[p]) if p in entry.compact
                          else static_ins[p] for p in copy_pos]
        entry.in_place_pos = tuple(in_place_pos)
        entry.copy_back_pos = tuple(p for p in copy_pos if p in spec.written)
        entry.volatile_pos = tuple(volatile_pos)
        entry.param_addrs = ParamPolicy.record(
            static_ins, [p for p in spec.param_pos if p not in entry.volatile_pos])
        entry.param_check = ParamPolicy.check_of(static_ins, entry.param_addrs)

    def capture(self, ins: list, grad_path: bool, call: Any, pad: Optional[Pad] = None) -> Union[Entry, NoEntry]:
        """A new entry for this call's signature, its graph captured, or why there is none."""
        spec = self.spec
        shared = self.shared
        device = next((v.device for v, k in zip(ins, spec.kinds) if k != VALUE), spec.device)
        if device is None or (device.type != "cuda" and not shared.capturer.simulate):
            return NoEntry(EagerReason.NO_CUDA, f"inputs on {device}")
        pool = shared.pools.get(device, 0)
        entry: Entry = TrainEntry() if grad_path else Entry()
        entry.pool = pool
        error = None
        try:
            self.prepare_static_inputs(ins, grad_path, entry, pad)
        except torch.OutOfMemoryError as exc:  # the static buffers are part of what capturing costs
            error = first_line(exc)
        if error is not None:  # outside the handler: its traceback holds the buffers made so far
            return self.failed_attempt(error)
        static_ins = entry.static_ins
        fn = self.code.fn
        saved_storages: dict[int, int] = {}
        if grad_path:
            entry.saved_modified = None

            def run() -> Any:
                # Hooks that skip autograd's version check (the static buffers are rewritten between
                # replays on purpose) but remember what it would have checked, and hold each saved
                # tensor in a slot the backward capture may loosen (saved.py).
                saved = SavedTensors()
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    out = fn(*static_ins)
                modified, storages = saved.finish()
                if modified is not None:
                    entry.saved_modified = modified
                entry.saved = saved
                saved_storages.update(storages)
                return out
        else:
            def run() -> Any:
                return fn(*static_ins)
        reserved_before = reserved(device, settle=not shared.capturer.simulate)
        start = time.perf_counter()
        try:
            graph, outputs = shared.capturer.capture(
                run, pool, restore=[t for t in static_ins if isinstance(t, torch.Tensor)], hooks=spec.hooks,
                once=spec.collectives)
        except CaptureError as exc:
            error = self._with_inputs(str(exc), static_ins)
        if error is not None:
            # the attempt's static buffers (and the handler's traceback) go before its pool's
            # blocks are handed back, and their addresses stop counting as graph memory
            shared.forget_persistent([static_ins[p] for p in entry.copy_pos])
            entry.static_ins = entry.copy_dst = None
            del static_ins, run, entry
            return self.failed_attempt(error)
        elapsed = time.perf_counter() - start
        entry.graph = graph
        entry.index = pool.new_index()
        entry.slot = call.slot
        if isinstance(graph, SimulatedGraph):
            graph.attach(pool, entry.index)
        self.counts.captured(entry, elapsed, reserved(device) - reserved_before, forward=grad_path)
        if grad_path:
            self._finish_train_entry(entry, outputs, saved_storages)
            # Inputs read from the caller's memory whose static tensor the forward saved: their
            # versions are checked again at backward (backward.RegionFunction).
            entry.saved_pos = tuple(
                p for p in self.caller_memory(entry) if isinstance(static_ins[p], torch.Tensor)
                and static_ins[p].numel() and static_ins[p].untyped_storage().data_ptr() in saved_storages)
        else:
            entry.outputs = outputs
            self._register_outputs(entry)
            if releases_outputs(entry, self.state.terminal, spec.hooks):
                release_outputs(entry)
            del outputs
        if pad is not None:
            entry.views = {}
            full = shared.padded_full
            for i in spec.bucket.outputs:
                t = entry.outputs[i]
                full[(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)] = t
        log.debug("cgbackend: captured %s (%s, slot %d) in %.3f s", spec.name,
                  "forward" if grad_path else "inference", call.slot, elapsed)
        return entry

    def _finish_train_entry(self, entry: TrainEntry, outputs: Any, saved: dict[int, int]) -> None:
        outs = list(outputs)
        entry.capture_outs = outs
        entry.released = False
        entry.pool.awaiting_backward += 1
        entry.tensor_pos = self.spec.tensor_pos
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
        entry.handed = False
        entry.held = None
        entry.grad_ptrs = frozenset()
        entry.leaves = []
        entry.reach = None
        self._register_outputs(entry, skip=entry.diff_out)
        # How many of the region's inputs and outputs lie in each storage, read once for every use.
        own = collections.Counter(t.untyped_storage().data_ptr()
                                  for t in iter_tensors([entry.static_ins, entry.outputs]) if t.numel())
        # What the forward's autograd graph alone keeps alive: saved tensors that are neither an
        # input nor an output of the region (the storages a Loosening may free, saved.py).
        alone = {ptr: n for ptr, n in saved.items() if ptr and ptr not in own}
        entry.saved_bytes = sum(alone.values())
        if entry.saved is not None:
            entry.saved.alone = frozenset(alone)
        # Pooled inputs go to the backward graph (BackwardMemory.release_inputs) only alone in their storage.
        entry.pooled_pos = [p for p in entry.pooled_pos
                            if own[entry.static_ins[p].untyped_storage().data_ptr()] == 1]
        entry.grad_out_shared = self._read_once(entry, entry.diff_out, saved, own)
        entry.nondiff_loose = self._read_once(entry, entry.nondiff_out, saved, own)

    def _read_once(self, entry: TrainEntry, positions: tuple[int, ...], saved: dict[int, int],
                   own: "collections.Counter[int]") -> frozenset[int]:
        """Of ``positions``, the outputs whose static memory nothing reads once the caller has its
        copy: only the caller reads them (``caller_only``: it got a copy); the forward saved
        nothing on their storage for its backward; and no other output or static input lies in
        that storage (``own``: tensors per storage). Every later forward replay writes them again.
        A differentiable one takes its incoming gradient at backward (``grad_out_shared``,
        Backward.capture) instead of a buffer of its size held for good; every such output goes to
        the pool's last backward graph (BackwardMemory.release_grad_outputs)."""
        shared = []
        for i in positions:
            out = entry.outputs[i]
            if i not in self.spec.caller_only or not out.numel() or not non_overlapping(out):
                continue
            ptr = out.untyped_storage().data_ptr()
            if ptr not in saved and own[ptr] == 1:
                shared.append(i)
        return frozenset(shared)

    def caller_memory(self, entry: Entry) -> list[int]:
        """Positions whose static tensor stands for a caller's memory: copies and parameters."""
        return list(entry.copy_pos) + list(self.spec.param_pos)

    def _register_outputs(self, entry: Entry, skip: tuple = ()) -> None:
        """Static outputs become inputs other graphs read in place, except views of a static input: those are
        rebuilt on the caller's tensor after each replay (inputs.InputViews)."""
        views = InputViews.find(entry.outputs, entry.static_ins, self.caller_memory(entry), skip)
        entry.input_views = views
        outs = entry.outputs if views is None else [
            o for i, o in enumerate(entry.outputs) if i not in views.views]
        self.shared.register_persistent(outs)

    # ------------------------------------------------------------------ failures

    def _with_inputs(self, error: str, static_ins: list) -> str:
        """A stride assertion (compiled code called with other strides than it was compiled for)
        names the region's inputs, their sizes and strides, and the strides compiled for."""
        if "stride" not in error:
            return error
        code = self.code
        return (f"{error} (region {self.spec.name} inputs: "
                f"{describe_inputs(code.module, self.spec.kinds, static_ins, code.layouts, PARAM)})")

    def failed_attempt(self, error: str) -> NoEntry:
        if torch.cuda.is_available() and not self.shared.capturer.simulate:
            # Hand back what the failed attempt held and cached (its pool's blocks): the eager
            # calls need it, and after an out-of-memory error they may need all of it.
            gc.collect()
            torch.cuda.empty_cache()
        return NoEntry(EagerReason.CAPTURE_FAILED, error)
