"""Outputs that alias something: returned as eager returns them.

A region's outputs live in graph memory, which the next replay overwrites, so the executor hands the
caller copies of them. An output that eager returns as a *view* must not become a copy: writes
through ``x[1:]`` or ``model.p[0]`` must reach ``x`` and ``p``, a view kept of a buffer
(``cache[:n]``) must follow the buffer, and ``y.view(-1)`` must share memory with the returned
``y``. This module decides once per Dynamo graph (:func:`output_aliases`, pure: graph in, plan out)
which outputs alias what, from the fake values' storages, and rebuilds them per call
(:class:`OutputBuilder`):

* ``INPUT`` groups: outputs that are views of a graph input (a user tensor, a parameter, a buffer),
  through view ops and in-place ops that return their argument. Rebuilt by running the same view
  ops eagerly on the real input (a few host-side ops, no kernels), so strides, offset, ``_base``
  and autograd history are eager's own.
* ``OUTPUT`` groups: outputs that are views of another output ``y`` (``y.view(-1)``). ``y`` is
  copied out of graph memory as before, the views are rebuilt on that copy.
* ``SHARED`` groups: several outputs viewing one tensor the model does not return (``z.view(-1)``,
  ``z[1:].t()``). When they come out of one graph storage they are copied together, as one block
  covering all of them, and returned as views of it with their strides and relative offsets, so
  they share memory as eagerly. Exception: views that do not overlap and cover less than half of
  that block are copied one by one (a copy of the whole block would cost more than the views).

The view ops are replayed from the graph: their other arguments must be graph inputs, values
regions hand on, or size arithmetic on them. An output whose view cannot be replayed that way is
rebuilt with ``as_strided`` when its memory is the input's (the region ran eagerly or read the input
in place); otherwise it stays a copy, counted as ``output_alias_lost`` (an error with ``strict``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..common.fx_utils import fake_value
from ..passes.effects import mutated_args
from .capture import non_overlapping
from .tangents import relay_copies

__all__ = ["INPUT", "OUTPUT", "SHARED", "AliasGroup", "OutputAliases", "OutputBuilder", "foreach_copy", "output_aliases"]

log = logging.getLogger(__name__)

INPUT, OUTPUT, SHARED = "input", "output", "shared"

foreach_copy = getattr(torch, "_foreach_copy_", None)
"""Feature-tested private API (present in torch 2.11 and 2.13): several copies, one launch."""

_VIEW, _SAME = "view", "same"

_SIZE_METHODS = {"size", "stride", "dim", "numel", "storage_offset", "__getitem__"}
_SIZE_FUNCTIONS = {getattr(operator, n) for n in (
    "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge",
    "getitem", "and_", "or_", "not_")} | {getattr, math.ceil, math.floor, math.sqrt, min, max, int}
_SIZE_FUNCTION_NAMES = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "sym_int", "sym_float",
                        "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sqrt", "_sym_sqrt"}


@dataclasses.dataclass(frozen=True)
class AliasGroup:
    kind: str
    """INPUT, OUTPUT or SHARED."""
    root: torch.fx.Node
    """The graph input, the returned output, or the unreturned tensor the members view."""
    members: tuple[torch.fx.Node, ...]
    """Output nodes that view the root (for OUTPUT groups, not the root itself)."""


@dataclasses.dataclass
class OutputAliases:
    """What :func:`output_aliases` found for one graph."""

    groups: tuple[AliasGroup, ...] = ()
    recipe: Optional[torch.fx.GraphModule] = None
    """Computes the rebuilt outputs (``rebuilt``, in order) from the values of ``leaves``."""
    leaves: tuple[torch.fx.Node, ...] = ()
    rebuilt: tuple[torch.fx.Node, ...] = ()
    unreplayable: dict = dataclasses.field(default_factory=dict)
    """INPUT/OUTPUT members whose view ops cannot be replayed -> why."""

    def group_of(self, node: torch.fx.Node) -> Optional[AliasGroup]:
        for group in self.groups:
            if node in group.members:
                return group
        return None


def _storage(value: Any) -> Optional[int]:
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _alias_step(node: torch.fx.Node) -> Optional[tuple[torch.fx.Node, str]]:
    """(the tensor node ``node`` aliases, VIEW or SAME), or None when it makes new memory.

    SAME: an in-place op returning its argument (or an op that returns it as it is); nothing to
    replay. VIEW: the output shares its argument's storage (a view op; an element of split/chunk)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    source = node.args[0]
    if not isinstance(source, torch.fx.Node):
        return None
    value, source_value = fake_value(node), fake_value(source)
    if isinstance(value, torch.Tensor):
        storage = _storage(value)
        if storage is None:
            return None
        if value is source_value:
            return source, _SAME
        if isinstance(source_value, torch.Tensor):
            if _storage(source_value) != storage:
                return None
            if source in mutated_args(node):
                return None  # an in-place op that returns something other than its argument
            return source, _VIEW
        if isinstance(source_value, (tuple, list)) and node.target is operator.getitem:
            if any(_storage(v) == storage for v in source_value if isinstance(v, torch.Tensor)):
                return source, _VIEW
        return None
    if isinstance(value, (tuple, list)) and isinstance(source_value, torch.Tensor):
        storage = _storage(source_value)
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        if tensors and storage is not None and all(_storage(v) == storage for v in tensors) \
                and source not in mutated_args(node):
            return source, _VIEW  # split / chunk / unbind
    return None


