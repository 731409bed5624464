"""What a dispatch loop's body may do for the loop rewrite (source_rewrite.py) to be sound.

Reads: the function's syntax tree, one loop of it and the names the body's selections bind.
Writes: nothing; each check returns None or the reason the loop stays as written.

The rewrite runs the body also for an expert the loop skipped, on its empty selection. That is the
loop as written exactly when such an iteration leaves nothing behind:

* every name the body binds (assignment, ``+=``, ``for``/``with`` targets, the loop variable) is a
  temporary: bound in the iteration before it is read, and read nowhere outside the body, so
  neither the next iteration nor the code after the loop sees an extra iteration's value;
* every write to an object that outlives the iteration is indexed by the selected tokens
  (``acc.index_add_(0, tok, v)``, ``acc[tok] += v``): with no token, no element is written.
  Container methods (``append``, ``update``, ...) and in-place tensor methods are allowed only on
  objects the body itself created; attribute writes, ``global``, ``nonlocal``, ``del``, ``return``,
  ``break``, ``raise``, ``assert``, ``yield`` and builtins with effects (``print``, ``next``, ...)
  are not;
* the routing the skip was decided on is the routing the body selects with: the names it is read
  from are not rebound or written between the count (or the hit test) and the loop, nor in the body.

Calls into other code (an expert module) are not looked into: the FX-level rewrite proves each
dispatch unit, and a unit it leaves dynamic keeps the skip (keep_skips.py).
"""

from __future__ import annotations

import ast
from typing import Iterable, Iterator, Optional

from ..passes.call_args import bind

__all__ = ["body_reason", "bound_names", "unchanged_between", "tensor_uses"]

_CONTAINER_WRITES = frozenset({
    "append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add",
    "discard", "sort", "reverse", "appendleft", "extendleft", "popleft", "put", "put_nowait", "write",
    "send", "__setitem__", "__delitem__", "__iadd__"})
"""Methods that change the object they are called on (lists, dicts, sets, deques, queues, files)."""

_INDEX_WRITES = {"index_add_", "index_copy_", "index_fill_", "scatter_", "scatter_add_", "scatter_reduce_"}
"""In-place tensor methods that write only where their ``index`` argument points."""

_EFFECT_BUILTINS = frozenset({"print", "setattr", "delattr", "exec", "eval", "open", "input", "next",
                              "globals", "locals", "vars", "__import__", "breakpoint"})

_FORBIDDEN = {ast.Global: "a global statement", ast.Nonlocal: "a nonlocal statement",
              ast.Delete: "a del statement", ast.Return: "a return statement",
              ast.Break: "a break statement", ast.Raise: "a raise statement",
              ast.Assert: "an assert statement", ast.Yield: "a yield", ast.YieldFrom: "a yield",
              ast.Await: "an await", ast.FunctionDef: "a function definition",
              ast.AsyncFunctionDef: "a function definition", ast.ClassDef: "a class definition",
              ast.Lambda: "a lambda", ast.Import: "an import", ast.ImportFrom: "an import"}

_SAME_ROWS = frozenset({"view", "reshape", "long", "int", "to", "flatten", "unsqueeze", "squeeze",
                        "contiguous"})
"""Tensor methods whose result is empty when their input is (the index of an index write)."""

_FRESH_CALLS = frozenset({"clone", "zeros", "ones", "empty", "full", "zeros_like", "ones_like",
                          "empty_like", "full_like", "new_zeros", "new_ones", "new_empty", "new_full",
                          "list", "dict", "set", "deque"})
"""Calls that return a new object (not a view or alias of an argument)."""


