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


def autograd_cache_check():
    """A function ``nodes -> [first line of each refusal]`` running AOT autograd's cache check on each
    node (a refused node makes a second process compile the graph again), or None where this torch
    has no such check."""
    try:
        from torch._functorch._aot_autograd import autograd_cache
    except ImportError:
        return None
    check = getattr(autograd_cache, "check_node_safe", None)
    bypass = getattr(autograd_cache, "BypassAOTAutogradCache", None)
    if check is None or bypass is None:
        return None

    def refusals(nodes) -> list[str]:
        refused = []
        for node in nodes:
            try:
                check(node)
            except bypass as exc:
                refused.append(str(exc).splitlines()[0])
        return refused
    return refusals
