"""Classification rule: collectives run eagerly, between graphs.

Dynamo turns ``torch.distributed`` calls into functional collectives
(``_c10d_functional.all_to_all_single`` + ``wait_tensor``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ...). cgbackend keeps them out of its CUDA graphs:

* their split sizes are often host values read from the device (an expert-parallel all-to-all's
  ``.tolist()``), so the shapes change every call;
* a CUDA graph that captured NCCL work holds the communicator, whose destruction then waits for
  the graph (a hang at exit);
* every rank must launch collectives in the same order; an eager fallback of a region on one rank
  (warm-up, capture failure, a replay-order hazard) but not on another would reorder them;
* the engines that issue them (FSDP2, DDP) run them on their own streams with buffers they
  allocate and free themselves.

Pure: ``(node, ctx) -> Reason | None`` like the rules in classify.py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx

from ..common.reasons import Reason, Rule, reason_for

__all__ = ["rule_collective", "is_collective"]

_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor", "symm_mem"})


def is_collective(target: Any) -> bool:
    """A c10d / functional-collective operator, or a Python function of torch.distributed."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = getattr(target, "_qualified_op_name", None) or getattr(target, "name", lambda: "")()
        return str(qualified).split("::")[0] in _NAMESPACES
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch.distributed") and callable(target)


def rule_collective(node: torch.fx.Node, ctx: Any) -> Optional[Reason]:
    if node.op != "call_function" or not is_collective(node.target):
        return None
    return reason_for(node, Rule.COLLECTIVE,
                      "a collective runs eagerly between graphs: its sizes may be host values, every "
                      "rank must issue it in the same order, and a graph holding NCCL work would "
                      "keep the communicator alive at exit")
