"""Constant tensors made from Python values inside traced code, hoisted out of the regions.

``torch.tensor(0.0, device=x.device)``, ``torch.full((), -inf, device=...)``,
``torch.scalar_tensor(2.0, device=...)`` inside a forward become call nodes whose arguments are
all Python constants (Dynamo specializes ``x.device``). On CUDA ``torch.tensor`` copies the Python
number to the device, a host synchronization that breaks a capture (Hugging Face's attention-mask
helper does exactly this), and every call makes the tensor again. Such a node is made once per
compiled graph (``runtime/executor.py``) and read by the regions as a constant input, read in place
like a parameter: out of every region, never copied, never synchronizing.

Reads: each node's target, arguments, fake value; the storages :class:`~cgbackend.passes.effects.Effects`
says are written in place; the graph's outputs.
Writes: nothing on the graph; returns :class:`Constants`.

The proof, per node (each failing check leaves the node where it is):

1. the target is a tensor factory that reads no tensor (:data:`FACTORIES`);
2. every argument is a Python constant (numbers, bools, None, strings, devices, dtypes, layouts,
   memory formats, and tuples/lists of those): no FX node, so no input, no symbolic size;
3. it does not require grad (``requires_grad=`` absent or False) and is not pinned;
4. nothing writes its storage in place (no node of ``Effects.writes`` touches it; fake tensors
   keep storage identity across views, so writes through views count);
5. no graph output aliases it (the caller could write it; the next call would see the change);
6. its fake value is a tensor of at most :data:`MAX_ELEMENTS` elements (a constant holds its
   memory for as long as the compiled graph lives).

A node that passes depends on nothing but Python constants and is never written: making it once
and reading that tensor on every call gives the values eager would make on every call.

Complexity: O(N + W) for N nodes and W written storages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx

from ..fx_utils import fake_value, storage_ids
from .effects import Effects

__all__ = ["Constants", "FACTORIES", "MAX_ELEMENTS", "find_constants", "make_constant"]

MAX_ELEMENTS = 1 << 16
"""Largest constant hoisted (elements): bigger ones are left to the region that makes them."""

_aten = torch.ops.aten
FACTORIES: frozenset = frozenset({
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.full, torch.zeros, torch.ones,
    torch.arange,
    _aten.scalar_tensor.default, _aten.full.default, _aten.zeros.default, _aten.ones.default,
    _aten.arange.default, _aten.arange.start, _aten.arange.start_step,
})
"""Functions that make a tensor from Python values only (no tensor argument)."""

_CONSTANT_TYPES = (int, float, bool, complex, str, type(None), torch.device, torch.dtype, torch.layout,
                   torch.memory_format)


@dataclasses.dataclass
class Constants:
    """Hoisted nodes in graph order; the runtime makes each once with :func:`make_constant`."""

    nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)

    def __contains__(self, node: object) -> bool:
        return node in self._set

    def __post_init__(self) -> None:
        self._set = set(self.nodes)

    def to_dict(self) -> list[dict[str, Any]]:
        from ..fx_utils import op_name, source_location
        out = []
        for node in self.nodes:
            value = fake_value(node)
            out.append({"node": node.name, "op": op_name(node), "source": source_location(node)[0],
                        "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                        "device": str(value.device)})
        return out


def _is_constant(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_constant(v) for v in value)
    return isinstance(value, _CONSTANT_TYPES)


def find_constants(gm: torch.fx.GraphModule, effects: Effects) -> Constants:
    """Nodes of ``gm`` that make a constant tensor from Python values (see the module docstring)."""
    written: set[int] = set()
    for ids in effects.writes.values():
        written |= ids
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    escaping: set[int] = set()
    if output is not None:
        for node in output.all_input_nodes:
            escaping |= storage_ids(fake_value(node))
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in FACTORIES:
            continue
        if node.all_input_nodes or not _is_constant(list(node.args)) \
                or not _is_constant(list(node.kwargs.values())):
            continue
        if node.kwargs.get("requires_grad") or node.kwargs.get("pin_memory"):
            continue
        value = fake_value(node)
        if not isinstance(value, torch.Tensor) or value.requires_grad or value.numel() > MAX_ELEMENTS:
            continue
        ids = storage_ids(value)
        if not ids or ids & written or ids & escaping:
            continue
        found.append(node)
    return Constants(nodes=found)


def make_constant(node: torch.fx.Node) -> torch.Tensor:
    """Make a hoisted node's tensor (outside any capture); checked against its fake value."""
    value = node.target(*node.args, **node.kwargs)
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


