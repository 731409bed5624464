"""Turn each region of a partition into its own GraphModule (inputs in Region.inputs order,
outputs as a tuple in Region.outputs order), with the rewrites the passes decided for it. The
mapping region -> module is kept by the caller; nothing is recovered from names.

In eager (dynamic) regions, Dynamo's host-only checks on sizes (``aten._assert_scalar``,
``aten.sym_size``) become plain Python: same results and errors, without a dispatcher round trip
per call (a per-expert loop has several per expert).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.fx

from ..common.fx_utils import is_subgraph_attr
from ..passes.partition import Region

__all__ = ["Step", "build_region_module"]


def _assert_scalar(cond: Any, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"Runtime assertion failed for expression {msg}")


def _sym_size(t: torch.Tensor, dim: int) -> int:
    return t.size(dim)


_HOST_ONLY_REPLACEMENTS = {
    torch.ops.aten._assert_scalar.default: _assert_scalar,
    torch.ops.aten.sym_size.int: _sym_size,
}


def build_region_module(gm: torch.fx.GraphModule, region: Region,
                        order: Optional[Sequence[torch.fx.Node]] = None,
                        rewrites: Optional[Mapping[torch.fx.Node, tuple[Callable[..., Any], tuple]]] = None,
                        ) -> torch.fx.GraphModule:
    """``region``'s nodes (in ``order`` when given: passes/schedule.py) as a GraphModule; a node in
    ``rewrites`` (passes/gather.py's plan) calls the function and arguments given there instead."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    origin: dict[torch.fx.Node, torch.fx.Node] = {}
    for inp in region.inputs:
        placeholder = graph.placeholder(inp.name)
        placeholder.meta = dict(inp.meta)
        env[inp] = placeholder
    for node in (order if order is not None else region.nodes):
        for body in node.all_input_nodes:
            if body not in env and is_subgraph_attr(body):  # passes/partition.py: read where called
                env[body] = graph.get_attr(body.target)
                env[body].meta = dict(body.meta)
        new = graph.node_copy(node, lambda n: env[n])
        if rewrites is not None and node in rewrites:
            target, args = rewrites[node]
            new.target = target
            new.args = torch.fx.node.map_arg(args, lambda n: env[n])
        if not region.is_static and new.op == "call_function":
            new.target = _HOST_ONLY_REPLACEMENTS.get(new.target, new.target)
        env[node] = new
        origin[new] = node
    graph.output(tuple(env[n] for n in region.outputs))
    graph.lint()
    # The root is the original module: get_attr targets (constants, nested graphs) resolve there.
    module = torch.fx.GraphModule(gm, graph, class_name=f"cgbackend_region_{region.name}")
    module.meta["cgbackend_origin"] = origin
    """The region module's node -> the node of Dynamo's graph it copies (runtime/syncsplit.py)."""
    return module


class Step:
    """One region of a compiled graph, in execution order: where its inputs come from, where its
    outputs go, what is freed after it, and the runner (static) or module (eager) that runs it."""

    __slots__ = ("ins", "outs", "frees", "runner", "module", "region", "range_name", "take")

    def __init__(self, ins, outs, frees, runner, module, region, range_name="") -> None:
        self.ins = ins
        self.take = _taker(ins)
        """take(env) -> this step's inputs, a new list (one C call for the lookups)."""
        self.outs = outs
        self.frees = frees
        self.runner = runner
        self.module = module
        self.region = region
        self.range_name = range_name
        """Profiler range of this region: "cgbackend g0.S0 attention" (report id and role)."""


def _taker(ins: Any) -> Callable[[list], list]:
    if len(ins) > 1:
        get = operator.itemgetter(*ins)
        return lambda env: list(get(env))
    return lambda env: [env[i] for i in ins]
