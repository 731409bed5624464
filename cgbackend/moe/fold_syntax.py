"""The source side of folded expert loops (see fold.py): which loops may be folded, and the code
that folds them while Dynamo traces.

A loop ``for e in range(N)`` (as written, or as the hit_loop and count_skip rewrites leave it) is
folded when its body selects rows with ``torch.where`` / ``nonzero`` and uses ``e`` only

* to pick the expert module, ``self.<list>[e]`` (called, or bound to a name), one list per loop;
* to read a row of a parameter table, ``self.<table>[e]``;
* in its selections (``M[e]``, ``ids == e``);
* in leading ``if <test>: continue`` statements whose test reads only ``e``, ``self`` and
  constants (transformers' ``if expert_idx == self.num_experts: continue``), or the skip our own
  rewrites keep for eager runs,

and passes proof.body_reason (an iteration leaves nothing behind). It becomes::

    __cgb_fold_in_K = __cgb_fold.inputs(K, self.<list>) if __cgb_compiling() else None  # None unless
                                                  # this frame is traced with the fold on
    if __cgb_fold_in_K is not None:
        __cgb_fold_runs_K = [e for e in range(N) if not (<leading skip tests>)]
        __cgb_fold.begin(K)
        for e in __cgb_fold_runs_K[:1]:
            <body, with self.<table>[e] read through __cgb_fold.row and
             self.<list>[e] through __cgb_fold.expert>
        __cgb_fold.end(K, __cgb_fold_runs_K, __cgb_fold_in_K)
    else:
        <the loop>
"""

from __future__ import annotations

import ast
import copy
from typing import Optional

from .loop_proof import body_reason

__all__ = ["FOLD", "fold_loop"]

FOLD = "__cgb_fold"
"""The rewritten function's name for the fold module (a closure variable, like __cgb_compiling)."""


def _self_chain(node: ast.AST, self_name: str) -> bool:
    """``self.a`` / ``self.a.b``."""
    while isinstance(node, ast.Attribute):
        node = node.value
        if isinstance(node, ast.Name):
            return node.id == self_name
    return False


def _parents(body: list[ast.stmt]) -> dict[int, ast.AST]:
    out: dict[int, ast.AST] = {}
    for stmt in body:
        for node in ast.walk(stmt):
            for child in ast.iter_child_nodes(node):
                out[id(child)] = node
    return out


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _leading_skips(body: list[ast.stmt]) -> list[ast.If]:
    out = []
    for stmt in body:
        if isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Continue):
            out.append(stmt)
        else:
            break
    return out


def _eager_only_test(test: ast.AST, compiling: str) -> bool:
    """``not __cgb_compiling() and ...``: false while traced."""
    return (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And) and isinstance(test.values[0], ast.UnaryOp)
            and isinstance(test.values[0].op, ast.Not) and isinstance(test.values[0].operand, ast.Call)
            and _is_name(test.values[0].operand.func, compiling))


