"""AST predicates the source rewrite (source_rewrite.py) reads a dispatch loop with: calls and
their names, what a condition tests, what a name is bound to, which selections a loop body makes,
and whether two expressions are the same. Pure functions of the syntax tree; no rewriting here."""

from __future__ import annotations

import ast
from typing import Any, Optional

import torch

from ..passes.call_args import Call, bind


def _call_name(node: ast.AST) -> str:
    """``nonzero`` for ``x.nonzero()`` / ``torch.nonzero(x)``; '' otherwise."""
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute):
            return f.attr
        if isinstance(f, ast.Name):
            return f.id
    return ""


def _is_attr_call(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name


def _nonzero_arg(node: ast.AST) -> Optional[ast.expr]:
    """COND of ``COND.nonzero()`` or ``torch.nonzero(COND)`` (no other arguments)."""
    if not isinstance(node, ast.Call) or _call_name(node) != "nonzero" or node.keywords:
        return None
    f = node.func
    if isinstance(f, ast.Attribute) and not node.args and not (
            isinstance(f.value, ast.Name) and f.value.id == "torch"):
        return f.value
    if len(node.args) == 1:
        return node.args[0]
    return None


def _zero(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0 and not isinstance(node.value, bool)


def _reduced(node: ast.AST, op: str) -> Optional[str]:
    """Name M of ``M.op(...)``, ``M.op(...).op(...)`` or ``torch.op(M, ...)`` (at least one ``op``)."""
    if _is_attr_call(node, op) and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
        inner = node.args[0] if node.args else None
        return inner.id if isinstance(inner, ast.Name) else _reduced(inner, op) if inner is not None else None
    if not _is_attr_call(node, op):
        return None
    while _is_attr_call(node, op):
        node = node.func.value
    return node.id if isinstance(node, ast.Name) else None


def _sum_of(node: ast.AST) -> Optional[str]:
    return _reduced(node, "sum")


def _hit_source(cond: ast.AST) -> Optional[tuple[str, bool]]:
    """(M, needs_nonneg) when COND is "M[e] has a nonzero entry" for every e."""
    if _reduced(cond, "any"):
        return _reduced(cond, "any"), False
    if isinstance(cond, ast.Compare) and len(cond.ops) == 1 and _zero(cond.comparators[0]) \
            and isinstance(cond.ops[0], (ast.Gt, ast.NotEq)):
        m = _sum_of(cond.left)
        return (m, True) if m else None
    if isinstance(cond, ast.Call) and _call_name(cond) in ("gt", "greater", "ne", "not_equal"):
        f = cond.func
        if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "torch"):
            operands = [f.value] + list(cond.args)
        else:
            operands = list(cond.args)
        if len(operands) == 2 and _zero(operands[1]):
            m = _sum_of(operands[0])
            return (m, True) if m else None
    return None


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _assignments(fn: ast.FunctionDef, name: str) -> list[ast.expr]:
    """Values assigned to ``name`` anywhere in the function (None for other kinds of binding)."""
    out: list[Any] = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name) and t.id == name:
                    out.append(node.value)
                elif isinstance(t, (ast.Tuple, ast.List)) and name in _names_in(t):
                    out.append(None)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.With, ast.NamedExpr)):
            targets = [getattr(node, "target", None)] + [i.optional_vars for i in getattr(node, "items", [])]
            if any(t is not None and name in _names_in(t) for t in targets):
                out.append(None)
    for a in fn.args.args + fn.args.kwonlyargs:
        if a.arg == name:
            out.append(None)
    return out


def _nonnegative(fn: ast.FunctionDef, name: str) -> bool:
    """Every assignment of ``name`` is a one-hot, a comparison, or a permute/transpose of itself."""
    values = _assignments(fn, name)
    if not values:
        return False
    for v in values:
        # through layout and type changes (permute, transpose, bool, to, ...) to what made the values
        while isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr in _LAYOUT:
            v = v.func.value
        if isinstance(v, ast.Compare) or isinstance(v, ast.Name) and v.id == name:
            continue
        if isinstance(v, ast.Call) and _call_name(v) == "one_hot":
            continue
        return False
    return True


_LAYOUT = ("permute", "transpose", "bool", "to", "long", "int", "float", "contiguous", "reshape", "view", "flatten")


def _loads(fn: ast.AST, name: str) -> int:
    return sum(1 for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load))


def _unpack_first(body: list[ast.stmt], var: str) -> bool:
    """The body starts with ``var = var[0]`` / ``var = var.item()`` / ``var = int(var)``."""
    if not body or not isinstance(body[0], ast.Assign) or len(body[0].targets) != 1:
        return False
    t, v = body[0].targets[0], body[0].value
    if not (isinstance(t, ast.Name) and t.id == var):
        return False
    if isinstance(v, ast.Subscript) and isinstance(v.value, ast.Name) and v.value.id == var and _zero(v.slice):
        return True
    if _is_attr_call(v, "item") and isinstance(v.func.value, ast.Name) and v.func.value.id == var and not v.args:
        return True
    return (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "int"
            and len(v.args) == 1 and isinstance(v.args[0], ast.Name) and v.args[0].id == var)


def _selections(body: list[ast.stmt]) -> list[tuple[ast.expr, set[str]]]:
    """(argument, names bound) of every ``torch.where(arg)`` / ``nonzero(arg, as_tuple=True)`` /
    ``arg.nonzero(as_tuple=True)`` assignment in the body."""
    out = []
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        v = node.value
        arg = None
        if isinstance(v, ast.Call) and _call_name(v) == "where" and len(v.args) == 1 and not v.keywords:
            arg = v.args[0]
        elif isinstance(v, ast.Call) and _call_name(v) == "nonzero" and any(
                k.arg == "as_tuple" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in v.keywords):
            f = v.func
            if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "torch"):
                arg = f.value
            elif len(v.args) == 1:
                arg = v.args[0]
        if arg is not None:
            out.append((arg, _names_in(node.targets[0])))
    return out


def _bincount_args(node: ast.AST) -> Optional[Call]:
    """``torch.bincount(...)`` / ``ids.bincount(...)`` bound to bincount's signature (its first
    parameter the counted ids); None for other expressions."""
    if not (isinstance(node, ast.Call) and _call_name(node) == "bincount") or any(
            isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
        return None
    keywords = {k.arg: k.value for k in node.keywords}
    f = node.func
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "torch"):
        return bind("bincount", [f.value, *node.args], keywords, method=True, typed=False)
    return bind(torch.bincount, node.args, keywords, typed=False)


def _strip_flatten(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
            node.func.attr == "flatten" and not node.args
            or node.func.attr in ("view", "reshape") and len(node.args) == 1
            and isinstance(node.args[0], ast.UnaryOp) and isinstance(node.args[0].op, ast.USub)):
        node = node.func.value
    return node


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


# ----------------------------------------------------------------------------- the two forms
