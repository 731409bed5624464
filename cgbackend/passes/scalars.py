"""Python floats that change from call to call, read as device values.

Reads: a Dynamo graph with fake values. Writes: the graph, where the rewrite below is proven;
returns :class:`DeviceScalars`.

Why: Dynamo hands a Python float argument that changed between calls (mixup's lambda, a schedule's
coefficient) to the graph as a 0-d CPU tensor it reads back with ``.item()``; the graph computes
with the number. A graph replays its kernels with their arguments as captured, so a region reading
that number is keyed on its value (runtime/graph_cache.py): a new value each call is a new warm-up
each call, and nothing replays.

How: where every use of the number is arithmetic with numbers (``1 - lam``, ``lam ** 0.5``) ending
in element-wise arithmetic with a floating tensor of at least one dimension on one device
(``lam * x``), a 0-d float64 tensor holding the number on that device computes the same: float64
is Python's float, and a 0-d operand takes the other tensor's dtype as the number would. The
``.item()`` goes, the arithmetic runs on the 0-d tensor, and the graph input becomes a device
value: the runtime moves it to that device before the graph's regions run (runtime/executor.py),
and a static region copies it into its static buffer like any input, so one graph serves every
value. Any other use (a branch, a size, a non-floating or 0-d operand, a keyword such as
``alpha``) leaves the graph as it is.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value, plain_name

__all__ = ["DeviceScalars", "device_scalars"]

_NUMBER_OPS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, operator.neg,
               operator.pos}
"""Arithmetic on Python numbers: on a 0-d float64 tensor it is the same double-precision math."""
_TENSOR_OPS = {"add", "sub", "mul", "truediv", "div", "true_divide", "pow", "rsub", "radd", "rmul",
               "rtruediv", "rdiv", "rpow", "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_",
               "pow_"}
"""Element-wise arithmetic taking the number as an operand (plain_name: Tensor methods, torch
functions and Python operators alike)."""


@dataclasses.dataclass
class DeviceScalars:
    """Graph inputs turned into device values: input position -> the device they move to."""

    inputs: dict[int, torch.device] = dataclasses.field(default_factory=dict)


def _is_number_input(node: torch.fx.Node) -> bool:
    value = fake_value(node)
    return (isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type == "cpu"
            and value.dtype == torch.float64 and not value.requires_grad)


def _tensor_use(node: torch.fx.Node, chain: set) -> Optional[torch.device]:
    """The device of the element-wise op ``node`` that takes a value of ``chain`` as an operand,
    if a 0-d float64 tensor there computes what the number does; else None."""
    if node.op not in ("call_function", "call_method") or plain_name(node) not in _TENSOR_OPS:
        return None
    if any(a in chain for a in node.kwargs.values()) or len(node.args) != 2 or node.kwargs:
        return None
    out = fake_value(node)
    others = [fake_value(a) if isinstance(a, torch.fx.Node) else a for a in node.args if a not in chain]
    tensors = [t for t in others if isinstance(t, torch.Tensor)]
    if not isinstance(out, torch.Tensor) or len(tensors) != 1:
        return None
    other = tensors[0]
    if other.dim() == 0 or not other.is_floating_point() or other.dtype != out.dtype or out.device != other.device:
        return None
    return out.device


def _number_use(node: torch.fx.Node, chain: set) -> bool:
    """``node`` is arithmetic on chain values and Python numbers, giving a number."""
    if node.op != "call_function" or node.target not in _NUMBER_OPS or node.kwargs:
        return False
    return isinstance(fake_value(node), torch.SymFloat) and all(
        a in chain or (isinstance(a, (int, float)) and not isinstance(a, bool)) for a in node.args)


def _proven(reads: list[torch.fx.Node]) -> Optional[tuple[list[torch.fx.Node], torch.device]]:
    """(the number's arithmetic nodes, the one device it meets tensors on) when every use of the
    ``.item()`` nodes ``reads`` is proven (module docstring); else None."""
    chain: set = set(reads)
    numbers: list[torch.fx.Node] = []
    devices: set = set()
    stack = list(reads)
    while stack:
        value = stack.pop()
        for user in value.users:
            if user in chain:
                continue
            if _number_use(user, chain):
                chain.add(user)
                numbers.append(user)
                stack.append(user)
                continue
            device = _tensor_use(user, chain)
            if device is None:
                return None
            devices.add(device)
    if len(devices) != 1:
        return None
    return numbers, devices.pop()


def device_scalars(gm: torch.fx.GraphModule) -> DeviceScalars:
    """Rewrite each proven float input (module docstring); returns what was rewritten."""
    found = DeviceScalars()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for position, node in enumerate(placeholders):
        if not _is_number_input(node) or not node.users:
            continue
        reads = list(node.users)
        if not all(r.op == "call_method" and r.target == "item" and len(r.args) == 1 for r in reads):
            continue
        proven = _proven(reads)
        if proven is None:
            continue
        numbers, device = proven
        fake = fake_value(node)
        with fake.fake_mode:
            value = torch.empty((), dtype=torch.float64, device=device)
        for n in [node] + numbers:
            _set_fake(n, value)
        for read in reads:
            read.replace_all_uses_with(node)
            gm.graph.erase_node(read)
        found.inputs[position] = device
    if found.inputs:
        gm.recompile()
    return found


def _set_fake(node: torch.fx.Node, value: Any) -> None:
    for key in ("example_value", "val"):
        if key in node.meta or key == "example_value":
            node.meta[key] = value
