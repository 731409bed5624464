"""What the runtime needs to know about each static region, decided once from the graph.

Reads: the partition's static regions, the effects (passes/effects.py: in-place writes, random ops,
global-state barriers), opaque module calls (opaque.py) and the graph's output node.
Writes: nothing. Returns one :class:`RegionFacts` per static region, by region index, and whether
the whole graph runs twice alike (:class:`GraphFacts`).

Why. A region runner copies back the inputs its region writes, may free a training entry's saved
activations only where the region computes the same thing a second time, and may give an output
only the caller reads its incoming gradient in its own memory (runtime/recorder.py). The runtime
reads those answers here; it runs no pass itself. A region split at run time (runtime/syncsplit.py)
gets its parts' facts from :func:`facts_of`, the same function.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch.fx

from ..integrations.opaque import opaque_info
from .bucket import written_positions
from .collectives import calls_collective
from .effects import Effects
from .partition import Partition, Region

__all__ = ["RegionFacts", "GraphFacts", "facts_of", "graph_facts", "reruns_alike", "issues_collectives"]


@dataclasses.dataclass(frozen=True)
class RegionFacts:
    """One static region, as its runner needs it."""

    written: tuple[int, ...] = ()
    """The region's inputs (by position, ascending) whose data one of its nodes writes in place."""
    reruns_alike: bool = False
    """Running the region a second time on the same inputs gives the same outputs and leaves the
    same state (:func:`reruns_alike`)."""
    caller_only: frozenset[int] = frozenset()
    """Positions of the region's outputs whose one user is the graph's output node: the caller gets
    them as copies and no graph or eager op reads the static buffer."""
    collectives: bool = False
    """The region issues collectives (passes/collectives.py): every call must issue them exactly
    once, on every path, so its simulated captures stand for their first replay as CUDA captures do
    (runtime/capture.py), and it never runs again to recompute."""


@dataclasses.dataclass
class GraphFacts:
    regions: dict[int, RegionFacts] = dataclasses.field(default_factory=dict)
    """Static region index -> its facts."""
    reruns_alike: bool = False
    """The whole graph runs twice alike on the same inputs (a call may run again after a layout
    check found a changed address, runtime/executor.py)."""


def reruns_alike(effects: Effects, nodes: Iterable[torch.fx.Node], inputs: Sequence[torch.fx.Node]) -> bool:
    """Running ``nodes`` (a graph, or a region of it, reading ``inputs``) a second time on the same
    inputs gives the same outputs and leaves the same state: they write none of their inputs, draw
    no random number, touch no global state and call no opaque module (whose own state they cannot
    see), and issue no collective (each run issues it again: once more on this rank than on the
    others, which then wait for a partner that never comes)."""
    nodes = list(nodes)
    if issues_collectives(nodes):
        return False
    members = set(nodes)
    if any(n in members for n in effects.random_nodes) or any(n in members for n in effects.barriers):
        return False
    if any(opaque_info(n) is not None for n in nodes):
        return False
    return not written_positions(effects, nodes, inputs)


def facts_of(region: Region, effects: Effects) -> RegionFacts:
    """The facts of one static region (or a part of a split one)."""
    return RegionFacts(
        written=tuple(sorted(written_positions(effects, region.nodes, region.inputs))),
        reruns_alike=reruns_alike(effects, region.nodes, region.inputs),
        caller_only=frozenset(i for i, node in enumerate(region.outputs)
                              if node.users and all(u.op == "output" for u in node.users)),
        collectives=issues_collectives(region.nodes))


def issues_collectives(nodes: Iterable[torch.fx.Node]) -> bool:
    """Do ``nodes`` call a collective (passes/collectives.py)?"""
    return any(calls_collective(n) for n in nodes)


def graph_facts(gm: torch.fx.GraphModule, partition: Partition, effects: Effects) -> GraphFacts:
    """The facts of every static region of ``partition``, and of the whole graph."""
    nodes = list(gm.graph.nodes)
    return GraphFacts(regions={r.index: facts_of(r, effects) for r in partition.static_regions()},
                      reruns_alike=reruns_alike(effects, nodes, [n for n in nodes if n.op == "placeholder"]))
