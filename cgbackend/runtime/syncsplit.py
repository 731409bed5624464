"""Split a static region at the op that synchronized with the host during its warm-up.

The warm-up (runtime/warmup.py) names the node; passes/sync_split.py (the one pass the runtime
calls, since the op shows up only when it runs) cuts the region into up to three parts: the static
nodes that do not depend on it (captured), the node with the elements of its tuple output (eager),
the static nodes after it (captured). :func:`apply_splits` then replaces the region's step of the compiled graph by the parts, after the call that found the node
(that call ran the whole region eagerly, so its results are eager's). Parts are new regions: they
warm up, compile (inner.py) and capture like any other, and a part that synchronizes again is
split again.

Only a region that holds no graph yet is split (a sync seen in the warm-up of a later input
signature leaves the region whole and eager, ``host_sync_in_warmup``). Bucketing plans are not
carried over: the parts key their graphs on exact sizes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch.fx

from ..fx_utils import op_name, source_location
from ..passes.partition import Region
from ..passes.sync_split import split_at_sync
from .split import Step, build_region_module

if TYPE_CHECKING:
    from .executor import CompiledGraph

__all__ = ["apply_splits"]

log = logging.getLogger(__name__)


def apply_splits(graph: "CompiledGraph") -> None:
    """Replace each region the runners asked to split by its parts (after the call that asked)."""
    pending, graph._pending_splits = graph._pending_splits, []
    for step, hit in pending:
        _apply(graph, step, hit)


def _apply(graph: "CompiledGraph", step: Any, hit: Any) -> None:

    region, old = step.region, step.runner
    region_of: dict[torch.fx.Node, Region] = {}
    for s in graph.steps:
        for n in s.region.nodes:
            region_of[n] = s.region
    parts = split_at_sync(region, hit.node, graph.analysis.effects, graph.config.min_region_ops, region_of)
    slot_of = graph._slot_of
    base = graph.n_values  # slots from here on hold values internal to the old region
    for part in parts:
        for n in part.outputs:
            if n not in slot_of:
                slot_of[n] = graph.n_values
                graph.n_values += 1
    # Slots this step freed go at the last part reading them; the parts' own values at their last use.
    last_part: dict[int, int] = {}
    for i, part in enumerate(parts):
        for n in part.inputs:
            last_part[slot_of[n]] = i
    new_steps = []
    for i, part in enumerate(parts):
        module = build_region_module(graph.analysis.gm, part)
        ins = tuple(slot_of[n] for n in part.inputs)
        outs = tuple(slot_of[n] for n in part.outputs)
        frees = tuple(s for s in ins if last_part.get(s) == i and (s in step.frees or s >= base))
        runner = graph._make_runner(part, module, None, part.facts) if part.is_static else None
        new_steps.append(Step(ins, outs, frees, runner, module, part, f"{step.range_name}.{i}"))
    position = graph.steps.index(step)
    graph.steps[position:position + 1] = new_steps
    graph.mark_terminal()
    # Later regions that read an output of the old runner in place now take it from the part computing it,
    # or, where an eager part computes it, read it as an eager value.
    for later in graph.steps[position + len(new_steps):]:
        runner = later.runner
        if runner is None:
            continue
        for pos, inp in enumerate(later.region.inputs):
            if runner.producers[pos] is old:
                producer = graph._runner_of.get(inp)
                if producer is old or producer is None:
                    runner.kinds[pos] = "eager"
                    runner.producers[pos] = None
                    graph._runner_of.pop(inp, None)
                else:
                    runner.producers[pos] = producer
    counters = graph.shared.counters
    counters.regions_split += 1
    n_static = sum(1 for p in parts if p.is_static)
    counters.static_regions += n_static - 1
    counters.dynamic_regions += len(parts) - n_static
    source, _ = source_location(hit.node)
    counters.sync_splits.append({"region": old.name, "node": hit.node.name, "op": op_name(hit.node),
                                 "source": source, "detail": hit.detail,
                                 "parts": [f"{p.label} ({p.kind})" for p in parts]})
    log.info("cgbackend: %s split at %s (%s%s) into %s", old.name, hit.node.name, op_name(hit.node),
             f" at {source}" if source else "", ", ".join(f"{p.label} ({p.kind})" for p in parts))
