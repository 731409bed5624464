"""What a region runner hands its collaborators instead of itself.

A :class:`~cgbackend.runtime.region.RegionRunner` decides per call; the graph cache, fast path,
recorder, caller graphs, backward side and warm-up each get the parts of the region they read,
explicitly, and return decisions:

* :class:`RegionSpec`: the region as the executor built it, immutable (name, input kinds and
  where graph-produced inputs come from, written inputs, bucket plan, hooks, ...);
* :class:`RegionCode`: what the region runs now (its FX module, or Inductor's code once its lazy
  compile ran at the first warm-up call);
* :class:`RegionState`: what other regions read of it while it runs (disabled for good, outputs
  rebuilt on a caller's tensor, last static region);
* :class:`Source`: the handle through which a region reads another's state: the executor points
  it at the part that computes the value after a split, or at nothing once eager code does;
* :class:`RegionCounts`: the region's counters, each count also added to the backend's.

Inputs of a region, by kind (decided once from the partition):

* ``PARAM``: a parameter or buffer (static address). Read in place, never
  copied; its address is part of the graph's key, so a replaced parameter
  (``p.data = ...``) leads to a new capture, never to a stale replay.
* ``FROM_GRAPH``: produced by another static region's graph. The graph reads the
  producer's static output where it lies; the address is part of the key.
* ``EAGER``: produced by eager code. Usually copied into a static buffer of
  the graph; read in place when it is another graph's static output (an eager
  ``index_add_`` returns the static buffer it wrote into), address in the key.
* ``COPY``: passed by the caller: copied into a static buffer of the graph
  before each replay (written back afterwards if the region writes it in place).
* ``VALUE``: not a tensor (sizes, flags): part of the key.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..integrations.opaque import RegionHooks
from ..passes.bucket import BucketPlan
from ..common.progress import CaptureProgress
from .inner import LazyInner
from .inputs import overlap_candidates
from .layouts import AdaptedCall, InputLayouts
from .stats import Counters

__all__ = ["PARAM", "FROM_GRAPH", "EAGER", "COPY", "VALUE", "RegionSpec", "RegionCode", "RegionState",
           "Source", "RegionCounts"]

log = logging.getLogger(__name__)

PARAM, FROM_GRAPH, EAGER, COPY, VALUE = "param", "from_graph", "eager", "copy", "value"


@dataclasses.dataclass(slots=True, eq=False)
class RegionState:
    """What changes about a region as it runs, and what other regions read of it (through a
    :class:`Source`). Its runner is the only writer."""

    bucket_symbol: Optional[str] = None
    """The size symbol the region's inference calls pad (its bucket plan's), or None."""
    disabled: Optional[str] = None
    """Set when the region runs eagerly for good (capture failed, no CUDA, capture off): an
    EagerReason."""
    disabled_detail: str = ""
    rebased_ptrs: set[int] = dataclasses.field(default_factory=set)
    """data_ptr() of the outputs the region's latest call rebuilt on a caller's tensor
    (inputs.InputViews): a consumer copies them like eager values. Cleared and filled in place."""
    terminal: bool = False
    """No static region of the graph runs after this one (set by the executor): its inference
    entries may hand their outputs out without a copy (runtime/caller_graphs.py) and release them
    after capture (runtime/loose_outputs.py)."""


@dataclasses.dataclass(slots=True, eq=False)
class Source:
    """Where an input another region's graph produces comes from."""

    state: Optional[RegionState]
    """The producing region's state; None once eager code produces the value (its region was split
    at a host synchronization and an eager part computes it: runtime/syncsplit.py). The input is
    then read as an ``EAGER`` one."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class RegionSpec:
    """One static region as its collaborators read it (see the module docstring). Immutable."""

    name: str
    """The report's region id ("g0.S1")."""
    kinds: tuple[str, ...]
    """How each input is read, by position (module docstring)."""
    sources: tuple[Optional[Source], ...]
    """Where each ``FROM_GRAPH`` input comes from (None at other positions)."""
    written: tuple[int, ...] = ()
    """Inputs the region writes in place, ascending (passes/region_facts.py)."""
    bucket: Optional[BucketPlan] = None
    """How inference calls pad a symbolic size up to a capture size (passes/bucket.py), or None."""
    device: Optional[torch.device] = None
    """Where the region computes (for regions whose inputs are all numbers)."""
    hooks: Optional[RegionHooks] = None
    """What the region's opaque module calls need around captures and replays (opaque.py)."""
    caller_only: frozenset[int] = frozenset()
    """Positions of the outputs only the caller reads (passes/region_facts.py): a training entry's
    backward may take its incoming gradient into such an output's memory (recorder.py)."""
    recomputable: bool = False
    """Running the region's code again on the same inputs gives the same outputs and changes
    nothing else: its training entries may free their saved activations and recompute them in a
    backward that cannot replay (backward.py)."""
    collectives: bool = False
    """The region issues collectives (passes/region_facts.py): its captures issue them exactly once
    per call, a simulated one too (capture.py, ``once``)."""
    param_pos: tuple[int, ...] = dataclasses.field(init=False)
    """Positions of the parameter inputs (a split may turn a graph's output into an eager value,
    never a parameter into anything else): the key reads them in one pass."""
    other_pos: tuple[int, ...] = dataclasses.field(init=False)
    """Positions of every other input."""
    caller_pos: tuple[int, ...] = dataclasses.field(init=False)
    """Tensor inputs that are not parameters."""
    tensor_pos: tuple[int, ...] = dataclasses.field(init=False)
    """Every tensor input (what a training entry's autograd.Function takes)."""
    overlap_pos: tuple[int, ...] = dataclasses.field(init=False)
    """Inputs that may overlap a written one (inputs.overlap_candidates)."""

    def __post_init__(self) -> None:
        kinds = self.kinds
        put = object.__setattr__
        put(self, "param_pos", tuple(p for p, k in enumerate(kinds) if k is PARAM))
        put(self, "other_pos", tuple(p for p, k in enumerate(kinds) if k is not PARAM))
        put(self, "caller_pos", tuple(p for p, k in enumerate(kinds) if k not in (VALUE, PARAM)))
        put(self, "tensor_pos", tuple(p for p, k in enumerate(kinds) if k != VALUE))
        put(self, "overlap_pos", overlap_candidates(kinds, self.written, PARAM, VALUE) if self.written else ())


