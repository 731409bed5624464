"""Split a static region at the op that synchronized with the host during its warm-up.

The warm-up (runtime/warmup.py) names the node; passes/sync_split.py (the one pass the runtime
calls, since the op shows up only when it runs) cuts the region into up to three parts: the static
nodes that do not depend on it (captured), the node with the elements of its tuple output (eager),
the static nodes after it (captured). :func:`split_step` makes the parts' steps (modules, value
slots, runners), which the executor puts in place of the region's step after the call that found
the node (that call ran the whole region eagerly, so its results are eager's). Parts are new
regions: they warm up, compile (inner.py) and capture like any other, and a part that synchronizes
again is split again.

Only a region that holds no graph yet is split (a sync seen in the warm-up of a later input
signature leaves the region whole and eager, ``host_sync_in_warmup``). Bucketing plans are not
carried over: the parts key their graphs on exact sizes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch.fx

from ..common.fx_utils import op_name, source_location
from ..passes.partition import Region
from ..passes.pipeline import Analysis
from ..passes.sync_split import SplitPart, split_at_sync
from .split import Step, build_region_module
from .stats import Counters
from .warmup import SyncHit

__all__ = ["split_step", "count_split"]

log = logging.getLogger(__name__)


def split_step(step: Step, node: torch.fx.Node, steps: list[Step], slot_of: dict[torch.fx.Node, int],
               n_values: int, analysis: Analysis, min_region_ops: int,
               make_runner: Callable[..., Any]) -> tuple[list[Step], int, list[SplitPart]]:
    """The steps that replace ``step`` (one of ``steps``) once its region is split at ``node``:
    (the parts' steps, the number of value slots now, the parts). The parts' values that were
    internal to the region get slots from ``n_values`` on (added to ``slot_of``); each static part
    gets its runner from ``make_runner(part, module, bucket, facts)``."""
    region_of: dict[torch.fx.Node, Region] = {}
    for s in steps:
        for n in s.region.nodes:
            region_of[n] = s.region
    parts = split_at_sync(step.region, node, analysis.effects, min_region_ops, region_of)
    base = n_values  # slots from here on hold values internal to the old region
    for part in parts:
        for n in part.outputs:
            if n not in slot_of:
                slot_of[n] = n_values
                n_values += 1
    # Slots this step freed go at the last part reading them; the parts' own values at their last use.
    last_part: dict[int, int] = {}
    for i, part in enumerate(parts):
        for n in part.inputs:
            last_part[slot_of[n]] = i
    new_steps = []
    for i, part in enumerate(parts):
        module = build_region_module(analysis.gm, part)
        ins = tuple(slot_of[n] for n in part.inputs)
        outs = tuple(slot_of[n] for n in part.outputs)
        frees = tuple(s for s in ins if last_part.get(s) == i and (s in step.frees or s >= base))
        runner = make_runner(part, module, None, part.facts) if part.is_static else None
        new_steps.append(Step(ins, outs, frees, runner, module, part, f"{step.range_name}.{i}"))
    return new_steps, n_values, parts


def count_split(counters: Counters, name: str, hit: SyncHit, parts: list[SplitPart]) -> None:
    """Count and log the split of region ``name`` at ``hit.node`` into ``parts``."""
    counters.regions_split += 1
    n_static = sum(1 for p in parts if p.is_static)
    counters.static_regions += n_static - 1
    counters.dynamic_regions += len(parts) - n_static
    source, _ = source_location(hit.node)
    counters.sync_splits.append({"region": name, "node": hit.node.name, "op": op_name(hit.node),
                                 "source": source, "detail": hit.detail,
                                 "parts": [f"{p.label} ({p.kind})" for p in parts]})
    log.info("cgbackend: %s split at %s (%s%s) into %s", name, hit.node.name, op_name(hit.node),
             f" at {source}" if source else "", ", ".join(f"{p.label} ({p.kind})" for p in parts))
