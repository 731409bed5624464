"""How many layers share one compiled graph, known ahead or seen.

A graph that serves several layers holds graphs and call slots for each of them: each layer's
parameters are a signature of their own (graph_cache.py keys on their addresses), and in training
each layer's forward waits for its backward in a call slot of its own (executor.SlotTable). The
bounds on both (options ``max_graphs_per_region`` and ``max_pending_forwards``) are per layer, so
a deep model needs no option set by hand.

Known ahead for a stack that ``cgbackend.compile`` compiles once (regional.py sets
``RuntimeShared.layer_copies``). Seen otherwise: Dynamo compiles a layer's frame once and every
layer of the same code reuses that graph when it is traced on its own (FSDP2's ``fully_shard`` on
each layer, which makes each layer's call a frame of its own, or a user compiling ``layer.forward``),
and a graph whose calls read different parameter objects serves that many layers.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["LayerSharing", "MAX_SEEN"]

MAX_SEEN = 4096
"""Distinct parameter objects counted at most (a model that makes new parameters every call would
otherwise raise the bounds without end)."""


class LayerSharing:
    """Layers sharing one compiled graph: ``copies`` scales the graph's per-layer bounds."""

    __slots__ = ("ahead", "_pos", "_seen")

    def __init__(self, ahead: int, param_pos: Optional[int]) -> None:
        self.ahead = max(ahead, 1)
        """Layers known to share the graph before any call (a regional stack's depth)."""
        self._pos = param_pos
        """Position of the graph input that identifies a layer (its first parameter), or None."""
        self._seen: set[int] = set()

    def note(self, args: Sequence[object]) -> None:
        """One call of the graph: count the layer it runs for (the id of its first parameter; the
        parameter objects of a layer stay the same while the layer lives, FSDP2's unsharded ones too)."""
        pos = self._pos
        if pos is not None:
            key = id(args[pos])
            seen = self._seen
            if key not in seen and len(seen) < MAX_SEEN:
                seen.add(key)

    @property
    def seen(self) -> int:
        """Distinct layers seen calling the graph."""
        return len(self._seen)

    @property
    def copies(self) -> int:
        return max(self.ahead, len(self._seen))
