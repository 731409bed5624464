"""Matching: which code is a dispatch unit, with the proof that rewriting it is safe.

Each matcher looks at one node (a unit's sink) and returns a :class:`_Plan` (the unit's pieces and a
masked-dense builder) or None; a recognized unit that cannot be rewritten raises ``_Skip`` with the
reason. Where-loop units also carry a :class:`WhereUnit` so a layer of them can take the grouped
form (grouped.py)."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value, plain_name, sizes_equal, source_location, storage_ids
from ..passes.call_args import argument, call_of
from ..passes.effects import mutated_args
from ..passes.rowdep import NotRowwise, propagate_rows
from .graph_builder import _Builder, _ancestors, _descendants, _is, _is_getitem, _shape, _strip_casts, _strip_type, _CASTS
from .masked_dense import _Weight, _bool_mask, _combine, _combine_weights, _dense_weight, routed_rows
from .records import _Skip

def _selection(node: Any) -> Optional[torch.fx.Node]:
    """The ``where(mask)`` / ``nonzero(mask, as_tuple=True)`` node a coordinate comes from."""
    if not _is_getitem(node):
        return None
    src = node.args[0]
    if _is(src, "where") and len(src.args) == 1 and not src.kwargs:
        return src
    if _is(src, "nonzero") and argument(src, "as_tuple") is True:
        return src
    return None



# ----------------------------------------------------------------------------- unit pieces

@dataclasses.dataclass
class _Rows:
    """A row computation: ``out`` computed from ``gathers`` (gather node -> (gathered tensor, the
    number of leading dimensions before its rows: 1 for ``x[None, idx]``))."""
    out: torch.fx.Node
    gathers: dict[torch.fx.Node, tuple[torch.fx.Node, int]]
    body: list[torch.fx.Node]

    def build(self, b: _Builder, rows: torch.fx.Node) -> torch.fx.Node:
        """The computation on every token's row, each token reading the row ``rows[token]`` of the
        gathered tensors (masked_dense.routed_rows: its own row where the expert receives it)."""
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for g, (src, lead) in self.gathers.items():
            dense = b.fn(torch.index_select, src, 0, rows)
            env[g] = b.fn(operator.getitem, dense, (None,) * lead) if lead else dense
        for node in self.body:
            b.copy(node, env)
        return env[self.out]

    def inputs(self) -> list[torch.fx.Node]:
        """The nodes the rows are computed from: the gathered tensors and the body's other inputs."""
        inside = set(self.body) | set(self.gathers)
        out = [src for src, _ in self.gathers.values()]
        out += [a for n in self.body for a in n.all_input_nodes if a not in inside]
        return list(dict.fromkeys(out))


def read_while_written(reads: list[torch.fx.Node], start: torch.fx.Node,
                       stop: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node]]:
    """(read, writer): a node of ``reads`` whose storage a node from ``start`` up to (not
    including) ``stop`` writes in place; None when there is none. A form that computes the rows
    elsewhere than where the loop gathered them reads other values there."""
    storages = {}
    for r in reads:
        for s in storage_ids(fake_value(r)):
            storages.setdefault(s, r)
    node = start
    while node is not stop and node.op != "output":
        for written in mutated_args(node):
            for s in storage_ids(fake_value(written)):
                if s in storages:
                    return storages[s], node
        node = node.next
    return None


def _row_computation(out: torch.fx.Node, gathers: dict, order: dict[torch.fx.Node, int],
                     forbidden: set[torch.fx.Node], what: str) -> _Rows:
    """Nodes between ``gathers`` (node -> (gathered tensor, row dim)) and ``out``, proven row-wise."""
    anc = _ancestors(out) | {out}
    reach = _descendants(list(gathers)) & anc
    body = sorted((n for n in reach if n not in gathers), key=order.__getitem__)
    for n in body:
        for a in n.all_input_nodes:
            if a in forbidden and a not in reach:
                raise _Skip(f"{what} uses {a.name}, which depends on the routing other than through the gather")
    try:
        dims = propagate_rows(body, {g: d for g, (_, d) in gathers.items()})
    except NotRowwise as exc:
        src, _ = source_location(exc.node)
        raise _Skip(f"{what} is not proven row-independent: {exc}" + (f" at {src}" if src else ""))
    if dims.get(out) != 0:
        raise _Skip(f"{what} does not keep rows in dimension 0")
    return _Rows(out=out, gathers=dict(gathers), body=body)