def fold_loop(fn: ast.FunctionDef, loop: ast.For, key: int, compiling: str,
              selections: list[tuple[ast.expr, set[str]]], proven: bool
              ) -> tuple[Optional[ast.stmt], str, tuple[str, ...]]:
    """(the folding statement, '', the expressions of the expert list ('' without one) and of the
    tables) or (None, why not, ()).
    ``selections``: the body's (argument, names bound); ``proven``: body_reason already passed."""
    if not (isinstance(loop.iter, ast.Call) and _is_name(loop.iter.func, "range") and len(loop.iter.args) == 1
            and not loop.iter.keywords and isinstance(loop.target, ast.Name)) or loop.orelse:
        return None, "the loop is not 'for e in range(n)'", ()
    var = loop.target.id
    self_name = fn.args.args[0].arg if fn.args.args else ""
    if not self_name:
        return None, "the function has no self argument", ()
    skips = _leading_skips(loop.body)
    sel_args = {id(n) for arg, _ in selections for n in ast.walk(arg)}
    skip_nodes = {id(n) for s in skips for n in ast.walk(s.test)}
    parents = _parents(loop.body)
    lists: set[str] = set()
    tables: list[ast.Subscript] = []
    for node in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
        if not (_is_name(node, var) and isinstance(node.ctx, ast.Load)):
            continue
        if id(node) in sel_args or id(node) in skip_nodes:
            continue
        parent = parents.get(id(node))
        if isinstance(parent, ast.Subscript) and parent.slice is node and _self_chain(parent.value, self_name):
            up = parents.get(id(parent))
            if isinstance(up, ast.Call) and up.func is parent or (
                    isinstance(up, ast.Assign) and up.value is parent and len(up.targets) == 1
                    and isinstance(up.targets[0], ast.Name)):
                lists.add(ast.unparse(parent.value))
            else:
                tables.append(parent)
            continue
        return None, f"the loop body uses {var} otherwise than to pick an expert or a row ({ast.unparse(parent or node)})", ()
    if len(lists) > 1:
        return None, f"the loop body picks experts from more than one list ({', '.join(sorted(lists))})", ()
    if not lists and not tables:
        return None, "the loop body picks no expert by its id", ()
    for s in skips:
        if _eager_only_test(s.test, compiling):
            continue
        names = {n.id for n in ast.walk(s.test) if isinstance(n, ast.Name)}
        if not names <= {var, self_name} or any(isinstance(n, ast.Call) for n in ast.walk(s.test)):
            return None, f"the loop skips experts on {ast.unparse(s.test)}, not on the expert id alone", ()
    if not proven:
        routing = {n.id for arg, _ in selections for n in ast.walk(arg) if isinstance(n, ast.Name)} - {var}
        why = body_reason(fn, loop, loop.body, var, set().union(*(names for _, names in selections)), routing)
        if why:
            return None, why, ()
    experts = next(iter(lists)) if lists else ""
    body = copy.deepcopy(loop.body)
    table_src = {ast.dump(t) for t in tables}
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        for field, value in ast.iter_fields(node):
            if isinstance(value, list):
                value[:] = [_folded_read(v, table_src, experts, var) for v in value]
            else:
                setattr(node, field, _folded_read(value, table_src, experts, var))
    fin, runs = f"__cgb_fold_in_{key}", f"__cgb_fold_runs_{key}"
    tests = [s.test for s in skips if not _eager_only_test(s.test, compiling)]
    cond = (ast.UnaryOp(op=ast.Not(), operand=tests[0] if len(tests) == 1 else ast.BoolOp(op=ast.Or(), values=tests))
            if tests else None)
    comp = ast.ListComp(elt=ast.Name(id=var, ctx=ast.Load()), generators=[ast.comprehension(
        target=ast.Name(id=var, ctx=ast.Store()), iter=copy.deepcopy(loop.iter), ifs=[cond] if cond else [],
        is_async=0)])
    one = ast.For(target=ast.Name(id=var, ctx=ast.Store()), iter=ast.Subscript(
        value=ast.Name(id=runs, ctx=ast.Load()), slice=ast.Slice(upper=ast.Constant(1)), ctx=ast.Load()),
        body=body, orelse=[])
    folded = [
        ast.Assign(targets=[ast.Name(id=runs, ctx=ast.Store())], value=comp),
        ast.Expr(value=_fold_call("begin", ast.Constant(key))),
        one,
        ast.Expr(value=_fold_call("end", ast.Constant(key), ast.Name(id=runs, ctx=ast.Load()),
                                  ast.Name(id=fin, ctx=ast.Load()))),
    ]
    expr = ast.parse(experts, mode="eval").body if experts else ast.Constant(None)
    stmt = ast.If(test=ast.Compare(left=ast.Name(id=fin, ctx=ast.Load()), ops=[ast.IsNot()],
                                   comparators=[ast.Constant(None)]), body=folded, orelse=[loop])
    # Asked only from a frame Dynamo traces: a frame it gives up on runs eagerly, and there the
    # helper, called from eager code, would be a frame of its own that Dynamo traces (and answers).
    setup = ast.Assign(targets=[ast.Name(id=fin, ctx=ast.Store())], value=ast.IfExp(
        test=ast.Call(func=ast.Name(id=compiling, ctx=ast.Load()), args=[], keywords=[]),
        body=_fold_call("inputs", ast.Constant(key), expr), orelse=ast.Constant(None)))
    block = ast.If(test=ast.Constant(True), body=[setup, stmt], orelse=[])
    for node in ast.walk(block):
        if node is not loop and not hasattr(node, "lineno") and isinstance(node, (ast.stmt, ast.expr)):
            ast.copy_location(node, loop)
    return block, "", (experts,) + tuple(sorted({ast.unparse(t.value) for t in tables}))


def _folded_read(node: object, table_src: set[str], experts: str, var: str) -> object:
    """In the traced iteration: a table row ``self.<table>[e]`` read through ``__cgb_fold.row``, the
    expert ``self.<list>[e]`` through ``__cgb_fold.expert`` (fold.expert says why); other nodes as
    they are."""
    if not isinstance(node, ast.Subscript):
        return node
    if ast.dump(node) in table_src:
        return _fold_call("row", node.value, node.slice)
    if experts and _is_name(node.slice, var) and ast.unparse(node.value) == experts:
        return _fold_call("expert", node.value, node.slice)
    return node


def _fold_call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Attribute(value=ast.Name(id=FOLD, ctx=ast.Load()), attr=name, ctx=ast.Load()),
                    args=list(args), keywords=[])
