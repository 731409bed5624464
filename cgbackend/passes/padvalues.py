"""Which values the padding rows of a bucketed region hold, and whether an op could fail on them.

Reads: a static region's nodes (in order) and its row sources along the padded symbol s (as
passes/bucket.py finds them). Writes nothing; returns the first op that could fail, or None.

Padding s up to B adds rows s..B-1 to every row source. What they hold decides whether the padded
call can fail where the real one would not (an index out of range, an integer division by zero):

* padded inputs: copies of the input's last real row (runtime/inputs.fill_padding). The region is
  row-independent along s (passes/rowdep.py), so each padding row computes exactly what that real
  row computed: nothing can fail that did not fail (or would not fail) on the real rows;
* constant factories (``zeros((s, c))``) and expands of tensors without rows: every row holds the
  same values, so the same argument holds;
* ``arange(s)``: row i holds i, so padding rows hold s..B-1, values no real row holds. They may
  flow through arithmetic (a float positional encoding, a scale), but not into an op that reads
  them as indices or divides integers by them; such a region is not bucketed, with the op.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value, plain_name
from .call_args import call_of

__all__ = ["unsafe_padding_use"]

_INDEX_OPS = {"embedding", "one_hot", "index_select", "gather", "take", "take_along_dim", "bincount",
              "index", "index_put", "index_put_", "index_add", "index_add_", "index_copy",
              "index_copy_", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
              "embedding_bag", "nll_loss", "cross_entropy", "multinomial", "narrow", "select",
              "repeat_interleave"}
_INT_DIVISIONS = {"floordiv", "floor_divide", "remainder", "fmod", "mod", "div", "truediv", "div_",
                  "ifloordiv", "imod"}


def _integer(node: torch.fx.Node) -> bool:
    value = fake_value(node)
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()) \
        and value.dtype != torch.bool


def _divisor(node: torch.fx.Node):
    """The divisor of a division: its ``other`` by the op's schema (``torch.div(a, other=b)``), the
    second operand of a Python operator."""
    call = call_of(node)
    if call is not None and "other" in call:
        return call.get("other")
    return node.args[1] if len(node.args) > 1 else None


def _in_index(key, tainted: set) -> bool:
    items = key if isinstance(key, (tuple, list)) else (key,)
    return any(isinstance(k, torch.fx.Node) and k in tainted for k in items)


def unsafe_padding_use(nodes: Iterable[torch.fx.Node], aranges: Iterable[torch.fx.Node]
                       ) -> Optional[tuple[torch.fx.Node, str]]:
    """The first op that could fail on the values ``arange(s)`` holds in padding rows (read as an
    index, or an integer divisor), with why; None if there is none."""
    tainted = set(aranges)
    if not tainted:
        return None
    for node in nodes:
        if node in tainted:
            continue
        uses = [a for a in node.all_input_nodes if a in tainted]
        if not uses:
            continue
        name = plain_name(node)
        if name == "getitem" and len(node.args) > 1 and _in_index(node.args[1], tainted):
            return node, ("indexing with values computed from arange over the padded size, which "
                          "hold indices past the real rows in padding rows")
        if name in _INDEX_OPS:
            return node, (f"{name} reads values computed from arange over the padded size, which "
                          "hold indices past the real rows in padding rows")
        divisor = _divisor(node) if name in _INT_DIVISIONS else None
        if isinstance(divisor, torch.fx.Node) and divisor in tainted and _integer(divisor):
            return node, (f"{name} divides by integers computed from arange over the padded size, "
                          "which padding rows change")
        tainted.add(node)
    return None
