"""Rewrite row gathers in eager regions so their backward is cheap.

Reads: the dynamic regions of a training graph's partition (:func:`plan_gathers`, run by the
pipeline), or one GraphModule (:func:`rewrite_gathers`, which rewrites it in place).
Returns the rewrites as data, by region: node -> the function and arguments it calls instead.
runtime/split.py builds each dynamic region's module with them; the runtime decides nothing.

Why. ``h[top_x]`` (advanced indexing with one index tensor) differentiates
through ``index_put_(accumulate=True)``, which sorts the indices: a dozen
launches and ~100 us of host time on CUDA, twice per expert in a per-expert
MoE loop. ``index_select`` computes the same values and differentiates through
``index_add`` (a zero fill and one kernel); ``x[i, j]`` on a 2-D ``x`` becomes
``index_select`` then ``gather`` likewise.

When. Only where the result is provably the same:
* ``x[k]`` with ``k`` a tuple of ``None`` / ``:`` entries and exactly one 1-D
  integer index tensor (pattern A), or ``x[i, j]`` / ``x[i, j, None]`` on a
  2-D ``x`` with two 1-D integer indices of the same length (pattern B);
* every index tensor is known to be non-negative (indexing wraps negative
  indices, index_select does not): it comes from ``nonzero`` / ``where(cond)``
  / ``argsort`` / ``sort`` or ``topk`` indices / ``argmax`` / ``arange``,
  through views, casts and floor division by a positive integer;
* deterministic algorithms are off (``index_add`` on CUDA accumulates with
  atomics, in no fixed order, when an index repeats).
Out-of-range indices raise in both forms. Forward values are bitwise equal;
gradients are equal up to the order of summing repeated indices.
"""

from __future__ import annotations

import operator
import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..common.fx_utils import callee_name, fake_value
from .partition import Partition

__all__ = ["GatherPlan", "plan_gathers", "rewrite_gathers"]

Rewrite = tuple[Callable[..., Any], tuple]
"""What a gather node calls instead: (function, arguments; FX nodes among them)."""


@dataclasses.dataclass
class GatherPlan:
    regions: dict[int, dict[torch.fx.Node, Rewrite]] = dataclasses.field(default_factory=dict)
    """Dynamic region index -> its rewritten gathers (only regions that have some)."""

    def count(self, index: int) -> int:
        return len(self.regions.get(index, ()))

_NONNEG_SOURCES = {"nonzero", "argwhere", "argsort", "argmax", "argmin", "arange", "randperm",
                   "bincount", "searchsorted"}
_INDICES_OF = {"topk", "sort", "max", "min", "kthvalue", "mode", "unique"}  # (values, indices)[1]
_VIEWS = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "detach", "clone",
          "to", "long", "int", "view_as", "reshape_as", "expand", "t", "permute", "transpose"}


def _nonnegative(node: Any, within: Optional[set], depth: int = 0) -> bool:
    """Is ``node``'s value known to be non-negative? Only nodes of ``within`` (a region's nodes;
    None: all) are looked into: a value from outside the region is an input it knows nothing of."""
    if not isinstance(node, torch.fx.Node) or depth > 12 or (within is not None and node not in within):
        return False
    name = callee_name(node)
    if name in _NONNEG_SOURCES or (name == "where" and len(node.args) == 1 and not node.kwargs):
        return True
    if node.op == "call_function" and node.target is operator.getitem and node.args:
        src, key = node.args[0], node.args[1] if len(node.args) > 1 else None
        src_name = (callee_name(src) if isinstance(src, torch.fx.Node) and (within is None or src in within)
                    else "")
        if isinstance(fake_value(src), (tuple, list)):
            if src_name in ("where", "nonzero") or (src_name in _INDICES_OF and key == 1):
                return True
            return False
        return _nonnegative(src, within, depth + 1) and _simple_key(key)
    if name in _VIEWS:
        return _nonnegative(node.args[0] if node.args else None, within, depth + 1)
    if name == "floordiv" and len(node.args) == 2:
        divisor = node.args[1]
        return isinstance(divisor, int) and divisor > 0 and _nonnegative(node.args[0], within, depth + 1)
    return False


def _simple_key(key: Any) -> bool:
    """Basic indexing only (ints >= 0, slices, None): selects elements, keeps them non-negative."""
    items = key if isinstance(key, tuple) else (key,)
    return all(k is None or isinstance(k, slice) or (isinstance(k, int) and k >= 0) for k in items)


def _index_tensor(node: Any) -> Optional[torch.Tensor]:
    if not isinstance(node, torch.fx.Node):
        return None
    value = fake_value(node)
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.dtype in (torch.int64, torch.int32):
        return value
    return None


def _take_rows(x: torch.Tensor, dim: int, index: torch.Tensor, new_axes: tuple[int, ...]) -> torch.Tensor:
    out = torch.index_select(x, dim, index)
    for axis in new_axes:
        out = out.unsqueeze(axis)
    return out


def _take_pairs(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, new_axes: tuple[int, ...]) -> torch.Tensor:
    out = torch.index_select(x, 0, rows).gather(1, cols.unsqueeze(1)).squeeze(1)
    for axis in new_axes:
        out = out.unsqueeze(axis)
    return out


def _match(node: torch.fx.Node, within: Optional[set] = None) -> Optional[Rewrite]:
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2):
        return None
    x, key = node.args
    x_val = fake_value(x) if isinstance(x, torch.fx.Node) else None
    if not isinstance(x_val, torch.Tensor):
        return None
    items = key if isinstance(key, tuple) else (key,)
    tensors = [(pos, k) for pos, k in enumerate(items) if isinstance(k, torch.fx.Node)]
    others_ok = all(k is None or k == slice(None) for k in items if not isinstance(k, torch.fx.Node))
    if not others_ok or not tensors:
        return None
    new_axes = tuple(pos for pos, k in enumerate(items) if k is None)
    if not all(_index_tensor(k) is not None and _nonnegative(k, within) for _, k in tensors):
        return None
    if len(tensors) == 1:
        pos, index = tensors[0]
        dim = sum(1 for k in items[:pos] if k is not None)
        return _take_rows, (x, dim, index, new_axes)
    if len(tensors) == 2 and x_val.dim() == 2 and [p for p, _ in tensors] == [0, 1]:
        (_, rows), (_, cols) = tensors
        if _index_tensor(rows).shape == _index_tensor(cols).shape:
            # The two indices make one output dimension: later new axes move one place left.
            return _take_pairs, (x, rows, cols, tuple(p - 1 for p in new_axes))
    return None


def plan_gathers(partition: Partition, training: bool) -> GatherPlan:
    """The gathers of each dynamic region to rewrite: only under autograd (the backward is the
    cheap part; in inference the two-index form costs one more launch), and not with deterministic
    algorithms on (as the graph is compiled)."""
    plan = GatherPlan()
    if not training or torch.are_deterministic_algorithms_enabled():
        return plan
    for region in partition.dynamic_regions():
        within = set(region.nodes)
        found = {}
        for node in region.nodes:
            rewrite = _match(node, within)
            if rewrite is not None:
                found[node] = rewrite
        if found:
            plan.regions[region.index] = found
    return plan


def rewrite_gathers(module: torch.fx.GraphModule) -> int:
    """Rewrite the gathers of ``module`` in place; returns how many."""
    if torch.are_deterministic_algorithms_enabled():
        return 0
    count = 0
    for node in list(module.graph.nodes):
        found = _match(node)
        if found is None:
            continue
        fn, args = found
        node.target = fn
        node.args = args
        count += 1
    if count:
        module.recompile()
    return count