def _gather_of(node: torch.fx.Node, index: torch.fx.Node) -> Optional[tuple[torch.fx.Node, int]]:
    """(source, row dim) if ``node`` gathers rows of a tensor by ``index`` (``x[idx]``,
    ``x[None, idx]``, ``index_select(x, 0, idx)``)."""
    if _is_getitem(node) and node.args[1] is index:
        return node.args[0], 0
    if _is_getitem(node) and isinstance(node.args[1], tuple):
        key = node.args[1]
        if key.count(index) == 1 and all(k is None for k in key if k is not index) \
                and key.index(index) == len(key) - 1:
            return node.args[0], len(key) - 1
    if _selects_rows(node, index):
        return next(iter(call_of(node).args.values())), 0
    return None


def _selects_rows(node: Any, index: torch.fx.Node) -> bool:
    """``node`` is ``index_select(x, 0, index)`` (any spelling)."""
    call = call_of(node) if _is(node, "index_select") else None
    return call is not None and call.get("dim") == 0 and call.get("index") is index


def _weight_of(node: torch.fx.Node, coords: dict[torch.fx.Node, int], forbidden: set) -> Optional[_Weight]:
    post: list[torch.fx.Node] = []
    while _is(node, "unsqueeze", *_CASTS):
        if any(isinstance(a, torch.fx.Node) for a in node.args[1:]):
            return None  # a cast to another tensor's type
        post.insert(0, node)
        node = node.args[0]
    if not _is_getitem(node):
        return None
    table, key = node.args[0], node.args[1]
    if table in forbidden:
        return None
    key = key if isinstance(key, tuple) else (key,)
    axes, nones, seen_none = [], 0, False
    for k in key:
        if k is None:
            nones += 1
            seen_none = True
        elif isinstance(k, torch.fx.Node) and k in coords and not seen_none:
            axes.append(coords[k])
        else:
            return None
    if not axes or len(set(axes)) != len(axes):
        return None
    if nones and len(_shape(table)) != len(axes):
        return None
    return _Weight(table, axes, nones, post)


# ----------------------------------------------------------------------------- matchers

@dataclasses.dataclass
class _Plan:
    pattern: str
    sink: torch.fx.Node
    roots: list[torch.fx.Node]
    experts: int
    tokens: Any
    build: Callable[[_Builder, dict], torch.fx.Node]
    unit: Optional["WhereUnit"] = None
    """Where-loop units: the pieces a layer of them needs for the grouped form (grouped.py)."""


@dataclasses.dataclass
class WhereUnit:
    """One expert's where-loop unit, as the grouped form reads it."""
    sink: torch.fx.Node
    acc: torch.fx.Node
    in_place: bool
    index: torch.fx.Node
    """the selected token coordinate the gathers index with"""
    mask: torch.fx.Node
    grid: tuple
    tok_axis: int
    rows: _Rows
    sources: dict[torch.fx.Node, tuple[torch.fx.Node, int]]
    """gather node -> (gathered tensor, row dimension)"""
    weight: Optional[_Weight]
    rows_first: bool
    casts: list[torch.fx.Node]
    value_dtype: torch.dtype


