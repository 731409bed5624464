"""Static MoE dispatch: rewrite data-dependent expert loops into sync-free code of fixed shapes.

Reads and writes: one Dynamo graph (in place), before the other passes, when static dispatch is
on (``DispatchMode.enabled``). Returns a :class:`DispatchResult` naming
every rewrite (pattern, source line, module path, form and why) and every
candidate left alone (with the reason).

Patterns (each one "dispatch unit", matched from its sink):

* ``where_loop``: ``i, j = torch.where(mask)`` (or ``mask.nonzero(as_tuple=True)``),
  a gather of rows by one coordinate (``x[j]``, ``x[None, j]``, ``index_select``),
  a computation on the gathered rows, optionally times a gathered weight
  (``w[j, i, None]``), accumulated with ``acc.index_add_(0, j, v)`` or
  ``acc[j] += v``. Hugging Face Mixtral's eager loop (one-hot mask, per-expert
  ``where``) and DeepSeek's ``torch.where(indices == e)`` loop are this pattern.
* ``sorted_split``: ``order = argsort(ids)``, ``counts = bincount(ids, minlength=E)``,
  ``split(x[order // k], counts.tolist())``, expert ``e`` on piece ``e``,
  ``cat(...) * w.flatten()[order]``, ``index_add_(0, order // k, ...)``.
* ``grouped_mm_fallback``: transformers' ``grouped_mm_fallback`` op (a per-expert loop
  over ``offsets.tolist()``, used under torch.compile for weights other than bf16).

Form. ``masked_dense``: each expert computes on every row; its output is multiplied by
the token's combine weight (the sum of its router weights routed to that expert, zero
when none) and added where the token is routed (``torch.where``, so a non-finite value
of an unrouted row cannot leak). Nothing reads device data on the host and every shape
is fixed by the token count and the number of experts, so the whole MoE layer joins
the surrounding static region. It costs E/k times the expert FLOPs of the dropless
loop and saves every host sync and the per-expert gathers; the cost model below says
when that trade is taken.

Safety. A unit is rewritten only when (1) the computation between gather and sink is
proven row-independent (passes/rowdep.py): row t of the result depends only on token
t, so computing all rows and keeping the routed ones gives the same rows; (2) every
node that depends on the selection is part of the unit or size bookkeeping
(``sym_size``, ``_assert_scalar``), so removing the unit removes nothing else; (3) the
row counts of the mask, the gathered tensor and the accumulator agree. Anything else
stays as it is, dynamic, with the reason in the report.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.fx

from ..common.fx_utils import module_path, source_location
from ..config.dispatch_mode import DispatchMode
from .form_choice import FORMS, GROUPED_FORMS, choose_form
from .fold_graph import fold_layers
from .grouped import build_grouped, find_layers, layer_form, products_text
from .match import _MATCHERS, _PATTERN_OF, _match_where, _removable
from .graph_builder import _Builder
from .records import DispatchResult, DispatchRewrite, DispatchSkipped, _Skip
from .keep_skips import KeptSkip, SkipNotKept, keep_skips

__all__ = ["DispatchResult", "DispatchRewrite", "DispatchSkipped", "rewrite_static_dispatch",
           "FORMS", "SkipNotKept"]


def _erase(gm: torch.fx.GraphModule, dead: set[torch.fx.Node]) -> None:
    for n in reversed(list(gm.graph.nodes)):  # users before their inputs
        if n in dead and not n.users:
            gm.graph.erase_node(n)



def _grouped_layers(gm: torch.fx.GraphModule, mode: DispatchMode, result: DispatchResult) -> tuple[bool, dict]:
    """Rewrite the layers the grouped form takes (mode GROUPED, or AUTO where the cost model picks
    it; mode SMALL_BATCH: its per-row variant). Returns whether the graph changed and the
    decisions for the units of the layers it did not rewrite ({sink: (form or None, why, figures)})."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    plans = []
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            try:
                plan = _match_where(node, order)
            except _Skip:
                continue
            if plan is not None:
                plans.append(plan)
    layers, rejected = find_layers(plans, order)
    decided: dict = {}
    forced_grouped = mode.requested_form in GROUPED_FORMS
    for ps, why in rejected:
        if forced_grouped:
            for p in ps:
                decided[p.sink] = ("masked_dense", f"masked dense: the grouped form does not apply ({why})", {})
    changed = False
    for layer in layers:
        form, why, figures, native = layer_form(layer, mode)
        if form not in GROUPED_FORMS:
            for p in layer.plans:
                # Off CUDA (form None) the per-unit rule decides, with what a GPU would choose.
                decided[p.sink] = ((None if form == "dynamic" else form, why, figures) if form is not None
                                   else choose_form(p, mode) + (figures,))
            continue
        try:
            dead: set = set()
            for p in layer.plans:
                dead |= _removable(p)
            new = build_grouped(gm, layer, per_row=form == "small_batch")
        except _Skip as exc:
            for p in layer.plans:
                decided[p.sink] = ("masked_dense" if forced_grouped else None,
                                   f"the grouped form does not apply ({exc})", figures)
            continue
        except Exception as exc:  # a shape the fake run rejects: leave the layer to the other forms
            for p in layer.plans:
                decided[p.sink] = ("masked_dense", f"the grouped form does not trace ({type(exc).__name__}: "
                                   f"{exc})", figures)
            continue
        last = layer.plans[-1].sink
        source, code = source_location(last)
        figures["grouped_mm"] = products_text(form == "small_batch", native)
        result.rewrites.append(DispatchRewrite(
            "where_loop", source, code, module_path(last), form=form, why=why, experts=layer.experts,
            removed_ops=sum(1 for n in dead if n.op in ("call_function", "call_method")), figures=figures))
        last.replace_all_uses_with(new)
        _erase(gm, dead)
        changed = True
    return changed, decided


