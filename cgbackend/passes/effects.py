"""Side effects of Dynamo graph nodes: in-place writes, global-state changes, RNG use.

Reads: each node's target, arguments and fake value (``fake_value``); fake
tensors keep storage identity across views, which gives the aliasing.
Writes: nothing on the graph; returns :class:`Effects`.

The partitioner may run nodes in another order than the graph lists them
(a static node can move into an earlier static region). That is only safe
when every ordering constraint that is not a data edge is explicit. This pass
turns them into extra edges ``before -> after``:

* write after read / read after write / write after write on one storage;
* global-state nodes (autocast enter/exit, grad-mode switches) are barriers:
  every node keeps its side of them;
* random ops keep their relative order, so eager execution draws the same
  numbers as the original program.

Complexity: O(N * W) for W in-place writes, O(N) for the rest.
"""

from __future__ import annotations

import dataclasses
import operator
import torch
import torch.fx

from ..common.fx_utils import META_KEY, arg_of, callee_name, compute_nodes, fake_value, storage_ids

__all__ = ["Effects", "analyze_effects", "mutated_args", "is_global_state_node", "is_random_node"]

# In-place tensor methods whose trailing underscore does not mean "writes the data".
_NOT_DATA_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "pin_memory", "record_stream"}

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
}

# Functions that write some arguments in place without saying so in their name.
# name -> (argument positions, keyword names, condition keyword that must be truthy or None)
_HIDDEN_WRITES = {
    "batch_norm": ((1, 2), ("running_mean", "running_var"), "training"),
    "instance_norm": ((1, 2), ("running_mean", "running_var"), "use_input_stats"),
}

_RANDOM_NAMES = {
    "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d",
    "dropout3d", "native_dropout", "rand", "randn", "randint", "rand_like", "randn_like",
    "randint_like", "randperm", "bernoulli", "bernoulli_", "multinomial", "normal", "normal_",
    "uniform_", "exponential_", "geometric_", "log_normal_", "cauchy_", "random_", "poisson",
    "rrelu", "gumbel_softmax",
}

_GLOBAL_STATE_NAMES = {
    "_enter_autocast", "_exit_autocast", "_set_grad_enabled", "set_grad_enabled",
    "_enter_grad_mode", "_exit_grad_mode", "_set_deterministic_algorithms",
    "_enter_inference_mode", "_exit_inference_mode",
}


@dataclasses.dataclass
class Effects:
    """What :func:`analyze_effects` found. Node keys are nodes of the analysed graph."""

    writes: dict[torch.fx.Node, set[int]]
    """In-place writers -> storage ids they write."""
    barriers: list[torch.fx.Node]
    """Global-state nodes in graph order."""
    random_nodes: list[torch.fx.Node]
    """Random ops in graph order."""
    extra_preds: dict[torch.fx.Node, set[torch.fx.Node]]
    """Ordering edges that are not data edges: node -> nodes that must run before it."""
    input_writes: dict[torch.fx.Node, list[torch.fx.Node]]
    """In-place writer -> argument nodes it writes (the tensors named in the call)."""

    def preds(self, node: torch.fx.Node) -> set[torch.fx.Node]:
        return self.extra_preds.get(node, set())


def is_global_state_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and callee_name(node) in _GLOBAL_STATE_NAMES