def _sink_parts(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node, bool]]:
    """(acc, index, value, in_place) of ``acc.index_add_(0, index, value)``, ``acc.index_add(...)``
    or ``acc[index] += value``."""
    if _is(node, "index_add_", "index_add"):
        call = call_of(node)
        if call is None or call.get("dim") != 0 or call.get("alpha", 1) != 1:
            return None
        return (next(iter(call.args.values())), call.get("index"), call.get("source"),
                plain_name(node) == "index_add_")
    if node.op == "call_function" and node.target is operator.setitem and len(node.args) == 3:
        acc, index, value = node.args
        if _is(value, "iadd", "add") and _is_getitem(value.args[0]) and value.args[0].args == (acc, index):
            return acc, index, value.args[1], True
    return None


def _match_where(node: torch.fx.Node, order: dict) -> Optional[_Plan]:
    parts = _sink_parts(node)
    if parts is None:
        return None
    acc, index, value, in_place = parts
    setitem = node.target is operator.setitem
    sel = _selection(index)
    if sel is None:
        return None
    mask = sel.args[0]
    grid = _shape(mask)
    if len(grid) not in (1, 2):
        raise _Skip(f"the routing mask has {len(grid)} dimensions (1 or 2 are rewritten)")
    coords = {u: u.args[1] for u in sel.users if _is_getitem(u) and isinstance(u.args[1], int)}
    tok_axis = coords[index]
    T = grid[tok_axis]
    if not sizes_equal(_shape(acc)[0], T):
        raise _Skip("the accumulator's rows are not the mask's token dimension")
    if setitem and len(grid) == 2 and not _one_per_token(mask, tok_axis):
        raise _Skip("acc[idx] += v keeps one of repeated indices; the mask is not proven to pick each "
                    "token at most once")
    forbidden = _descendants([sel])
    base, casts = _strip_casts(value)
    rows_node, weight, rows_first = base, None, True
    if _is(base, "mul") and len(base.args) == 2:
        a, bb = base.args
        for cand, other, first in ((bb, a, True), (a, bb, False)):
            if isinstance(cand, torch.fx.Node):
                w = _weight_of(cand, coords, forbidden)
                if w is not None:
                    rows_node, weight, rows_first = other, w, first
                    break
    gathers, sources = {}, {}
    for n in _descendants([index]) & (_ancestors(rows_node) | {rows_node}):
        g = _gather_of(n, index)
        if g is not None:
            src, d = g
            sources[n] = (src, d)
            if src in forbidden:
                raise _Skip("the gathered tensor depends on the routing")
            if not sizes_equal(_shape(src)[0], T):
                raise _Skip(f"the gathered tensor {src.name} has other rows than the mask's tokens")
            gathers[n] = (src, d)
    if not gathers:
        raise _Skip("no gather of rows by the selected token index feeds the accumulated value")
    rows = _row_computation(rows_node, gathers, order, forbidden, "the expert computation")
    reads = rows.inputs() + ([weight.table] if weight is not None else [])
    clash = read_while_written(reads, min(gathers, key=order.__getitem__), node)
    if clash is not None:
        raise _Skip(f"{clash[1].name} writes {clash[0].name} in place after the expert gathered its rows "
                    "and before it accumulates them")

    # Sibling units (mask = base[e] for the experts e of one layer) share one computation of the
    # combine weights of all experts: a few kernels per layer instead of a few per expert.
    if _is_getitem(mask) and isinstance(mask.args[1], int) and len(_shape(mask.args[0])) == len(grid) + 1:
        base, expert = mask.args[0], mask.args[1]
    else:
        base, expert = mask, None
    key = ("where_loop", base, tok_axis, None if weight is None else
           (weight.table, tuple(weight.axes), weight.nones, tuple(weight.post)), fake_value(rows_node).dtype)

    def build(b: _Builder, cache: dict) -> torch.fx.Node:
        if key not in cache:
            masks = _bool_mask(b, base)
            if expert is None:
                masks = b.method("unsqueeze", masks, 0)
            if len(grid) == 2 and tok_axis == 1:
                masks = b.method("transpose", masks, 1, 2)
            dense_w = _dense_weight(b, weight, len(grid), tok_axis) if weight is not None else None
            c_all, routed_all = _combine_weights(b, masks, dense_w, len(grid), fake_value(rows_node).dtype)
            cache[key] = c_all, routed_all, routed_rows(b, routed_all)
        c_all, routed_all, rows_all = cache[key]
        e = 0 if expert is None else expert
        c = b.fn(operator.getitem, c_all, e) if c_all is not None else None
        routed = b.fn(operator.getitem, routed_all, e)
        dense = rows.build(b, b.fn(operator.getitem, rows_all, e))
        return _combine(b, dense, c, routed, rows_first, casts, acc, in_place)

    unit = WhereUnit(node, acc, in_place, index, mask, tuple(grid), tok_axis, rows, sources, weight, rows_first, casts,
                     fake_value(rows_node).dtype)
    return _Plan("where_loop", node, [sel], 1, T, build, unit)


