"""Classification rule: which collectives a graph may hold, and which run eagerly between graphs.

Reads: a node's target, its arguments (by the op's schema), the fake values of its inputs and
output, its users; the config's ``capture_collectives`` and ``dynamic_ops``; the nodes classified
dynamic so far (``ctx.eager_nodes``). Writes: nothing. Pure: ``(node, ctx) -> Reason | None``
like the rules in classify.py.

Dynamo turns ``torch.distributed`` calls into functional collectives
(``_c10d_functional.all_to_all_single`` + ``wait_tensor``, ``all_reduce``,
``all_gather_into_tensor``, ...). A collective is **static** (it joins a static region, and is
captured in its CUDA graph) when all of these hold:

* it is one of :data:`CAPTURED` (the functional all-to-all, with or without autograd, and
  all-reduce), issued by the user's code that Dynamo traced. FSDP2's and DDP's collectives never
  reach this rule: they run in hooks outside Dynamo's graphs, on their engines' streams, with
  buffers the engines free themselves;
* its sizes are fixed by shapes: the split sizes of an all-to-all are constants or backed size
  expressions (``None`` in the user's call: equal blocks), never values read from the device
  (``.tolist()`` gives unbacked symbols that change every call), and neither its input nor its
  output has a data-dependent size;
* every user is its ``wait_tensor``, none of them marked dynamic by the user, so the collective and
  its wait are captured together: a graph cannot wait for work it did not issue, and work issued
  inside a graph cannot be waited for outside it (an event recorded in a capture);
* the option ``capture_collectives`` is on (off by default: config/options.py says why).

A ``wait_tensor`` is static exactly when the collective it waits for is. Every other collective
(host-read split sizes, ``c10d`` ops, DTensor's and symmetric memory's, ops not listed) stays
dynamic, eagerly between graphs.

Waits inside a higher-order op count as waits. Before torch 2.12, ``all_to_all_single_autograd``
returns its result through an autograd.Function whose forward is ``wait_tensor``, which Dynamo
records as ``autograd_function_apply`` with the wait in its forward body: not a collective by its
target. Taken for an ordinary op, it joined the next static region, its collective stayed eager,
and the graph waited for that eager work only at its capture: every replay (and the staging copy of
the collective's output before it) read the receive buffer while NCCL was still writing it. So a
higher-order op whose bodies call collectives is classified by what they call: one whose only
collective is ``wait_tensor`` on its one input is a wait (static exactly when its collective is),
any other stays dynamic.

Why ranks cannot deadlock on a captured collective: NCCL matches collectives by the order each
rank issues them on a communicator, and a region's collectives are issued at the same point of
the program whatever runs the region: its eager warm-up calls, a capture (on a GPU a capture
executes nothing; the replay right after it issues the work), a graph replay, or an eager call
for a reason of one rank alone (a capture that failed, the replay-order rule, a moved
parameter). NCCL supports graph launches and ordinary launches of one communicator side by side
(``NCCL_GRAPH_MIXING_SUPPORT``, on by default). So a region may fall back on one rank and not on
another, as long as each call of it issues its collectives exactly once; the runtime keeps that
(runtime/executor.py: a region holding a collective is never recomputed for a backward; its
simulated capture stands for its first replay, as on a GPU). Exit: a graph holding NCCL work
keeps its communicator referenced until the graph is destroyed, so the graphs go before
``destroy_process_group`` (the backend's finalizer at exit, ``cgbackend.distributed.release``,
and ``torch._dynamo.reset()``, which releases the graphs of every backend it resets).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..common.fx_utils import attr_module, fake_value, iter_tensors, op_key, op_name, source_location
from ..frontend.marks import marked_op_reason
from ..common.reasons import Reason, Rule, reason_for
from .call_args import call_of

__all__ = ["CAPTURED", "WAIT", "rule_collective", "is_collective", "calls_collective", "inner_collectives", "is_wait",
           "why_eager", "collectives_by_op"]

_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor", "symm_mem"})

CAPTURED = frozenset({
    "_c10d_functional::all_to_all_single",
    "_c10d_functional_autograd::all_to_all_single",  # torch < 2.12: all_to_all_single_autograd
    "_c10d_functional::all_reduce",
})
"""Functional collectives a graph may hold when their sizes are fixed: the ones the tests run
captured (gloo with simulated graphs on a CPU; the ``multigpu`` expert-parallel scenario under NCCL).
Another op joins the list with a two-GPU test of its own."""

WAIT = "_c10d_functional::wait_tensor"

_SPLIT_ARGUMENTS = ("output_split_sizes", "input_split_sizes")


def _qualified(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return getattr(target, "_qualified_op_name", "")
    return ""


def is_collective(target: Any) -> bool:
    """A c10d / functional-collective operator, or a Python function of torch.distributed."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _qualified(target).split("::")[0] in _NAMESPACES
    module = getattr(target, "__module__", None) or ""
    return module.startswith("torch.distributed") and callable(target)


