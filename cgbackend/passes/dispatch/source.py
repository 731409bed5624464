"""Source-level loop rewrites: dispatch loops whose Python control flow depends on the routing,
turned into the fixed-length loops they are equivalent to, before Dynamo traces them.

Dynamo cannot iterate a tensor of data-dependent length (``for e in hit.nonzero():``) and cannot
branch on a count read on the host (``if counts[e] == 0: continue``) without breaking the graph (or,
with ``capture_scalar_outputs`` on, failing). Both skip experts that received no token. When the
loop body has no effect for such an expert, running it for every expert is the same computation,
and the loop becomes ``for e in range(E)``, which Dynamo unrolls into one graph where the FX-level
static dispatch (match.py) finds one dispatch unit per expert.

Two forms are rewritten, each only when the syntax proves the equivalence:

``hit_loop``::

    hit = COND.nonzero()            # or torch.nonzero(COND), or the loop iterates it directly
    for e in hit:
        e = e[0]                    # or e.item() / int(e): the body uses the expert id as a number
        ... torch.where(M[e]) ...   # every selection in the body reads M[e]

  with ``COND`` one of ``M.sum(...) > 0`` / ``torch.greater(M.sum(...), 0)`` / ``.gt(0)`` / ``!= 0`` /
  ``M.any(...)`` and ``M`` a one-hot or boolean tensor (every assignment of ``M`` in the function is
  ``one_hot(...)``, a comparison, or a permute/transpose of ``M``): an expert outside ``hit`` has an
  all-zero ``M[e]``, so its selections are empty. Rewritten to::

    __cgb_cond = COND
    if __cgb_cond.dim() == 1:       # nonzero() rows are expert ids only for a 1-D condition
        for e in range(__cgb_cond.shape[0]):
            ...                     # the body without its first statement
    else:
        (the original loop)

``count_skip``::

    counts = torch.bincount(IDS..., minlength=E).tolist()
    for e in range(...):
        if counts[e] == 0:          # or `if not counts[e]:`
            continue
        ... torch.where(IDS == e) ...   # every selection in the body compares IDS with e

  ``counts`` used nowhere else: the skip is removed and so is the ``.tolist()``.

In both forms the body's writes must be the dispatch's accumulation: every in-place method call
(a name ending in ``_``) and every subscript assignment or augmented assignment indexes with names
bound from the body's selections; nothing else is written (attribute assignment, ``global``,
``nonlocal``, ``del``, ``yield``). Experts with side effects of their own on empty input (a call
counter) are outside what the syntax sees; the FX-level matcher still proves each unit's rewrite.
Anything else is left as it was, with the reason recorded.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import textwrap
import types
from typing import Any, Callable, Optional

import torch

__all__ = ["LoopRewrite", "rewrite_function", "install", "uninstall", "installed", "survey"]

log = logging.getLogger(__name__)

_ATTR = "__cgbackend_loops__"


@dataclasses.dataclass
class LoopRewrite:
    """One loop of one function: rewritten (``form``) or left alone (``reason``)."""
    function: str
    source: str
    form: str = ""
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- syntax helpers

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


def _writes_only_selected(body: list[ast.stmt], selected: set[str]) -> Optional[str]:
    """None when every write in the body indexes with selected names; else why not."""
    mod = ast.Module(body=body, type_ignores=[])
    for node in ast.walk(mod):
        if isinstance(node, (ast.Global, ast.Nonlocal, ast.Delete, ast.Yield, ast.YieldFrom, ast.Return)):
            return f"the loop body has a {type(node).__name__.lower()} statement"
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute):
                    return "the loop body assigns an attribute"
                if isinstance(t, ast.Subscript) and not (_names_in(t.slice) & selected):
                    return "the loop body writes a subscript not indexed by the selected tokens"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr.endswith("_") and not node.func.attr.startswith("_"):
            if not any(_names_in(a) & selected for a in node.args):
                return f"the loop body calls {node.func.attr} without the selected tokens"
    return None


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

_COND = "__cgb_hit_cond_{}"


class _Rewriter:
    def __init__(self, fn: ast.FunctionDef, where: Callable[[ast.AST], str]) -> None:
        self.fn = fn
        self.where = where
        self.records: list[tuple[str, str, str]] = []  # (source, form, reason)
        self.counter = 0

    # -- hit_loop
    def hit_loop(self, parent: list[ast.stmt], i: int) -> bool:
        loop = parent[i]
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)) or loop.orelse:
            return False
        var = loop.target.id
        assign = None
        cond = _nonzero_arg(loop.iter)
        if cond is None and isinstance(loop.iter, ast.Name):
            values = _assignments(self.fn, loop.iter.id)
            if len(values) == 1 and values[0] is not None and _nonzero_arg(values[0]) is not None:
                if _loads(self.fn, loop.iter.id) != 1:
                    self.records.append((self.where(loop), "", f"{loop.iter.id} (the nonzero() result) is also "
                                         "used outside the loop"))
                    return False
                cond = _nonzero_arg(values[0])
                assign = next(a for a in ast.walk(self.fn) if isinstance(a, ast.Assign) and a.value is values[0])
        if cond is None:
            return False
        src = self.where(loop)
        hit = _hit_source(cond)
        if hit is None:
            self.records.append((src, "", "the loop iterates nonzero() of a condition that is not "
                                 "'M.sum(...) > 0' or 'M.any(...)'"))
            return False
        m, needs_nonneg = hit
        if needs_nonneg and not _nonnegative(self.fn, m):
            self.records.append((src, "", f"{m} is not proven non-negative (a one-hot or boolean mask), so a "
                                 "zero sum does not prove an empty selection"))
            return False
        if not _unpack_first(loop.body, var):
            self.records.append((src, "", f"the loop body does not start with '{var} = {var}[0]' (or .item() / "
                                 "int()): it uses the nonzero() row as a tensor"))
            return False
        body = loop.body[1:]
        sels = _selections(body)
        expected = ast.Subscript(value=ast.Name(id=m, ctx=ast.Load()), slice=ast.Name(id=var, ctx=ast.Load()),
                                 ctx=ast.Load())
        if not sels or any(not _same(arg, expected) for arg, _ in sels):
            self.records.append((src, "", f"the loop body's selections do not all read {m}[{var}]"))
            return False
        why = _writes_only_selected(body, set().union(*(names for _, names in sels)))
        if why:
            self.records.append((src, "", why))
            return False
        if assign is not None:
            # the name now holds the condition, wherever it was assigned (a ``with no_grad()`` block)
            name = assign.targets[0].id
            assign.value = cond
            keep: list[ast.stmt] = []
        else:
            name = _COND.format(self.counter)
            self.counter += 1
            keep = [ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())], value=cond)]
        new_loop = ast.For(
            target=ast.Name(id=var, ctx=ast.Store()),
            iter=ast.Call(func=ast.Name(id="range", ctx=ast.Load()), args=[ast.Subscript(
                value=ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="shape", ctx=ast.Load()),
                slice=ast.Constant(0), ctx=ast.Load())], keywords=[]),
            body=body, orelse=[])
        old_iter = ast.Call(func=ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="nonzero",
                                               ctx=ast.Load()), args=[], keywords=[])
        old_loop = ast.For(target=loop.target, iter=old_iter, body=loop.body, orelse=[])
        test = ast.Compare(left=ast.Call(func=ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="dim",
                                                            ctx=ast.Load()), args=[], keywords=[]),
                           ops=[ast.Eq()], comparators=[ast.Constant(1)])
        branch = ast.If(test=test, body=[new_loop], orelse=[old_loop])
        for node in keep + [new_loop, old_loop, branch]:
            ast.copy_location(node, loop)
        parent[i:i + 1] = keep + [branch]
        self.records.append((src, "hit_loop", ""))
        return True

    # -- count_skip
    def count_skip(self, loop: ast.For) -> None:
        if not isinstance(loop.target, ast.Name) or not loop.body:
            return
        var = loop.target.id
        first = loop.body[0]
        if not (isinstance(first, ast.If) and not first.orelse and len(first.body) == 1
                and isinstance(first.body[0], ast.Continue)):
            return
        t = first.test
        counts_sub = None
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq) and _zero(t.comparators[0]):
            counts_sub = t.left
        elif isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not):
            counts_sub = t.operand
        if not (isinstance(counts_sub, ast.Subscript) and isinstance(counts_sub.value, ast.Name)
                and isinstance(counts_sub.slice, ast.Name) and counts_sub.slice.id == var):
            return
        counts = counts_sub.value.id
        src = self.where(first)
        values = _assignments(self.fn, counts)
        if len(values) != 1 or values[0] is None or not _is_attr_call(values[0], "tolist"):
            self.records.append((src, "", f"{counts} is not assigned once from .tolist()"))
            return
        bc = values[0].func.value
        if not (isinstance(bc, ast.Call) and _call_name(bc) == "bincount" and bc.args):
            self.records.append((src, "", f"{counts} is not bincount(ids, ...).tolist()"))
            return
        if _loads(self.fn, counts) != 1:
            self.records.append((src, "", f"{counts} is also used outside the skip"))
            return
        ids = bc.args[0] if isinstance(bc.func, ast.Attribute) and isinstance(bc.func.value, ast.Name) \
            and bc.func.value.id == "torch" or isinstance(bc.func, ast.Name) else bc.func.value
        ids = _strip_flatten(ids)
        body = loop.body[1:]
        sels = _selections(body)
        ok = bool(sels)
        for arg, _ in sels:
            if not (isinstance(arg, ast.Compare) and len(arg.ops) == 1 and isinstance(arg.ops[0], ast.Eq)
                    and _same(_strip_flatten(arg.left), ids) and isinstance(arg.comparators[0], ast.Name)
                    and arg.comparators[0].id == var):
                ok = False
        if not ok:
            self.records.append((src, "", f"the loop body's selections do not all compare the counted ids "
                                 f"with {var}"))
            return
        why = _writes_only_selected(body, set().union(*(names for _, names in sels)))
        if why:
            self.records.append((src, "", why))
            return
        loop.body = body
        # drop the now unused host read
        for node in ast.walk(self.fn):
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list):
                    stmts[:] = [s for s in stmts if not (isinstance(s, ast.Assign) and s.value is values[0])]
        self.records.append((src, "count_skip", ""))

    def run(self) -> None:
        def visit(stmts: list[ast.stmt]) -> None:
            i = 0
            while i < len(stmts):
                s = stmts[i]
                if isinstance(s, ast.For):
                    self.count_skip(s)
                    n = len(stmts)
                    if self.hit_loop(stmts, i):
                        i += 1 + len(stmts) - n
                        continue
                for field in ("body", "orelse", "finalbody"):
                    inner = getattr(s, field, None)
                    if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                        visit(inner)
                for h in getattr(s, "handlers", []) or []:
                    visit(h.body)
                i += 1
        visit(self.fn.body)


# ----------------------------------------------------------------------------- functions

def rewrite_function(fn: Callable) -> tuple[Optional[Callable], list[LoopRewrite]]:
    """The rewritten function (None when nothing was rewritten) and a record per loop looked at.

    Only plain functions without closures are rewritten (a ``super()`` call or a nested function's
    free variables keep the original); the new function shares the original's globals, defaults
    and source lines, so tracebacks and the report point at the user's file."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", repr(fn))
    if code is None:
        return None, []
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None, []
    text = textwrap.dedent("".join(lines))
    if "nonzero" not in text and "tolist" not in text:
        return None, []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None, []
    fdef = tree.body[0] if tree.body else None
    if not isinstance(fdef, ast.FunctionDef):
        return None, []
    ast.increment_lineno(tree, start - 1)
    filename = code.co_filename
    short = filename.replace("\\", "/").rsplit("/", 1)[-1]
    rw = _Rewriter(fdef, lambda node: f"{short}:{getattr(node, 'lineno', '?')} in {fdef.name}")
    rw.run()
    records = [LoopRewrite(name, s, form=f, reason=r) for s, f, r in rw.records]
    if not any(r.form for r in records):
        return None, records
    if fn.__closure__:
        for r in records:
            if r.form:
                r.reason, r.form = "the function has a closure (super() or free variables); left as it is", ""
        return None, records
    fdef.decorator_list = []
    ast.fix_missing_locations(tree)
    namespace: dict[str, Any] = {}
    exec(compile(tree, filename, "exec"), fn.__globals__, namespace)
    new = namespace[fdef.name]
    new.__defaults__ = fn.__defaults__
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    return new, records