def _topk_indices(node: Any) -> bool:
    """``topk(...)[1]`` / ``.indices``, through views and integer casts."""
    while _is(node, "view", "reshape", "long", "int", "to", "contiguous", "clone"):
        node = node.args[0]
    if _is_getitem(node) and node.args[1] == 1 and _is(node.args[0], "topk"):
        return True
    return (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is getattr
            and node.args[1] == "indices" and _is(node.args[0], "topk"))


def _one_per_token(mask: torch.fx.Node, tok_axis: int) -> bool:
    """Each token (row of the mask along tok_axis) selected at most once: the mask compares
    distinct top-k indices with one expert id, directly or through a one-hot."""
    if _is(mask, "eq") and isinstance(mask.args[1], int) and _topk_indices(mask.args[0]):
        return tok_axis == 0
    if _is_getitem(mask) and isinstance(mask.args[1], int):
        permuted = _strip_type(mask.args[0])
        one_hot = permuted.args[0] if _is(permuted, "permute") else None
        if _is(one_hot, "one_hot") and _topk_indices(one_hot.args[0]):
            perm = argument(permuted, "dims")
            # one_hot(idx [T, K]) -> [T, K, E]; permuted, indexed by expert: the remaining two axes
            return perm is not None and list(perm)[1:][tok_axis] == 0
    return False


def _index_source(node: Any) -> Optional[tuple[torch.fx.Node, int]]:
    """(order, k) of ``order // k`` with order from argsort / sort indices."""
    if _is(node, "floordiv", "floor_divide") and isinstance(node.args[1], int):
        return node.args[0], node.args[1]
    if _is(node, "div") and isinstance(node.args[1], int) and argument(node, "rounding_mode") == "floor":
        return node.args[0], node.args[1]
    return None


def _flat_source(node: Any) -> Optional[torch.fx.Node]:
    if _is(node, "reshape", "view", "flatten") and isinstance(node.args[0], torch.fx.Node):
        if len(_shape(node)) == 1 and len(_shape(node.args[0])) == 2:
            return node.args[0]
    return None


