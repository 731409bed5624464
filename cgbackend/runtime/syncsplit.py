"""Split a static region at the op that synchronized with the host during its warm-up.

The warm-up (runtime/warmup.py) names the node; :func:`split_region` cuts the region into up to
three parts with the partitioner's own level rule (passes/partition.py), the node taken as
dynamic: the static nodes that do not depend on it (captured), the node with the elements of its
tuple output (eager), the static nodes after it (captured). A part estimated below
``min_region_ops`` kernel launches runs eagerly like any small region. :func:`apply_splits` then
replaces the region's step of the compiled graph by the parts, after the call that found the node
(that call ran the whole region eagerly, so its results are eager's). Parts are new regions: they
warm up, compile (inner.py) and capture like any other, and a part that synchronizes again is
split again.

Only a region that holds no graph yet is split (a sync seen in the warm-up of a later input
signature leaves the region whole and eager, ``host_sync_in_warmup``). Bucketing plans are not
carried over: the parts key their graphs on exact sizes.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import torch.fx

from ..common.fx_utils import op_name, source_location
from ..passes.launch_estimate import estimate_kernels
from ..passes.partition import Region, levels, set_boundaries
from .split import Step, build_region_module

if TYPE_CHECKING:
    from .executor import CompiledGraph

__all__ = ["SplitPart", "split_region", "apply_splits"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SplitPart(Region):
    """A part of a split region; named after it (``S0.a``, ``S0.sync``, ``S0.b``)."""

    label: str = ""

    @property
    def name(self) -> str:
        return self.label


def split_region(region: Region, node: torch.fx.Node, effects: Any, min_region_ops: int,
                 region_of: dict[torch.fx.Node, Region]) -> list[SplitPart]:
    """The parts of ``region`` with ``node`` run eagerly, in execution order. ``region_of`` maps
    every node of the graph to its region (the parts' inputs and outputs are found with it)."""
    nodes = list(region.nodes)
    static = {n: n is not node for n in nodes}
    level = levels(nodes, static, effects)
    groups: dict[tuple[int, int], list[torch.fx.Node]] = {}
    for n in nodes:
        groups.setdefault((level[n], 0 if static[n] else 1), []).append(n)
    steps: list[list] = []
    for key in sorted(groups):
        members = groups[key]
        kind = "static" if key[1] == 0 else "dynamic"
        if kind == "static" and sum(estimate_kernels(n) for n in members) < min_region_ops:
            kind = "dynamic"
        if steps and steps[-1][0] == kind == "dynamic":
            steps[-1][1].extend(members)
        else:
            steps.append([kind, list(members)])
    order = {n: i for i, n in enumerate(nodes)}
    parts: list[SplitPart] = []
    static_labels = iter("abcdefghijklmnopqrstuvwxyz")
    local = dict(region_of)
    for kind, members in steps:
        members.sort(key=order.__getitem__)
        label = f"{region.name}.{next(static_labels)}" if kind == "static" else f"{region.name}.sync"
        part = SplitPart(index=region.index, kind=kind, nodes=members, label=label)
        parts.append(part)
        for n in members:
            local[n] = part
    set_boundaries(None, parts, local)
    return parts


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
    parts = split_region(region, hit.node, graph.analysis.effects, graph.config.min_region_ops, region_of)
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
        runner = graph._make_runner(part, module, None) if part.is_static else None
        new_steps.append(Step(ins, outs, frees, runner, module, part, f"{step.range_name}.{i}"))
    position = graph.steps.index(step)
    graph.steps[position:position + 1] = new_steps
    graph.mark_terminal()
    # Later regions that took a hand-off from the old runner now take it from the part computing it,
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
