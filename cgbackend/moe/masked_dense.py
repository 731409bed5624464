"""The masked-dense form: each expert computes on every row; a token adds ``where(routed, row, 0)``
times its combine weight. No host sync and shapes fixed by the token count and the number of
experts, at E/k times the expert FLOPs of the dropless loop (see the package docstring). A token
the expert does not receive computes on a copy of a row it does receive (``routed_rows``), so the
backward is masked too."""

from __future__ import annotations

import dataclasses
import operator
from typing import Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value
from ..passes.call_args import argument
from .graph_builder import _Builder, _is, _shape
from .records import _Skip

@dataclasses.dataclass
class _Weight:
    """A per-selected-position factor ``w[coords...]`` followed by unsqueezes / casts."""
    table: torch.fx.Node
    axes: list[int]          # grid axis indexing each leading dim of ``table``
    nones: int               # trailing None entries of the key
    post: list[torch.fx.Node]


def _dense_weight(b: _Builder, w: _Weight, grid_nd: int, tok_axis: int) -> torch.fx.Node:
    """The weight laid out over the token-major selection grid: [T, (K,) *tail]."""
    order = [tok_axis] + [a for a in range(grid_nd) if a != tok_axis]
    table = w.table
    present = [a for a in order if a in w.axes]
    perm = [w.axes.index(a) for a in present]
    extra = len(_shape(table)) - len(w.axes)
    if perm != list(range(len(perm))):
        table = b.method("permute", table, *(perm + list(range(len(perm), len(perm) + extra))))
    for pos, a in enumerate(order):
        if a not in w.axes:
            table = b.method("unsqueeze", table, pos)
    for _ in range(w.nones):
        table = b.method("unsqueeze", table, -1)
    for p in w.post:
        if _is(p, "unsqueeze"):
            d = argument(p, "dim")
            if d == 0:
                raise _Skip("the router weight is unsqueezed in front of the rows")
            table = b.method("unsqueeze", table, d if d < 0 else d + grid_nd - 1)
        else:
            table = b.copy(p, {p.args[0]: table})
    return table


def _combine_weights(b: _Builder, masks: torch.fx.Node, weight: Optional[torch.fx.Node], grid_nd: int,
                     dtype: torch.dtype) -> tuple[Optional[torch.fx.Node], torch.fx.Node]:
    """Per expert e and token t: the combine weight c[e, t, *tail] (the token's router weights
    routed to e, summed over its slots; zero when none) and routed[e, t]. ``masks`` is boolean
    [E, T] or [E, T, K]; ``weight`` the router weight over the token-major grid [T, (K,) *tail]."""
    routed = b.method("any", masks, 2) if grid_nd == 2 else masks
    if weight is None:
        if grid_nd == 1:
            return None, routed  # each routed token adds its row once
        return b.method("unsqueeze", b.method("to", b.method("sum", masks, 2), dtype), -1), routed
    m = masks
    for _ in range(len(_shape(weight)) - grid_nd):
        m = b.method("unsqueeze", m, -1)
    picked = b.fn(torch.where, m, weight, 0)
    return (b.method("sum", picked, 2) if grid_nd == 2 else picked), routed


def _combine(b: _Builder, rows: torch.fx.Node, c: Optional[torch.fx.Node], routed: torch.fx.Node,
             rows_first: bool, casts: list[torch.fx.Node], acc: torch.fx.Node, in_place: bool) -> torch.fx.Node:
    """acc (+)= where(routed, rows, 0) * c, cast as the original value was.

    An unrouted token adds exactly zero, also when its (never used) expert row is not finite. A
    routed token adds the same product, rounded the same way, as the loop did: its combine weight
    is its one router weight (plus exact zeros), so low-precision results match the loop bit for
    bit and the next layer's routing does not flip. (A fused multiply-add would round once and
    drift from the loop.)"""
    for _ in range(len(_shape(rows)) - 1):
        routed = b.method("unsqueeze", routed, -1)
    val = b.fn(torch.where, routed, rows, 0)
    if c is not None:
        val = b.fn(operator.mul, val, c) if rows_first else b.fn(operator.mul, c, val)
    for cast in casts:
        val = b.copy(cast, {cast.args[0]: val})
    return b.method("add_", acc, val) if in_place else b.fn(operator.add, acc, val)


def routed_rows(b: _Builder, routed: torch.fx.Node) -> torch.fx.Node:
    """Per expert e and token t (``routed`` is boolean [E, T]): t where t is routed to e, else the
    first token routed to e (token 0 when none is). Each expert computes on these rows: a token it
    does not receive gets the copy of a row it does, one the loop computed too, so a row on which
    the expert is not finite (``sqrt(x)`` of a token routed elsewhere) never enters its backward,
    where ``0 * inf`` would make the gradients NaN. The routed rows are the loop's rows, bit for bit.
    The gather copies the rows, so no in-place write of the gathered tensor (an expert accumulating
    into the tensor it reads) reaches what autograd saved."""
    T = _shape(routed)[1]
    n = T if isinstance(T, int) else b.fn(torch.ops.aten.sym_size.int, routed, 1)
    first = b.method("argmax", b.method("to", routed, torch.uint8), 1, keepdim=True)
    tokens = b.fn(torch.arange, n, device=fake_value(routed).device)
    return b.fn(torch.where, routed, tokens, first)


def _bool_mask(b: _Builder, mask: torch.fx.Node) -> torch.fx.Node:
    if fake_value(mask).dtype == torch.bool:
        return mask
    return b.fn(operator.ne, mask, 0)