def _is_size_arithmetic(node: torch.fx.Node) -> bool:
    """A host-side computation on sizes (no tensor result, no side effect): safe to run again."""
    if isinstance(fake_value(node), torch.Tensor):
        return False
    if node.op == "call_method":
        return node.target in _SIZE_METHODS
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target._opname in _SIZE_FUNCTION_NAMES
    try:
        if target in _SIZE_FUNCTIONS:
            return True
    except TypeError:  # unhashable target
        return False
    return getattr(target, "__name__", "") in _SIZE_FUNCTION_NAMES


def _concrete(value: Any) -> bool:
    """A plain number (or sizes) fixed for the graph, not a symbolic one."""
    if isinstance(value, (tuple, list)):
        return all(_concrete(v) for v in value)
    return isinstance(value, (int, float, bool)) and not isinstance(value, torch.Tensor)


class _Unreplayable(Exception):
    pass


def output_aliases(gm: torch.fx.GraphModule, available: set[torch.fx.Node]) -> OutputAliases:
    """Which outputs of ``gm`` alias an input, another output or each other (pure).

    ``available``: nodes whose runtime values the executor still holds when it assembles the
    outputs (graph inputs, values regions hand on). Complexity: O(outputs x view-chain length)."""
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outs: list[torch.fx.Node] = []
    for n in output_node.all_input_nodes:
        if isinstance(fake_value(n), torch.Tensor) and n not in outs:
            outs.append(n)
    steps: dict[torch.fx.Node, tuple[torch.fx.Node, str]] = {}
    root_of: dict[torch.fx.Node, torch.fx.Node] = {}
    for out in outs:
        node = out
        while node.op != "placeholder":
            step = steps.get(node) or _alias_step(node)
            if step is None:
                break
            steps[node] = step
            node = step[0]
        root_of[out] = node
    by_root: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for out in outs:
        by_root.setdefault(root_of[out], []).append(out)
    groups = []
    out_set = set(outs)
    for root, members in by_root.items():
        if root.op == "placeholder":
            groups.append(AliasGroup(INPUT, root, tuple(members)))
        elif root in out_set:
            rest = tuple(m for m in members if m is not root)
            if rest:
                groups.append(AliasGroup(OUTPUT, root, rest))
        elif len(members) > 1:
            groups.append(AliasGroup(SHARED, root, tuple(members)))
    result = OutputAliases(groups=tuple(groups))
    replay = [g for g in groups if g.kind != SHARED]
    if replay:
        _build_recipe(gm, replay, steps, available, result)
    return result


