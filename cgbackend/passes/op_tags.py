"""Operators whose output size PyTorch reads from device data: ``torch.Tag.dynamic_output_shape``.

PyTorch tags each such ATen or custom operator; a node calling one syncs with the host to size its
output, even where a ``torch._check`` has fixed the traced size. The tag sits on operator overloads,
while Dynamo's graph calls torch-level functions (``torch.nonzero``, ``Tensor.unique_consecutive``):
those are looked up as ``torch.ops.aten.<name>`` and count when every functional overload (the
``out=`` variants left aside) is tagged. A name whose overloads disagree (``repeat_interleave``:
only its tensor-repeats overload; ``index``: only boolean masks) cannot be decided by name, so
classify.py keeps its argument checks for those.

The tag describes an operator as a whole; where an argument removes the data dependence, it is
listed in :data:`STATIC_WHEN` with why. Operators an older supported release leaves untagged are
in :data:`LATE_TAGGED`.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.fx

from ..common.fx_utils import callee_name
from .call_args import argument

__all__ = ["LATE_TAGGED", "STATIC_WHEN", "tagged_dynamic_output_shape"]

_TAG = getattr(torch.Tag, "dynamic_output_shape", None)

STATIC_WHEN: dict[str, tuple[Callable[[torch.fx.Node], bool], str]] = {
    "one_hot": (lambda node: isinstance(argument(node, "num_classes", -1), int)
                and argument(node, "num_classes", -1) >= 0,
                "the tag covers num_classes=-1 (classes from max(input)); with num_classes given the "
                "size is fixed and CUDA reads nothing back (it relies on scatter's device assert)"),
}


LATE_TAGGED: dict[str, str] = {
    "_unique": "untagged in torch 2.11 (its fake kernel there even gives a static size of 1); tagged since",
    "one_hot": "untagged in torch 2.11; tagged since (STATIC_WHEN still exempts num_classes >= 0)",
}
"""ATen operators a supported torch release leaves untagged although their output size comes from
device data: counted as tagged wherever the tag is missing (aten namespace only)."""


@functools.lru_cache(maxsize=None)
def _packet_tagged(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None) if name and name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    overloads = [o for o in packet.overloads() if o != "out" and not o.endswith("_out")]
    return bool(overloads) and all(_TAG in getattr(packet, o).tags for o in overloads)


def tagged_dynamic_output_shape(node: torch.fx.Node) -> Optional[str]:
    """The tagged operator ``node`` calls (its qualified name), or None."""
    if _TAG is None or node.op not in ("call_function", "call_method"):
        return None
    target, short = node.target, callee_name(node)
    if isinstance(target, torch._ops.OpOverload):
        tagged, name = _TAG in target.tags, target.name()
    elif isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
        tagged = bool(overloads) and all(_TAG in o.tags for o in overloads if not o._overloadname.endswith("out"))
        name = target._qualified_op_name
    else:
        tagged, name = _packet_tagged(short), f"aten::{short}"
    if not tagged and short in LATE_TAGGED and name.startswith("aten::") \
            and isinstance(getattr(torch.ops.aten, short, None), torch._ops.OpOverloadPacket):
        tagged = True
    if not tagged:
        return None
    exempt = STATIC_WHEN.get(short)
    if exempt is not None and exempt[0](node):
        return None
    return name
