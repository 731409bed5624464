"""Group classified nodes into static regions (future CUDA graphs) and dynamic regions (eager).

Reads: the :class:`~cgbackend.passes.classify.Classification`, the ordering
edges of :class:`~cgbackend.passes.effects.Effects`, data edges, and
``config.min_region_ops``.
Writes: nothing on the graph; returns :class:`Partition`.

Algorithm ("eager depth" levels). Walking the graph in order, each node gets
``level(n) = max over predecessors p of level(p) + [p dynamic and n static]``.
Static nodes of one level form one static region; dynamic nodes of one level
one dynamic region; regions run as S0, D0, S1, D1, ... That order is valid:
a static node only depends on static nodes of its own level or lower and on
dynamic nodes of lower levels; a dynamic node on static nodes of its level or
lower and dynamic nodes of its level (earlier in graph order) or lower. So no
static region needs its own output back through eager code, and every static
node lands in the earliest region its inputs allow, which makes regions
maximal under that order. Inside a region nodes keep graph order.

Static regions estimated below ``min_region_ops`` kernel launches are folded
into the eager code around them. An autocast block whose enter and exit do not
land in one static region is made dynamic (its switches must run in Python),
and the levels are computed again.

Complexity: O(N + E) per round; at most one round per autocast block.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Collection, Optional

import torch
import torch.fx

from ..config import Config
from ..common.fx_utils import callee_name, compute_nodes, fake_value, is_subgraph_attr
from ..common.reasons import Reason, Rule, reason_for
from .classify import Classification
from .launch_estimate import estimate_kernels
from .effects import Effects

__all__ = ["Region", "Partition", "levels", "partition", "set_boundaries"]


@dataclasses.dataclass
class Region:
    """A run of nodes executed together: one CUDA graph (static) or one eager step (dynamic)."""

    index: int
    kind: str  # "static" | "dynamic"
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    """Values the region reads from outside it (placeholders or other regions' nodes), first use first."""
    outputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    """Region nodes read by later regions or by the graph's output, in graph order."""

    @property
    def is_static(self) -> bool:
        return self.kind == "static"

    @property
    def name(self) -> str:
        return f"{'S' if self.is_static else 'D'}{self.index}"


@dataclasses.dataclass
class Partition:
    regions: list[Region]
    """In execution order."""
    region_of: dict[torch.fx.Node, Region]
    extra_reasons: dict[torch.fx.Node, Reason]
    """Static nodes that run eagerly anyway: folded small regions, cut autocast blocks."""

    def static_regions(self) -> list[Region]:
        return [r for r in self.regions if r.is_static]

    def dynamic_regions(self) -> list[Region]:
        return [r for r in self.regions if not r.is_static]

    def reason_of(self, node: torch.fx.Node, classification: Classification) -> Optional[Reason]:
        verdict = classification.verdicts[node]
        return verdict.reason if verdict.reason is not None else self.extra_reasons.get(node)


def _container_source(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """For ``getitem(x, i)`` where x is a tuple/list value (topk, where, split): x."""
    if node.op == "call_function" and node.target is operator.getitem and node.args:
        src = node.args[0]
        if isinstance(src, torch.fx.Node) and isinstance(fake_value(src), (tuple, list)):
            return src
    return None


def levels(nodes: list[torch.fx.Node], static: dict[torch.fx.Node, bool],
            effects: Effects) -> dict[torch.fx.Node, int]:
    level: dict[torch.fx.Node, int] = {}
    for node in nodes:
        src = _container_source(node)
        if src is not None and src in level:
            # Elements of a tuple stay with the op that made it: regions pass tensors, not tuples.
            static[node] = static[src]
            level[node] = level[src]
            continue
        lv = 0
        node_static = static[node]
        for pred in list(node.all_input_nodes) + list(effects.preds(node)):
            if pred not in level:  # placeholders
                continue
            lv = max(lv, level[pred] + (1 if node_static and not static[pred] else 0))
        level[node] = lv
    return level


def _autocast_partner(node: torch.fx.Node, nodes: list[torch.fx.Node]) -> Optional[torch.fx.Node]:
    name = callee_name(node)
    if name == "_exit_autocast" and node.args and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    if name == "_enter_autocast":
        for user in node.users:
            if callee_name(user) == "_exit_autocast":
                return user
    return None


def _grad_switch_value(node: torch.fx.Node) -> Optional[bool]:
    if callee_name(node) in ("_set_grad_enabled", "set_grad_enabled") and node.args \
            and isinstance(node.args[0], bool):
        return node.args[0]
    return None


def _grad_mode_before(barriers: list[torch.fx.Node], initial: bool) -> dict[torch.fx.Node, Optional[bool]]:
    """Grad-mode switches with a constant argument -> the mode in force just before them."""
    out: dict[torch.fx.Node, Optional[bool]] = {}
    mode: Optional[bool] = initial
    for node in barriers:
        value = _grad_switch_value(node)
        if value is None:
            if callee_name(node) in ("_set_grad_enabled", "set_grad_enabled"):
                mode = None  # unknown from here on: such switches are always cut
            continue
        out[node] = mode
        mode = value
    return out


def partition(gm: torch.fx.GraphModule, classification: Classification, effects: Effects,
              config: Config, constants: Collection[torch.fx.Node] = ()) -> Partition:
    """``constants``: nodes hoisted out of every region (passes/constants.py); they become region
    inputs, like placeholders."""
    # Higher-order ops' bodies belong to no region: each region that calls one reads it itself.
    nodes = [n for n in compute_nodes(gm) if n not in constants and not is_subgraph_attr(n)]
    order = {n: i for i, n in enumerate(nodes)}
    static = {n: classification.is_static(n) for n in nodes}
    extra: dict[torch.fx.Node, Reason] = {}

    grad_before = _grad_mode_before(effects.barriers, classification.grad_enabled)
    for _round in range(len(effects.barriers) + 1):
        level = levels(nodes, static, effects)
        cut: list[torch.fx.Node] = []
        grad_switches: dict[int, list[torch.fx.Node]] = {}
        for barrier in effects.barriers:
            if not static[barrier]:
                continue
            if barrier in grad_before:
                grad_switches.setdefault(level[barrier], []).append(barrier)
                continue
            partner = _autocast_partner(barrier, nodes)
            if partner is None or not static.get(partner, False) or level[partner] != level[barrier]:
                cut.append(barrier)
        for switches in grad_switches.values():
            # A region may switch grad mode inside (a no_grad block) if it leaves it as it found it.
            if grad_before[switches[0]] != _grad_switch_value(switches[-1]):
                cut.extend(switches)
        if not cut:
            break
        for barrier in cut:
            static[barrier] = False
            extra[barrier] = reason_for(
                barrier, Rule.GLOBAL_STATE,
                f"{callee_name(barrier)} switches global state for code that also runs eagerly; "
                "the switch must run in Python on every call")
    else:  # pragma: no cover - each round makes at least one barrier dynamic
        raise AssertionError("partition: autocast rounds did not converge")

    for node in nodes:
        if not static[node] and classification.is_static(node) and node not in extra:
            extra[node] = reason_for(node, Rule.TUPLE_ELEMENT,
                                     "takes an element of a tuple made by an eager op")

    # Group by (level, kind) in execution order S0, D0, S1, D1, ...
    groups: dict[tuple[int, int], list[torch.fx.Node]] = {}
    for node in nodes:
        groups.setdefault((level[node], 0 if static[node] else 1), []).append(node)

    steps: list[tuple[str, list[torch.fx.Node]]] = []
    for key in sorted(groups):
        members = groups[key]
        kind = "static" if key[1] == 0 else "dynamic"
        if kind == "static":
            kernels = sum(estimate_kernels(n) for n in members)
            if kernels < config.min_region_ops:
                for n in members:
                    extra[n] = reason_for(
                        n, Rule.SMALL_REGION,
                        f"its static region has about {kernels} kernel launch(es), fewer than "
                        f"min_region_ops={config.min_region_ops}; a graph would not pay for itself")
                kind = "dynamic"
        if steps and steps[-1][0] == kind == "dynamic":
            steps[-1][1].extend(members)
        else:
            steps.append((kind, list(members)))

    regions: list[Region] = []
    region_of: dict[torch.fx.Node, Region] = {}
    for index, (kind, members) in enumerate(steps):
        members.sort(key=order.__getitem__)
        region = Region(index=index, kind=kind, nodes=members)
        regions.append(region)
        for n in members:
            region_of[n] = region
    set_boundaries(gm, regions, region_of)
    return Partition(regions=regions, region_of=region_of, extra_reasons=extra)


def set_boundaries(gm: torch.fx.GraphModule, regions: list[Region],
                    region_of: dict[torch.fx.Node, Region]) -> None:
    for region in regions:
        seen: set[torch.fx.Node] = set()
        for node in region.nodes:
            for inp in node.all_input_nodes:
                if region_of.get(inp) is not region and inp not in seen and not is_subgraph_attr(inp):
                    seen.add(inp)
                    region.inputs.append(inp)
        for node in region.nodes:
            if any(region_of.get(user) is not region for user in node.users):
                region.outputs.append(node)
