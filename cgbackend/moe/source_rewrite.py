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
        for e in range(min(__cgb_cond.shape[0], len(T), ...) if __cgb_compiling() else __cgb_cond.shape[0]):
            if not __cgb_compiling() and not __cgb_cond[e]:
                continue
            ...                     # the body without its first statement
    else:
        (the original loop)

  When the body's first statement is ``e = e[0]`` (a tensor), the body may use ``e`` only where an
  int means the same: as an index or in a comparison (``e.item()`` leaves the loop as written).
  The traced loop runs over the ids that can select an expert: the mask's width (its classes; a
  mask built with more classes than experts, as DBRX's ``one_hot(ids, E + 1)``, has classes no
  expert answers to) bounded by the length of every table ``T`` the body indexes with ``e``.

``count_skip``::

    counts = torch.bincount(IDS..., minlength=E).tolist()
    for e in range(...):
        if counts[e] == 0:          # or `if not counts[e]:`
            continue
        ... torch.where(IDS == e) ...   # every selection in the body compares IDS with e

  ``counts`` used nowhere else, the count unweighted (with ``weights=`` a zero count is a zero
  sum, not the absence of ids: padding counted with weight 0 still selects its experts), ``IDS`` a
  local name that nothing rebinds or writes between the count and the loop (so the loop selects
  from the very ids that were counted). The call's arguments are bound by bincount's signature
  (positional or keyword). Rewritten to::

    if not __cgb_compiling():
        counts = torch.bincount(IDS..., minlength=E).tolist()
    for e in range(...):
        if not __cgb_compiling() and counts[e] == 0:
            continue
        ...

``__cgb_compiling`` is ``torch.compiler.is_compiling``: traced by Dynamo the skip and the host read
are gone and every expert runs; run eagerly (a frame Dynamo gives up on) the loop skips as written.

Either form is rewritten only when its body passes the checks of loop_proof.py: running it for an
expert without tokens leaves nothing behind (no name outlives the iteration, every write outside
the body is indexed by the selected tokens, the routing is not rebound). Experts with side effects
of their own on empty input (a call counter) are outside what the syntax sees; the FX-level pass
proves each dispatch unit, and keeps the skip for a unit it leaves dynamic (keep_skips.py). Anything
else is left as written, with the reason recorded.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import textwrap
from typing import Any, Callable, Optional

import torch

from . import fold as _fold
from .fold_syntax import FOLD, fold_loop
from .loop_proof import body_reason, bound_names, tensor_uses, unchanged_between
from .source_syntax import _call_name, _is_attr_call, _nonzero_arg, _zero, _hit_source, _names_in, _assignments, _nonnegative, _loads, _unpack_first, _selections, _bincount_args, _strip_flatten, _same, _LAYOUT

__all__ = ["LoopRewrite", "loop_records", "rewrite_function"]



@dataclasses.dataclass
class LoopRewrite:
    """One loop of one function: rewritten (``form``) or left alone (``reason``)."""
    function: str
    source: str
    form: str = ""
    reason: str = ""
    fold: str = ""
    """"folded" where, while traced, the loop runs one expert for all (fold.py); else why not."""
    fold_key: int = dataclasses.field(default=0, repr=False)
    fold_reads: tuple = dataclasses.field(default=(), repr=False)
    """What the folded loop reads by expert id: the expert list's expression ('' without one), then
    the parameter tables' (``self.experts``, ``self.w1``)."""
    filename: str = dataclasses.field(default="", repr=False)
    lines: tuple[int, int] = dataclasses.field(default=(0, 0), repr=False)
    """The loop's file and first and last line: where the graph's nodes of its body come from."""
    traced: Optional[bool] = dataclasses.field(default=None, repr=False)
    """Whether a graph Dynamo handed cgbackend has nodes from the loop's lines (loop_forwards.mark_traced):
    False where the model took another path (transformers' grouped_mm experts next to their eager
    loop); None before any graph was seen."""
    own_expert_params: bool = dataclasses.field(default=True, repr=False)
    """Whether the modules that run the loop hold each expert as a module of its own (a ModuleList of
    modules with parameters): eager then leaves an expert without tokens with ``.grad`` None. False
    where the experts' weights are stacked in one parameter, which gets a gradient either way."""

    def to_dict(self) -> dict[str, Any]:
        out = {"function": self.function, "source": self.source, "form": self.form, "reason": self.reason,
               "fold": _fold.REASONS.get(self.fold_key) or self.fold}
        if self.traced is not None:
            out["traced"] = self.traced
        return out

    def holds(self, filename: str, line: int) -> bool:
        """Whether ``filename:line`` lies in the loop."""
        return filename == self.filename and self.lines[0] <= line <= self.lines[1]


# ----------------------------------------------------------------------------- syntax helpers

