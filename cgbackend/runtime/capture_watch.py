"""The one-time warning that a compiled model runs with nothing captured.

Every region of a model can end up eager without an error: CPU tensors, a machine without CUDA,
``capture=False``, every static region disabled, or a value that changes each call and keeps the
model warming up (a new input signature each call) or recompiling (a Python number Dynamo bakes
into each graph). The counters say so (``stats()["nothing_captured_reason"]``, ``eager_calls``),
but nobody reads them unprompted. :class:`CaptureWatch` looks once per compiled graph, right after
the call at which its regions capture (the call after ``warmup`` warm-up calls), and at each
compile of a function Dynamo compiled twice before for the same parameters (a function compiled
once per layer is not a value changing each call; a graph without static regions is not counted);
if the backend instance has captured nothing by then, it warns once (``NothingCapturedWarning``,
Python's warnings) naming the reason, and logs the same line at INFO. The check costs one integer comparison per call of a compiled graph.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..common.fx_utils import dynamo_compile_id
from ..common.notices import NothingCapturedWarning
from ..common.reasons import EagerReason
from ..common.machine import torch_build
from ..common.user_code import warn

__all__ = ["CaptureWatch", "settle_call"]

log = logging.getLogger(__name__)

_PATIENCE = 8
"""Calls of a graph, in units of its first settle call, before 'still warming up' is a warning."""

_WARMING = "the static regions of graph"

_RECOMPILES = 3
"""Compiles of one function (Dynamo's frame) with nothing captured that make it a pattern."""


def settle_call(config: Any, layer_copies: int) -> int:
    """The call of a compiled graph after which its static regions have captured if they ever will
    on these inputs: ``warmup`` warm-up calls, then the capture (per layer sharing the graph)."""
    return (config.warmup + 1) * max(layer_copies, 1)


def _no_cuda(graph: Any) -> str:
    device = graph.analysis.classification.compute_device
    if torch.cuda.is_available():
        return (f"graph {graph.index} computes on {device} tensors and CUDA graphs replay device work "
                "only: move the model and its inputs to a CUDA device")
    return (f"this machine has no CUDA device ({torch_build()}) and CUDA graphs need "
            "one; simulate_graphs=True tests cgbackend's runtime on CPU")


def nothing_captured_reason(graph: Any) -> str:
    """Why graph ``graph`` (a CompiledGraph) captured nothing, in words a user can act on."""
    if graph.blocked == EagerReason.NO_CUDA:
        return _no_cuda(graph)
    if graph.blocked == EagerReason.CAPTURE_DISABLED:
        return "the option capture=False: the graphs are partitioned and run eagerly"
    if not graph.runners:
        return (f"graph {graph.index} has no static region, every op of it runs eagerly "
                "(cgbackend.report(compiled) names the reasons)")
    disabled = [(r.name, r.state) for r in graph.runners if r.state.disabled]
    if len(disabled) == len(graph.runners):
        shown = ", ".join(f"{name} ({state.disabled}: {state.disabled_detail})" for name, state in disabled[:3])
        return f"every static region of graph {graph.index} runs eagerly for good: {shown}"
    eager: dict[str, int] = {}
    for runner in graph.runners:
        for reason, n in runner.counts.eager_calls.items():
            eager[reason] = eager.get(reason, 0) + n
    if eager and max(eager, key=eager.get) == EagerReason.WARMUP:
        return (f"{_WARMING} {graph.index} are still warming up after {graph.calls} calls "
                f"({eager[EagerReason.WARMUP]} warm-up calls, option warmup={graph.config.warmup}): each call "
                "brought a new input signature (a shape, dtype or Python value the graph depends on), and a "
                "new signature warms up again; cgbackend.report(compiled) lists each region's graphs")
    text = ", ".join(f"{k} {v}" for k, v in sorted(eager.items(), key=lambda kv: -kv[1]))
    return f"static regions of graph {graph.index} ran eagerly: {text or 'no call reached them'}"


class CaptureWatch:
    """One backend instance's watch (its counters); warns at most once."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters
        self.enabled = True
        """False where capturing nothing is the point (explain)."""
        self.warned = False
        self.compiles: dict[tuple, int] = {}

    def on_compile(self, graph: Any) -> None:
        """A new graph was compiled (backend.py): the third compile of one function with nothing
        captured means a value that changes each call is baked into each graph."""
        compile_id = dynamo_compile_id() if self.enabled else None
        if compile_id is None or self.warned or not graph.runners:
            return  # a graph without static regions has nothing to warm up or capture: its recompiles
            # (a MoE loop body's activation compiled again for each new row count) cost no capture
        # Dynamo counts a frame's compiles per process; these are this model's. A function compiled
        # once per layer (each layer's graph reads its own parameters) is not a value changing per
        # call: counted by the frame and the graph's parameters.
        frame = (compile_id[0], graph.params_key)
        self.compiles[frame] = self.compiles.get(frame, 0) + 1
        if self.compiles[frame] >= _RECOMPILES and self.counters.graphs_captured == 0:
            self.warn(f"Dynamo compiled the same function {self.compiles[frame]} times with "
                      f"{self.counters.graph_calls} calls run: a value that changes each call (a Python number "
                      "or attribute the code branches on, loops over or sizes by) is a constant in each "
                      "graph, and every new graph warms up again (TORCH_LOGS=recompiles names the value; "
                      "pass it as a tensor, or keep it fixed)")

    def on_settled(self, graph: Any) -> Optional[int]:
        """``graph`` just ran the call at which its regions capture (executor.py); returns the call at
        which to look again, or None. Regions still warming up (new signatures, such as sizes spread
        over several capture sizes) may capture later: that reason waits for _PATIENCE times as many
        calls, looking again at each doubling, before it warns."""
        if self.warned or not self.enabled or self.counters.graphs_captured:
            return None
        reason = nothing_captured_reason(graph)
        first = settle_call(graph.config, graph.shared.layer_copies)
        if reason.startswith(_WARMING) and graph.calls < _PATIENCE * first:
            return graph.calls * 2
        self.warn(reason)
        return None

    def warn(self, reason: str) -> None:
        self.warned = True
        message = f"cgbackend: nothing was captured as a CUDA graph, every call runs eagerly: {reason}"
        log.info("%s", message)
        warn(message, NothingCapturedWarning)  # at the user's call, not at this file

    def reset(self) -> None:
        self.warned = False
        self.compiles.clear()
