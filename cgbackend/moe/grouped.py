"""The grouped form: a layer's experts as one grouped matrix product per expert weight.

A *layer* is the set of where-loop units (match.py) of one MoE layer: one unit per expert
``e = 0 .. n-1``, all selecting from the same routing ids (``one_hot(ids).permute(...)[e]`` or
``ids == e``), gathering the same tokens, weighting by the same router table and accumulating into
one tensor. Its rewrite, with no host sync and shapes fixed by the token count:

    flat ids (token-major, slots outside 0..n-1 -> n)    sort (stable) -> sorted ids, perm
    tokens = perm // k        offsets = cumsum(bincount(ids, n+1)[:n])   (on the device)
    rows = x[tokens]          the expert body once, each per-expert linear a grouped product
    value = rows * router_weight[perm]     (cast as the loop cast it)
    acc += (where(sorted id < n, value, 0) back in slot order).reshape(T, k, ...).sum(1)

Its cost follows the routed rows (T*k), not E/k times them. Each unit's body must be the same
computation with per-expert weights only as the weight (or bias) of ``linear`` / ``matmul``; those
weights are either one stacked parameter indexed by expert (transformers' experts: used as they
are) or one parameter per expert (a ModuleList: stacked with ``torch.stack`` on every call, a
copy whose bytes the cost model counts and the report shows).

The grouped product is ``torch._grouped_mm`` on CUDA for bf16 with 16-byte aligned rows; elsewhere
an equivalent: every row multiplied by its group's weight (a per-row weight gather and a batched
product), exact in float64 for the CPU tests. Rows past the last offset (slots routed to no expert
of the layer) are computed with some expert's weights and dropped by the final ``where``.

The small-batch form (``static_dispatch="small_batch"``) is this rewrite with each linear taken
per row instead of per group: row ``s`` times its own expert's weights, an elementwise product
summed over the input width, which Inductor makes one reduction kernel reading the weights where
they lie. In decode each expert sees a row or two, where a grouped product wastes its tiles; the
cost is one expert's weights per row, so it pays only while rows are few against the experts.
Rows routed to no expert still read expert n-1's weights (their result is dropped).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value, plain_name, sizes_equal
from ..passes.call_args import argument
from .form_choice import choose_layer_form, current_device_name
from .graph_builder import _Builder, _is, _is_getitem, _shape, _strip_type
from .expert_layout import consecutive, stacked_view
from ..config.dispatch_mode import DispatchMode
from .masked_dense import _dense_weight
from .match import _Plan, WhereUnit, _removable, read_while_written
from .records import _Skip

__all__ = ["Layer", "find_layers", "build_grouped", "grouped_mm_supported", "layer_form", "layer_is_native",
           "products_text"]


@dataclasses.dataclass
class _Linear:
    """A body node with per-expert weights: ``linear(h, W_e[, b_e])`` or ``matmul(h, W_e)``."""
    node: torch.fx.Node
    kind: str                          # "linear" | "matmul"
    weights: list[torch.fx.Node]       # per expert
    biases: Optional[list[torch.fx.Node]]


@dataclasses.dataclass
class Layer:
    plans: list[_Plan]
    ids: torch.fx.Node
    perm: tuple                        # grid axes of ids (ids.permute(perm) is laid out like the mask)
    k: int
    tokens: Any
    linears: list[_Linear]
    flops_per_row: int                 # multiply-adds x2 of the expert body per routed row
    stack_bytes: int                   # bytes torch.stack copies per call (per-module experts)
    gathers: dict[torch.fx.Node, torch.fx.Node]  # unit-0 gather node -> gathered tensor
    index: torch.fx.Node                         # unit 0's selected token coordinate
    n_experts: int = 0                           # a folded loop's experts (fold_graph.py): one plan for all

    @property
    def experts(self) -> int:
        return self.n_experts or len(self.plans)

    @property
    def units(self) -> list[WhereUnit]:
        return [p.unit for p in self.plans]


# ----------------------------------------------------------------------------- routing ids

def _ints(args: Any) -> Optional[tuple]:
    if len(args) == 1 and isinstance(args[0], (list, tuple)):
        args = args[0]
    return tuple(args) if all(isinstance(a, int) for a in args) else None


def _routing(unit: WhereUnit) -> Optional[tuple[torch.fx.Node, tuple, int]]:
    """(ids, perm, expert) when the unit's mask is ``one_hot(ids, C).permute(p)[e]`` or ``ids == e``."""
    mask = unit.mask
    if _is(mask, "eq") and len(mask.args) == 2 and isinstance(mask.args[1], int) \
            and isinstance(mask.args[0], torch.fx.Node):
        ids = mask.args[0]
        return ids, tuple(range(len(_shape(ids)))), mask.args[1]
    if _is_getitem(mask) and isinstance(mask.args[1], int):
        base, e = _strip_type(mask.args[0]), mask.args[1]
        if _is(base, "permute") and isinstance(base.args[0], torch.fx.Node):
            p = _ints(tuple(argument(base, "dims") or ()))
            oh = base.args[0]
            if p and _is(oh, "one_hot") and isinstance(oh.args[0], torch.fx.Node):
                ids = oh.args[0]
                nd = len(_shape(ids))
                if len(p) == nd + 1 and p[0] == nd:
                    return ids, tuple(p[1:]), e
    return None