def _text(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


def _walk(stmts: Iterable[ast.AST]) -> Iterator[ast.AST]:
    for s in stmts:
        yield from ast.walk(s)


def _method(node: ast.AST) -> Optional[tuple[ast.expr, str]]:
    """(receiver, name) of a method call ``R.name(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value, node.func.attr
    return None


def _index_argument(call: ast.Call, receiver: ast.expr, name: str) -> Optional[ast.expr]:
    """The ``index`` argument of the method call ``receiver.name(...)``, bound by the method's
    signature (positional or keyword); None where the call does not bind."""
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    bound = bind(name, [receiver, *call.args], {k.arg: k.value for k in call.keywords}, method=True, typed=False)
    return None if bound is None else bound.get("index")


def _root(node: ast.AST) -> Optional[str]:
    """The name an expression starts from: ``out`` of ``out``, ``out.view(-1)`` or ``out[0]``."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return None


# ----------------------------------------------------------------------------- names

def _comprehension_targets(stmts: Iterable[ast.AST]) -> set[int]:
    """ids of the Name nodes bound by comprehensions (local to the comprehension)."""
    out: set[int] = set()
    for node in _walk(stmts):
        if isinstance(node, ast.comprehension):
            out.update(id(n) for n in ast.walk(node.target) if isinstance(n, ast.Name))
    return out


def bound_names(stmts: list[ast.stmt]) -> set[str]:
    """Every name the statements bind in the function's scope."""
    inner = _comprehension_targets(stmts)
    names = {n.id for n in _walk(stmts) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
             and id(n) not in inner}
    names |= {n.name for n in _walk(stmts) if isinstance(n, ast.ExceptHandler) and n.name}
    return names


def _stores(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}


class _Carried(Exception):
    """A name read in an iteration before the iteration binds it."""

    def __init__(self, name: str, where: ast.AST) -> None:
        super().__init__(name)
        self.name, self.where = name, where


def _check_reads(node: Optional[ast.AST], local: set[str], bound: set[str]) -> None:
    """Raise _Carried at a read in ``node`` of a name of ``local`` not in ``bound``."""
    if node is None:
        return
    inner = _comprehension_targets([node])
    shadowed = {n.id for n in ast.walk(node) if id(n) in inner}  # names of the comprehensions' own
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in local \
                and n.id not in bound and n.id not in shadowed:
            raise _Carried(n.id, node)


def _bind(target: ast.AST, bound: set[str]) -> set[str]:
    return bound | {n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _flow(stmts: list[ast.stmt], local: set[str], bound: set[str]) -> Optional[set[str]]:
    """The names certainly bound after ``stmts`` (None when they never fall through, ``continue``);
    raises _Carried at a read of a body name not yet bound in the iteration."""
    for s in stmts:
        if isinstance(s, ast.Continue):
            return None
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            _check_reads(s.value, local, bound)
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            for t in targets:
                if not isinstance(t, ast.Name):
                    _check_reads(t, local, bound)  # out[tok] = v reads out and tok
            if isinstance(s, ast.Assign) or s.value is not None:
                for t in targets:
                    bound = _bind(t, bound)
        elif isinstance(s, ast.AugAssign):
            _check_reads(s.value, local, bound)
            if isinstance(s.target, ast.Name) and s.target.id in local and s.target.id not in bound:
                raise _Carried(s.target.id, s)
            _check_reads(s.target if not isinstance(s.target, ast.Name) else None, local, bound)
        elif isinstance(s, ast.If):
            _check_reads(s.test, local, bound)
            a, b = _flow(s.body, local, bound), _flow(s.orelse, local, bound)
            if a is None and b is None:
                return None
            bound = b if a is None else a if b is None else a & b
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                _check_reads(item.context_expr, local, bound)
                if item.optional_vars is not None:
                    bound = _bind(item.optional_vars, bound)
            after = _flow(s.body, local, bound)
            if after is None:
                return None
            bound = after
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            _check_reads(s.iter, local, bound)
            _flow(s.body, local, _bind(s.target, bound))
            _flow(s.orelse, local, bound)
        elif isinstance(s, ast.While):
            _check_reads(s.test, local, bound)
            _flow(s.body, local, bound)
            _flow(s.orelse, local, bound)
        elif isinstance(s, ast.Try):
            _flow(s.body, local, bound)
            for h in s.handlers:
                _flow(h.body, local, bound | ({h.name} if h.name else set()))
            _flow(s.orelse, local, bound)
            _flow(s.finalbody, local, bound)
        else:
            _check_reads(s, local, bound)
        bound = bound | {n.target.id for n in ast.walk(s) if isinstance(n, ast.NamedExpr)}
    return bound


# ----------------------------------------------------------------------------- writes

def _empty_index(node: ast.AST, selected: set[str]) -> bool:
    """``node`` is empty whenever the selection is: a selected name, through reshapes and casts."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SAME_ROWS:
        node = node.func.value
    return isinstance(node, ast.Name) and node.id in selected


def _indexed_by_selection(key: ast.AST, selected: set[str]) -> bool:
    """A subscript key that selects no element when the selection is empty: a selected index,
    with slices, ``None``, ``...`` and integer constants beside it."""
    items = key.elts if isinstance(key, ast.Tuple) else [key]
    if not any(_empty_index(i, selected) for i in items):
        return False
    return all(_empty_index(i, selected) or isinstance(i, ast.Slice)
               or isinstance(i, ast.Constant) and (i.value is None or i.value is Ellipsis or type(i.value) is int)
               for i in items)


def _fresh(value: ast.AST) -> bool:
    """An expression whose value is a new object: a display, arithmetic, or a constructor call."""
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp, ast.BinOp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        return name in _FRESH_CALLS
    return False


def _created_here(stmts: list[ast.stmt], name: str) -> bool:
    """Every binding of ``name`` in the statements is a plain assignment of a new object."""
    values = []
    for node in _walk(stmts):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            values.append(node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.With, ast.NamedExpr)) \
                or isinstance(node, ast.Assign) and any(name in _stores(t) for t in node.targets):
            targets = [getattr(node, "target", None)] + [i.optional_vars for i in getattr(node, "items", [])] \
                + list(getattr(node, "targets", []))
            if any(t is not None and name in _stores(t) for t in targets):
                return False
    return bool(values) and all(_fresh(v) for v in values)


def _write_reason(node: ast.AST, body: list[ast.stmt], selected: set[str], routing: set[str]) -> Optional[str]:
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                    return f"assigns the attribute {_text(sub)}, which outlives the iteration"
                if isinstance(sub, ast.Subscript) and isinstance(sub.ctx, ast.Store):
                    if not _indexed_by_selection(sub.slice, selected):
                        return f"writes {_text(sub)}, not indexed by the selected tokens"
                    if _root(sub.value) in routing:
                        return f"writes {_text(sub)}, the routing its selections read"
        return None
    call = _method(node)
    if call is not None:
        receiver, name = call
        root = _root(receiver)
        if name in _CONTAINER_WRITES:
            if isinstance(receiver, ast.Name) and _created_here(body, receiver.id):
                return None
            return f"calls {_text(node)}, which changes an object from outside the loop body"
        if name.endswith("_") and not name.endswith("__") and not name.startswith("_"):
            index = _index_argument(node, receiver, name) if name in _INDEX_WRITES else None
            if root in routing:
                return f"calls {_text(node)}, which writes the routing its selections read"
            if index is not None and _empty_index(index, selected):
                return None
            if name == "index_put_" and node.args and isinstance(node.args[0], ast.Tuple) \
                    and all(_empty_index(i, selected) for i in node.args[0].elts):
                return None
            if isinstance(receiver, ast.Name) and _created_here(body, receiver.id):
                return None
            return f"calls {_text(node)} in place, not on rows of the selected tokens"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _EFFECT_BUILTINS:
        return f"calls {node.func.id}(), which has an effect outside the loop body"
    return None


# ----------------------------------------------------------------------------- public checks

def body_reason(fn: ast.FunctionDef, loop: ast.For, body: list[ast.stmt], var: str, selected: set[str],
                routing: set[str]) -> Optional[str]:
    """None when running ``body`` (the loop body as rewritten, without its skip) on an expert with no
    token leaves nothing behind (see the module docstring); else why not, naming the code.

    ``var`` is the loop variable, ``selected`` the names bound from the body's selections and
    ``routing`` the names the skip was decided on (the counted ids, the one-hot mask)."""
    for node in _walk(body):
        for kind, what in _FORBIDDEN.items():
            if isinstance(node, kind):
                return f"the loop body has {what}"
    for node in _walk(body):
        why = _write_reason(node, body, selected, routing)
        if why:
            return "the loop body " + why
    local = bound_names(body) | {var}
    for name in sorted(local & routing):
        return f"the loop body rebinds {name}, the routing its selections read"
    for name in sorted(selected):
        if sum(1 for n in _walk(body) if isinstance(n, ast.Name) and n.id == name
               and isinstance(n.ctx, ast.Store)) > 1:
            return f"the loop body rebinds {name}, an index its selection made"
    try:
        _flow(body, local, {var})
    except _Carried as exc:
        if isinstance(exc.where, ast.AugAssign):
            return (f"the loop body updates {exc.name} ({_text(exc.where)}), defined before the loop: an "
                    "expert without tokens would change it")
        return (f"the loop body reads {exc.name} before binding it in the iteration ({_text(exc.where)}): "
                "its value comes from before the loop or an earlier expert")
    for node in _reads_outside(fn, loop, local):
        return (f"{node.id}, bound in the loop body, is read outside it (line {node.lineno}): an expert "
                "without tokens would change its value there")
    return None


def _reads_outside(fn: ast.FunctionDef, loop: ast.For, names: set[str]) -> Iterator[ast.Name]:
    """Reads of ``names`` outside ``loop``'s body that may see a value the body bound: all of them,
    except reads inside another loop's body that binds the name itself before reading it (two
    dispatch loops of one function, each with its own temporaries)."""
    inside = {id(n) for n in _walk(loop.body)}
    own: list[tuple[set[int], set[str]]] = []
    for other in ast.walk(fn):
        if isinstance(other, (ast.For, ast.While)) and other is not loop \
                and id(loop) not in {id(n) for n in ast.walk(other)}:
            start = _bind(other.target, set()) if isinstance(other, ast.For) else set()
            fresh = set()
            for name in names:
                try:
                    _flow(other.body, {name}, start)
                    fresh.add(name)
                except _Carried:
                    pass
            own.append(({id(n) for n in _walk(other.body)}, fresh))
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in names \
                and id(node) not in inside and not any(id(node) in ids and node.id in fresh for ids, fresh in own):
            yield node


def tensor_uses(body: list[ast.stmt], var: str) -> list[str]:
    """Uses of ``var`` that need it to be a tensor: anything but an index (``M[var]``,
    ``x[a, var]``), a comparison operand, or ``int(var)``."""
    allowed: set[int] = set()
    for node in _walk(body):
        if isinstance(node, ast.Subscript):
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            allowed.update(id(i) for i in items if isinstance(i, ast.Name))
        elif isinstance(node, ast.Compare):
            allowed.update(id(i) for i in [node.left, *node.comparators] if isinstance(i, ast.Name))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int":
            allowed.update(id(a) for a in node.args if isinstance(a, ast.Name))
    uses = []
    parents = {id(c): p for p in _walk(body) for c in ast.iter_child_nodes(p)}
    for node in _walk(body):
        if isinstance(node, ast.Name) and node.id == var and isinstance(node.ctx, ast.Load) \
                and id(node) not in allowed:
            use: ast.AST = node
            while isinstance(parents.get(id(use)), ast.Attribute) or \
                    isinstance(parents.get(id(use)), ast.Call) and parents[id(use)].func is use:
                use = parents[id(use)]
            uses.append(_text(use if use is not node else parents.get(id(node), node)))
    return uses


def _statement_lists(node: ast.AST) -> Iterator[list[ast.stmt]]:
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(node, field, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            yield stmts
    for h in getattr(node, "handlers", []) or []:
        yield h.body


def _path(fn: ast.FunctionDef, target: ast.stmt) -> Optional[list[tuple[list[ast.stmt], int]]]:
    """(statement list, index) from the function's body down to ``target``."""
    def search(stmts: list[ast.stmt]) -> Optional[list]:
        for i, s in enumerate(stmts):
            if s is target:
                return [(stmts, i)]
            for inner in _statement_lists(s):
                found = search(inner)
                if found is not None:
                    return [(stmts, i)] + found
        return None
    return search(fn.body)


def _touches(stmts: Iterable[ast.AST], names: set[str], what: str) -> Optional[str]:
    for node in _walk(stmts):
        stored = _stores(node) & names if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For,
                                                             ast.With, ast.NamedExpr, ast.Delete)) else set()
        if stored:
            return f"{sorted(stored)[0]} is rebound between {what} and the loop ({_text(node)})"
        call = _method(node)
        if call is not None and call[1].endswith("_") and not call[1].endswith("__") and _root(call[0]) in names:
            return f"{_root(call[0])} is written in place between {what} and the loop ({_text(node)})"
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and _root(node.value) in names:
            return f"{_root(node.value)} is written between {what} and the loop ({_text(node)})"
    return None