def _match_sorted(node: torch.fx.Node, order_of: dict) -> Optional[_Plan]:
    parts = _sink_parts(node)
    if parts is None or node.target is operator.setitem:
        return None
    acc, index, value, in_place = parts
    src = _index_source(index)
    if src is None:
        return None
    order, k = src
    if _is(order, "argsort"):
        ids_flat = order.args[0]
    elif _is_getitem(order) and order.args[1] == 1 and _is(order.args[0], "sort"):
        ids_flat = order.args[0].args[0]
    else:
        return None
    ids = _flat_source(ids_flat)
    if ids is None:
        return None
    T, K = _shape(ids)
    if not sizes_equal(K, k):
        raise _Skip(f"tokens are recovered as order // {k} but each token has {K} routed slots")
    if not sizes_equal(_shape(acc)[0], T):
        raise _Skip("the accumulator's rows are not the routed tokens")
    base, casts = _strip_casts(value)
    if not (_is(base, "mul") and len(base.args) == 2):
        raise _Skip("the accumulated value is not expert outputs times router weights")
    cat, wnode = base.args
    rows_first = True
    if not _is(cat, "cat", "concat"):
        cat, wnode, rows_first = wnode, cat, False
    if not _is(cat, "cat", "concat") or argument(cat, "dim") != 0:
        raise _Skip("the expert outputs are not concatenated along the rows")
    outs = list(cat.args[0])
    # the weight: w.reshape(-1)[order] (+ unsqueeze / casts)
    w = _weight_of(wnode, {order: 0}, set())
    if w is None or w.axes != [0] or _flat_source(w.table) is None:
        raise _Skip("the router weights are not gathered as w.flatten()[order]")
    table2d = _flat_source(w.table)
    # pieces: split(x[order // k], sizes)
    splits = [u for g in index.users
              if (_is_getitem(g) and g.args[1] is index) or _selects_rows(g, index)
              for u in g.users if _is(u, "split", "split_with_sizes") and argument(u, "dim") == 0]
    if len(splits) != 1:
        raise _Skip("the tokens gathered by order // k are not split once into expert groups")
    split = splits[0]
    grouped, sizes = list(call_of(split).args.values())[:2]  # the tensor, then its sizes
    pieces = {u.args[1]: u for u in split.users if _is_getitem(u) and isinstance(u.args[1], int)}
    pieces_by_out = []
    for i, out in enumerate(outs):
        anc = _ancestors(out) | {out}
        used = [j for j, p in pieces.items() if p in anc]
        if used != [i]:
            raise _Skip(f"expert output {i} does not come from split piece {i} alone")
        pieces_by_out.append(pieces[i])
    h = grouped.args[0]
    if not sizes_equal(_shape(h)[0], T):
        raise _Skip("the gathered tensor's rows are not the routed tokens")
    E = len(outs)
    counts = _counts_node(sizes, E)
    if counts is None:
        raise _Skip("the split sizes are not bincount(ids, minlength=E) read back per expert")
    if _flat_source(counts.args[0]) is not ids and counts.args[0] is not ids_flat:
        raise _Skip("the split sizes count other ids than the ones sorted")
    if not _ids_below(ids, E):
        raise _Skip(f"expert ids are not proven to lie in [0, {E}) (top-k over {E} scores)")
    forbidden = _descendants([order, counts])
    per_expert = []
    for i, out in enumerate(outs):
        piece = pieces_by_out[i]
        per_expert.append(_row_computation(out, {piece: (h, 0)}, order_of, forbidden, f"expert {i}"))
    wpost = _Weight(table2d, [0, 1], 0, w.post)

    def build(b: _Builder, cache: dict) -> torch.fx.Node:
        dense_w = _dense_weight(b, wpost, 2, 0)
        experts = b.fn(torch.arange, E, device=fake_value(ids).device)
        masks = b.fn(operator.eq, b.method("unsqueeze", ids, 0), b.method("view", experts, E, 1, 1))
        c_all, routed_all = _combine_weights(b, masks, dense_w, 2, fake_value(outs[0]).dtype)
        rows_all = routed_rows(b, routed_all)
        result = acc
        for e, rows in enumerate(per_expert):
            c, routed = b.fn(operator.getitem, c_all, e), b.fn(operator.getitem, routed_all, e)
            dense = rows.build(b, b.fn(operator.getitem, rows_all, e))
            result = _combine(b, dense, c, routed, rows_first, casts, result, in_place or e > 0)
        return result

    return _Plan("sorted_split", node, [order, counts], E, T, build)