def _build_recipe(gm: torch.fx.GraphModule, groups: list[AliasGroup], steps: dict,
                  available: set[torch.fx.Node], result: OutputAliases) -> None:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    leaves: list[torch.fx.Node] = []

    def leaf(node: torch.fx.Node) -> torch.fx.Node:
        placeholder = graph.placeholder(f"leaf{len(leaves)}")
        leaves.append(node)
        env[node] = placeholder
        return placeholder

    def value(node: torch.fx.Node) -> Any:
        if node in env:
            return env[node]
        step = steps.get(node)
        if step is None and _concrete(fake_value(node)):
            return fake_value(node)  # a size Dynamo specialized: a constant of this graph
        if step is not None and step[1] == _SAME:
            env[node] = value(step[0])
        elif step is not None or _is_size_arithmetic(node):
            # A view op is always replayed, never read from a region: its value there is graph memory.
            env[node] = graph.node_copy(node, value)
        elif node in available:
            return leaf(node)
        else:
            raise _Unreplayable(f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)}) "
                                "is computed inside a region and not handed on")
        return env[node]

    for group in groups:
        leaf(group.root)
    rebuilt, outputs = [], []
    for group in groups:
        for member in group.members:
            try:
                outputs.append(value(member))
            except _Unreplayable as exc:
                result.unreplayable[member] = str(exc)
                continue
            rebuilt.append(member)
    if not rebuilt:
        return
    graph.output(tuple(outputs))
    graph.eliminate_dead_code()
    graph.lint()
    result.recipe = torch.fx.GraphModule(gm, graph, class_name="cgbackend_output_views")
    result.leaves = tuple(leaves)
    result.rebuilt = tuple(rebuilt)


