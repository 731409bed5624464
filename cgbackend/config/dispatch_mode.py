"""The ``static_dispatch`` option as a typed value: :class:`Config` parses the option's text once
(options.py) into a :class:`DispatchMode`, and every other module reads that value, never the text.
The MoE feature that acts on it is ``cgbackend/moe/``."""

from __future__ import annotations

import enum
from typing import Optional

__all__ = ["DispatchMode", "GROUPED_FORMS"]

GROUPED_FORMS = ("grouped", "small_batch")
"""The forms built from the grouped routing (moe/grouped.py)."""


class DispatchMode(enum.Enum):
    """What static dispatch does: nothing (``OFF``), the cost model's choice per layer (``AUTO``), or
    one form asked for by name. The value is the option's text (``Config.to_dict()``, the report)."""

    OFF = "off"
    AUTO = "auto"
    MASKED_DENSE = "masked_dense"
    GROUPED = "grouped"
    SMALL_BATCH = "small_batch"

    def __str__(self) -> str:
        return self.value

    @property
    def enabled(self) -> bool:
        """Dispatch loops are rewritten (in the model's source and in the graph)."""
        return self is not DispatchMode.OFF

    @property
    def requested_form(self) -> Optional[str]:
        """The form the option names ("masked_dense", "grouped", "small_batch"); None for ``AUTO``
        (the cost model picks) and ``OFF``."""
        return None if self in (DispatchMode.OFF, DispatchMode.AUTO) else self.value

    @property
    def builds_grouped(self) -> bool:
        """The grouped forms may be built: expert weights are laid out as one block, loops may be
        folded, and where-loop layers are offered to the grouped rewrite (``AUTO`` and the two
        grouped forms)."""
        return self is DispatchMode.AUTO or self.requested_form in GROUPED_FORMS

    @classmethod
    def grouped_modes(cls) -> tuple["DispatchMode", ...]:
        """The modes that build the grouped forms, in declaration order."""
        return tuple(m for m in cls if m.builds_grouped)