def _eager_experts_forward(cls: type) -> Optional[Callable]:
    """transformers' experts classes (``use_experts_implementation``) keep their own eager forward
    behind a dispatching wrapper; that eager forward is what runs for ``"eager"``."""
    forward = cls.__dict__.get("forward")
    inner = getattr(forward, "__wrapped__", None)
    if inner is None or "experts_interface" not in getattr(forward, "__code__", types.CodeType).co_freevars:
        return None
    return inner


def _experts_dispatch(rewritten: Callable, original: Callable) -> Callable:
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(self, "config", None), "_experts_implementation", "eager") in ("eager", None):
            return rewritten(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    return forward


def _forwards(model: torch.nn.Module):
    """(module, class, the forward to rewrite, whether it is transformers' eager experts forward)."""
    for module in model.modules():
        cls = type(module)
        eager = _eager_experts_forward(cls)
        fn = eager if eager is not None else getattr(cls, "forward", None)
        if fn is None or fn in (torch.nn.Module.forward,):
            continue
        yield module, cls, fn, eager is not None


def survey(model: torch.nn.Module) -> list[LoopRewrite]:
    """What :func:`install` would find, without installing anything: a record per loop looked at
    (``form`` set where static dispatch would rewrite it). For the report's hints."""
    records: list[LoopRewrite] = []
    seen: set = set()
    for module, _cls, fn, _eager in _forwards(model):
        if "forward" in module.__dict__ or fn in seen:
            continue
        seen.add(fn)
        records.extend(rewrite_function(fn)[1])
    return records


def install(model: torch.nn.Module) -> list[LoopRewrite]:
    """Give each module of ``model`` whose forward holds a rewritable loop the rewritten forward
    (an instance attribute; ``uninstall`` removes it). Returns every loop looked at."""
    records: list[LoopRewrite] = []
    cache: dict[Any, tuple[Optional[Callable], list[LoopRewrite]]] = {}
    for module, cls, fn, eager in _forwards(model):
        if _ATTR in module.__dict__ or "forward" in module.__dict__:
            continue  # already rewritten, or a forward the user (or another wrapper) set on the instance
        if fn not in cache:
            new, recs = rewrite_function(fn)
            if new is not None and eager:
                new = _experts_dispatch(new, cls.forward)
            cache[fn] = (new, recs)
            records.extend(recs)
        new, _ = cache[fn]
        if new is not None:
            module.__dict__["forward"] = types.MethodType(new, module)
            module.__dict__[_ATTR] = True
    for r in records:
        if r.form:
            log.info("cgbackend: %s loop at %s rewritten to a fixed-length loop", r.form, r.source)
        else:
            log.debug("cgbackend: loop at %s left as it is: %s", r.source, r.reason)
    return records


def installed(module: torch.nn.Module) -> bool:
    return module.__dict__.get(_ATTR, False)


def uninstall(model: torch.nn.Module) -> None:
    for module in model.modules():
        if module.__dict__.pop(_ATTR, False):
            module.__dict__.pop("forward", None)