class OutputBuilder:
    """Assembles a call's return value from the executor's values (see the module docstring)."""

    def __init__(self, aliases: OutputAliases, template: Any, slot_of: dict, shared: Any) -> None:
        self.aliases = aliases
        self.template = template
        self.slot_of = slot_of
        self.shared = shared
        rebuilt = set(aliases.rebuilt) | set(aliases.unreplayable)
        self.plain = [n for n in _template_nodes(template) if n not in rebuilt]
        self.output_roots = {g.root for g in aliases.groups if g.kind == OUTPUT}
        self.shared_groups = [g for g in aliases.groups if g.kind == SHARED]
        self.fallback = [(m, aliases.group_of(m)) for m in aliases.unreplayable]
        self._warned: set = set()
        self._plans: list = []
        """Which plain outputs lay in graph memory, by position, for the latest few sets of tensor
        objects returned (a replayed graph returns its static outputs; a region with caller graphs
        alternates between theirs): reused while a call returns the same objects and no graph
        memory was added since."""

    def build(self, env: list, anchor: Optional[Callable[[dict], None]] = None) -> Any:
        slot_of = self.slot_of
        raw = {n: env[slot_of[n]] for n in self.plain}
        values = dict(raw)
        done: set = set()
        for group in self.shared_groups:
            done |= self._copy_together(group, values)
        self._own_memory([n for n in self.plain if n not in done] if done else self.plain, values)
        if anchor is not None:
            anchor(values)
        aliases = self.aliases
        counters = self.shared.counters
        if aliases.recipe is not None:
            feeds = [values[n] if n in self.output_roots else env[slot_of[n]] for n in aliases.leaves]
            for node, view in zip(aliases.rebuilt, aliases.recipe(*feeds)):
                values[node] = view
            counters.output_views += len(aliases.rebuilt)
        for node, group in self.fallback:
            values[node] = self._fallback(node, group, env, values)
        return torch.fx.node.map_arg(self.template, values.__getitem__)

    def _own_memory(self, nodes: list, values: dict) -> None:
        """Copies of the tensors in graph memory (a later replay would overwrite them); the rest as
        they are. One allocation per tensor, as ``clone()`` makes, but one ``_foreach_copy_`` for
        all of them rather than a kernel launch each: on the zoo's small models the per-output
        clones were the largest item of the host time a call spent beyond reduce-overhead's (which
        copies nothing and raises when an overwritten output is read). Tensors autograd must see
        copied (a training call's outputs) keep ``clone()``."""
        storages = self.shared.persistent_storages
        callers = self.shared.caller_storages
        if not storages and not callers:
            return
        sources = [values[n] for n in nodes]
        plan = None
        for known in self._plans:
            if known.holds(nodes, storages, callers, sources):
                plan = known
                break
        if plan is None:
            plan = _OwnPlan(nodes, storages, callers, sources)
            if nodes is self.plain:
                self._plans = [plan] + self._plans[:_PLANS_KEPT - 1]
        if plan.handed:
            # A caller graph's outputs (runtime/caller_graphs.py): a new tensor object on the same memory,
            # which the graph does not write again while it (or anything made from it) is alive.
            for i in plan.handed:
                values[nodes[i]] = sources[i].detach()
            self.shared.counters.outputs_handed += len(plan.handed)
        if not plan.copied:
            return
        batch: list = []
        grad = torch.is_grad_enabled()
        self.shared.counters.output_clones += len(plan.copied)
        traced = []
        for i in plan.copied:
            value = sources[i]
            if grad and value.requires_grad:
                traced.append(i)
            else:
                batch.append(nodes[i])
        if traced:
            # clone() that hands the incoming gradients on as the region's own (tangents.py).
            copies = relay_copies([sources[i] for i in traced], self.shared.counters)
            for i, copy in zip(traced, copies):
                values[nodes[i]] = copy
        if len(batch) == 1 or (batch and foreach_copy is None):
            for node in batch:
                values[node] = values[node].clone()
        elif batch:
            copies = copy_out([values[n] for n in batch])
            for node, copy in zip(batch, copies):
                values[node] = copy

    def _copy_together(self, group: AliasGroup, values: dict) -> set:
        """Members of a SHARED group in one graph storage: one copy of the block they cover, the
        members as views of it with their own strides and relative offsets."""
        tensors = [values[m] for m in group.members]
        if any(not isinstance(t, torch.Tensor) or t.numel() == 0 or not non_overlapping(t) for t in tensors):
            return set()
        ptr = tensors[0].untyped_storage().data_ptr()
        if ptr not in self.shared.persistent_storages or any(
                t.untyped_storage().data_ptr() != ptr or t.dtype != tensors[0].dtype for t in tensors):
            return set()
        spans = [(t.storage_offset(), t.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())))
                 for t in tensors]
        lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
        ordered = sorted(spans)
        overlap = any(ordered[i + 1][0] < ordered[i][1] for i in range(len(ordered) - 1))
        if not overlap and hi - lo > 2 * sum(t.numel() for t in tensors):
            return set()
        first = tensors[0]
        block = torch.empty(hi - lo, dtype=first.dtype, device=first.device)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        with torch.enable_grad() if grad else torch.no_grad():
            for t in tensors:
                block.as_strided(t.shape, t.stride(), t.storage_offset() - lo).copy_(t)
        for m, t in zip(group.members, tensors):
            values[m] = block.as_strided(t.shape, t.stride(), t.storage_offset() - lo)
        counters = self.shared.counters
        counters.output_clones += 1
        counters.output_views += len(tensors)
        return set(group.members)

    def _fallback(self, node: torch.fx.Node, group: AliasGroup, env: list, values: dict) -> Any:
        """A view whose ops cannot be replayed: ``as_strided`` on the real base when the value lies
        in the base's memory, else a counted copy."""
        value = env[self.slot_of[node]]
        if group.kind == INPUT:
            base = env[self.slot_of[group.root]]
            offset = value.storage_offset() if _same_storage(value, base) else None
        else:
            raw_root, base = env[self.slot_of[group.root]], values[group.root]
            offset = None
            if _same_storage(value, raw_root) and base.stride() == raw_root.stride():
                offset = base.storage_offset() + value.storage_offset() - raw_root.storage_offset()
        counters = self.shared.counters
        if offset is not None:
            counters.output_views += 1
            return base.as_strided(value.shape, value.stride(), offset)
        counters.output_alias_lost += 1
        detail = (f"cgbackend: output {node.name} is a view of {group.root.name}, but its view ops cannot "
                  f"be replayed ({self.aliases.unreplayable[node]}): it is returned as a copy")
        if self.shared.config.strict:
            raise RuntimeError(detail + "; strict=True forbids that")
        if node not in self._warned:
            self._warned.add(node)
            log.warning("%s (counted as output_alias_lost)", detail)
        own = {node: value}
        self._own_memory([node], own)
        return own[node]


_foreach_clone = getattr(torch, "_foreach_clone", None)
"""Feature-tested private API (torch 2.13; absent in 2.11): a clone of each tensor, one call."""
_foreach_mul = getattr(torch, "_foreach_mul", None)