# ----------------------------------------------------------------------------- body correspondence

def _leaf_stack(leaves: list[torch.fx.Node]) -> Optional[tuple[str, Any]]:
    """("indexed", P) when leaf e is ``P[e]``; ("params", leaves) when each is a graph input of one
    shape (a parameter of its own); None otherwise."""
    if all(_is_getitem(l) and l.args[1] == e and l.args[0] is leaves[0].args[0] for e, l in enumerate(leaves)):
        return "indexed", leaves[0].args[0]
    shapes = {tuple(_shape(l)) for l in leaves}
    if len(shapes) == 1 and all(l.op in ("placeholder", "get_attr") for l in leaves):
        return "params", leaves
    return None


def _correspond(units: list[WhereUnit]) -> list[_Linear]:
    """Check that every unit's body is unit 0's with other per-expert weights; return the linears."""
    u0 = units[0]
    b0 = u0.rows.body
    per_node: dict[torch.fx.Node, dict[int, list[torch.fx.Node]]] = {}
    for ue in units[1:]:
        if len(ue.rows.body) != len(b0):
            raise _Skip("the experts' computations differ (not one body with per-expert weights)")
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for g0, (src0, d0) in u0.sources.items():
            match = [g for g, (src, d) in ue.sources.items() if src is src0 and d == d0 and g.target == g0.target]
            if len(match) != 1:
                raise _Skip("the experts gather different tensors")
            env[g0] = match[0]
        for a, b in zip(b0, ue.rows.body):
            if a.op != b.op or a.target != b.target or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
                raise _Skip(f"the experts' computations differ at {a.name} / {b.name}")
            pairs = list(zip(a.args, b.args)) + [(a.kwargs[k], b.kwargs[k]) for k in a.kwargs]
            for pos, (x, y) in enumerate(pairs):
                if isinstance(x, torch.fx.Node) and isinstance(y, torch.fx.Node):
                    if x in env:
                        if env[x] is not y:
                            raise _Skip(f"the experts' computations differ at {a.name}")
                    elif x is not y:
                        per_node.setdefault(a, {}).setdefault(pos, [x]).append(y)
                elif isinstance(x, torch.fx.Node) or isinstance(y, torch.fx.Node) or x != y:
                    raise _Skip(f"the experts' computations differ at {a.name} ({x!r} / {y!r})")
            env[a] = b
    linears = []
    for node, positions in per_node.items():
        name = plain_name(node)
        kind = "linear" if name == "linear" else "matmul" if name in ("matmul", "mm") else None
        allowed = {1, 2} if kind == "linear" else {1} if kind == "matmul" else set()
        if not set(positions) <= allowed or 1 not in positions or node.kwargs:
            raise _Skip(f"a per-expert weight is used by {name} ({node.name}), not as the weight of a "
                        "linear layer or matrix product")
        for pos, leaves in positions.items():
            if _leaf_stack(leaves) is None:
                raise _Skip(f"the per-expert weights of {node.name} are neither one parameter indexed by "
                            "expert nor one parameter per expert")
        if len(_shape(node.args[0])) != 2:
            raise _Skip(f"{node.name} multiplies a {len(_shape(node.args[0]))}-D tensor (rows x features expected)")
        linears.append(_Linear(node, kind, positions[1], positions.get(2)))
    if not linears:
        raise _Skip("no per-expert weights: the experts do not differ")
    return linears