_COND = "__cgb_hit_cond_{}"
_COMPILING = "__cgb_compiling"
"""The rewritten function's own ``torch.compiler.is_compiling`` (a closure variable): Dynamo reads
it as True and traces the loop over every expert; run eagerly (a frame Dynamo skips, a graph
break), the rewritten loop keeps the skip it was written with."""


def _hittable(width: ast.expr, body: list[ast.stmt], var: str, mask: str) -> ast.expr:
    """How many expert ids the traced loop runs: the mask's width (its classes: ``one_hot(ids,
    num_classes=E + 1)`` has a class no id reaches), bounded while traced by the length of every
    table the body indexes with the id (``self.experts[e]``, ``self.w1.view(shape)[e]``): an id
    past a table's end is no expert, eager would raise before it ran one. Run eagerly, the width
    as written."""
    rebound = bound_names(body) | {var}
    tables: dict[str, ast.expr] = {}
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Name) \
                and node.slice.id == var and _pure(node.value) and not _names_in(node.value) & rebound \
                and ast.unparse(node.value) != mask:
            tables.setdefault(ast.unparse(node.value), node.value)
    if not tables:
        return width
    bounded = _call("min", width, *(_call("len", t) for t in tables.values()))
    return ast.IfExp(test=_call(_COMPILING), body=bounded, orelse=copy.deepcopy(width))