def _bodies(node: torch.fx.Node) -> list[torch.fx.GraphModule]:
    """The subgraphs a higher-order op calls (its ``get_attr`` arguments that are graph modules:
    the forward and backward bodies of Dynamo's ``autograd_function_apply``, a cond's branches)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return []
    bodies = (attr_module(arg) for arg in node.all_input_nodes)
    return [body for body in bodies if isinstance(body, torch.fx.GraphModule)]


def inner_collectives(node: torch.fx.Node) -> list[str]:
    """The collectives (qualified names, ``target`` for Python functions) the subgraphs of a
    higher-order op call, nested ones included; empty for any other node."""
    found: list[str] = []
    for body in _bodies(node):
        for inner in body.graph.nodes:
            if inner.op != "call_function":
                continue
            if is_collective(inner.target):
                found.append(_qualified(inner.target) or str(inner.target))
            found.extend(inner_collectives(inner))
    return found


def calls_collective(node: torch.fx.Node) -> bool:
    """Does ``node`` call a collective: a collective op or function, or a higher-order op whose
    bodies call one (a wait included)?"""
    return node.op == "call_function" and (is_collective(node.target) or bool(inner_collectives(node)))


def is_wait(node: torch.fx.Node) -> bool:
    """``wait_tensor``, or a higher-order op whose bodies call no collective but ``wait_tensor``
    on its one tensor input (torch < 2.12's ``all_to_all_single_autograd`` ends in one)."""
    if node.op != "call_function":
        return False
    if _qualified(node.target) == WAIT:
        return True
    inner = inner_collectives(node)
    return bool(inner) and all(name == WAIT for name in inner) and len(_waited(node)) == 1


def _waited(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The values a wait waits for: ``wait_tensor``'s argument, a higher-order op's inputs other
    than its bodies."""
    if _qualified(node.target) == WAIT:
        return [a for a in node.args[:1] if isinstance(a, torch.fx.Node)]
    return [a for a in node.all_input_nodes if a.op != "get_attr"]


def _unbacked(value: Any) -> set:
    if isinstance(value, torch.fx.Node):
        value = fake_value(value)
    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # values free_unbacked_symbols does not understand
        return set()


def _sizes_problem(node: torch.fx.Node) -> Optional[str]:
    """Why the collective's sizes are not fixed by shapes, or None."""
    if _qualified(node.target).endswith("::all_to_all_single"):
        call = call_of(node)
        for name in _SPLIT_ARGUMENTS:
            sizes = call.get(name) if call is not None else None
            if not isinstance(sizes, (list, tuple)):
                return f"its {name} could not be read"
            for size in sizes:
                if isinstance(size, torch.fx.Node):
                    size = fake_value(size)
                if isinstance(size, bool) or not isinstance(size, (int, torch.SymInt)):
                    return f"its {name} are not sizes ({type(size).__name__})"
                symbols = _unbacked(size)
                if symbols:
                    names = ", ".join(sorted(str(s) for s in symbols))
                    return (f"its {name} are read from device data ({names}: .tolist() / .item()); they "
                            "change every call")
    symbols: set = set()
    for inp in node.all_input_nodes:
        symbols |= _unbacked(inp)
    symbols |= _unbacked(node)
    if symbols:
        names = ", ".join(sorted(str(s) for s in symbols))
        return f"a data-dependent size ({names}) reaches it"
    if not any(True for _ in iter_tensors(fake_value(node))):
        return "its traced value is unknown"
    return None


def _user_marked(node: torch.fx.Node, ctx: Any) -> bool:
    key = op_key(node)
    config = getattr(ctx, "config", None)
    return (config is not None and key in config.dynamic_ops) or marked_op_reason(key) is not None


def why_eager(node: torch.fx.Node, ctx: Any = None) -> Optional[str]:
    """Why the collective ``node`` runs eagerly, or None: it may be captured (the module docstring
    lists the conditions). ``ctx``: the classify context (None: default options)."""
    name = _qualified(node.target)
    config = getattr(ctx, "config", None)
    if config is not None and not config.capture_collectives:
        return "the option capture_collectives is off"
    if is_wait(node):
        waited = _waited(node)
        producer = waited[0] if len(waited) == 1 else None
        if not (isinstance(producer, torch.fx.Node) and producer.op == "call_function"
                and _qualified(producer.target) in CAPTURED):
            return "it waits for a value that is not the output of a collective a graph may hold"
        eager = getattr(ctx, "eager_nodes", None)
        if eager is not None:
            return "it waits for a collective that runs eagerly" if producer in eager else None
        return "it waits for a collective that runs eagerly" if why_eager(producer, ctx) else None
    inner = inner_collectives(node)
    if inner:
        return (f"{node.target} calls {', '.join(sorted(set(inner)))} in its body, not one of the collectives "
                "cgbackend captures")
    if name not in CAPTURED:
        return f"{name or node.target} is not one of the collectives cgbackend captures"
    problem = _sizes_problem(node)
    if problem is not None:
        return problem
    for user in node.users:
        if not is_wait(user):
            return f"its output is read by {user.name} before or without a wait_tensor"
        if _user_marked(user, ctx):
            return "its wait_tensor is marked dynamic, and a graph cannot issue work it does not wait for"
    if not node.users:
        return "nothing waits for it"
    return None


def rule_collective(node: torch.fx.Node, ctx: Any) -> Optional[Reason]:
    if not calls_collective(node):
        return None
    why = why_eager(node, ctx)
    if why is None:
        return None
    return reason_for(node, Rule.COLLECTIVE,
                      f"a collective runs eagerly between graphs: {why}. Every rank issues it at the same "
                      "point of the program; captured are only functional all-to-all / all-reduce whose "
                      "sizes are fixed by shapes (passes/collectives.py)")


def collectives_by_op(nodes: list[torch.fx.Node]) -> list[dict[str, Any]]:
    """The collectives among ``nodes`` (a static region's, which its graphs issue) per op:
    ``{"op", "count", "source"}`` (source: the first call's line), for the report."""
    found: dict[str, dict[str, Any]] = {}
    for node in nodes:
        if calls_collective(node):
            op = op_name(node)
            if op not in found:
                found[op] = {"op": op, "count": 0, "source": source_location(node)[0]}
            found[op]["count"] += 1
    return list(found.values())
