"""An op's arguments by name, read the way the op's own schema reads them.

Reads: a call (an FX node, or a target with its positional and keyword arguments: the loop
rewrite binds Python syntax with it). Writes: nothing.

Why: ``F.leaky_relu(x, 0.1, True)`` writes ``x``, ``h.norm(2, 0)`` reduces over dimension 0 and
``F.softmax(h)`` over the dimension its rank implies; the meaning hides in positions and defaults.
A pass that reads an argument asks for it by name (``"inplace"``, ``"dim"``, ``"weights"``) and
gets what the op itself would use, positional or keyword, default included, never a hand-kept
position.

How: Dynamo's graphs call torch-level targets: functions of ``torch`` and
``torch.nn.functional`` (builtins with ATen schemas, or Python functions with Python signatures),
``Tensor`` methods (``call_method`` nodes, named by a string), Python operators; AOT graphs call
``OpOverload``s. :func:`signatures` finds the candidate signatures of a target (the ATen schema's
overloads through ``torch.fx.operator_schemas.get_signature_for_torch_op``, a Python function's
own signature, a method's Python definition on ``Tensor``, else the ``torch`` function or ATen op
of its name), :func:`bind` binds the call to the one that accepts it (overloads told apart by the
arguments' types, read from the nodes' fake values), defaults applied. Signatures are cached per
target; binding one call costs a few microseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import warnings
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.fx
from torch.fx.operator_schemas import create_type_hint, get_signature_for_torch_op, type_matches

from ..common.fx_utils import fake_value

__all__ = ["Call", "argument", "bind", "call_of", "implicit_softmax_dim", "signatures"]

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Call:
    """One call bound to its op's signature."""

    args: dict[str, Any]
    """Every parameter of the signature by name, in order, defaults included."""
    written: tuple[str, ...] = ()
    """Parameters the op's schema marks as written in place (``Tensor(a!)``)."""

    def get(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)

    def __contains__(self, name: str) -> bool:
        return name in self.args


_Candidate = tuple[inspect.Signature, tuple[str, ...]]

_BOUND: "weakref.WeakKeyDictionary[torch.fx.Node, tuple]" = weakref.WeakKeyDictionary()
"""Node -> (its args, its kwargs, their Call): the binding of the arguments it still has."""


def _written(sig: inspect.Signature, schema: Any) -> tuple[str, ...]:
    names = list(sig.parameters)
    arguments = list(getattr(schema, "arguments", ()) or ())
    if len(arguments) != len(names):
        return ()
    return tuple(n for n, a in zip(names, arguments)
                 if getattr(a, "alias_info", None) is not None and a.alias_info.is_write)


def _from_torch_op(op: Any) -> list[_Candidate]:
    try:
        sigs, schemas = get_signature_for_torch_op(op, return_schemas=True)
    except Exception:  # an op torch cannot describe
        return []
    if not sigs:
        return []
    schemas = schemas or [None] * len(sigs)
    return [(s, _written(s, sc)) for s, sc in zip(sigs, schemas)]


def _python_signature(fn: Any) -> list[_Candidate]:
    from torch._jit_internal import boolean_dispatched
    if fn in boolean_dispatched:  # F.max_pool2d and friends: two functions behind one name
        fn = boolean_dispatched[fn]["if_true"]
    try:
        return [(inspect.signature(inspect.unwrap(fn)), ())]
    except (TypeError, ValueError):
        return []


@functools.lru_cache(maxsize=None)
def signatures(target: Any, method: bool = False) -> tuple[_Candidate, ...]:
    """Candidate signatures of ``target`` (a callable, or a ``Tensor`` method's name with
    ``method=True``; the receiver is then the first parameter), each with the parameters its
    schema writes in place."""
    if method:
        name = str(target)
        defined = getattr(torch.Tensor, name, None)
        if isinstance(defined, types.FunctionType):  # a method written in Python (Tensor.norm, .split)
            return tuple(_python_signature(defined))
        fn = getattr(torch, name, None)
        found = _from_torch_op(fn) if isinstance(fn, types.BuiltinFunctionType) else []
        if not found:
            packet = getattr(torch.ops.aten, name, None) if not name.startswith("_") else None
            found = _from_torch_op(packet) if packet is not None else []
        return tuple(found)
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, types.BuiltinFunctionType)):
        return tuple(_from_torch_op(target))
    if callable(target) and not isinstance(target, type):
        return tuple(_python_signature(target))
    return ()


