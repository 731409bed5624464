"""What a region's runtime is made of: the kinds of its inputs, the state all regions of a backend
share, and the graph entries it holds (an inference entry holds one graph, a training entry a
forward and a backward graph), with the small helpers that fill their buffers.

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
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..config import Config
from ..common.progress import CaptureProgress
from ..common.fx_utils import iter_tensors
from .capture import Capturer, non_overlapping
from .handout import HandoutGraph
from .inputs import InputViews
from .outputs import foreach_copy
from .params import ParamPolicy
from .pool import PoolSet
from .stats import Counters
from .warmup import SyncDetector, cuda_sync_detector

__all__ = ["PARAM", "HANDOFF", "EAGER", "COPY", "VALUE", "RuntimeShared", "Entry", "TrainEntry", "Pad",
           "is_static_address", "static_buffer_like", "fill_grads", "freeze", "reserved", "copy_all"]

PARAM, HANDOFF, EAGER, COPY, VALUE = "param", "handoff", "eager", "copy", "value"


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
        (coverage.py, counting launches) and by the option profile (timing.py, timing regions)."""
        self.capture_watch: Optional[Any] = None
        """Told when a compiled graph has run the call at which its regions capture
        (runtime/capture_watch.py: the warning that nothing was captured)."""
        self.handout_storages: set[int] = set()
        """Storage base pointers of handout graphs' outputs (runtime/handout.py): outputs lying in
        them are handed to the caller as aliases, not copied."""
        self.progress = CaptureProgress()
        """Counts captures and logs the progress of a long burst of them (progress.py)."""
        self.layer_copies = 1
        """How many layers of a stack share this backend's compiled graphs (regional.py): the bounds
        that count a region's graphs, warm-up signatures and call slots scale by it, since each
        layer's parameters are a signature of their own."""
        self.handed: dict[int, tuple[Any, "TrainEntry"]] = {}
        """Training entries whose static gradients were handed to autograd and may still be held
        (as .grad or elsewhere): live data of their backward graph until reclaimed, by id, with the
        region's backward side (runtime/backward.py) that reclaims them."""

    def reclaim_handed(self) -> None:
        """Before any replay of a new call: give each .grad still aliasing a static gradient its
        own memory, and release the gradients nobody holds any more."""
        for side, entry in list(self.handed.values()):
            side.reclaim_grads(entry, entry.leaves)

    def register_persistent(self, values: Any, handoff: bool = True) -> None:
        for t in iter_tensors(values):
            if t.numel() == 0:
                continue
            if handoff:
                self.persistent_ptrs.add(t.data_ptr())
            self.persistent_storages.add(t.untyped_storage().data_ptr())


class Entry:
    """One captured signature of a region (inference: one graph); common part of training entries."""

    __slots__ = ("pool", "static_ins", "copy_pos", "handoff_pos", "copy_back_pos",
                 "outputs", "index", "graph", "slot", "pad_dims", "views", "nbytes", "copy_kinds",
                 "param_addrs", "param_check", "volatile_pos",
                 "pad_block", "input_views", "handouts", "compact", "copy_dst", "size", "out_released")

    training = False
    """A training entry (TrainEntry): read where the entry types cannot be imported."""

    def __init__(self) -> None:
        self.graph = None
        self.size: Optional[int] = None
        """Bucketed entries: the capture size the call was padded to (stats' captured_sizes)."""
        self.compact: dict[int, tuple[int, ...]] = {}
        """Copied input position -> the dims its static buffer reads with stride 0 (an expanded
        input, runtime/layouts.py): a replay copies one slice along them."""
        self.copy_dst: list = []
        """What each copied input is copied into, in ``copy_pos`` order: its static buffer, or the
        buffer's slice (``compact``)."""
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
        self.out_released = 0
        """Bytes of static outputs the runtime holds no more (runtime/loose_outputs.py): their
        blocks are the pool's, for later captures."""
        self.param_addrs: tuple = ()
        """(pos, data_ptr, nbytes) of parameters read in place, at capture (runtime/params.py)."""
        self.param_check: Optional[tuple] = None
        """param_addrs as ParamPolicy.unmoved compares them (one C++ call), or None."""
        self.volatile_pos: tuple = ()
        """Volatile parameters (FSDP2's): positions copied before every forward and backward replay."""

    def in_use(self) -> bool:
        return bool(self.pool.live.get(self.index))


