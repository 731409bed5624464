"""The graph side of folded expert loops (see fold.py): the one traced expert between the markers
becomes the grouped form over every expert the loop runs.

For each ``begin(K)`` ... ``end(K, runs, params)`` pair of the graph: exactly one where-loop unit
lies between them, its routing is ``one_hot(ids)[0]`` / ``ids == 0`` (the first expert), the
experts run are ``0..n-1``, and every per-expert value the unit reads (a parameter of the traced
expert, one of ``params``' first entries, or a table row ``row(T, 0)``) is used only as the weight
or bias of a linear layer or matrix product in the unit's row computation. Then the unit is
replaced by the grouped form with the weights of all n experts (``params`` stacked, or the table).
Anything else switches the fold off and restarts the trace (fold.decline): the loop is then
traced unrolled and rewritten, or left, as any other.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value, module_path, source_location
from . import fold
from ..config.dispatch_mode import DispatchMode
from .form_choice import GROUPED_FORMS
from .graph_builder import _shape
from .grouped import Layer, _Linear, _routing, build_grouped, costs, layer_form, products_text, slots
from .expert_layout import LayoutCheck, block_view, consecutive
from .match import _match_where, _removable, read_while_written
from .records import DispatchResult, DispatchRewrite, _Skip

__all__ = ["fold_layers"]


def _is_marker(node: torch.fx.Node, fn: Any) -> bool:
    return node.op == "call_function" and node.target is fn


def _pairs(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, torch.fx.Node]]:
    """(begin, end) pairs in graph order; an unpaired marker (a graph break inside the traced
    iteration) declines its fold."""
    open_: list[torch.fx.Node] = []
    pairs = []
    for node in gm.graph.nodes:
        if _is_marker(node, fold.begin):
            open_.append(node)
        elif _is_marker(node, fold.end):
            if not open_ or open_[-1].args[0] != node.args[0]:
                fold.decline(node.args[0], "the folded loop's trace was cut by a graph break")
            pairs.append((open_.pop(), node))
    if open_:
        fold.decline(open_[-1].args[0], "the folded loop's trace was cut by a graph break")
    return pairs


def _rows_as_getitem(gm: torch.fx.GraphModule) -> None:
    """``row(T, e)`` -> ``T[e]``, the form the grouped pass reads as an indexed table."""
    for node in list(gm.graph.nodes):
        if _is_marker(node, fold.row):
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(operator.getitem, node.args)
            new.meta = dict(node.meta, cgb_row=True)  # a row the traced expert read
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)


def _block_row(gm: torch.fx.GraphModule, key: int, i: int, w0: torch.fx.Node, n: int, begin: torch.fx.Node,
               inside: set, checks: list) -> torch.fx.Node:
    """Parameter ``i`` of the spec, given for expert 0 only (fold.inputs in an inference trace): the
    expert list it belongs to, found by Dynamo's real value of ``w0``, must hold its n experts'
    parameters as the consecutive slices of one block. The traced expert's uses of ``w0`` then read
    ``block_view(w0, n)[0]``, a table row like ``row(T, 0)``, and the runtime checks the layout
    at each call (expert_layout.LayoutCheck, appended to ``checks``)."""
    real = fold.real_input(w0) if w0.op == "placeholder" else None
    if not isinstance(real, torch.Tensor):
        raise _Skip("Dynamo kept no value of expert 0's parameter")
    parts, name = fold._SPECS[key].params[i]
    what = f"{'.'.join(parts + (name,))} of {n} experts"

    def find(w: torch.Tensor) -> Optional[torch.nn.Module]:
        lists = [o for o in fold.owners(key) if len(o) == n and fold.param_of(o[0], parts, name) is w]
        return lists[0] if len(lists) == 1 else None

    def resolve(experts: torch.nn.Module) -> list:
        return [fold.param_of(expert, parts, name) for expert in experts]

    owner = find(real)
    if owner is None:
        raise _Skip(f"expert 0's {what} belongs to no one expert list of the loop")
    if not consecutive([p.data for p in resolve(owner)]):
        raise _Skip(f"the {what} are not the slices of one block")
    fake = fake_value(w0)
    with gm.graph.inserting_before(begin):
        block = gm.graph.call_function(block_view, (w0, n))
        row = gm.graph.call_function(operator.getitem, (block, 0))
    # Fake values under Dynamo's key too: AOTAutograd's cache takes a method call only on a node
    # that has one (else it bypasses the cache, and a second process compiles the layer again).
    whole = block_view(fake, n)
    block.meta = {"val": whole, "example_value": whole, "cgb_row": True}
    row.meta = {"val": whole[0], "example_value": whole[0], "cgb_row": True}
    w0.replace_all_uses_with(row, delete_user_cb=lambda user: user in inside)
    position = [nd for nd in gm.graph.nodes if nd.op == "placeholder"].index(w0)
    checks.append(LayoutCheck(position, find, resolve, what))
    return row


def _layer(gm: torch.fx.GraphModule, begin: torch.fx.Node, end: torch.fx.Node, order: dict,
           checks: list) -> Layer:
    key, runs, params = end.args[0], end.args[1], end.args[2]
    why = fold.recheck(key)
    if why:
        raise _Skip(why)
    if not isinstance(runs, (list, tuple)) or not runs or list(runs) != list(range(len(runs))):
        raise _Skip(f"the loop runs experts {runs}, not 0..n-1")
    n = len(runs)
    region = [nd for nd in gm.graph.nodes if order[begin] < order[nd] < order[end]]
    plans, why = [], "no dispatch unit"
    for node in region:
        if node.op in ("call_function", "call_method"):
            try:
                plan = _match_where(node, order)
            except _Skip as exc:
                why = str(exc)
                continue
            if plan is not None:
                plans.append(plan)
    if len(plans) != 1:
        raise _Skip(f"the traced expert's iteration holds {len(plans)} dispatch units ({why})")
    plan = plans[0]
    unit = plan.unit
    r = _routing(unit) if unit is not None else None
    if r is None or r[2] != 0:
        raise _Skip("the traced expert's selection is not one_hot(ids)[e] or ids == e")
    ids, perm, _ = r
    k = slots(unit)
    _removable(plan)
    reads = unit.rows.inputs() + ([unit.weight.table] if unit.weight is not None else [])
    start = min(unit.sources, key=order.__getitem__)
    clash = read_while_written(list(dict.fromkeys(reads)), start, unit.sink.next)
    if clash is not None:
        raise _Skip(f"the expert reads {clash[0].name}, which {clash[1].name} writes: expert e's input would "
                    "depend on the earlier experts' outputs")
    per_expert: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    inside = set(region)
    for i, group in enumerate(params or ()):
        group = list(group)
        if len(group) == 1 and n > 1:  # an inference trace: expert 0's parameter, the rest in its block
            row = _block_row(gm, key, i, group[0], n, begin, inside, checks)
            per_expert[row] = [row]
            continue
        if len(group) != n:
            raise _Skip(f"the loop runs {n} experts but the list holds {len(group)}")
        per_expert[group[0]] = group
    for node in region:
        if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0 \
                and node.args[0].op in ("placeholder", "get_attr") and node.meta.get("cgb_row"):
            per_expert[node] = [node]
    body = set(unit.rows.body)
    linears: dict[torch.fx.Node, _Linear] = {}
    for leaf, weights in per_expert.items():
        for user in leaf.users:
            if user is end:
                continue
            pos = [i for i, a in enumerate(user.args) if a is leaf]
            name = getattr(user.target, "__name__", str(user.target))
            kind = "linear" if name == "linear" else "matmul" if name in ("matmul", "mm") else ""
            if user not in body or not kind or user.kwargs or any(p not in ((1, 2) if kind == "linear" else (1,))
                                                                  for p in pos) or len(pos) != 1:
                raise _Skip(f"a per-expert value ({leaf.name}) is used by {user.name}, not as the weight of a "
                            "linear layer or matrix product of the expert's rows")
            if len(_shape(user.args[0])) != 2:
                raise _Skip(f"{user.name} multiplies a {len(_shape(user.args[0]))}-D tensor (rows x features expected)")
            lin = linears.setdefault(user, _Linear(user, kind, [], None))
            if pos[0] == 1:
                lin.weights = weights
            else:
                lin.biases = weights
    if not linears or any(not lin.weights for lin in linears.values()):
        raise _Skip("the traced expert has no per-expert weight")
    lins = list(linears.values())
    return Layer([plan], ids, perm, k, unit.grid[unit.tok_axis], lins, *costs(lins),
                 {g: src for g, (src, _) in unit.sources.items()}, unit.index, n_experts=n)


def fold_layers(gm: torch.fx.GraphModule, mode: DispatchMode, result: DispatchResult) -> bool:
    """Rewrite every folded loop of ``gm`` into the grouped form (in place); True when any was.
    Raises fold.FoldDeclined (Dynamo traces again, unrolled) where one cannot be."""
    if not any(_is_marker(n, fold.begin) or _is_marker(n, fold.end) for n in gm.graph.nodes):
        return False
    _rows_as_getitem(gm)
    pairs = _pairs(gm)
    for begin, end in pairs:
        key = end.args[0]
        order = {nd: i for i, nd in enumerate(gm.graph.nodes)}
        try:
            layer = _layer(gm, begin, end, order, result.layout_checks)
            dead = _removable(layer.plans[0])
            form, why, figures, native = layer_form(layer, mode)
            if form not in GROUPED_FORMS:
                # the folded trace has only the grouped forms to give; the unrolled one has them all
                raise _Skip(f"the cost model picks {form or 'no static form'} here ({why})")
            new = build_grouped(gm, layer, per_row=form == "small_batch")
        except _Skip as exc:
            fold.decline(key, str(exc))
        except Exception as exc:  # a shape the fake run rejects
            fold.decline(key, f"the grouped form does not trace ({type(exc).__name__}: {exc})")
        sink = layer.plans[0].sink
        source, code = source_location(sink)
        figures["folded"] = f"one expert traced for {layer.experts}"
        figures["grouped_mm"] = products_text(form == "small_batch", native)
        result.rewrites.append(DispatchRewrite(
            "where_loop", source, code, module_path(sink), form=form,
            why=f"{why}; folded loop: one expert traced, the {form.replace('_', '-')} form runs all {layer.experts}",
            experts=layer.experts, removed_ops=sum(1 for d in dead if d.op in ("call_function", "call_method")),
            figures=figures))
        sink.replace_all_uses_with(new)
        for nd in reversed(list(gm.graph.nodes)):
            if (nd in dead or nd is begin or nd is end) and not nd.users:
                gm.graph.erase_node(nd)
    for nd in reversed(list(gm.graph.nodes)):  # table rows the traced expert read
        if nd.meta.get("cgb_row") and not nd.users:
            gm.graph.erase_node(nd)
    return True
