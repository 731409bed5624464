"""The hoisted constants of a compiled graph (passes/constants.py decides which), made once when
the graph is compiled, outside any capture: the regions read them in place like parameters."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.fx

from ..common.fx_utils import fake_value

__all__ = ["make_constant", "make_constants"]


def make_constants(nodes: Sequence[torch.fx.Node]) -> dict[torch.fx.Node, torch.Tensor]:
    """Each hoisted node's tensor, made in graph order (a conversion reads a constant made
    before it)."""
    made: dict[torch.fx.Node, torch.Tensor] = {}
    for node in nodes:
        made[node] = make_constant(node, made)
    return made


def make_constant(node: torch.fx.Node, made: Optional[dict] = None) -> torch.Tensor:
    """Make a hoisted node's tensor (outside any capture); checked against its fake value. ``made``:
    the tensors of the constants made before it (a conversion reads one)."""
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), (made or {}).__getitem__)
    if node.op == "call_method":
        value = getattr(args[0], node.target)(*args[1:], **kwargs)
    else:
        value = node.target(*args, **kwargs)
    expected = fake_value(node)
    if not isinstance(value, torch.Tensor) or value.shape != expected.shape or value.dtype != expected.dtype \
            or value.device.type != expected.device.type:
        raise RuntimeError(
            f"cgbackend: constant {node.name} ({node.target}) made {_describe(value)} at run time but was "
            f"traced as {_describe(expected)}")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}@{value.dtype} on {value.device}"
    return type(value).__name__