def _pure(node: ast.expr) -> bool:
    """Reading ``node`` again has no effect: names, attributes, constant subscripts and layout
    methods (``view``, ``reshape``, ...) of them."""
    if isinstance(node, (ast.Name, ast.Constant)):
        return True
    if isinstance(node, ast.Attribute):
        return _pure(node.value)
    if isinstance(node, ast.Subscript):
        return _pure(node.value) and _pure(node.slice)
    if isinstance(node, ast.Tuple):
        return all(_pure(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _pure(node.operand)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _LAYOUT:
        return _pure(node.func.value) and all(_pure(a) for a in node.args) and not node.keywords
    return False


def _call(name: str, *args: ast.expr) -> ast.Call:
    return ast.Call(func=ast.Name(id=name, ctx=ast.Load()), args=list(args), keywords=[])


def _eager_only(test: ast.expr) -> ast.expr:
    """``not __cgb_compiling() and test``."""
    return ast.BoolOp(op=ast.And(), values=[ast.UnaryOp(op=ast.Not(), operand=_call(_COMPILING)), test])


class _Rewriter:
    def __init__(self, fn: ast.FunctionDef, where: Callable[[ast.AST], str]) -> None:
        self.fn = fn
        self.where = where
        self.records: list[tuple[str, ast.stmt, str, str]] = []  # (source, loop, form, reason)
        self.folds: dict[int, tuple[str, int, tuple]] = {}  # id(loop) -> ("folded" or why not, key, reads)
        self.counter = 0

    def note(self, at: ast.AST, loop: ast.stmt, form: str, reason: str = "") -> None:
        self.records.append((self.where(at), loop, form, reason))

    def fold(self, loop: ast.For, record: ast.stmt, proven: bool) -> Optional[ast.stmt]:
        """The statement that folds ``loop`` while traced (fold_syntax.py), or None; noted on
        ``record`` (the loop as written)."""
        key = _fold.new_key()
        stmt, why, reads = fold_loop(self.fn, loop, key, _COMPILING, _selections(loop.body), proven)
        self.folds[id(record)] = ("folded", key, reads) if stmt is not None else (why, 0, ())
        return stmt

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
                    self.note(loop, loop, "", f"{loop.iter.id} (the nonzero() result) is also used outside the loop")
                    return False
                cond = _nonzero_arg(values[0])
                assign = next(a for a in ast.walk(self.fn) if isinstance(a, ast.Assign) and a.value is values[0])
        if cond is None:
            return False
        hit = _hit_source(cond)
        if hit is None:
            self.note(loop, loop, "", "the loop iterates nonzero() of a condition that is not 'M.sum(...) > 0' "
                      "or 'M.any(...)'")
            return False
        m, needs_nonneg = hit
        if needs_nonneg and not _nonnegative(self.fn, m):
            self.note(loop, loop, "", f"{m} is not proven non-negative (a one-hot or boolean mask), so a zero sum "
                      "does not prove an empty selection")
            return False
        if not _unpack_first(loop.body, var):
            self.note(loop, loop, "", f"the loop body does not start with '{var} = {var}[0]' (or .item() / int()): "
                      "it uses the nonzero() row as a tensor")
            return False
        body = loop.body[1:]
        sels = _selections(body)
        expected = ast.Subscript(value=ast.Name(id=m, ctx=ast.Load()), slice=ast.Name(id=var, ctx=ast.Load()),
                                 ctx=ast.Load())
        if not sels or any(not _same(arg, expected) for arg, _ in sels):
            self.note(loop, loop, "", f"the loop body's selections do not all read {m}[{var}]")
            return False
        uses = tensor_uses(body, var) if isinstance(loop.body[0].value, ast.Subscript) else []
        if uses:
            self.note(loop, loop, "", f"the loop body uses {var} as a tensor ({uses[0]}), which the rewrite "
                      "would make a Python int")
            return False
        why = body_reason(self.fn, loop, body, var, set().union(*(names for _, names in sels)), {m})
        if why is None and assign is not None:
            why = unchanged_between(self.fn, assign, loop, {m}, "the hit test")
        if why:
            self.note(loop, loop, "", why)
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
        skip = ast.If(test=_eager_only(ast.UnaryOp(op=ast.Not(), operand=ast.Subscript(
            value=ast.Name(id=name, ctx=ast.Load()), slice=ast.Name(id=var, ctx=ast.Load()), ctx=ast.Load()))),
            body=[ast.Continue()], orelse=[])
        width = ast.Subscript(value=ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="shape",
                                                  ctx=ast.Load()), slice=ast.Constant(0), ctx=ast.Load())
        new_loop = ast.For(target=ast.Name(id=var, ctx=ast.Store()),
                           iter=_call("range", _hittable(width, body, var, m)), body=[skip] + body, orelse=[])
        old_iter = ast.Call(func=ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="nonzero",
                                               ctx=ast.Load()), args=[], keywords=[])
        old_loop = ast.For(target=loop.target, iter=old_iter, body=loop.body, orelse=[])
        test = ast.Compare(left=ast.Call(func=ast.Attribute(value=ast.Name(id=name, ctx=ast.Load()), attr="dim",
                                                            ctx=ast.Load()), args=[], keywords=[]),
                           ops=[ast.Eq()], comparators=[ast.Constant(1)])
        for node in [new_loop, skip, old_loop]:
            ast.copy_location(node, loop)
        folded = self.fold(new_loop, loop, proven=True)
        branch = ast.If(test=test, body=[folded or new_loop], orelse=[old_loop])
        for node in keep + [branch]:
            ast.copy_location(node, loop)
        parent[i:i + 1] = keep + [branch]
        self.note(loop, loop, "hit_loop")
        return True

    # -- count_skip
    def count_skip(self, loop: ast.For) -> bool:
        if not isinstance(loop.target, ast.Name) or not loop.body:
            return False
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
        values = _assignments(self.fn, counts)
        if len(values) != 1 or values[0] is None or not _is_attr_call(values[0], "tolist"):
            self.note(first, loop, "", f"{counts} is not assigned once from .tolist()")
            return
        bc = values[0].func.value
        bound = _bincount_args(bc)
        if bound is None:
            self.note(first, loop, "", f"{counts} is not bincount(ids, ...).tolist()")
            return
        if _loads(self.fn, counts) != 1:
            self.note(first, loop, "", f"{counts} is also used outside the skip")
            return
        weights = bound.get("weights")
        if weights is not None and not (isinstance(weights, ast.Constant) and weights.value is None):
            self.note(first, loop, "", f"{counts} counts weighted ids (weights={ast.unparse(weights)}): a zero "
                      "count does not prove that no id selects the expert")
            return
        ids = _strip_flatten(next(iter(bound.args.values())))
        if not isinstance(ids, ast.Name):
            self.note(first, loop, "", f"the counted ids ({ast.unparse(ids)}) are not a local name, so the loop is "
                      "not proven to select from the ids that were counted")
            return
        body = loop.body[1:]
        sels = _selections(body)
        ok = bool(sels)
        for arg, _ in sels:
            if not (isinstance(arg, ast.Compare) and len(arg.ops) == 1 and isinstance(arg.ops[0], ast.Eq)
                    and _same(_strip_flatten(arg.left), ids) and isinstance(arg.comparators[0], ast.Name)
                    and arg.comparators[0].id == var):
                ok = False
        if not ok:
            self.note(first, loop, "", f"the loop body's selections do not all compare the counted ids with {var}")
            return
        count = next(a for a in ast.walk(self.fn) if isinstance(a, ast.Assign) and a.value is values[0])
        why = (body_reason(self.fn, loop, body, var, set().union(*(names for _, names in sels)), {ids.id})
               or unchanged_between(self.fn, count, loop, {ids.id}, "the count"))
        if why:
            self.note(first, loop, "", why)
            return
        # Traced, the skip and the host read are gone; run eagerly, both stay.
        first.test = _eager_only(first.test)
        for node in ast.walk(self.fn):
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list) and count in stmts:
                    guarded = ast.If(test=ast.UnaryOp(op=ast.Not(), operand=_call(_COMPILING)), body=[count],
                                     orelse=[])
                    stmts[stmts.index(count)] = ast.copy_location(guarded, count)
        self.note(first, loop, "count_skip")
        return True

    def run(self) -> None:
        def visit(stmts: list[ast.stmt]) -> None:
            i = 0
            while i < len(stmts):
                s = stmts[i]
                if isinstance(s, ast.For):
                    counted = self.count_skip(s)
                    n = len(stmts)
                    if self.hit_loop(stmts, i):
                        i += 1 + len(stmts) - n
                        continue
                    plain = not counted and _selections(s.body) and isinstance(s.iter, ast.Call) \
                        and _call_name(s.iter) == "range"
                    folded = self.fold(s, s, proven=bool(counted)) if counted or plain else None
                    if plain and not any(loop is s for _, loop, _, _ in self.records):
                        self.note(s, s, "")  # a loop over range(E) as written: listed for its fold
                    if folded is not None:
                        stmts[i] = folded
                        i += 1
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

