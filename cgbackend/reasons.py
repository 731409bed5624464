"""Why something is not graphed: one record type read by the report, the logs, the stats and tests."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch.fx

from .fx_utils import module_path, op_name, source_location

__all__ = ["Rule", "Reason", "reason_for"]


class Rule(str, enum.Enum):
    """The rule that made a node (or a region) run eagerly. The value is the stable JSON name."""

    DATA_DEPENDENT_SHAPE = "data_dependent_shape"
    """The node's output size is read from device data (nonzero, where(cond), masked_select, ...)."""
    DEPENDS_ON_DYNAMIC_SHAPE = "depends_on_data_dependent_shape"
    """An input of the node has a data-dependent size."""
    HOST_SYNC = "host_sync"
    """The node copies a device value to the host (.item(), .tolist(), bool(tensor))."""
    DEVICE_MOVE = "device_move"
    """The node moves data between devices (.cpu(), .to(other device))."""
    CPU_TENSOR = "cpu_tensor"
    """The node computes on CPU tensors; a CUDA graph can only replay device work."""
    UNSAFE_TAG = "cudagraph_unsafe"
    """The operator carries torch.Tag.cudagraph_unsafe."""
    USER_MARKED = "user_marked"
    """The user marked the op or module dynamic (mark_dynamic, dynamic_ops, dynamic_modules)."""
    GLOBAL_STATE = "global_state"
    """An autocast / grad-mode switch whose block is cut by eager code: it must run in Python."""
    INPLACE_ON_GRAD = "inplace_on_requires_grad"
    """Training: an in-place write to a tensor that requires grad."""
    TUPLE_ELEMENT = "element_of_eager_tuple"
    """getitem on a tuple made by an eager op: regions pass tensors, not tuples."""
    SMALL_REGION = "small_region"
    """A static region too small to be worth a graph (min_region_ops); folded into eager."""
    COLLECTIVE = "collective"
    """A collective (all-to-all, all-gather, reduce-scatter, ...): kept eager (passes/collectives.py)."""

    def __str__(self) -> str:  # shows the JSON name in text and f-strings
        return self.value

    @property
    def is_root_cause(self) -> bool:
        """False for rules that only follow from another node's verdict."""
        return self not in (Rule.DEPENDS_ON_DYNAMIC_SHAPE, Rule.TUPLE_ELEMENT)


@dataclasses.dataclass(frozen=True)
class Reason:
    """One reason, pointing at the user's code."""

    rule: Rule
    node: str
    op: str
    source: str
    code: str
    module_path: str
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule.value,
            "node": self.node,
            "op": self.op,
            "source": self.source,
            "code": self.code,
            "module_path": self.module_path,
            "detail": self.detail,
        }


def reason_for(node: torch.fx.Node, rule: Rule, detail: str) -> Reason:
    source, code = source_location(node)
    return Reason(rule=rule, node=node.name, op=op_name(node), source=source, code=code,
                  module_path=module_path(node), detail=detail)
