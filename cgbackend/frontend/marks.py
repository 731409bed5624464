"""User declarations that an op or a module must stay out of CUDA graphs.

A mark is a property of the user's code (like an operator tag), so it lives on
the marked class or in a registry of operator names, not on a backend instance.
Per-backend choices go through the options ``dynamic_ops`` / ``dynamic_modules``.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

import torch

__all__ = ["mark_dynamic", "marked_module_reason", "marked_op_reason", "unmark_op"]

_ATTR = "__cgbackend_dynamic__"
_op_marks: dict[str, str] = {}
_lock = threading.Lock()

T = TypeVar("T")


def _op_qualname(op: Any) -> str | None:
    if isinstance(op, torch._ops.OpOverload):
        return op.overloadpacket._qualified_op_name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, str):
        return op
    custom = getattr(op, "_qualname", None)  # torch.library.custom_op objects
    if isinstance(custom, str):
        return custom
    return None


def mark_dynamic(target: Any = None, reason: str = "marked dynamic by the user") -> Any:
    """Keep ``target`` out of CUDA graphs; it runs eagerly between them, with ``reason`` in the report.

    ``target`` is an ``nn.Module`` subclass (use as a class decorator), an ``nn.Module``
    instance (only that instance), or an operator (``torch.ops.ns.op``, a custom op, or its
    name ``"ns::op"``). ``@mark_dynamic(reason="...")`` also works as a decorator factory.
    """
    if target is None:
        def decorator(obj: T) -> T:
            return mark_dynamic(obj, reason)
        return decorator
    if isinstance(target, type) and issubclass(target, torch.nn.Module):
        setattr(target, _ATTR, reason)
        return target
    if isinstance(target, torch.nn.Module):
        # A subclass with the same name carries the mark for this instance only; Dynamo records
        # the class in nn_module_stack, which is where the classifier looks.
        target.__class__ = _marked_subclass(_unmarked_class(type(target)), reason)
        return target
    name = _op_qualname(target)
    if name is None:
        raise TypeError(
            "mark_dynamic takes an nn.Module class or instance, an operator, or an operator name "
            f"like 'mylib::op'; got {type(target).__name__}"
        )
    with _lock:
        _op_marks[name] = reason
    return target


_INSTANCE_MARK = "__cgbackend_instance_mark__"


def _unmarked_class(cls: type) -> type:
    return cls.__bases__[0] if cls.__dict__.get(_INSTANCE_MARK) else cls


def _marked_subclass(base: type, reason: str) -> type:
    return type(base.__name__, (base,), {
        _ATTR: reason, _INSTANCE_MARK: True, "__module__": base.__module__,
        "__qualname__": base.__qualname__, "__reduce_ex__": _reduce_marked})


def _reduce_marked(self: Any, protocol: int) -> Any:
    """Pickle / deepcopy a marked instance as its real class plus the mark (the generated
    subclass itself cannot be found by name)."""
    cls = type(self)
    base = _unmarked_class(cls)
    reduced = base.__reduce_ex__(self, protocol)
    state = reduced[2] if len(reduced) > 2 else None
    return (_restore_marked, (base, cls.__dict__[_ATTR])) + ((state,) if state is not None else ()) + tuple(reduced[3:])


def _restore_marked(base: type, reason: str) -> Any:
    obj = base.__new__(base)
    obj.__class__ = _marked_subclass(base, reason)
    return obj


def unmark_op(op: Any) -> None:
    name = _op_qualname(op)
    with _lock:
        _op_marks.pop(name, None)


def marked_op_reason(qualname: str) -> str | None:
    return _op_marks.get(qualname)


def marked_module_reason(cls: Any) -> str | None:
    if isinstance(cls, type):
        return getattr(cls, _ATTR, None)
    return None