# ----------------------------------------------------------------------------- layers

def _acc_chain(plans: list[_Plan], order: dict, closure: set) -> None:
    """The units accumulate into one tensor in turn, and nothing outside them (``closure``: the
    nodes that die with them, such as ``acc[idx]`` of ``acc[idx] += v``) reads it in between."""
    units = [p.unit for p in plans]
    first = units[0].acc
    for prev, u in zip(units, units[1:]):
        if not (u.acc is first and u.in_place or u.acc is prev.sink):
            raise _Skip("the experts do not accumulate into one tensor in turn")
    last = order[units[-1].sink]
    sinks = {u.sink for u in units}
    for u in [first] + [u.sink for u in units[:-1]]:
        for user in u.users:
            if user not in sinks and user not in closure and order.get(user, -1) < last and order.get(user, -1) > order[units[0].sink]:
                raise _Skip(f"{user.name} reads the accumulator between two experts")


def _inputs_before_outputs(plans: list[_Plan], order: dict) -> None:
    """Each expert's input is independent of the other experts' outputs: nothing the experts read
    (the gathered tensor, weights, the router weights) is written in place between the first
    expert's gather and the last expert's accumulation (the accumulation into the tensor the experts
    read, ``h.index_add_(0, tok, expert(h[tok]))``, is such a write). The grouped form computes every
    expert from the values at the last expert; the loop's expert e saw the earlier experts' writes."""
    units = [p.unit for p in plans]
    reads = [n for u in units for n in u.rows.inputs() + ([u.weight.table] if u.weight is not None else [])]
    start = min((g for u in units for g in u.sources), key=order.__getitem__)
    clash = read_while_written(list(dict.fromkeys(reads)), start, units[-1].sink)
    if clash is not None:
        read, writer = clash
        raise _Skip(f"the experts read the tensor they accumulate into ({read.name}, written by {writer.name} "
                    "between the experts): expert e's input depends on the earlier experts' outputs")


def slots(unit: WhereUnit) -> int:
    """The routed slots per token of a unit whose routing grid is tokens (x slots)."""
    if len(unit.grid) not in (1, 2):
        raise _Skip("the routing grid is not tokens (x slots)")
    k = 1 if len(unit.grid) == 1 else unit.grid[1 - unit.tok_axis]
    if not isinstance(k, int):
        raise _Skip("the number of routed slots per token is not a constant")
    return k


def costs(linears: list[_Linear]) -> tuple[int, int]:
    """(multiply-adds x2 per routed row, bytes torch.stack copies per call) of a layer's linears."""
    flops = stack = 0
    for lin in linears:
        shape = _shape(lin.weights[0])
        flops += 2 * int(shape[0]) * int(shape[1])
        kind, _ = _leaf_stack(lin.weights)
        if kind == "params" and not consecutive([fake_value(w) for w in lin.weights]):
            stack += len(lin.weights) * int(shape[0]) * int(shape[1]) * fake_value(lin.weights[0]).element_size()
    return flops, stack


