"""A region whose input shapes change at every call: found early, so it stops capturing per shape.

A shape is captured only after ``warmup`` calls of it, so a region whose inputs bring a new
signature nearly every call warms up again and again and, where signatures come back now and then,
captures graphs that are rarely replayed, until its cache thrashes (graph_cache.py). By name,
Dynamo breaks the graph at an MoE layer's data-dependent dispatch, and the code after the break sees
each expert's token count (and, with an expert module per expert, each expert's parameters): a
signature seen before is the exception. :class:`ShapeChurn` watches the inference calls that find no
graph to replay: once the region has made ``VARY_CALLS`` inference calls (or four per layer sharing
its graph, runtime/sharing.py, if more), replays included, and at least half of them brought a
signature never seen before, the region stops capturing and runs its code (Inductor's where it is
compiled) without a graph; graphs it already holds still replay. Counted in ``eager_calls`` as
``shapes_vary_every_call`` and shown in the report.

What it does not mistake for churn: layers sharing one graph (each layer's parameters are a
signature of their own, but the next calls replay them all); serving over capture sizes (a padded
size is one signature, seen ``warmup`` times before its capture and replayed after), and
``cgbackend.warm_up`` (each size called ``warmup`` + 1 times: one call in four is new). What it does
take for churn, by name: a region whose unpadded sizes keep changing, such as a decode over a
growing cache, or a served region that cannot pad (passes/bucket.py) over more sizes than its first
calls repeat.
Training calls are not watched (their signatures carry call slots and layers). Only instances made
by name watch (RuntimeShared.watch_churn): ``cgbackend.compile`` rewrites the dispatch loops, and a
served region of it keeps capturing the sizes that come back (seen on an H200: an MoE served with
static dispatch off stopped capturing after 32 calls of random batch sizes, and its repeats then
ran without graphs).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["ShapeChurn", "VARY_CALLS"]

VARY_CALLS = 32
"""Inference calls a region makes before its signatures are judged (at least four per layer sharing
its graph)."""

_SEEN_MAX = 4096
"""Signatures remembered at most (beyond, a signature not remembered counts as new)."""


class ShapeChurn:
    """The signatures one region's inference calls brought when they found no graph, and the verdict."""

    __slots__ = ("seen", "misses", "new", "varying")

    def __init__(self) -> None:
        self.seen: set = set()
        self.misses = 0
        """Inference calls that found no graph to replay."""
        self.new = 0
        """Of those, calls whose signature was never seen before."""
        self.varying: Optional[str] = None
        """Why the region stopped capturing per shape, once it did."""

    def note(self, key: tuple, layers: int, replays: int) -> bool:
        """One inference call that found no graph, with signature ``key``, of a region whose graph
        ``layers`` layers share and that replayed ``replays`` times so far; True once the region's
        signatures churn (it then stays so)."""
        if self.varying is not None:
            return True
        self.misses += 1
        seen = self.seen
        if key not in seen:
            self.new += 1
            if len(seen) < _SEEN_MAX:
                seen.add(key)
        calls = self.misses + replays
        if calls < max(VARY_CALLS, 4 * layers) or 2 * self.new < calls:
            return False
        self.varying = (f"{self.new} of its {calls} calls brought a signature (shapes, parameters) never seen "
                        "before: it captures no graph per signature from now on and runs its compiled code "
                        "without one (graphs it holds still replay)")
        return True