def unchanged_between(fn: ast.FunctionDef, first: ast.stmt, loop: ast.stmt, names: set[str],
                      what: str) -> Optional[str]:
    """None when ``first`` runs right before ``loop`` on every path (earlier in the same block, or
    inside ``with`` blocks there) and nothing in between rebinds or writes ``names``: the loop then
    reads the very values ``first`` read. Else why not."""
    to_loop, to_first = _path(fn, loop), _path(fn, first)
    if to_loop is None or to_first is None:
        return f"{what} is not in the function's body"
    depth = len(to_loop) - 1
    block, at = to_loop[depth]
    if len(to_first) <= depth or any(a[0] is not b[0] or a[1] != b[1] for a, b in zip(to_first[:depth], to_loop)) \
            or to_first[depth][0] is not block:
        return f"{what} is not in the loop's block"
    start = to_first[depth][1]
    if start >= at:
        return f"{what} comes after the loop"
    between: list[ast.stmt] = list(block[start + 1:at])
    for stmts, i in to_first[depth:-1]:
        if not isinstance(stmts[i], (ast.With, ast.AsyncWith)):
            return f"{what} is inside a block that may not run before the loop"
    for stmts, i in to_first[depth + 1:]:
        between.extend(stmts[i + 1:])
    return _touches(between, names, what)
