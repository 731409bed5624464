"""By name: a function with nothing to graph that Dynamo compiles again runs as written from then on.

``torch.compile(model, backend="cgbackend")`` cannot rewrite a MoE dispatch loop before Dynamo
traces it, so Dynamo breaks the graph there and runs the loop as plain Python. Each call the loop
makes into a module (transformers' experts call their activation, ``self.act_fn(gate)``) is a new
frame that Dynamo compiles and runs through its own machinery: a guard check, its wrappers, then
the backend's callable, per expert and per layer. Each expert sees another row count, so the
function is compiled a second time (with a symbolic size); its graph is one activation, which
cgbackend cannot capture (a region too small, or sizes that change every call) and runs eagerly.
On a CPU the round trip cost 23-30 us against the activation's 4-5 us; a 48-layer model with 128
experts makes 6144 such calls per forward.

:class:`AsWritten` decides, at each compile of a by-name instance, whether the frame is better left
to Python: the function's graphs so far and this one have no static region and no hoisted
constant (nothing is captured or made once: the graph's ops run eagerly either way), this graph is
the whole frame (it ends at the function's return, not at a graph break, so nothing after it is
given up), it is the first graph of this compile (nothing compiled earlier in it is thrown away),
and this instance compiled the function before (a recompile: the first compile's graph is kept
and reported). Dynamo skips the code from then on for every caller in the process: a function
another compiled model also runs as a frame of its own runs as written there too, the same ops. Then it raises Dynamo's ``SkipFrame``, with which a backend asks Dynamo to run the
frame as written and skip that code from then on (its own calls; the functions it calls are still
compiled). The results are the same ops eager runs. The frames are counted
(``stats()["frames_as_written"]``, ``frames_as_written_by``: the function) and named in the report.

Not for ``cgbackend.compile`` (its loops are rewritten before tracing) nor explain's traces (a trace
runs once: nothing recompiles).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..common.fx_utils import dynamo_compile_id

log = logging.getLogger(__name__)

__all__ = ["AsWritten", "skip_frame_error"]


def skip_frame_error() -> Optional[type]:
    """Dynamo's exception with which a backend asks for its frame to run as written (torch 2.11 and
    2.13 re-raise it from the backend call); None where this torch has none (feature-tested)."""
    exc = getattr(getattr(torch, "_dynamo", None), "exc", None)
    return getattr(exc, "SkipFrame", None)


class AsWritten:
    """One by-name instance's frames left to Python (module docstring)."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters
        self._graphed: dict[int, bool] = {}
        """Frame id -> whether any graph of it had something to graph."""
        self._compiles_seen: set[tuple[int, int, int]] = set()

    def check(self, analysis: Any, ended_at_break: bool, function: str) -> None:
        """Before a graph is compiled: raise SkipFrame where the frame runs as written (module
        docstring); note what the graph had otherwise."""
        compile_id = dynamo_compile_id()
        error = skip_frame_error()
        if compile_id is None or error is None:
            return
        frame = compile_id[0]
        first_of_compile = compile_id not in self._compiles_seen
        self._compiles_seen.add(compile_id)
        nothing = not analysis.partition.static_regions() and not analysis.constants.nodes
        seen_before = frame in self._graphed  # this instance compiled the function before
        graphed_before = self._graphed.get(frame, False)
        self._graphed[frame] = graphed_before or not nothing
        if not (nothing and seen_before and not graphed_before and not ended_at_break and first_of_compile):
            return
        self.counters.frames_as_written += 1
        self.counters.frames_as_written_by[function] += 1
        log.info("cgbackend: %s has nothing to graph and Dynamo compiles it again: it runs as written from "
                 "now on (Dynamo skips its frame; the functions it calls are still compiled)", function)
        raise error(f"cgbackend: {function} has nothing to graph (no static region, no constant); "
                    "run as written")

    def notes(self) -> list[str]:
        by = self.counters.frames_as_written_by
        if not by:
            return []
        shown = ", ".join(f"{name} ({n}x)" for name, n in by.most_common(5))
        return [f"{sum(by.values())} function(s) run as written, Dynamo skipping their frames: {shown}: each "
                "had nothing to graph (no static region, no constant) and Dynamo compiled it again (new "
                "sizes); its ops run eagerly either way, without Dynamo's per-call checks"]
