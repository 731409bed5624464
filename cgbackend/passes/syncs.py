"""Fuse the host syncs of several ``nonzero`` / ``where(cond)`` into one.

Reads and writes: one dynamic region's GraphModule (in place), before it runs.
Returns how many nonzero-like nodes now share one sync.

Why. ``torch.where(mask_e)`` reads its output size back to the host: a count
kernel, a device-to-host copy and a wait, once per expert in a per-expert MoE
loop (8 per layer). When the conditions are all available up front (the
scheduler, passes/schedule.py, already issues these ops first), one
``count_nonzero`` per condition, stacked and read back once, gives every size;
then ``torch.nonzero_static(cond, size=n)`` needs no sync and returns exactly
``nonzero(cond)`` (same indices, same order, same dtype), and
``nonzero_static(...).unbind(1)`` exactly ``where(cond)``.

When. Two or more such nodes of one region whose conditions are region inputs
(computed before the region runs).
"""

from __future__ import annotations

import torch
import torch.fx

from ..fx_utils import callee_name

__all__ = ["fuse_nonzero_syncs"]


def _is_nonzero_like(node: torch.fx.Node) -> bool:
    name = callee_name(node)
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if name == "where":
        return len(node.args) == 1 and not node.kwargs
    if name == "nonzero":
        return not node.kwargs or node.kwargs == {"as_tuple": False}
    return False


def _counts(*conds: torch.Tensor) -> list[int]:
    """Sizes of every nonzero(cond), with one device-to-host read."""
    return torch.stack([torch.count_nonzero(c) for c in conds]).tolist()


def _nonzero_static(cond: torch.Tensor, counts: list[int], i: int) -> torch.Tensor:
    return torch.nonzero_static(cond, size=counts[i])


def _where_static(cond: torch.Tensor, counts: list[int], i: int) -> tuple[torch.Tensor, ...]:
    return _nonzero_static(cond, counts, i).unbind(1)


def fuse_nonzero_syncs(module: torch.fx.GraphModule) -> int:
    if not hasattr(torch, "nonzero_static"):
        return 0
    graph = module.graph
    placeholders = {n for n in graph.nodes if n.op == "placeholder"}
    group = [n for n in graph.nodes if _is_nonzero_like(n) and n.args[0] in placeholders]
    if len(group) < 2:
        return 0
    first = group[0]
    with graph.inserting_before(first):
        counts = graph.call_function(_counts, tuple(n.args[0] for n in group))
    for i, node in enumerate(group):
        fn = _where_static if callee_name(node) == "where" else _nonzero_static
        node.op = "call_function"
        node.target = fn
        node.args = (node.args[0], counts, i)
        node.kwargs = {}
    graph.lint()
    module.recompile()
    return len(group)

