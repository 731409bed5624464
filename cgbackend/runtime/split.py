"""Turn each region of a partition into its own GraphModule (inputs in Region.inputs order,
outputs as a tuple in Region.outputs order). The mapping region -> module is kept by the caller;
nothing is recovered from names."""

from __future__ import annotations

import torch.fx

from ..passes.partition import Partition, Region

__all__ = ["build_region_module", "split"]


def build_region_module(gm: torch.fx.GraphModule, region: Region) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for inp in region.inputs:
        placeholder = graph.placeholder(inp.name)
        placeholder.meta = dict(inp.meta)
        env[inp] = placeholder
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in region.outputs))
    graph.lint()
    # The root is the original module: get_attr targets (constants, nested graphs) resolve there.
    return torch.fx.GraphModule(gm, graph, class_name=f"cgbackend_region_{region.name}")


def split(gm: torch.fx.GraphModule, partition: Partition) -> list[torch.fx.GraphModule]:
    return [build_region_module(gm, region) for region in partition.regions]
