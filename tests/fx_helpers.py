"""Helpers shared by the CPU tests of the passes."""

from __future__ import annotations

import contextlib

import torch


def trace(fn, *args, dynamic_ops: bool = True, **compile_kwargs) -> torch.fx.GraphModule:
    """The one FX graph Dynamo hands a backend for ``fn(*args)`` (data-dependent ops traced into the
    graph unless ``dynamic_ops=False``)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    scope = (torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)
             if dynamic_ops else contextlib.nullcontext())
    with scope:
        torch.compile(fn, backend=record, fullgraph=True, **compile_kwargs)(*args)
    assert len(graphs) == 1, f"expected one graph, Dynamo made {len(graphs)}"
    return graphs[0]