class Pad:
    """One padded call: the actual sizes of the region's symbols and the sizes it runs at."""

    __slots__ = ("actual", "padded")

    def __init__(self, actual: dict[str, int], padded: dict[str, int]) -> None:
        self.actual = actual
        self.padded = padded


class TrainEntry(Entry):
    """A training signature: the forward graph (replayed inside an autograd.Function) and the
    backward graph captured at the first backward; its call slot stays busy until the backward
    pass is over (executor.CallState)."""

    __slots__ = ("bwd_graph", "bwd_index", "capture_outs", "diff_in", "diff_out", "static_grad_outs",
                 "static_grad_ins", "tensor_pos", "nondiff_out", "bwd_failed", "handed", "held", "grad_ptrs",
                 "leaves", "reach", "saved_modified", "saved_pos", "released", "saved_bytes",
                 "grad_out_shared", "nondiff_loose", "pooled_pos", "released_in", "released_out", "saved")

    training = True

    def __init__(self) -> None:
        super().__init__()
        self.saved: Any = None
        """The capture's saved-tensor hooks (saved.SavedTensors): the slots its autograd graph holds."""
        self.pooled_pos: list[int] = []
        """Copied inputs whose static buffer was made in the graph pool, alone in its storage (no
        output lies there): those Backward.release_inputs may give to the backward graph."""
        self.released_in: dict[int, int] = {}
        """Position -> bytes of the static inputs the runtime holds no more: their blocks are the
        backward graph's (Backward.release_inputs); each replay's staging copy writes them again."""
        self.nondiff_loose: frozenset[int] = frozenset()
        """Outputs without a gradient that only the caller reads, as a copy (recorder.py): the
        pool's last backward graph takes their memory (Backward.release_grad_outputs)."""
        self.released_out: dict[int, int] = {}
        """Position -> bytes of the outputs the runtime holds no more (Backward.release_grad_outputs,
        tangents.py): each forward replay writes them again, and for those holding their incoming
        gradient each backward replay's staging copy."""

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


def copy_all(dst: list, src: list) -> None:
    """Copy each of ``src`` into ``dst``: one ``_foreach_copy_`` (one kernel launch for all of them
    on CUDA, where a ``copy_`` between same-typed device tensors is a ``cudaMemcpyAsync`` that took
    longer to issue on the H100 host: 11 against 7 us), or ``copy_`` each where torch lacks it or
    grad mode is on (``copy_`` records autograd history the way it always did)."""
    if foreach_copy is not None and dst and not torch.is_grad_enabled():
        foreach_copy(dst, src)
        return
    for d, v in zip(dst, src):
        d.copy_(v)


def static_buffer_like(value: torch.Tensor) -> torch.Tensor:
    """A buffer to copy ``value`` into before each replay: same strides where they are a valid
    layout to write, dense otherwise (expanded inputs); the graph is keyed by the input strides."""
    if non_overlapping(value):
        return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device)
    return torch.empty(value.size(), dtype=value.dtype, device=value.device)


def fill_grads(bufs: list[torch.Tensor], positions: tuple[int, ...], grads: tuple) -> int:
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


def freeze(value: Any) -> Any:
    """Non-tensor inputs become part of a dict key: lists (of sizes) as tuples."""
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    return value


def reserved(device: Optional[torch.device], settle: bool = False) -> int:
    """The caching allocator's reserved bytes on ``device`` (0 off CUDA). ``settle``: first hand
    its cached free blocks back, as ``torch.cuda.graph`` does when a capture begins; measured after
    that, the growth across a capture is its pool's alone (measured before it, the cache the
    capture hands back hid the pool's growth: 0 bytes for a 156 MiB graph after eager warm-up calls)."""
    if device is None or device.type != "cuda":
        return 0
    if settle:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)
