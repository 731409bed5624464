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

from ..common.fx_utils import META_KEY, callee_name, compute_nodes, fake_value, storage_ids
from .call_args import argument, call_of, signatures

__all__ = ["Effects", "analyze_effects", "mutated_args", "is_global_state_node", "is_random_node"]

# In-place tensor methods whose trailing underscore does not mean "writes the data".
_NOT_DATA_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "pin_memory", "record_stream"}

_INPLACE_OPERATORS = {
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
    operator.ilshift, operator.irshift, operator.imatmul,
}

# Functions that write some arguments in place without saying so in their name or schema:
# name -> (parameters written, the parameter that must be true for the write)
_HIDDEN_WRITES = {
    "batch_norm": (("running_mean", "running_var"), "training"),
    "instance_norm": (("running_mean", "running_var"), "use_input_stats"),
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
            training, p = argument(node, "training", True), argument(node, "p", 0.5)
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
    name = callee_name(node)
    if node.op == "call_function" and (target in _INPLACE_OPERATORS or target is operator.setitem):
        written.append(node.args[0])
    elif node.op == "call_method" or not isinstance(target, torch._ops.OpOverload):
        if name.endswith("_") and not name.endswith("__") and name not in _NOT_DATA_WRITES and node.args:
            written.append(node.args[0])
    call = call_of(node) if _may_write(node, name) else None
    if call is not None:
        # The schema's own marks (``Tensor(a!)``: in-place overloads, ``out=``), the ``inplace``
        # flag of torch.nn.functional's activations (``leaky_relu(x, 0.1, True)``) and the writes
        # no schema marks, each read the way the op reads it: positional or keyword, or default.
        written.extend(call.args[w] for w in call.written)
        written.append(call.get("out"))
        if call.get("inplace") is True:
            written.append(next(iter(call.args.values())))  # the input: the signature's first parameter
        hidden = _HIDDEN_WRITES.get(name)
        if hidden is not None and call.get(hidden[1], True):
            written.extend(call.get(p) for p in hidden[0])
    elif "out" in node.kwargs or node.kwargs.get("inplace") is True:  # an op without a known signature
        written.append(node.kwargs.get("out", node.args[0] if node.args else None))
    nodes: list[torch.fx.Node] = []
    for w in written:
        for item in (w if isinstance(w, (tuple, list)) else (w,)):
            if isinstance(item, torch.fx.Node) and item not in nodes:
                nodes.append(item)
    return nodes


def _may_write(node: torch.fx.Node, name: str) -> bool:
    """Can the op of ``node`` write an argument, by its signatures (cached per op)? Binding a call
    costs microseconds; most nodes of a graph cannot write."""
    if name in _HIDDEN_WRITES:
        return True
    method = node.op == "call_method"
    try:
        candidates = signatures(str(node.target) if method else node.target, method)
    except TypeError:  # an unhashable target
        return True
    return any(written or _WRITE_PARAMS & sig.parameters.keys() for sig, written in candidates) \
        or not candidates


_WRITE_PARAMS = {"inplace", "out"}


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