def _counts_node(sizes: Any, E: int) -> Optional[torch.fx.Node]:
    if not isinstance(sizes, (list, tuple)) or len(sizes) != E:
        return None
    counts = None
    for e, s in enumerate(sizes):
        if _is(s, "item") and _is_getitem(s.args[0]) and s.args[0].args[1] == e:
            c = s.args[0].args[0]
        elif _is_getitem(s) and s.args[1] == e and _is(s.args[0], "tolist"):
            c = s.args[0].args[0]
        else:
            return None
        if counts is None:
            counts = c
        elif c is not counts:
            return None
    if not _is(counts, "bincount") or argument(counts, "minlength", 0) != E:
        return None
    if argument(counts, "weights") is not None:
        return None
    return counts


def _ids_below(ids: torch.fx.Node, E: int) -> bool:
    if not _topk_indices(ids):
        return False
    topk = ids
    while not _is(topk, "topk"):
        topk = topk.args[0]
    scores = topk.args[0]
    dim = argument(topk, "dim")
    shape = _shape(scores)
    return dim in (-1, len(shape) - 1) and sizes_equal(shape[-1], E)


def _match_grouped_mm_fallback(node: torch.fx.Node, order: dict) -> Optional[_Plan]:
    target = node.target
    name = getattr(getattr(target, "overloadpacket", target), "_qualified_op_name", "")
    if node.op != "call_function" or name != "transformers::grouped_mm_fallback":
        return None
    names = ("input", "weight", "offs")
    if any(i >= len(node.args) and k not in node.kwargs for i, k in enumerate(names)):
        raise _Skip("grouped_mm_fallback called without input, weight and offs")
    inp, weight, offs = (node.args[i] if i < len(node.args) else node.kwargs[k] for i, k in enumerate(names))
    S, E, O = _shape(inp)[0], _shape(weight)[0], _shape(weight)[2]

    def build(b: _Builder, cache: dict) -> torch.fx.Node:
        off_dtype = fake_value(offs).dtype
        n = S if isinstance(S, int) else b.fn(torch.ops.aten.sym_size.int, inp, 0)
        pos = b.fn(torch.arange, n, dtype=off_dtype, device=fake_value(inp).device)
        group = b.fn(torch.searchsorted, offs, pos, right=True)
        valid = b.method("unsqueeze", b.fn(operator.lt, group, E), -1)
        clamped = b.method("clamp", group, max=E - 1)
        # [E, S, O]; bmm of an expanded input rather than a broadcasting matmul, whose fake-tensor
        # decomposition (torch 2.11) reads the sizes as ints: a marked-dynamic token count became a
        # constant and Dynamo refused the graph
        every = b.fn(torch.bmm, b.method("expand", b.method("unsqueeze", inp, 0), E, -1, -1), weight)
        index = b.method("expand", b.method("view", clamped, 1, -1, 1), 1, n, O)
        picked = b.method("squeeze", b.fn(torch.gather, every, 0, index), 0)
        return b.fn(torch.where, valid, picked, 0)

    return _Plan("grouped_mm_fallback", node, [], E, S, build)


_MATCHERS = (_match_where, _match_sorted, _match_grouped_mm_fallback)
_PATTERN_OF = {_match_where: "where_loop", _match_sorted: "sorted_split",
               _match_grouped_mm_fallback: "grouped_mm_fallback"}


# ----------------------------------------------------------------------------- driver

def _removable(plan: _Plan) -> set[torch.fx.Node]:
    """The nodes that die with the unit: the sink and everything that depends on its selection,
    which must not be used (or written through) by anything else."""
    closure = _descendants(plan.roots, stop=plan.sink)
    closure.add(plan.sink)
    for n in closure:
        if n.op == "output":
            raise _Skip(f"{n.name}: the routing result is an output of the graph")
        for user in n.users:
            if user not in closure and n is not plan.sink:
                raise _Skip(f"{n.name} (depends on the routing) is also used by {user.name}")
        for written in mutated_args(n):
            if written not in closure and n is not plan.sink:
                raise _Skip(f"{n.name} writes {written.name} in place")
    return closure


