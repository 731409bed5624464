"""Keeping a rewritten loop's skip for the dispatch units the graph rewrite leaves dynamic.

Reads: one Dynamo graph after the static-dispatch rewrite, and the loops the source rewrite changed
(source_rewrite.LoopRewrite: file and lines).
Writes: the graph, in place. Each selection (``where(mask)``, ``nonzero(mask, as_tuple=True)``)
made inside a rewritten loop that is still in the graph, together with everything that depends on
it, becomes one call that runs that code only when the selection is not empty.

Why: the source rewrite (source_rewrite.py) drops a loop's skip (``if counts[e] == 0: continue``, the loop
over the experts that received tokens), so an expert without tokens runs its body on no rows. That
is the loop as written only where the graph rewrite then replaces each expert's unit by a static
form. A unit it leaves dynamic (not row-independent, such as a per-expert ``amax()`` scale; a form
the cost model declines; code no pattern matches) would run on no rows and may fail there
(``amax()`` of nothing, Dynamo's ``u >= 1`` assertion) or differ. Its selection is empty exactly
when the loop skipped the expert (source_rewrite.py proves that every selection of the body reads ``M[e]``
or compares the counted ids with ``e``), so running the unit only for a non-empty selection is the
skip as written.

A unit whose code cannot be taken out as one call (a value of it used elsewhere, other code in
between touching what it reads or writes) raises :class:`SkipNotKept`: the model cannot be
compiled with that loop rewritten (static_dispatch="off" leaves it as written).

Complexity: O(N) per selection for N graph nodes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence

import torch
import torch.fx

from ..common.fx_utils import META_KEY, fake_value, storage_ids
from ..passes.effects import is_global_state_node, is_random_node, mutated_args
from ..passes.call_args import argument
from .graph_builder import _descendants, _is

__all__ = ["KeptSkip", "SkipNotKept", "keep_skips"]

_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


class SkipNotKept(RuntimeError):
    """A dynamic unit of a rewritten loop that cannot keep the loop's skip."""


@dataclasses.dataclass
class KeptSkip:
    """One selection of a rewritten loop left in the graph: its nodes now run only when it is not empty."""
    selection: torch.fx.Node
    nodes: list[torch.fx.Node]
    """The nodes moved into the call, in graph order (the sink among them)."""
    loop: Any
    """The source_rewrite.LoopRewrite the selection comes from."""


class _SkipWhenEmpty:
    """Runs ``body(*args)`` unless the selection (``args[0]``, a tuple of index tensors) is empty."""

    __name__ = "run_unless_no_token"  # what FX's generated code calls it
    __qualname__ = "run_unless_no_token"

    def __init__(self, body: torch.fx.GraphModule) -> None:
        self.body = body

    def __call__(self, selection: tuple, *args: Any) -> None:
        if selection[0].numel() == 0:
            return None
        self.body(selection, *args)
        return None


def _selection(node: torch.fx.Node) -> bool:
    if _is(node, "where"):
        return len(node.args) == 1 and not node.kwargs
    return _is(node, "nonzero") and argument(node, "as_tuple") is True


def _loop_of(node: torch.fx.Node, loops: Sequence[Any]) -> Optional[Any]:
    for m in _FRAME_RE.finditer(node.meta.get("stack_trace") or ""):
        for loop in loops:
            if loop.holds(m.group("file"), int(m.group("line"))):
                return loop
    return None


def _storages(nodes: Sequence[torch.fx.Node]) -> set[int]:
    out: set[int] = set()
    for n in nodes:
        out |= storage_ids(fake_value(n))
    return out


def _check_movable(body: list[torch.fx.Node], inputs: list[torch.fx.Node]) -> None:
    """The body can run as one call at its last node: nothing outside it uses its values, and the
    code between its first and last node neither writes what it reads or writes nor reads what it
    writes, nor changes global state or draws random numbers around it."""
    inside = set(body)
    for n in body:
        for user in n.users:
            if user not in inside:
                raise SkipNotKept(f"{n.name} (made from the selection) is used outside the expert's code, by "
                                  f"{user.name}")
    reads = _storages(inputs) | _storages(body)
    writes = _storages([w for n in body for w in mutated_args(n)])
    random_inside = any(is_random_node(n) for n in body)
    node = body[0]
    while node is not body[-1]:
        if node not in inside:
            if is_global_state_node(node) or random_inside and is_random_node(node):
                raise SkipNotKept(f"{node.name} (global state or random numbers) sits inside the expert's code")
            theirs = _storages([w for w in mutated_args(node)])
            if theirs & (reads | writes) or _storages(node.all_input_nodes) & writes:
                raise SkipNotKept(f"{node.name} reads or writes what the expert's code writes, in between")
        node = node.next


def _move(gm: torch.fx.GraphModule, selection: torch.fx.Node, body: list[torch.fx.Node]) -> torch.fx.Node:
    """Replace ``body`` by one call of it that runs unless ``selection`` is empty."""
    inside = set(body)
    inputs = [selection] + [a for a in dict.fromkeys(x for n in body for x in n.all_input_nodes)
                            if a not in inside and a is not selection]
    _check_movable(body, inputs)
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in body:
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(None)
    sub = torch.fx.GraphModule(gm, graph, class_name="cgbackend_kept_skip")
    written = {w for n in body for w in mutated_args(n)}
    with gm.graph.inserting_after(body[-1]):
        call = gm.graph.call_function(_SkipWhenEmpty(sub), tuple(inputs))
    call.meta = {k: v for k, v in body[-1].meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                  "source_fn_stack")}
    call.meta["example_value"] = None
    call.meta[META_KEY] = {"writes": [i for i, a in enumerate(inputs) if a in written],
                           "random": any(is_random_node(n) for n in body)}
    for n in reversed(body):
        gm.graph.erase_node(n)
    return call


def keep_skips(gm: torch.fx.GraphModule, loops: Sequence[Any]) -> list[KeptSkip]:
    """Make every selection of a rewritten loop (``loops``: source_rewrite.LoopRewrite records with a form)
    still in ``gm`` run its code only when not empty; see the module docstring. Returns what it
    changed, in graph order; raises SkipNotKept where it cannot."""
    loops = [l for l in loops if l.form]
    if not loops:
        return []
    found = [(n, _loop_of(n, loops)) for n in gm.graph.nodes if _selection(n)]
    found = [(n, loop) for n, loop in found if loop is not None]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    kept = []
    taken: set[torch.fx.Node] = set()
    for selection, loop in found:
        body = sorted(_descendants([selection]) - {selection}, key=order.__getitem__)
        if not body:
            continue  # an unused selection does nothing for an empty mask either
        if taken & set(body):
            raise SkipNotKept(f"{selection.name}: two selections of the loop at {loop.source} share code")
        taken |= set(body)
        kept.append(KeptSkip(selection, body, loop))
    for k in kept:
        _move(gm, k.selection, k.nodes)
    return kept
