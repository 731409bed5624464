"""Making the region runners of one compiled graph: each static region's spec (how it reads each
input, where the graph-produced ones come from), its code (its FX module, compiled by Inductor
lazily or by a given compiler up front), and its runner.

The builder keeps one :class:`~cgbackend.runtime.spec.Source` per value a static region's graph
produces; a consumer's spec holds that source, never the producing runner. After a split
(runtime/syncsplit.py), the sources of the old region's values point at the parts that compute
them, or at nothing where eager code does (:meth:`RunnerBuilder.retire`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value
from ..integrations.opaque import opaque_info, region_hooks
from ..passes.partition import Region
from ..passes.region_facts import RegionFacts
from .inner import InnerFallback, LazyInner
from .region import RegionRunner
from .shared import RuntimeShared
from .sharing import LayerSharing
from .spec import COPY, EAGER, FROM_GRAPH, PARAM, VALUE, RegionCode, RegionSpec, Source
from ..common.reasons import EagerReason
from .warmup import SyncHit

__all__ = ["RunnerBuilder"]

_BLOCKED_DETAIL = {
    EagerReason.NO_CUDA: "the graph computes on the CPU; CUDA graphs need CUDA tensors",
    EagerReason.CAPTURE_DISABLED: "the option capture=False",
}


class RunnerBuilder:
    """Makes the runners of one compiled graph's static regions, in execution order."""

    def __init__(self, shared: RuntimeShared, index: int, static_address: dict[torch.fx.Node, bool],
                 constants: set, inner: Optional[Callable[..., Callable]], inner_mode: str,
                 blocked: Optional[str], on_sync: Callable[[Region, SyncHit], bool],
                 sharing: Optional[LayerSharing] = None) -> None:
        self.shared = shared
        self.sharing = sharing if sharing is not None else LayerSharing(shared.layer_copies, None)
        """How many layers share the graph (sharing.py): scales each region's bound on graphs."""
        self.config = shared.config
        self.index = index
        self.static_address = static_address
        """Placeholder -> is it a parameter or buffer (read in place)."""
        self.constants = constants
        """The hoisted constants (read in place like parameters)."""
        self.inner = inner
        self.inner_mode = inner_mode
        self.blocked = blocked
        self.on_sync = on_sync
        """The executor's split request, for a region and the op that synchronized in it."""
        self.sources: dict[torch.fx.Node, Source] = {}
        """Value -> the source a consumer's spec reads its producer through."""
        self.runners: list[RegionRunner] = []
        """Every runner made, in order (a split region's stays: it runs eagerly for good)."""

    def input_kinds(self, region: Region) -> tuple[tuple[str, ...], tuple[Optional[Source], ...]]:
        """How a static region reads each input (spec.py), and where those a graph produces come from."""
        kinds: list[str] = []
        sources: list[Optional[Source]] = []
        for inp in region.inputs:
            value = fake_value(inp)
            source = self.sources.get(inp)
            if not isinstance(value, torch.Tensor):
                kinds.append(VALUE)
            elif inp in self.constants:
                kinds.append(PARAM)  # made once, never written: read in place like a parameter
            elif inp.op == "placeholder":
                kinds.append(PARAM if self.static_address[inp] else COPY)
            elif source is not None and source.state is not None:
                kinds.append(FROM_GRAPH)
                sources.append(source)
                continue
            else:
                kinds.append(EAGER)
            sources.append(None)
        return tuple(kinds), tuple(sources)

    def make(self, region: Region, module: torch.fx.GraphModule, bucket: Any, facts: RegionFacts) -> RegionRunner:
        """The runner of static region ``region`` (its module, bucket plan and facts)."""
        kinds, sources = self.input_kinds(region)
        config = self.config
        hooks = region_hooks(region.nodes)
        opaque_calls = any(opaque_info(n) is not None for n in region.nodes)
        name = f"g{self.index}.{region.name}"  # the report's region id
        recomputable = hooks is None and facts.reruns_alike
        fn: Callable[..., Any] = module
        lazy = None
        if self.inner is not None:
            # Inductor would trace an opaque call with fake tensors and keep only its shape:
            # regions holding one run their FX module as it is.
            fn = module if opaque_calls else self.inner(module, region)
        elif self.inner_mode == "inductor" and self.blocked is None:
            lazy = LazyInner(module, name, self.shared.counters, strict=config.strict,
                             copied=tuple(p for p, k in enumerate(kinds) if k in (COPY, EAGER)),
                             written=facts.written,
                             donate=recomputable and not self.shared.capturer.simulate)
            if opaque_calls:  # a policy, not an error: counted, never raised under strict
                lazy.strict = False
                lazy.fall_back(InnerFallback.OPAQUE_CALL, "opaque module call in the region")
                lazy = None
        spec = RegionSpec(name, kinds, sources, written=facts.written,
                          bucket=bucket if config.capture_sizes else None, device=_region_device(region),
                          hooks=hooks, caller_only=facts.caller_only, recomputable=recomputable,
                          collectives=facts.collectives)
        runner = RegionRunner(spec, RegionCode(fn, lazy), self.shared,
                              on_sync=functools.partial(self.on_sync, region), sharing=self.sharing)
        if self.blocked is not None:
            runner.disable(self.blocked, _BLOCKED_DETAIL.get(self.blocked, self.blocked))
        for node in region.outputs:
            source = self.sources.get(node)
            if source is None:
                self.sources[node] = Source(runner.state)
            else:  # a part of a split region computes it now
                source.state = runner.state
        self.runners.append(runner)
        return runner

    def retire(self, old: RegionRunner, region: Region) -> None:
        """``old`` (the runner of ``region``) was split: the values of its that no part's graph
        computes are computed by eager code now, and read as eager values."""
        for node in region.outputs:
            source = self.sources.get(node)
            if source is not None and source.state is old.state:
                source.state = None


def _region_device(region: Region) -> Optional[torch.device]:
    """Where a region computes, from the fake values of its nodes (for regions fed only numbers)."""
    for node in region.outputs + region.nodes:
        value = fake_value(node)
        if isinstance(value, torch.Tensor):
            return value.device
    return None
