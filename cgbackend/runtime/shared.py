"""The state every region of one backend instance shares, declared in one place.

A :class:`RuntimeShared` belongs to one ``CGBackend`` (backend.py); its compiled graphs and their
region runners read it. Every field is declared here with the part of cgbackend that owns it (sets
it, or is the only writer); nothing else attaches a field (the class has slots), and nothing probes
for one with ``getattr``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from ..config import Config
from ..common.fx_utils import iter_tensors
from ..common.progress import CaptureProgress
from .capture import Capturer
from .capture_watch import CaptureWatch
from .mirror import CounterMirror
from .params import ParamPolicy
from .pool import PoolSet
from .stats import Counters
from .warmup import SyncDetector, cuda_sync_detector

__all__ = ["RuntimeShared"]


@dataclasses.dataclass(slots=True, eq=False)
class RuntimeShared:
    """What all runners of one backend instance share: pools, capturer, counters, config."""

    config: Config
    """The backend's options (owner: CGBackend, at construction; never changed)."""
    counters: Counters = dataclasses.field(default_factory=Counters)
    """The backend's counters, which ``cgbackend.stats`` reads (owner: CGBackend; every runtime
    part adds to them, ``CGBackend.reset`` clears them in place)."""
    mirror: Optional[CounterMirror] = None
    """Brings ``counters`` into ``torch._dynamo.utils.counters["cgbackend"]`` when that is read
    (runtime/mirror.py; owner: CGBackend). Each compiled-graph call first checks it was not
    cleared since (``CounterMirror.begin``). None: not mirrored (a RuntimeShared made for a test)."""
    watch: Optional[Callable[..., Any]] = None
    """Called instead of each region of each call when set: ``watch(graph, position, run_step,
    step, ins, call)`` runs ``run_step(step, ins, call)`` and returns its result. Owners: CGBackend
    (option profile: runtime/region_timer.py, timing regions) and explain (reporting/coverage.py,
    counting launches, set around its measured calls)."""
    capture_watch: Optional[CaptureWatch] = None
    """Told when a compiled graph has run the call at which its regions capture
    (runtime/capture_watch.py: the warning that nothing was captured; owner: CGBackend, which
    explain switches off)."""
    layer_copies: int = 1
    """How many layers of a stack share this backend's compiled graphs (regional.py; owner:
    ``cgbackend.compile``, before the first call): the bounds that count a region's graphs, warm-up
    signatures and call slots scale by it, since each layer's parameters are a signature of their
    own."""
    watch_churn: bool = False
    """Whether regions whose input signatures change at nearly every call stop capturing per
    signature (runtime/churn.py; owner: CGBackend, at construction: by name only, where Dynamo's
    breaks at MoE dispatch leave regions that see each expert's token count. cgbackend.compile
    rewrites those loops, and its served regions keep capturing sizes that come back)."""
    pools: PoolSet = dataclasses.field(init=False)
    """The graph memory pools by device and call slot (runtime/pool.py; owner: the recorders, which
    capture into them)."""
    capturer: Capturer = dataclasses.field(init=False)
    """Captures graphs, or simulates them (option simulate_graphs; runtime/capture.py)."""
    sync_detector: Optional[SyncDetector] = dataclasses.field(init=False)
    """What watches warm-up calls for host synchronization (runtime/warmup.py): CUDA's sync debug
    mode where CUDA graphs are captured; tests may set a stand-in for simulated graphs."""
    params: ParamPolicy = dataclasses.field(default_factory=ParamPolicy)
    """How parameter inputs are keyed, checked and (for volatile ones) copied: runtime/params.py
    (owner: cgbackend.distributed, which registers FSDP2's volatile parameters)."""
    progress: CaptureProgress = dataclasses.field(default_factory=CaptureProgress)
    """Counts captures and logs the progress of a long burst of them (progress.py; owner: the
    region counters, runtime/spec.py)."""
    persistent_ptrs: set[int] = dataclasses.field(default_factory=set)
    """data_ptr() of every static output of every graph: the inputs a graph may read in place
    (owner: the recorders and backward sides, register_persistent)."""
    persistent_storages: set[int] = dataclasses.field(default_factory=set)
    """Storage base pointers of static outputs and static input buffers: outputs aliasing them are
    cloned before they reach the caller (runtime/outputs.py; owner as persistent_ptrs)."""
    padded_full: dict[tuple, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Static outputs of padded (bucketed) graphs by (data_ptr, full shape, stride, dtype): a
    bucketed consumer given the sliced view reads the full padded tensor in place (owner: the
    recorders, which add them, and the graph caches, which drop them with their entries)."""
    caller_storages: set[int] = dataclasses.field(default_factory=set)
    """Storage base pointers of caller graphs' outputs (runtime/caller_graphs.py, option
    handout_graphs): outputs lying in them are handed to the caller as aliases, not copied
    (owner: the caller graphs, which add them, and the graph caches, which drop them)."""
    handed: dict[int, Any] = dataclasses.field(default_factory=dict)
    """Training entries whose static gradients were given to autograd and may still be held (as
    .grad or elsewhere): live data of their backward graph until reclaimed, by id (owner:
    runtime/static_grads.py, which the executor asks before each call's first replay)."""

    def __post_init__(self) -> None:
        config = self.config
        simulate = config.simulate_graphs or not torch.cuda.is_available()
        self.pools = PoolSet(simulate=simulate)
        self.capturer = Capturer(simulate=config.simulate_graphs)
        self.sync_detector = None if config.simulate_graphs else cuda_sync_detector()

    def register_persistent(self, values: Any, in_place: bool = True) -> None:
        """Static tensors of a graph: their storages are graph memory (copied before they reach the
        caller); ``in_place``: a graph reading one of them as an input reads it where it lies."""
        for t in iter_tensors(values):
            if t.numel() == 0:
                continue
            if in_place:
                self.persistent_ptrs.add(t.data_ptr())
            self.persistent_storages.add(t.untyped_storage().data_ptr())

    def forget_persistent(self, values: Any) -> None:
        """Static tensors about to be freed that no graph holds (a failed capture's input buffers):
        their addresses stop being graph memory. Called while they are still alive, so no other
        live storage shares those addresses; left registered, an eager tensor allocated there
        later would be copied needlessly on its way to the caller (an extra allocation where
        memory is short: the eager call after a capture's out-of-memory error)."""
        for t in iter_tensors(values):
            if t.numel() == 0:
                continue
            self.persistent_ptrs.discard(t.data_ptr())
            self.persistent_storages.discard(t.untyped_storage().data_ptr())