def _note_kept(kept: list[KeptSkip], skipped_at: dict, result: DispatchResult) -> None:
    """Each kept skip on the record of its unit (a record of its own where no pattern matched)."""
    for k in kept:
        record = next((skipped_at[n] for n in k.nodes if n in skipped_at), None)
        if record is None:
            source, code = source_location(k.selection)
            record = DispatchSkipped("selection", source, code, module_path(k.selection),
                                     reason="no dispatch pattern matches what the loop body does with this selection")
            result.skipped.append(record)
        record.loop = k.loop.source
        record.reason += (f"; it runs only for an expert that receives tokens, as the loop at {k.loop.source} "
                          "was written")


_ROW_BLOCK_PATTERNS = ("where_loop", "sorted_split")
"""Units whose masked-dense form keeps rows apart as a whole (rowdep.ROW_BLOCK). Not
``grouped_mm_fallback``: its groups come from the model's own offsets, counted over every row."""


def rewrite_static_dispatch(gm: torch.fx.GraphModule, mode: DispatchMode, loops: Sequence = ()) -> DispatchResult:
    """Rewrite every recognized dispatch unit of ``gm`` (in place) per ``mode``; see module doc.
    ``loops``: the loops the source rewrite changed (source_rewrite.LoopRewrite); a unit of theirs left
    dynamic keeps the loop's skip (keep_skips.py)."""
    result = DispatchResult(mode=mode)
    skipped_at: dict = {}
    if not mode.enabled:
        return result
    folded = fold_layers(gm, mode, result)
    changed, decided = _grouped_layers(gm, mode, result) if mode.builds_grouped else (False, {})
    changed = changed or folded
    cache: dict = {}  # combine weights shared by sibling units (built once, before the first)
    shared_block: Optional[str] = None  # the row block (rowdep.ROW_BLOCK) of the units sharing it
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node not in order or node.op not in ("call_function", "call_method"):
            continue  # erased with an earlier unit
        for matcher in _MATCHERS:
            try:
                plan = matcher(node, order)
                if plan is None:
                    continue
                dead = _removable(plan)
                form, why, figures = decided.get(node, choose_form(plan, mode) + ({},))
                if form is None:
                    raise _Skip(why)
                builder = _Builder(gm, node)
                try:
                    new = plan.build(builder, cache)
                except Exception as exc:
                    builder.undo(cache)
                    if isinstance(exc, _Skip):
                        raise
                    raise _Skip(f"the static form does not trace ({type(exc).__name__}: {exc})") from exc
                if plan.pattern in _ROW_BLOCK_PATTERNS:
                    # Row t of the result: the accumulator's row t plus, per expert, the product on
                    # row t where the expert receives token t (zero elsewhere): row t alone. A
                    # where-loop unit reads the combine weights its siblings built: one block.
                    if plan.pattern == "where_loop":
                        shared_block = shared_block or new.name
                    builder.tag_row_block(new, shared_block if plan.pattern == "where_loop" else None)
            except _Skip as exc:
                source, code = source_location(node)
                skipped_at[node] = DispatchSkipped(_PATTERN_OF[matcher], source, code, module_path(node),
                                                   reason=str(exc))
                result.skipped.append(skipped_at[node])
                break
            source, code = source_location(node)
            result.rewrites.append(DispatchRewrite(
                plan.pattern, source, code, module_path(node), form=form, why=why, experts=plan.experts,
                removed_ops=sum(1 for n in dead if n.op in ("call_function", "call_method")), figures=figures))
            node.replace_all_uses_with(new)
            _erase(gm, dead)
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            changed = True
            break
    kept = keep_skips(gm, loops)
    _note_kept(kept, skipped_at, result)
    if changed or kept:
        gm.graph.lint()
        gm.recompile()
    return result