def find_layers(plans: list[_Plan], order: dict) -> tuple[list[Layer], list[tuple[list[_Plan], str]]]:
    """Group where-loop plans into layers that can take the grouped form. Returns the layers and,
    for groups that cannot, (their plans, why)."""
    groups: dict[Any, list[tuple[int, _Plan]]] = {}
    for plan in plans:
        if plan.unit is None:
            continue
        r = _routing(plan.unit)
        if r is None:
            continue
        ids, perm, e = r
        groups.setdefault((ids, perm), []).append((e, plan))
    layers, rejected = [], []
    for (ids, perm), members in groups.items():
        members.sort(key=lambda m: order[m[1].sink])
        ps = [p for _, p in members]
        try:
            experts = [e for e, _ in members]
            if sorted(experts) != list(range(len(experts))) or experts != list(range(len(experts))):
                raise _Skip(f"the loop's experts are {experts}, not 0..n-1 in order")
            u0 = ps[0].unit
            for p in ps[1:]:
                u = p.unit
                same_w = (u.weight is None) == (u0.weight is None) and (u.weight is None or (
                    u.weight.table is u0.weight.table and u.weight.axes == u0.weight.axes
                    and u.weight.nones == u0.weight.nones))
                if u.grid != u0.grid or u.tok_axis != u0.tok_axis or not same_w or u.rows_first != u0.rows_first \
                        or [c.target for c in u.casts] != [c.target for c in u0.casts]:
                    raise _Skip("the experts are weighted or laid out differently")
            k = slots(u0)
            closure = set()
            for p in ps:
                closure |= _removable(p)
            _acc_chain(ps, order, closure)
            _inputs_before_outputs(ps, order)
            linears = _correspond([p.unit for p in ps])
            layers.append(Layer(ps, ids, perm, k, u0.grid[u0.tok_axis], linears, *costs(linears),
                                {g: src for g, (src, _) in u0.sources.items()}, u0.index))
        except _Skip as exc:
            rejected.append((ps, str(exc)))
    return layers, rejected


# ----------------------------------------------------------------------------- building

def _native(x: Any, w_dtype: torch.dtype, out_features: Any, on_cuda: bool = False) -> bool:
    """``on_cuda``: as if ``x`` were a CUDA tensor (the choice a GPU run makes, for a CPU trace)."""
    return (hasattr(torch, "_grouped_mm") and (on_cuda or getattr(x, "is_cuda", False)) and x.dtype == torch.bfloat16
            and w_dtype == torch.bfloat16 and int(x.shape[-1]) % 8 == 0 and int(out_features) % 8 == 0)


def grouped_mm_supported(x: Any, w: Any) -> bool:
    """``torch._grouped_mm`` applies: CUDA, bf16, rows 16-byte aligned (shapes as [S, in] @ [n, in, out])."""
    return _native(x, w.dtype, w.shape[-1])


def layer_is_native(layer: Layer, on_cuda: bool = False) -> bool:
    """Every grouped product of the layer takes ``torch._grouped_mm`` (else its stand-in); ``on_cuda``:
    would on a CUDA device."""
    for lin in layer.linears:
        w = fake_value(lin.weights[0])
        out_features = w.shape[0] if lin.kind == "linear" else w.shape[-1]
        if not _native(fake_value(lin.node.args[0]), w.dtype, out_features, on_cuda):
            return False
    return True


def _stacked(b: _Builder, leaves: list[torch.fx.Node], n: int) -> torch.fx.Node:
    kind, what = _leaf_stack(leaves)
    if kind == "indexed":
        table = what
        if not sizes_equal(_shape(table)[0], n):
            table = b.fn(operator.getitem, table, slice(0, n))
        return table
    if consecutive([fake_value(w) for w in what]):
        return b.fn(stacked_view, *what)  # slices of one block (expert_layout.py): a view, no copy
    return b.fn(torch.stack, list(what))


def layer_form(layer: Layer, mode: DispatchMode) -> tuple[Optional[str], str, dict, bool]:
    """form_choice.choose_layer_form for ``layer`` with what its traced values say (device, element size,
    whether its output needs a gradient), and whether torch._grouped_mm applies to it: (form, why,
    figures, native)."""
    value = fake_value(layer.units[0].rows.out)
    native = layer_is_native(layer)
    form, why, figures = choose_layer_form(layer, mode, value.device.type, value.element_size(), native,
                                           value.requires_grad, device_name=current_device_name(value.device),
                                           native_on_cuda=layer_is_native(layer, on_cuda=True))
    return form, why, figures, native


def products_text(per_row: bool, native: bool) -> str:
    """How a rewritten layer's expert products run, for the report's figures."""
    if per_row:
        return "per-row products (small-batch form: no grouping)"
    return "torch._grouped_mm" if native else "per-row weight gather + bmm (equivalent)"


