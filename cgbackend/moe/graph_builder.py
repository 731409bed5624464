"""Graph helpers of the static-dispatch pass: node predicates, reachability, and the builder that
inserts new nodes with fake values computed under the graph's own fake mode."""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value, plain_name
from ..passes.label import DISPATCH_FORM
from ..passes.rowdep import ROW_BLOCK
from .records import _Skip

# ----------------------------------------------------------------------------- small helpers

def _is(node: Any, *names: str) -> bool:
    return isinstance(node, torch.fx.Node) and node.op in ("call_function", "call_method") \
        and plain_name(node) in names


def _is_getitem(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem


def _shape(node: Any) -> tuple:
    value = fake_value(node)
    if not isinstance(value, torch.Tensor):
        raise _Skip(f"{getattr(node, 'name', node)} has no tensor value")
    return tuple(value.shape)


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _descendants(roots: list[torch.fx.Node], stop: Optional[torch.fx.Node] = None) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set(roots)
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n is stop:
            continue
        for u in n.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


_CASTS = ("to", "type", "float", "half", "bfloat16", "type_as")


def _strip_casts(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]]:
    casts: list[torch.fx.Node] = []
    while _is(node, *_CASTS) and all(not isinstance(a, torch.fx.Node) for a in node.args[1:]):
        casts.insert(0, node)
        node = node.args[0]
    return node, casts


class _Builder:
    """Inserts nodes before ``anchor`` with fake values computed under the graph's fake mode."""

    def __init__(self, gm: torch.fx.GraphModule, anchor: torch.fx.Node) -> None:
        self.graph = gm.graph
        self.anchor = anchor
        # The graph's own fake mode (the ambient tracing context may hold another one).
        self.fake_mode = next((fake_value(n).fake_mode for n in gm.graph.nodes
                               if getattr(fake_value(n), "fake_mode", None) is not None), None)
        self.created: list[torch.fx.Node] = []
        if self.fake_mode is None:
            raise _Skip("the graph carries no fake tensors to check the rewrite's shapes")

    def _meta(self, node: torch.fx.Node, like: Optional[torch.fx.Node]) -> None:
        if like is None:  # the form's own routing and combining, not a copy of the user's op
            node.meta[DISPATCH_FORM] = True
        like = like or self.anchor
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]

    def _value(self, op: str, target: Any, args: tuple, kwargs: dict) -> Any:
        def val(a: Any) -> Any:
            return fake_value(a) if isinstance(a, torch.fx.Node) else a
        fargs = torch.fx.node.map_aggregate(args, val)
        fkwargs = torch.fx.node.map_aggregate(kwargs, val)
        with self.fake_mode:
            if op == "call_method":
                return getattr(fargs[0], target)(*fargs[1:], **fkwargs)
            return target(*fargs, **fkwargs)

    def add(self, op: str, target: Any, *args: Any, like: Optional[torch.fx.Node] = None,
            **kwargs: Any) -> torch.fx.Node:
        value = self._value(op, target, args, kwargs)
        with self.graph.inserting_before(self.anchor):
            node = self.graph.create_node(op, target, args, kwargs)
        self.created.append(node)
        node.meta["example_value"] = value
        self._meta(node, like)
        return node

    def undo(self, cache: dict) -> None:
        created = set(self.created)
        for key in [k for k, v in cache.items() if created & set(x for x in v if x is not None)]:
            del cache[key]
        for node in reversed(self.created):
            self.graph.erase_node(node)
        self.created.clear()

    def tag_row_block(self, result: torch.fx.Node, key: Optional[str] = None) -> torch.fx.Node:
        """Mark every node made so far as part of the block ``key`` (default: ``result``'s name),
        ``result`` as one of its results, which keep the rows of their inputs (rowdep.ROW_BLOCK:
        the bucketing proof takes the block whole); returns ``result``."""
        key = key or result.name
        for node in self.created:
            node.meta[ROW_BLOCK] = (key, node is result)
        return result

    def fn(self, target: Callable, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return self.add("call_function", target, *args, **kwargs)

    def method(self, name: str, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return self.add("call_method", name, *args, **kwargs)

    def copy(self, node: torch.fx.Node, env: dict[torch.fx.Node, torch.fx.Node]) -> torch.fx.Node:
        args = torch.fx.node.map_arg(node.args, lambda a: env.get(a, a))
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: env.get(a, a))
        new = self.add(node.op, node.target, *args, like=node, **kwargs)
        env[node] = new
        return new




def _strip_type(node: Any) -> Any:
    """Through type changes that keep which entries are nonzero (``bool()``, ``to(dtype)``, ...)."""
    while _is(node, "bool", "to", "long", "int") and all(not isinstance(a, torch.fx.Node) for a in node.args[1:]):
        node = node.args[0]
    return node
