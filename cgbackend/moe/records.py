"""Records of the static-dispatch pass: one per rewritten or skipped unit, shared by every form and
read by the report (``graphs[].dispatch``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config.dispatch_mode import DispatchMode

__all__ = ["DispatchRewrite", "DispatchSkipped", "DispatchResult", "_Skip"]


@dataclasses.dataclass
class _UnitRecord:
    """Where a dispatch unit is: its pattern and the sink's source line and module path."""
    pattern: str
    source: str
    code: str
    module_path: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class DispatchRewrite(_UnitRecord):
    form: str = ""
    why: str = ""
    experts: int = 0
    removed_ops: int = 0
    figures: dict = dataclasses.field(default_factory=dict)
    """The cost model's inputs and estimates for this choice (form_choice.py), where it ran."""


@dataclasses.dataclass
class DispatchSkipped(_UnitRecord):
    reason: str = ""
    loop: str = ""
    """The rewritten loop (its LoopRewrite source) whose skip this unit keeps (keep_skips.py), if any."""


@dataclasses.dataclass
class DispatchResult:
    mode: DispatchMode = DispatchMode.OFF
    rewrites: list[DispatchRewrite] = dataclasses.field(default_factory=list)
    skipped: list[DispatchSkipped] = dataclasses.field(default_factory=list)
    layout_checks: list = dataclasses.field(default_factory=list)
    """Checks the runtime makes at each call of the graph (expert_layout.LayoutCheck): the expert
    parameters an inference graph reads from one block still are that block's slices."""

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "rewrites": [r.to_dict() for r in self.rewrites],
                "skipped": [s.to_dict() for s in self.skipped]}


class _Skip(Exception):
    """A recognized dispatch unit that cannot be rewritten; the message is the reason."""