def _per_row(b: _Builder, h: torch.fx.Node, w: torch.fx.Node, group: torch.fx.Node) -> torch.fx.Node:
    """The small-batch form's product: row ``s`` of h [S, in] times its own expert's w[group[s]]
    [in, out], as an elementwise product summed over ``in`` (in float32 at least, as a matrix
    product accumulates). Inductor makes it one reduction kernel that reads each row's expert
    weights where they lie, no gathered copy and no grouping, so the cost follows the rows there are
    (seen in its CPU code: one fused kernel, no [S, in, out] buffer; on an H100 the same expression
    in benchmarks/dispatch_costs.py ran 32768 rows of 2048 x 768, whose [S, in, out] buffer would
    take 206 GB, in 142 ms)."""
    dtype = fake_value(h).dtype
    wide = torch.promote_types(dtype, torch.float32)
    rows = b.method("unsqueeze", b.method("to", h, wide), -1)                  # [S, in, 1]
    weights = b.method("to", b.fn(operator.getitem, w, group), wide)          # [S, in, out]
    return b.method("to", b.method("sum", b.fn(operator.mul, rows, weights), 1), dtype)


def _gmm(b: _Builder, h: torch.fx.Node, w: torch.fx.Node, offs: torch.fx.Node, group: torch.fx.Node) -> torch.fx.Node:
    """h [S, in] @ w [n, in, out] by groups of rows (offs, int32) -> [S, out]."""
    if grouped_mm_supported(fake_value(h), fake_value(w)):
        return b.fn(torch._grouped_mm, h, w, offs=offs)
    per_row = b.fn(operator.getitem, w, group)                         # [S, in, out]
    return b.method("squeeze", b.fn(torch.bmm, b.method("unsqueeze", h, 1), per_row), 1)


def _direct_rows(b: _Builder, h: torch.fx.Node, tokens: torch.fx.Node) -> Optional[torch.fx.Node]:
    """``x[tokens]`` where ``h`` is ``x[None, tokens].reshape(...)`` to ``[S, C]`` with ``x`` of
    ``[T, C]`` (transformers' ``hidden_states[None, top_x].reshape(-1, hidden_dim)``): the same
    rows (``x[None, t]`` is ``[1, S, C]`` with row ``i`` = ``x[t[i]]``; the reshape drops the leading
    1), gathered into a tensor of their own rather than a view. None for any other form."""
    if h.op != "call_method" or h.target not in ("reshape", "view") or not h.args:
        return None
    src = h.args[0]
    if not (isinstance(src, torch.fx.Node) and _is_getitem(src) and len(src.args) == 2):
        return None
    x, index = src.args
    if not (isinstance(x, torch.fx.Node) and isinstance(index, tuple) and len(index) == 2
            and index[0] is None and index[1] is tokens):
        return None
    fx, fs, fh = fake_value(x), fake_value(src), fake_value(h)
    if fx is None or fs is None or fh is None or fx.dim() != 2 or fh.dim() != 2:
        return None
    want = (1,) + tuple(fh.shape)
    if fs.dim() != 3 or not all(sizes_equal(a, w) for a, w in zip(fs.shape, want)) \
            or not sizes_equal(fx.shape[1], fh.shape[1]):
        return None
    return b.fn(operator.getitem, x, tokens)