def _type_of(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        value = fake_value(value)
    if isinstance(value, torch.Tensor):
        return torch.Tensor
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
    if isinstance(value, (list, tuple)):
        return create_type_hint([_type_of(v) for v in value])
    return type(value)


def _types_match(sig: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    try:
        bound = sig.bind(*[_type_of(a) for a in args], **{k: _type_of(v) for k, v in kwargs.items()})
    except TypeError:
        return False
    for name, arg_type in bound.arguments.items():
        annotation = sig.parameters[name].annotation
        if annotation is inspect.Parameter.empty or isinstance(annotation, str):
            continue
        try:
            with warnings.catch_warnings():  # it warns on nested parametric types, then answers False
                warnings.simplefilter("ignore")
                if not type_matches(annotation, arg_type):
                    return False
        except Exception:  # an annotation type_matches does not handle: no evidence either way
            continue
    return True


def bind(target: Any, args: Sequence[Any], kwargs: Optional[dict[str, Any]] = None, *,
         method: bool = False, typed: bool = True) -> Optional[Call]:
    """``target(*args, **kwargs)`` bound to its signature, or None when no signature of the target
    accepts the call (or it has none). ``typed``: the arguments' types (FX nodes' fake values) tell
    overloads apart; without them (Python syntax) the first signature that binds is taken. A
    method's receiver is ``args[0]``; a method that takes its sizes as varargs (``x.view(2, 3)``)
    binds as if they were one list."""
    kwargs = kwargs or {}
    candidates = signatures(target, method)
    if not candidates:
        return None
    attempts = [tuple(args)]
    if method and len(args) >= 2:
        attempts.append((args[0], tuple(args[1:])))
    for attempt in attempts:
        matched = []
        for sig, written in candidates:
            try:
                sig.bind(*attempt, **kwargs)
            except TypeError:
                continue
            matched.append((sig, written))
        if len(matched) > 1 and typed:
            matched = [m for m in matched if _types_match(m[0], attempt, kwargs)] or matched
        if matched:
            sig, written = matched[0]
            bound = sig.bind(*attempt, **kwargs)
            bound.apply_defaults()
            return Call(dict(bound.arguments), written)
    return None


def call_of(node: torch.fx.Node) -> Optional[Call]:
    """``node``'s call bound to its op's signature (see :func:`bind`); None for other nodes and
    ops without a known signature. Kept per node while its arguments are the same objects (FX
    replaces them, never changes them in place)."""
    if node.op not in ("call_method", "call_function"):
        return None
    kept = _BOUND.get(node)
    if kept is not None and kept[0] is node.args and kept[1] is node.kwargs:
        return kept[2]
    if node.op == "call_method":
        call = bind(str(node.target), node.args, dict(node.kwargs), method=True)
    else:
        try:
            call = bind(node.target, node.args, dict(node.kwargs))
        except TypeError:  # an unhashable target: no cached signature
            call = None
    _BOUND[node] = (node.args, node.kwargs, call)
    return call


def argument(node: torch.fx.Node, name: str, default: Any = None) -> Any:
    """The value the op of ``node`` takes for its parameter ``name`` (passed positionally or by
    keyword, else its default); ``default`` when the op has no such parameter or no known
    signature (then only a keyword of that name is read, never a position)."""
    call = call_of(node)
    if call is None:
        return node.kwargs.get(name, default)
    return call.args.get(name, default)


def implicit_softmax_dim(ndim: int) -> int:
    """The dimension ``F.softmax`` / ``log_softmax`` / ``softmin`` use when called without ``dim``
    (torch.nn.functional._get_softmax_dim)."""
    return 0 if ndim in (0, 1, 3) else 1
