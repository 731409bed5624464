"""Counters that tests and users read: what was captured, replayed, copied, and what ran eagerly why."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

__all__ = ["Counters"]


@dataclasses.dataclass
class Counters:
    compiled_graphs: int = 0
    graph_calls: int = 0
    """Calls of compiled Dynamo graphs (each execution, whatever ran inside)."""
    trace_fallbacks: int = 0
    """cgbackend.compile calls re-traced without capture_scalar_outputs / capture_dynamic_output_shape_ops
    after Dynamo failed on a data-dependent value (the backend's ``trace_fallback`` says why)."""
    uncompiled_calls: int = 0
    """Calls Dynamo ran without the backend (a regional layer, or the whole compiled model, during
    which no compiled graph of this instance ran: its function at Dynamo's recompile limit, a frame
    whose compile failed); ``uncompiled_by`` says where, the report why (uncompiled.py)."""
    uncompiled_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """uncompiled_calls by where they ran: a layer's path (``layers.8``), ``model``, or ``frame``."""
    frames_as_written: int = 0
    """By name: functions with nothing to graph that Dynamo compiled again, left to run as written
    from then on (frontend/as_written.py); ``frames_as_written_by``: by function."""
    frames_as_written_by: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    trace_scope_missed: int = 0
    """Graphs of cgbackend.compile calls that Dynamo traced without those settings (no compile
    callback ran for them: another compile was in progress); the instance then switches them around
    each call (tracing.CompileScope)."""
    static_regions: int = 0
    dynamic_regions: int = 0
    graphs_captured: int = 0
    """Every captured CUDA graph: inference, training forward and training backward."""
    fwd_graphs: int = 0
    bwd_graphs: int = 0
    replays: int = 0
    fast_replays: int = 0
    """Inference replays that took the fast path (runtime/fast.py, FastPath.replay): the entry
    replayed last, its key checked part by part instead of built. Included in ``replays``."""
    fwd_replays: int = 0
    bwd_replays: int = 0
    bwd_recaptures: int = 0
    saved_released: int = 0
    """Training entries whose saved activations were freed once their backward graph existed
    (runtime/backward.py): their graphs keep the memory in the pool, the allocator no longer counts
    it as allocated between steps."""
    saved_released_bytes: int = 0
    """Bytes of those saved activations (tensors the forward saved that are neither its inputs nor
    its outputs)."""
    grad_outputs_shared: int = 0
    """Incoming-gradient buffers of captured backward graphs that are the memory of their own output
    (an output only the caller reads, which it got as a copy; runtime/recorder.py): no buffer of
    its size is held for them between steps."""
    grad_outputs_released: int = 0
    """Of those, the buffers the runtime stopped holding at their pool's last backward capture
    (runtime/tangents.py): their blocks are the backward graph's, which reuses them once it has
    read the gradient; each forward replay writes the output there again."""
    grad_outputs_released_in_capture: int = 0
    """Of the released ones, those the compiled backward took as its own argument in the capture,
    freeing them at their last read, as it frees a recording input of cudagraph trees; the others
    were freed when the capture was over."""
    grads_relayed: int = 0
    """Incoming gradients of outputs only the caller reads (its copies in training, a warm-up
    call's outputs) handed on to the region's backward on storages that do not own their memory
    (runtime/tangents.py, GradRelay): the region's backward, not autograd's buffers, then holds
    the last reference to them."""
    grads_relayed_freed_early: int = 0
    """Of those, the ones whose memory went before the backward pass ended: taken by a compiled
    backward as its own argument (freed after its last read), or dropped once copied into a backward
    graph's buffer, before that graph replays or is captured."""
    grads_loosened: int = 0
    """Backward graphs whose gradients the runtime stopped owning once nobody held the ones given
    out (runtime/loose_grads.py: FSDP2 drops each layer's after its reduce-scatter copy): their
    blocks went back to the pool, for the backward graphs captured after them."""
    grads_loosened_bytes: int = 0
    """Bytes of those gradients."""
    bwd_recomputes: int = 0
    """Backwards of released entries that could not replay their graph (an eager_calls reason says
    why) and ran autograd through the region's forward computed again."""
    eager_calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Static-region calls that ran eagerly, by EagerReason."""
    capture_failures: list = dataclasses.field(default_factory=list)
    """One entry per failed capture: {"region", "error"}."""
    copies_made: int = 0
    """Inputs copied into static buffers before a replay (plus gradient copies in backward)."""
    copies_avoided: int = 0
    """Inputs read in place: another graph's static output handed over, or a parameter/buffer."""
    copied_by_kind: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """copies_made split by what was copied: user_input, eager_value, grad_output, param."""
    copy_backs: int = 0
    layout_copies: int = 0
    """Inputs copied into the layout a region's compiled code reads them in (runtime/layouts.py)
    before an eager or warm-up call of that code: the call's strides differed from the compiled
    ones. Graph replays never need one (their static buffers lie in the compiled layout)."""
    output_clones: int = 0
    handout_graphs: int = 0
    """Caller graphs captured (option handout_graphs, runtime/caller_graphs.py): second captures of an
    inference graph, each in a pool of its own, whose outputs go to the caller without a copy. Not
    part of graphs_captured."""
    handout_replays: int = 0
    """Replays of caller graphs (included in replays)."""
    outputs_handed: int = 0
    """Returned tensors that are a caller graph's outputs, handed to the caller without a copy."""
    handout_failures: list = dataclasses.field(default_factory=list)
    """One entry per caller graph whose capture failed ({"region", "error"}): the region then
    copies its outputs, as with handout_graphs=0."""
    output_views: int = 0
    """Returned tensors rebuilt as views of what eager returns them as views of: a graph input
    (parameter, buffer, user tensor), another output, or a block copied for several outputs."""
    output_alias_lost: int = 0
    """Returned tensors that eager returns as views but cgbackend could only copy (their view ops
    could not be replayed); an error with strict=True."""
    capture_time_s: float = 0.0
    pool_bytes: int = 0
    """Growth of the CUDA caching allocator's reserved memory across captures."""
    pool_bytes_held: int = 0
    """The part of pool_bytes whose graphs are still held (evicted graphs' growth subtracted; their
    memory stays reserved in the pool, where later captures reuse it)."""
    graphs_evicted: int = 0
    """Graphs dropped by a region's least-recently-used cache (option graph_cache)."""
    graphs_recaptured: int = 0
    """Inference graphs captured again (replacing the old one) because a graph captured after them
    held live outputs: next to exact-keyed regions, a padded region's graph can be older than them."""
    inner_compiled: int = 0
    """Static regions whose code Inductor compiled (inner="inductor", or "auto" on CUDA graphs)."""
    inner_compile_s: float = 0.0
    """Time spent in those compiles (lazily, at each region's first warm-up call)."""
    inner_fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    """Regions that should have been compiled by Inductor but run eager's kernels, by reason
    (cgbackend.runtime.inner.InnerFallback)."""
    inner_failures: list = dataclasses.field(default_factory=list)
    """One entry per inner fallback: {"region", "reason", "detail"}."""
    constants_hoisted: int = 0
    """Constant tensors made from Python values in the traced code (torch.tensor(0.0, device=...))
    made once per compiled graph instead of on every call (passes/constants.py)."""
    layout_reruns: int = 0
    """Calls run a second time because an expert parameter's address had changed since the last
    call (a replaced parameter, laid out as one block again): the check is made once the graph is
    launched (moe/expert_layout.py LayoutCheck), so the first run may have read the old one."""
    regions_split: int = 0
    """Static regions split at an op that synchronized with the host during warm-up: the op runs
    eagerly, the parts before and after it are captured (runtime/syncsplit.py)."""
    sync_splits: list = dataclasses.field(default_factory=list)
    """One entry per split: {"region", "node", "op", "source", "detail"}."""

    def clear(self) -> None:
        """Back to zero, in place (runners hold this object)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING
                    else f.default)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eager_calls"] = dict(self.eager_calls)
        d["copied_by_kind"] = dict(self.copied_by_kind)
        d["capture_failures"] = list(self.capture_failures)
        d["inner_fallbacks"] = dict(self.inner_fallbacks)
        d["inner_failures"] = list(self.inner_failures)
        d["sync_splits"] = list(self.sync_splits)
        d["handout_failures"] = list(self.handout_failures)
        d["uncompiled_by"] = dict(self.uncompiled_by)
        d["frames_as_written_by"] = dict(self.frames_as_written_by)
        return d

