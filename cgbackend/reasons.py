"""Why something is not graphed: one record type read by the report, the logs, the stats and tests."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch.fx

from .fx_utils import module_path, op_name, source_location

__all__ = ["RULE_DESCRIPTIONS", "Rule", "Reason", "reason_for"]


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
    """A collective kept eager: host-read sizes, an op not captured, or capture_collectives off
    (passes/collectives.py)."""

    def __str__(self) -> str:  # shows the JSON name in text and f-strings
        return self.value

    @property
    def description(self) -> str:
        """One line for people: what the rule means (the report prints it where the rule first
        appears)."""
        return RULE_DESCRIPTIONS[self]

    @property
    def is_root_cause(self) -> bool:
        """False for rules that only follow from another node's verdict."""
        return self not in (Rule.DEPENDS_ON_DYNAMIC_SHAPE, Rule.TUPLE_ELEMENT)


RULE_DESCRIPTIONS: dict[Rule, str] = {
    Rule.DATA_DEPENDENT_SHAPE: "the op's output size is read from device data (nonzero, where(cond), "
                               "masked_select, ...), so no graph can be recorded for it ahead of the data",
    Rule.DEPENDS_ON_DYNAMIC_SHAPE: "an input of the op has a data-dependent size, so it runs eagerly after "
                                   "the op that made that size",
    Rule.HOST_SYNC: "the op copies a device value to the host (.item(), .tolist(), bool(tensor)); "
                    "a CUDA graph cannot wait for the host",
    Rule.DEVICE_MOVE: "the op moves data between devices (.cpu(), .to(other device))",
    Rule.CPU_TENSOR: "the op computes on CPU tensors; a CUDA graph replays device work only",
    Rule.UNSAFE_TAG: "the operator carries torch.Tag.cudagraph_unsafe",
    Rule.USER_MARKED: "marked dynamic by the user (cgbackend.mark_dynamic, the options dynamic_ops or "
                      "dynamic_modules)",
    Rule.GLOBAL_STATE: "an autocast or grad-mode switch whose block eager code cuts: it must run in Python",
    Rule.INPLACE_ON_GRAD: "training: an in-place write to a tensor that requires grad",
    Rule.TUPLE_ELEMENT: "an element of a tuple an eager op made: regions pass tensors, not tuples",
    Rule.SMALL_REGION: "a static run of ops too small to be worth a graph (fewer estimated kernels than "
                       "the option min_region_ops), folded into the eager code around it",
    Rule.COLLECTIVE: "a collective kept eager between graphs: its sizes are read from the device, or it is not "
                     "a functional all-to-all / all-reduce with sizes fixed by shapes (those are captured)",
}
"""One line per rule for people, read by the text report (reasons as data)."""


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
