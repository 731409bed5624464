"""Split a static region at the op that synchronized with the host during its warm-up.

Reads: one region, the node that synchronized (the runtime's warm-up found it: runtime/warmup.py),
the effects, ``min_region_ops`` and the region of every node of the graph.
Writes: nothing on the graph; returns the parts as :class:`SplitPart` regions with their
boundaries set and, for static parts, their :class:`~cgbackend.passes.region_facts.RegionFacts`.

Why at run time. A host synchronization the classifier does not know (a custom op that reads a
value back, ``torch.tensor(0.0, device="cuda")`` copying a Python number) shows up only when the
region runs, so this is the one pass the runtime calls after the pipeline (runtime/syncsplit.py
applies the parts). It returns data and changes nothing.

How. The partitioner's own level rule (passes/partition.py), the node taken as dynamic: the static
nodes that do not depend on it, the node with the elements of its tuple output (eager), the static
nodes after it. A static part estimated below ``min_region_ops`` kernel launches runs eagerly like
any small region; consecutive eager parts merge. Parts are named after the region (``S0.a``,
``S0.sync``, ``S0.b``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.fx

from .launch_estimate import estimate_kernels
from .effects import Effects
from .partition import Region, levels, set_boundaries
from .region_facts import RegionFacts, facts_of

__all__ = ["SplitPart", "split_at_sync"]


@dataclasses.dataclass
class SplitPart(Region):
    """A part of a split region; named after it (``S0.a``, ``S0.sync``, ``S0.b``)."""

    label: str = ""
    facts: Optional[RegionFacts] = None
    """A static part's facts (None for the eager part)."""

    @property
    def name(self) -> str:
        return self.label


def split_at_sync(region: Region, node: torch.fx.Node, effects: Effects, min_region_ops: int,
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
    for part in parts:
        if part.is_static:
            part.facts = facts_of(part, effects)
    return parts