@dataclasses.dataclass(slots=True, eq=False)
class RegionCode:
    """What a region runs: ``fn`` (its FX module, a compiled callable, or Inductor's code once
    ``lazy`` compiled it at the first warm-up call: runtime/warmup.py); the warm-up is its one
    writer after the executor."""

    fn: Callable[..., Any]
    lazy: Optional[LazyInner] = None
    """The region's pending Inductor compile (inner.py), or None."""

    @property
    def layouts(self) -> Optional[InputLayouts]:
        """The layouts the region's compiled code reads its copied inputs in (runtime/layouts.py);
        None while it runs its FX module, which reads any layout."""
        fn = self.fn
        return fn.layouts if type(fn) is AdaptedCall else None

    @property
    def module(self) -> Optional[torch.fx.GraphModule]:
        """The region's FX module (the one Inductor compiled, if it did), or None."""
        lazy = self.lazy
        module = lazy.module if lazy is not None else self.fn
        return module if isinstance(module, torch.fx.GraphModule) else None


@dataclasses.dataclass(slots=True, eq=False)
class RegionCounts:
    """One region's counters (the runtime summary's per-region numbers); every count also goes to
    the backend's ``counters``."""

    name: str
    counters: Counters
    progress: CaptureProgress
    graphs: int = 0
    """Graphs captured so far (a training entry's backward counts too), evicted ones included."""
    replays: int = 0
    eager_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    """Calls that ran eagerly, by EagerReason."""
    capture_time_s: float = 0.0

    def eager(self, reason: str) -> None:
        self.eager_calls[reason] = self.eager_calls.get(reason, 0) + 1
        self.counters.eager_calls[reason] += 1

    def captured(self, entry: Any, elapsed: float, pool_growth: int, forward: bool) -> None:
        """A graph of ``entry`` was captured in ``elapsed`` seconds, the pool grown by ``pool_growth``."""
        counters = self.counters
        counters.graphs_captured += 1
        if forward:
            counters.fwd_graphs += 1
        self.capture_cost(entry, elapsed, pool_growth)
        self.graphs += 1
        self.progress.captured(self.name, elapsed)
        if elapsed > 1.0:
            log.info("cgbackend: capturing %s took %.2f s", self.name, elapsed)

    def capture_cost(self, entry: Any, elapsed: float, pool_growth: int) -> None:
        """A capture's time and the reserved memory it added, for ``entry``'s graphs."""
        counters = self.counters
        counters.capture_time_s += elapsed
        growth = max(pool_growth, 0)
        counters.pool_bytes += growth
        counters.pool_bytes_held += growth
        entry.nbytes += growth
        self.capture_time_s += elapsed
