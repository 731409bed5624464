"""Static dispatch's part of a model's preparation before Dynamo traces it (frontend/prepare.py)."""

from __future__ import annotations

from typing import Optional

import torch

from ..config.dispatch_mode import DispatchMode
from .expert_layout import Relayout, stack_expert_params
from .loop_forwards import LoopForwards

__all__ = ["prepare_dispatch"]


def prepare_dispatch(model: torch.nn.Module, mode: DispatchMode, *,
                     lay_out_experts: bool) -> tuple[Optional[LoopForwards], list[Relayout]]:
    """The rewritten loops' forwards of ``model`` (source_rewrite.py, loop_forwards.py; None when
    static dispatch is off) and, where ``mode`` builds the grouped forms and ``lay_out_experts``,
    the expert weights laid out as one block each (expert_layout.py). The layout comes first: a
    folded loop's inference traces read its experts from the blocks (fold.enable)."""
    if not mode.enabled:
        return None, []
    relayouts = stack_expert_params(model) if lay_out_experts and mode.builds_grouped else []
    return LoopForwards(model, mode), relayouts
