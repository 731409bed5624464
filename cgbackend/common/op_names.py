"""Does an operator name of the option ``dynamic_ops`` name an existing operator?

The names are the ones :func:`cgbackend.common.fx_utils.op_key` gives graph nodes: ``ns::op`` for
registered ops (``aten::nonzero``, ``mylib::op``), ``Tensor.method``, ``torch.fn``,
``torch.nn.functional.fn`` and ``module.fn`` for other Python functions. A name that resolves to
nothing would keep nothing eager, silently; the config rejects it instead.
"""

from __future__ import annotations

import importlib
import sys
from typing import Iterable

import torch

__all__ = ["resolves", "unresolved_op_names"]


def _registered_op(name: str) -> bool:
    namespace, _, op = name.partition("::")
    if not namespace or not op:
        return False
    op, _, overload = op.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
        return not overload or hasattr(packet, overload)
    except (AttributeError, RuntimeError):
        return False


def _python_attribute(name: str) -> bool:
    """``a.b.c``: the longest importable module prefix, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except Exception:  # not a module (or it fails to import): try a shorter prefix
                continue
        obj = module
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return False
        return True
    return False


def resolves(name: str) -> bool:
    if "::" in name:
        return _registered_op(name)
    if name.startswith("Tensor."):
        return hasattr(torch.Tensor, name[len("Tensor."):])
    return _python_attribute(name)


def unresolved_op_names(names: Iterable[str]) -> list[str]:
    """The names among ``names`` that name no operator, in order."""
    return [name for name in names if not resolves(name)]