# Multiplying by True is exact in these dtypes (-0.0, infinities, subnormals and integers kept; a
# NaN stays a NaN, its payload may not); complex numbers would not be (inf * 0 in the product).
_MUL_EXACT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8,
                        torch.int8, torch.int16, torch.int32, torch.int64, torch.bool})

OUTPUT_COPY = "auto"
"""How several outputs are copied out of graph memory in one call (:func:`copy_out`):
``"clone"`` (``torch._foreach_clone``), ``"mul"`` (``torch._foreach_mul(tensors, True)`` on CUDA: one
launch, the outputs allocated in C++), ``"copy"`` (one ``empty_like`` each, then one
``_foreach_copy_``), or ``"auto"``: clone where torch has it, else mul where it applies, else copy."""


def copy_out(tensors: list) -> list:
    """New tensors equal to ``tensors`` (same dtype, shape, strides, device), each in its own
    storage, made with one foreach call per device and dtype: per output, a Python ``empty_like``
    cost about 3 us of host time on an H100 host, and the zoo's calls return 5. A foreach
    op given several dtypes at once takes its per-tensor path (a launch and an allocation each):
    Mistral's two int64 scalars beside its five float outputs made its copies 120 us a call against
    llama's 48 (H100)."""
    first = tensors[0]
    kind = (first.device, first.dtype)
    for t in tensors:
        if (t.device, t.dtype) != kind:
            break
    else:
        return _copy_alike(tensors)
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    copies: list = [None] * len(tensors)
    for positions in groups.values():
        for i, copy in zip(positions, _copy_alike([tensors[i] for i in positions])):
            copies[i] = copy
    return copies


def _copy_alike(tensors: list) -> list:
    """copy_out of tensors of one device and dtype."""
    mode = OUTPUT_COPY
    if mode in ("auto", "clone") and _foreach_clone is not None:
        return _foreach_clone(tensors)
    if mode in ("auto", "mul") and _foreach_mul is not None:
        first = tensors[0]
        if first.is_cuda and first.dtype in _MUL_EXACT:
            return _foreach_mul(tensors, True)
    copies = [torch.empty_like(t) for t in tensors]
    foreach_copy(copies, tensors)
    return copies


_PLANS_KEPT = 4


class _OwnPlan:
    """Which outputs (positions in ``nodes``) lie in graph memory and are copied, and which are a
    caller graph's and are handed out as aliases, decided for the tensor objects ``sources``. It
    holds for a later call that passes the same ``nodes`` list and the same tensor objects (weakly
    referenced: a plan keeps no graph memory alive) while the sets of graph storages and caller
    graph storages have not changed size (graph storages are only added; caller graph storages go
    with their entry, whose tensor objects then die, so no plan made for them holds any more)."""

    __slots__ = ("nodes", "storages", "size", "callers", "callers_size", "refs", "copied", "handed")

    def __init__(self, nodes: list, storages: set, callers: set, sources: list) -> None:
        self.nodes = nodes
        self.storages = storages
        self.size = len(storages)
        self.callers = callers
        self.callers_size = len(callers)
        refs: list = []
        copied: list = []
        handed: list = []
        for i, value in enumerate(sources):
            if not isinstance(value, torch.Tensor):
                refs.append(None)
                continue
            refs.append(weakref.ref(value))
            if not value.numel():
                continue
            ptr = value.untyped_storage().data_ptr()
            if ptr in storages:
                copied.append(i)
            elif ptr in callers:
                handed.append(i)
        self.refs = tuple(refs)
        self.copied = tuple(copied)
        self.handed = tuple(handed)

    def holds(self, nodes: list, storages: set, callers: set, sources: list) -> bool:
        if nodes is not self.nodes or storages is not self.storages or len(storages) != self.size \
                or callers is not self.callers or len(callers) != self.callers_size:
            return False
        for ref, value in zip(self.refs, sources):
            if ref is None:
                if isinstance(value, torch.Tensor):
                    return False
            elif ref() is not value:
                return False
        return True


def _same_storage(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _template_nodes(template: Any) -> list[torch.fx.Node]:
    nodes: list[torch.fx.Node] = []
    torch.fx.node.map_arg(template, lambda n: nodes.append(n) if n not in nodes else None)
    return nodes