def _private_name(fdef: ast.FunctionDef) -> Optional[str]:
    """A ``__name`` the function uses: Python mangles it only inside its class, and the rewritten
    function is compiled outside it."""
    for node in ast.walk(fdef):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
        if name.startswith("__") and not name.endswith("__"):
            return name
    return None


def _closed_over(fdef: ast.FunctionDef) -> ast.Module:
    """``def __cgb_make(__cgb_compiling, __cgb_fold): <fdef>; return <name>``, at the function's own lines."""
    maker = ast.FunctionDef(
        name="__cgb_make", args=ast.arguments(posonlyargs=[], args=[ast.arg(arg=_COMPILING), ast.arg(arg=FOLD)],
                                              vararg=None,
                                              kwonlyargs=[], kw_defaults=[], kwarg=None, defaults=[]),
        body=[fdef, ast.Return(value=ast.Name(id=fdef.name, ctx=ast.Load()))], decorator_list=[], returns=None,
        type_comment=None)
    if "type_params" in ast.FunctionDef._fields:
        maker.type_params = []
    ast.copy_location(maker, fdef)
    return ast.Module(body=[maker], type_ignores=[])


def loop_records(fdef: ast.FunctionDef, filename: str, name: str) -> list[LoopRewrite]:
    """A record per dispatch loop of ``fdef`` (the function ``name`` of ``filename``, at its lines in
    the file): rewritten (``form``) or why not. Rewrites ``fdef`` in place."""
    short = filename.replace("\\", "/").rsplit("/", 1)[-1]
    rw = _Rewriter(fdef, lambda node: f"{short}:{getattr(node, 'lineno', '?')} in {fdef.name}")
    rw.run()
    records = [LoopRewrite(name, s, form=f, reason=r, filename=filename, lines=(loop.lineno, loop.end_lineno))
               for s, loop, f, r in rw.records]
    for rec, (_, loop, _, _) in zip(records, rw.records):
        rec.fold, rec.fold_key, rec.fold_reads = rw.folds.get(id(loop), ("", 0, ()))
    return records


def rewrite_function(fn: Callable, is_compiling: Callable[[], bool] = torch.compiler.is_compiling
                     ) -> tuple[Optional[Callable], list[LoopRewrite]]:
    """The rewritten function (None when nothing was rewritten) and a record per loop looked at.

    Only plain functions without closures are rewritten (a ``super()`` call or a nested function's
    free variables keep the original); the new function shares the original's globals, defaults
    and source lines, so tracebacks and the report point at the user's file. It drops a loop's
    skip only where ``is_compiling()`` is true (while Dynamo traces it); called eagerly it skips
    as written. Tests pass ``lambda: True`` to run the traced meaning eagerly."""
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", repr(fn))
    if code is None:
        return None, []
    try:
        lines, start = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None, []
    text = textwrap.dedent("".join(lines))
    if "nonzero" not in text and "tolist" not in text and "where(" not in text:
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
    private = _private_name(fdef)
    records = loop_records(fdef, filename, name)
    if not any(r.form or r.fold_key for r in records):
        return None, records
    refusal = ("the function has a closure (super() or free variables)" if fn.__closure__ else
               f"the function uses {private}, a name Python mangles only inside its class" if private else "")
    if refusal:
        for r in records:
            if r.form:
                r.reason, r.form = refusal + "; left as it is", ""
            if r.fold_key:
                r.fold, r.fold_key = refusal, 0
        return None, records
    fdef.decorator_list = []
    module = _closed_over(fdef)
    ast.fix_missing_locations(module)
    namespace: dict[str, Any] = {}
    exec(compile(module, filename, "exec"), fn.__globals__, namespace)
    new = namespace["__cgb_make"](is_compiling, _fold)
    new.__defaults__ = fn.__defaults__
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__doc__ = fn.__doc__
    return new, records
