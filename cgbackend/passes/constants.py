"""Constant tensors made from Python values inside traced code, hoisted out of the regions.

``torch.tensor(0.0, device=x.device)``, ``torch.full((), -inf, device=...)``,
``torch.scalar_tensor(2.0, device=...)`` inside a forward become call nodes whose arguments are
all Python constants (Dynamo specializes ``x.device``). On CUDA ``torch.tensor`` copies the Python
number to the device, a host synchronization that breaks a capture (Hugging Face's attention-mask
helper does exactly this), and every call makes the tensor again. Such a node is made once per
compiled graph (``runtime/constants.py``) and read by the regions as a constant input, read in place
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
5. no graph output aliases it (the caller could write it; the next call would see the change),
   except the node itself returned as an output: the runtime then returns a copy of the constant
   on every call (:attr:`Constants.returned`), as eager returns a fresh tensor; a view of it returned
   keeps it in its region;
6. its fake value is a tensor of at most :data:`MAX_ELEMENTS` elements (a constant holds its
   memory for as long as the compiled graph lives).

A node that passes depends on nothing but Python constants and is never written: making it once
and reading that tensor on every call gives the values eager would make on every call.

**Conversions of constants** are constants too: a device move or dtype conversion (:data:`CONVERSIONS`:
``.to(...)``, ``.cuda()``, ``.float()``, ..., ``aten._to_copy``) whose only tensor argument is a
hoisted constant, whose other arguments are Python constants, and which passes checks 3 to 6.
transformers' sliding-window cache makes ``torch.tensor(window)`` on the CPU and moves it to the
GPU in every call (``cache_utils.py``): the move was a dynamic region of its own (a copy from host
memory), and the one thing keeping Mistral from running as a single graph. The moved tensor is an
attribute of the cache the model returns, so it is a graph output: check 5's exception.

**Arithmetic on constants** is folded the same way: a pure, deterministic op (:data:`FOLDED_FUNCTIONS`,
:data:`FOLDED_METHODS`: arithmetic, powers, exponentials, trigonometry, outer products, shape views
and concatenation, none in place, none random) whose tensor arguments are all hoisted constants and
whose other arguments are Python constants, and which passes checks 3 to 6. A rotary embedding that
recomputes ``inv_freq = 1 / base ** (torch.arange(0, d, 2).float() / d)`` on the CPU in every call
and moves it to the GPU (seen in transformers MoE models) was a dynamic region between two static
ones (host arithmetic, then a copy from host memory); the whole chain is now made once per
compiled graph. Its inputs are Python numbers that Dynamo guards on, so a call with other values
compiles a new graph and makes the chain again: the constant never outlives its inputs. Indexing
with indices written in the code (``inv_freq[None, :, None]``: integers, slices, None, Ellipsis)
is folded too: PhiMoE's rotary embedding indexes the CPU-made ``inv_freq`` and expands it before
moving it to the GPU, and the three ops were a dynamic region of their own on a GPU run.

Complexity: O(N + W) for N nodes and W written storages.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx

from ..common.fx_utils import fake_value, storage_ids
from .call_args import argument
from .effects import Effects

__all__ = ["CONVERSIONS", "Constants", "FACTORIES", "FOLDED_FUNCTIONS", "FOLDED_METHODS", "MAX_ELEMENTS",
           "find_constants"]

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

CONVERSIONS: frozenset = frozenset({"to", "cuda", "cpu", "float", "double", "half", "bfloat16", "long", "int",
                                    "short", "bool", _aten._to_copy.default})
"""Tensor methods (by name) and functions that convert one tensor (device, dtype) and read no other
tensor: applied to a hoisted constant, their result is one too."""

FOLDED_FUNCTIONS: frozenset = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow, operator.neg,
    operator.mod, operator.getitem,
    torch.add, torch.sub, torch.mul, torch.div, torch.true_divide, torch.pow, torch.neg, torch.reciprocal,
    torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.sin, torch.cos, torch.outer, torch.cat,
    torch.stack, torch.clamp, torch.minimum, torch.maximum, torch.floor, torch.ceil, torch.round,
    torch.where, torch.unsqueeze, torch.reshape, torch.flatten,
})
"""Functions that compute a new tensor from their arguments alone (pure, deterministic): applied to
hoisted constants and Python values, their result is a constant too."""

FOLDED_METHODS: frozenset = frozenset({
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "reciprocal", "exp", "log", "sqrt", "rsqrt",
    "sin", "cos", "outer", "clamp", "floor", "ceil", "round", "__rpow__", "__rtruediv__", "__rsub__",
    "unsqueeze", "reshape", "view", "flatten", "expand", "repeat", "contiguous", "t",
})
"""Tensor methods (by name) of the same kind."""

_CONSTANT_TYPES = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.device, torch.dtype,
                   torch.layout, torch.memory_format)


@dataclasses.dataclass
class Constants:
    """Hoisted nodes in graph order; the runtime makes each once (runtime/constants.py)."""

    nodes: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    returned: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    """Hoisted nodes the graph returns (themselves, no view of them): copied out on every call."""

    def __contains__(self, node: object) -> bool:
        return node in self._set

    def __post_init__(self) -> None:
        self._set = set(self.nodes)

    def to_dict(self) -> list[dict[str, Any]]:
        from ..common.fx_utils import op_name, source_location
        out = []
        for node in self.nodes:
            value = fake_value(node)
            out.append({"node": node.name, "op": op_name(node), "source": source_location(node)[0],
                        "shape": list(value.shape), "dtype": str(value.dtype).replace("torch.", ""),
                        "device": str(value.device), "returned": node in self.returned})
        return out


def _is_constant(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_is_constant(v) for v in value)
    if isinstance(value, slice):  # an index written in the code: x[None, :, 1:]
        return all(_is_constant(v) for v in (value.start, value.stop, value.step))
    return isinstance(value, _CONSTANT_TYPES)


def find_constants(gm: torch.fx.GraphModule, effects: Effects) -> Constants:
    """Nodes of ``gm`` that make a constant tensor from Python values (see the module docstring)."""
    written: set[int] = set()
    for ids in effects.writes.values():
        written |= ids
    output = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    escaping: dict[int, set] = {}
    """Storage -> the output nodes whose values lie in it."""
    if output is not None:
        for node in output.all_input_nodes:
            for sid in storage_ids(fake_value(node)):
                escaping.setdefault(sid, set()).add(node)
    found: list[torch.fx.Node] = []
    returned: list[torch.fx.Node] = []
    hoisted: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if not (_is_factory(node) or _is_conversion(node, hoisted) or _is_folded(node, hoisted)):
            continue
        if argument(node, "requires_grad") or argument(node, "pin_memory"):
            continue
        value = fake_value(node)
        if not isinstance(value, torch.Tensor) or value.requires_grad or value.numel() > MAX_ELEMENTS:
            continue
        ids = storage_ids(value)
        if not ids or ids & written:
            continue
        outputs = set().union(*(escaping.get(sid, ()) for sid in ids))
        if outputs and outputs != {node}:
            continue  # a view of it, or another value in its storage, reaches the caller
        found.append(node)
        hoisted.add(node)
        if outputs:
            returned.append(node)
    return Constants(nodes=found, returned=returned)


def _python_args_constant(node: torch.fx.Node) -> bool:
    """Every argument but FX nodes is a Python constant (nodes stand in as None)."""
    args = torch.fx.node.map_arg((list(node.args), list(node.kwargs.values())), lambda _: None)
    return _is_constant(args[0]) and _is_constant(args[1])


def _is_factory(node: torch.fx.Node) -> bool:
    return (node.op == "call_function" and node.target in FACTORIES and not node.all_input_nodes
            and _python_args_constant(node))


def _is_conversion(node: torch.fx.Node, hoisted: set) -> bool:
    """A conversion of one hoisted constant (its first argument) with Python constants otherwise."""
    if node.op not in ("call_method", "call_function") or node.target not in CONVERSIONS or not node.args:
        return False
    inputs = node.all_input_nodes
    return (len(inputs) == 1 and node.args[0] is inputs[0] and inputs[0] in hoisted
            and _python_args_constant(node))


def _is_folded(node: torch.fx.Node, hoisted: set) -> bool:
    """Pure arithmetic whose tensor arguments are all hoisted constants (at least one)."""
    if node.op == "call_function":
        known = node.target in FOLDED_FUNCTIONS
    else:
        known = node.op == "call_method" and node.target in FOLDED_METHODS
    inputs = node.all_input_nodes
    return known and bool(inputs) and all(n in hoisted for n in inputs) and _python_args_constant(node)
