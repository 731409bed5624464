"""The calls of a compiled graph: call slots and the state of one call.

Training calls take a *call slot*: slot ``k`` means "the k-th forward still waiting for its
backward". Every graph replayed in the call belongs to slot ``k`` (its own entries and pool), and
the slot stays busy until the backward pass through the call has finished (``queue_callback`` at
the first graphed backward of the call), or until the call's autograd graph is freed without a
backward. Inference calls use slot 0 and release it when they return.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .sharing import LayerSharing
from .tangents import QUEUE_CALLBACK

__all__ = ["AnchorClone", "CallState", "SlotTable"]


class SlotTable:
    """Busy flags and generations of the call slots of one compiled graph (training). At most
    ``per_layer`` slots for each layer sharing the graph (``sharing``: runtime/sharing.py)."""

    def __init__(self, per_layer: int, sharing: Optional[LayerSharing] = None) -> None:
        self.per_layer = per_layer
        self.sharing = sharing
        self.busy: list[bool] = []
        self.generation: list[int] = []

    @property
    def max_slots(self) -> int:
        return self.per_layer * (self.sharing.copies if self.sharing is not None else 1)

    def acquire(self) -> Optional[tuple[int, int]]:
        for k, busy in enumerate(self.busy):
            if not busy:
                break
        else:
            if len(self.busy) >= self.max_slots:
                return None
            self.busy.append(False)
            self.generation.append(0)
            k = len(self.busy) - 1
        self.busy[k] = True
        self.generation[k] += 1
        return k, self.generation[k]

    def release(self, k: int, generation: int, live: list) -> None:
        if self.busy[k] and self.generation[k] == generation:
            self.busy[k] = False
            for pool, index in live:
                pool.release(index)
            live.clear()

    def pending(self) -> int:
        return sum(self.busy)


class CallState:
    """One call of a compiled graph: its slot, the graphs it replayed, its training anchors."""

    __slots__ = ("slot", "generation", "training", "live", "tokens", "_table", "_scheduled",
                 "__weakref__")

    def __init__(self, slot: int, generation: int, training: bool, table: Optional[SlotTable]) -> None:
        self.slot = slot
        self.generation = generation
        self.training = training
        self.live: list = []
        self.tokens = 0
        self._table = table
        self._scheduled = False

    def add_token(self) -> None:
        self.tokens += 1

    def still_valid(self, generation: int) -> bool:
        table = self._table
        return table is None or table.generation[self.slot] == generation

    def release(self) -> None:
        if self._table is not None:
            self._table.release(self.slot, self.generation, self.live)
        else:
            for pool, index in self.live:
                pool.release(index)
            self.live.clear()

    def on_backward(self) -> None:
        """A graphed backward of this call runs: free the slot once the whole backward pass is over."""
        if self._scheduled:
            return
        self._scheduled = True
        if QUEUE_CALLBACK is not None:
            QUEUE_CALLBACK(self.release)
        else:  # no engine hook: no forward can start before this backward pass returns anyway
            self.release()


class AnchorClone(torch.autograd.Function):
    """Clones of a training call's outputs whose backward frees the call's slot (executor.py,
    CompiledGraph._anchor): the slot stays busy until that backward has run."""

    @staticmethod
    def forward(ctx: Any, call: CallState, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        call.add_token()
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.call.on_backward()
        return (None,) + grads
