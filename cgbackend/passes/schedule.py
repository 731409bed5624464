"""Order the nodes of each dynamic region so that host synchronizations come first.

Reads: the partition's dynamic regions, data edges, the ordering edges of
:class:`~cgbackend.passes.effects.Effects`, the classification (which nodes
synchronize with the host).
Writes: nothing on the graph; returns :class:`Schedule` (a node order per
dynamic region), which the runtime uses when it builds the region's module.

Why. In a per-expert loop (``for e: idx = where(mask[e]); y = expert(x[idx])``)
each ``where`` waits for the GPU to finish everything launched before it, so
the CPU's launches and the GPU's work alternate instead of overlapping. Every
``where`` only depends on the router's mask: issued first, they wait once for
the router and briefly for each other, and the experts' kernels then launch
back to back while the GPU runs them.

How. Kahn's algorithm over the region's nodes; among the ready nodes, host
synchronizations and host-only nodes (sizes, asserts: no kernel) go first,
then the rest in graph order. Every data and effect edge is respected, so the
result computes the same values (random ops keep their order through the
effect edges). O(N log N) per region.
"""

from __future__ import annotations

import dataclasses
import heapq

import torch
import torch.fx

from ..common.fx_utils import fake_value, iter_tensors
from ..common.reasons import Rule
from .classify import Classification
from .effects import Effects
from .partition import Partition

__all__ = ["Schedule", "schedule"]


@dataclasses.dataclass
class Schedule:
    order: dict[int, list[torch.fx.Node]]
    """Dynamic region index -> its nodes in execution order."""
    moved: dict[int, int]
    """Dynamic region index -> how many host synchronizations run earlier than in graph order."""


def _urgent(node: torch.fx.Node, classification: Classification) -> bool:
    verdict = classification.verdicts.get(node)
    reason = verdict.reason if verdict is not None else None
    if reason is not None and reason.rule in (Rule.HOST_SYNC, Rule.DATA_DEPENDENT_SHAPE):
        return True
    value = fake_value(node)
    return value is None or not any(True for _ in iter_tensors(value))


def schedule(partition: Partition, classification: Classification, effects: Effects) -> Schedule:
    order: dict[int, list[torch.fx.Node]] = {}
    moved: dict[int, int] = {}
    for region in partition.regions:
        if region.is_static:
            continue
        members = set(region.nodes)
        position = {n: i for i, n in enumerate(region.nodes)}
        preds = {n: {p for p in list(n.all_input_nodes) + list(effects.preds(n)) if p in members}
                 for n in region.nodes}
        users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in region.nodes}
        for n, ps in preds.items():
            for p in ps:
                users[p].append(n)
        waiting = {n: len(ps) for n, ps in preds.items()}
        ready: list[tuple[int, int, torch.fx.Node]] = []
        urgent = {n: _urgent(n, classification) for n in region.nodes}
        for n in region.nodes:
            if waiting[n] == 0:
                heapq.heappush(ready, (0 if urgent[n] else 1, position[n], n))
        result: list[torch.fx.Node] = []
        while ready:
            _, _, node = heapq.heappop(ready)
            result.append(node)
            for user in users[node]:
                waiting[user] -= 1
                if waiting[user] == 0:
                    heapq.heappush(ready, (0 if urgent[user] else 1, position[user], user))
        if len(result) != len(region.nodes):  # pragma: no cover - the graph order is a valid schedule
            raise AssertionError(f"schedule: cycle in dynamic region {region.name}")
        order[region.index] = result
        syncs = [n for n in region.nodes if urgent[n] and fake_value(n) is not None
                 and any(True for _ in iter_tensors(fake_value(n)))]
        new_position = {n: i for i, n in enumerate(result)}
        moved[region.index] = sum(1 for n in syncs if new_position[n] < position[n])
    return Schedule(order=order, moved=moved)