def build_grouped(gm: torch.fx.GraphModule, layer: Layer, per_row: bool = False) -> torch.fx.Node:
    """Insert the grouped computation before the layer's last sink; return the accumulated result.
    ``per_row``: the small-batch form, the same routing with each row's products taken alone
    (:func:`_per_row`) instead of by groups."""
    units = layer.units
    u0 = units[0]
    b = _Builder(gm, units[-1].sink)
    n, k = layer.experts, layer.k
    device = fake_value(layer.ids).device
    ids = layer.ids
    if layer.perm != tuple(range(len(layer.perm))):
        ids = b.method("permute", ids, *layer.perm)
    if len(u0.grid) == 2 and u0.tok_axis == 1:
        ids = b.method("transpose", ids, 0, 1)
    flat = b.method("reshape", ids, -1)
    inside = b.fn(operator.and_, b.fn(operator.ge, flat, 0), b.fn(operator.lt, flat, n))
    flat = b.fn(torch.where, inside, flat, n)
    sort = b.fn(torch.sort, flat, stable=True)
    sorted_ids, perm = b.fn(operator.getitem, sort, 0), b.fn(operator.getitem, sort, 1)
    tokens = perm if k == 1 else b.fn(torch.div, perm, k, rounding_mode="floor")
    # Counted in int32: Inductor lowers an int32 scatter_add into its own kernel (Triton's atomic
    # add has no int64), where int64 counts fall back to ATen's scatter kernel (12.7 against 3.3 us a
    # layer at 512 tokens, 128 experts, on an H100). T * k rows fit in int32 as the offsets do.
    offs = None  # the group offsets: the grouped products' only (the per-row form needs no groups)
    if not per_row:
        counts = b.method("scatter_add", b.fn(torch.zeros, n + 1, dtype=torch.int32, device=device),
                          0, flat, b.fn(torch.ones_like, flat, dtype=torch.int32))
        offs = b.fn(torch.cumsum, b.fn(operator.getitem, counts, slice(0, n)), 0, dtype=torch.int32)
    valid = b.fn(operator.lt, sorted_ids, n)
    group = b.method("clamp", sorted_ids, max=n - 1)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for g in layer.gathers:
        # the same gather with the sorted tokens in place of unit 0's selection
        args = torch.fx.node.map_aggregate(g.args, lambda a: tokens if a is layer.index else a)
        env[g] = b.add(g.op, g.target, *args, like=g, **g.kwargs)
    linears = {lin.node: lin for lin in layer.linears}
    readers: dict[torch.fx.Node, int] = {}
    for lin in layer.linears:
        readers[lin.node.args[0]] = readers.get(lin.node.args[0], 0) + 1
    shared: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in u0.rows.body:
        lin = linears.get(node)
        if lin is None:
            b.copy(node, env)
            continue
        h = env.get(node.args[0], node.args[0])
        if readers[node.args[0]] > 1:
            # Rows that several grouped products read (gate and up) made once: Inductor realizes
            # a view of the gathered rows once for each product that reads it (measured on an
            # H200: 73 us against 23 us per layer at 2048 tokens, top-8 of 128), and drops a
            # clone as a no-op, so the rows are gathered straight into [S, C] where that is the
            # same (_direct_rows), else cloned.
            if h not in shared:
                shared[h] = (_direct_rows(b, h, tokens)
                             or b.fn(torch.clone, h, memory_format=torch.contiguous_format))
            h = shared[h]
        w = _stacked(b, lin.weights, n)
        if lin.kind == "linear":
            w = b.method("transpose", w, -2, -1)
        out = _per_row(b, h, w, group) if offs is None else _gmm(b, h, w, offs, group)
        if lin.biases is not None:
            bias = _stacked(b, lin.biases, n)
            out = b.fn(operator.add, out, b.fn(operator.getitem, bias, group))
        env[node] = out
    rows = env[u0.rows.out]
    val = rows
    if u0.weight is not None:
        dense_w = _dense_weight(b, u0.weight, len(u0.grid), u0.tok_axis)    # [T, (k,) *tail]
        tail = _shape(dense_w)[len(u0.grid):]
        flat_w = b.method("reshape", dense_w, -1, *tail)
        w_rows = b.fn(torch.index_select, flat_w, 0, perm)
        val = b.fn(operator.mul, rows, w_rows) if u0.rows_first else b.fn(operator.mul, w_rows, rows)
    for cast in u0.casts:
        val = b.copy(cast, {cast.args[0]: val})
    keep = valid
    for _ in range(len(_shape(val)) - 1):
        keep = b.method("unsqueeze", keep, -1)
    val = b.fn(torch.where, keep, val, 0)
    # Back to slot order (a permutation: a copy, no atomics), then each token's k slots summed and
    # added to the accumulator once; index_add_ of bf16 rows with atomics measured 1.5x slower here.
    # perm is a permutation of every slot: each row of the destination is written (no fill needed).
    slots = b.fn(torch.index_copy, b.fn(torch.empty_like, val), 0, perm, val)
    tail = _shape(val)[1:]
    per_token = slots if k == 1 else b.method("sum", b.method("reshape", slots, -1, k, *tail), 1)
    # Row t of the result is the layer's function of row t of the accumulator, the gathered rows
    # and the routing alone, for any number of rows: bucketing may pad the tokens (rowdep.ROW_BLOCK).
    if u0.in_place:
        return b.tag_row_block(b.method("add_", u0.acc, per_token))
    return b.tag_row_block(b.fn(operator.add, u0.acc, per_token))