def is_random_node(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if node.meta.get(META_KEY, {}).get("random"):
        return True
    name = callee_name(node)
    if name in _RANDOM_NAMES:
        if "dropout" in name:
            # F.dropout(x, p, training=False) draws nothing.
            training, p = arg_of(node, 2, "training", True), arg_of(node, 1, "p", 0.5)
            return not (training is False or p == 0 or p == 0.0)
        return True
    return False


def mutated_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Argument nodes whose data ``node`` writes in place (empty for pure nodes). A call that runs a
    piece of graph (moe/keep_skips.py) names the arguments it writes in
    ``meta["cgbackend"]["writes"]`` (positions)."""
    if node.op not in ("call_function", "call_method"):
        return []
    target = node.target
    written: list = [node.args[i] for i in node.meta.get(META_KEY, {}).get("writes", ())]
    if node.op == "call_method":
        name = str(target)
        if name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_WRITES:
            written.append(node.args[0])
    else:
        if isinstance(target, torch._ops.OpOverload):
            for i, arg in enumerate(target._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    if i < len(node.args):
                        written.append(node.args[i])
                    elif arg.name in node.kwargs:
                        written.append(node.kwargs[arg.name])
        elif target in _INPLACE_OPERATORS or target is operator.setitem:
            written.append(node.args[0])
        else:
            name = callee_name(node)
            if name.endswith("_") and not name.endswith("__") and node.args:
                written.append(node.args[0])
            hidden = _HIDDEN_WRITES.get(name)
            if hidden is not None:
                positions, keywords, condition = hidden
                flag = node.kwargs.get(condition)
                if flag is None and name == "batch_norm" and len(node.args) > 5:
                    flag = node.args[5]
                if flag is None or flag:
                    written.extend(node.args[p] for p in positions if p < len(node.args))
                    written.extend(node.kwargs[k] for k in keywords if k in node.kwargs)
    if "out" in node.kwargs:
        written.append(node.kwargs["out"])
    if node.kwargs.get("inplace") is True:
        written.append(node.args[0])
    nodes: list[torch.fx.Node] = []
    for w in written:
        for item in (w if isinstance(w, (tuple, list)) else (w,)):
            if isinstance(item, torch.fx.Node) and item not in nodes:
                nodes.append(item)
    return nodes


def _touched(node: torch.fx.Node) -> set[int]:
    """Storages a node reads (its tensor inputs) or creates aliases of (its output)."""
    ids = storage_ids(fake_value(node))
    for inp in node.all_input_nodes:
        ids |= storage_ids(fake_value(inp))
    return ids


def analyze_effects(gm: torch.fx.GraphModule) -> Effects:
    nodes = compute_nodes(gm)
    writes: dict[torch.fx.Node, set[int]] = {}
    input_writes: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in nodes:
        args = mutated_args(node)
        if args:
            ids: set[int] = set()
            for a in args:
                ids |= storage_ids(fake_value(a))
            writes[node] = ids
            input_writes[node] = args

    extra: dict[torch.fx.Node, set[torch.fx.Node]] = {}

    def add_edge(before: torch.fx.Node, after: torch.fx.Node) -> None:
        if before is not after:
            extra.setdefault(after, set()).add(before)

    if writes:
        touched = [(n, _touched(n)) for n in nodes]
        position = {n: i for i, (n, _) in enumerate(touched)}
        for writer, ids in writes.items():
            if not ids:
                continue
            w = position[writer]
            for i, (other, other_ids) in enumerate(touched):
                if i != w and other_ids & ids:
                    if i < w:
                        add_edge(other, writer)
                    else:
                        add_edge(writer, other)

    barriers = [n for n in nodes if is_global_state_node(n)]
    if barriers:
        # Chain: every node depends on the last barrier before it; each barrier on every node
        # since the previous barrier. Transitively that orders each node against every barrier.
        last_barrier = None
        since_last: list[torch.fx.Node] = []
        for node in nodes:
            if node in barriers:
                for other in since_last:
                    add_edge(other, node)
                if last_barrier is not None:
                    add_edge(last_barrier, node)
                last_barrier = node
                since_last = []
            else:
                if last_barrier is not None:
                    add_edge(last_barrier, node)
                since_last.append(node)

    random_nodes = [n for n in nodes if is_random_node(n)]
    for before, after in zip(random_nodes, random_nodes[1:]):
        add_edge(before, after)

    return Effects(writes=writes, barriers=barriers, random_nodes=random_nodes,
                   extra_preds=extra, input_writes=input_writes)

