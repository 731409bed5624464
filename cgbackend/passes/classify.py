"""Classify every node of a Dynamo graph as static (graphable) or dynamic (eager), with a reason.

Reads: node targets, arguments, fake values (``fake_value``), ``stack_trace``
and ``nn_module_stack``; the config's ``dynamic_ops`` / ``dynamic_modules``;
marks made with :func:`cgbackend.mark_dynamic`.
Writes: nothing on the graph; returns :class:`Classification`.

The rules are small predicates ``(node, ctx) -> Reason | None`` tried in the
order of :data:`RULES`; the first that answers decides. A node no rule names is
static. Placeholders and the output node are not classified. Global-state
nodes (autocast, grad mode) are static here: the partitioner turns them
dynamic when a region boundary cuts their block.

Complexity: O(N) over nodes, plus the size of each node's fake value.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
from typing import Callable, Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..config import Config
from ..common.fx_utils import (callee_name, class_name, compute_nodes, fake_value, iter_tensors,
                        module_stack, op_key, op_name, storage_ids)
from ..frontend.marks import marked_module_reason, marked_op_reason
from ..common.reasons import Reason, Rule, reason_for
from .call_args import argument
from .effects import mutated_args
from .op_tags import tagged_dynamic_output_shape

__all__ = ["Classification", "ClassifyContext", "NodeVerdict", "RULES", "classify"]


@dataclasses.dataclass(frozen=True)
class NodeVerdict:
    static: bool
    reason: Optional[Reason] = None


@dataclasses.dataclass
class Classification:
    verdicts: dict[torch.fx.Node, NodeVerdict]
    compute_device: str
    training: bool
    grad_enabled: bool = True
    """Grad mode when the graph was traced (the state its grad-mode switches start from)."""

    def is_static(self, node: torch.fx.Node) -> bool:
        return self.verdicts[node].static

    def dynamic_nodes(self) -> list[torch.fx.Node]:
        return [n for n, v in self.verdicts.items() if not v.static]


@dataclasses.dataclass
class ClassifyContext:
    config: Config
    compute_device: str
    training: bool
    host_nodes: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    """Nodes whose tensors live on the host (CPU work inside a device graph)."""
    grad_input_storages: set[int] = dataclasses.field(default_factory=set)
    """Storages of graph inputs that require grad."""
    eager_nodes: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    """Nodes classified dynamic so far (graph order): a collective's wait follows its verdict."""


_SYNC_METHODS = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                 "nonzero_static_host", "_local_scalar_dense"}
_SYNC_FUNCTIONS = {"_local_scalar_dense", "synchronize", "item"}
_TO_HOST_METHODS = {"cpu", "numpy", "tolist"}
# Ops that read device data on the host to size their output, even when a torch._check has fixed
# the traced size, and that PyTorch's torch.Tag.dynamic_output_shape does not name (passes/op_tags.py
# finds the tagged ones: nonzero, argwhere, bincount, masked_select, unique_consecutive, _unique,
# _unique2, unique_dim, one_hot without num_classes). Each entry says why the tag misses it.
_SYNCING_OPS = {
    "unique": "torch.unique is a Python function choosing _unique2 / unique_dim; Dynamo records the "
              "Python name",
}
# Custom operators of libraries known to read device data on the host inside (opaque to tracing).
_SYNCING_CUSTOM_OPS = {
    "transformers::grouped_mm_fallback": "loops over offsets.tolist() (one host sync per call)",
}
_TO_DEVICE_METHODS = {"cuda", "to"}


def _device_type(t: torch.Tensor) -> str:
    return t.device.type


def _node_tensors(node: torch.fx.Node) -> list[torch.Tensor]:
    return list(iter_tensors(fake_value(node)))


def _input_tensors(node: torch.fx.Node) -> list[tuple[torch.fx.Node, torch.Tensor]]:
    out = []
    for inp in node.all_input_nodes:
        for t in iter_tensors(fake_value(inp)):
            out.append((inp, t))
    return out


def _unbacked(value) -> set:
    try:
        return set(free_unbacked_symbols(value))
    except Exception:  # values free_unbacked_symbols does not understand (opaque objects)
        return set()

from .collectives import rule_collective  # noqa: E402  (a rule kept in its own file)


# --------------------------------------------------------------------------- rules

def rule_user_marked(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    key = op_key(node)
    if key in ctx.config.dynamic_ops:
        return reason_for(node, Rule.USER_MARKED, f"operator {key} is listed in the option dynamic_ops")
    marked = marked_op_reason(key)
    if marked is not None:
        return reason_for(node, Rule.USER_MARKED, f"operator {key} was marked dynamic: {marked}")
    for path, cls in module_stack(node):
        reason = marked_module_reason(cls)
        if reason is not None:
            return reason_for(node, Rule.USER_MARKED,
                              f"module {path or '<root>'} ({class_name(cls)}) was marked dynamic: {reason}")
        for pattern in ctx.config.dynamic_modules:
            if path and fnmatch.fnmatchcase(path, pattern):
                return reason_for(node, Rule.USER_MARKED,
                                  f"module {path} matches dynamic_modules pattern {pattern!r}")
    return None


def rule_unsafe_tag(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    target = node.target
    if tag is None or node.op != "call_function":
        return None
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = [getattr(target, o) for o in target.overloads()]
    elif isinstance(target, torch._ops.OpOverload):
        overloads = [target]
    else:
        return None
    if any(tag in o.tags for o in overloads):
        return reason_for(node, Rule.UNSAFE_TAG,
                          f"operator {op_key(node)} is tagged torch.Tag.cudagraph_unsafe")
    return None


def _bool_index(node: torch.fx.Node) -> bool:
    """x[mask] with a boolean mask: a nonzero under the hood."""
    if not (node.op == "call_function" and node.target is operator.getitem and len(node.args) > 1):
        return False
    index = node.args[1]
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.fx.Node) and isinstance(fake_value(i), torch.Tensor)
               and fake_value(i).dtype == torch.bool for i in items)


def _syncing_op(node: torch.fx.Node) -> bool:
    name = callee_name(node)
    if name in _SYNCING_OPS or op_key(node) in _SYNCING_CUSTOM_OPS:
        return True
    if tagged_dynamic_output_shape(node) is not None:
        return True
    # The rest is conditional on arguments, which a tag on the operator cannot say.
    # where(cond): composite over nonzero, and aten.where's other overloads are element-wise.
    if name == "where" and len(node.args) + len(node.kwargs) == 1:  # only the condition
        return True
    if name == "histc":
        # histc reads the data's min and max on the host only when its range is empty (min == max,
        # the default); with a range given (tokens per expert: min=0, max=E-1) it stays on the device.
        lo, hi = argument(node, "min", 0), argument(node, "max", 0)
        return not (isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo != hi)
    # repeat_interleave: only the tensor-repeats overload is tagged, and output_size fixes it.
    if name == "repeat_interleave" and argument(node, "output_size") is None:
        repeats = argument(node, "repeats")
        return isinstance(repeats, torch.fx.Node) and isinstance(fake_value(repeats), torch.Tensor)
    return _bool_index(node)  # aten.index is tagged only for masks; Dynamo records operator.getitem


def rule_host_sync(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    name = callee_name(node)
    if not ((node.op == "call_method" and name in _SYNC_METHODS)
            or (node.op == "call_function" and name in _SYNC_FUNCTIONS)):
        return None
    if name == "synchronize":
        detail = "a device synchronize stops the host until the GPU is idle; it cannot be replayed"
    else:
        detail = (f"{op_name(node)} copies a device value to the host and waits for it; "
                  "a graph cannot return host values and the value changes every call")
    return reason_for(node, Rule.HOST_SYNC, detail)


def rule_data_dependent_shape(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    out_syms = _unbacked(fake_value(node))
    in_syms: set = set()
    for inp in node.all_input_nodes:
        in_syms |= _unbacked(fake_value(inp))
    new = out_syms - in_syms
    if new:
        names = ", ".join(sorted(str(s) for s in new))
        return reason_for(node, Rule.DATA_DEPENDENT_SHAPE,
                          f"{op_name(node)} sizes its output from device data (new size {names}): "
                          "the size is read back to the host and differs from call to call")
    if in_syms:
        names = ", ".join(sorted(str(s) for s in in_syms))
        return reason_for(node, Rule.DEPENDS_ON_DYNAMIC_SHAPE,
                          f"an input has a data-dependent size ({names}); a graph replays fixed sizes")
    return None


def rule_syncing_op(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    if node.op not in ("call_function", "call_method") or not _syncing_op(node):
        return None
    custom = _SYNCING_CUSTOM_OPS.get(op_key(node))
    if custom:
        return reason_for(node, Rule.HOST_SYNC, f"{op_key(node)} {custom}; static_dispatch rewrites it")
    tagged = tagged_dynamic_output_shape(node)
    if tagged is not None:
        return reason_for(node, Rule.HOST_SYNC,
                          f"{op_name(node)} ({tagged}) is tagged torch.Tag.dynamic_output_shape: it reads "
                          "device data on the host to size its output (a hidden synchronize), which "
                          "cannot be captured")
    return reason_for(node, Rule.HOST_SYNC,
                      f"{op_name(node)} reads device data on the host to size its output "
                      "(a hidden synchronize), which cannot be captured")


def _requested_device(node: torch.fx.Node) -> Optional[str]:
    """The device a .to()/.cuda() call asks for, as written in the code: "cuda", "cpu", or None
    when the call names no device (a dtype-only .to)."""
    method = node.target if node.op == "call_method" else None
    if method == "cuda":
        return "cuda"
    candidates = list(node.args[1:]) + [node.kwargs.get("device")]
    for arg in candidates:
        if isinstance(arg, torch.device):
            return arg.type
        if isinstance(arg, str):
            return torch.device(arg).type
        if isinstance(arg, torch.fx.Node):
            value = fake_value(arg)
            if isinstance(value, torch.Tensor):  # .to(other_tensor)
                return value.device.type
    return None


def _cpu_literal(node: torch.fx.Node) -> bool:
    """.to("cpu") written with the string: a copy to the host even on a CPU trace."""
    return any(isinstance(a, str) and a == "cpu" for a in list(node.args[1:]) + [node.kwargs.get("device")])


def rule_device_move(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    method = node.target if node.op == "call_method" else None
    outs = _node_tensors(node)
    ins = _input_tensors(node)
    if method in _TO_HOST_METHODS:
        return reason_for(node, Rule.DEVICE_MOVE,
                          f"Tensor.{method}() copies to the host; copies between devices synchronize")
    if not (method in _TO_DEVICE_METHODS or (node.op == "call_function" and
                                            callee_name(node) in ("to", "_to_copy"))):
        return None
    in_devices = {_device_type(t) for _, t in ins}
    out_devices = {_device_type(t) for t in outs}
    if in_devices and out_devices and in_devices != out_devices:
        return reason_for(node, Rule.DEVICE_MOVE,
                          f"moves data from {'/'.join(sorted(in_devices))} to {'/'.join(sorted(out_devices))}")
    requested = _requested_device(node)
    host_input = any(inp in ctx.host_nodes for inp, _ in ins)
    if host_input and requested is not None:
        return reason_for(node, Rule.DEVICE_MOVE, f"moves a host tensor to the device ({op_name(node)})")
    # On a CPU trace a device move cannot be seen in the values. A literal "cpu" string in the
    # code still says "copy to the host" (a torch.device may equally be x.device: no way to tell).
    if _cpu_literal(node) and not host_input:
        return reason_for(node, Rule.DEVICE_MOVE, f"{op_name(node)}('cpu') copies to the host")
    return None


def rule_cpu_tensor(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    host_inputs = [inp for inp in node.all_input_nodes if inp in ctx.host_nodes]
    if host_inputs:
        return reason_for(node, Rule.CPU_TENSOR,
                          f"computes on host tensor(s) {', '.join(i.name for i in host_inputs)}")
    if ctx.compute_device != "cpu":
        cpu_outs = [t for t in _node_tensors(node) if _device_type(t) == "cpu"]
        cpu_ins = [inp.name for inp, t in _input_tensors(node) if _device_type(t) == "cpu"]
        if cpu_outs or cpu_ins:
            what = f"input(s) {', '.join(cpu_ins)}" if cpu_ins else "its output"
            return reason_for(node, Rule.CPU_TENSOR,
                              f"{what} on the CPU while the model computes on {ctx.compute_device}; "
                              "a CUDA graph would bake in the host value of the first capture")
    return None


def rule_inplace_on_grad(node: torch.fx.Node, ctx: ClassifyContext) -> Optional[Reason]:
    """Training: an in-place write to a graph input that requires grad (a parameter, an input
    leaf). Writes to intermediates (ReLU(inplace=True) after a norm) are fine inside a region's own
    autograd; one that lands on another region's output fails that region's capture, which then
    runs eagerly with the reason."""
    if not ctx.training:
        return None
    for arg in mutated_args(node):
        if any(t.requires_grad for t in iter_tensors(fake_value(arg))) and \
                storage_ids(fake_value(arg)) & ctx.grad_input_storages:
            return reason_for(node, Rule.INPLACE_ON_GRAD,
                              f"{op_name(node)} writes the graph input {arg.name} in place while it "
                              "requires grad; graphed regions take inputs by copy or hand-off, so "
                              "the write stays eager under autograd")
    return None


Rule_ = Callable[[torch.fx.Node, ClassifyContext], Optional[Reason]]

RULES: tuple[Rule_, ...] = (
    rule_user_marked,
    rule_collective,
    rule_unsafe_tag,
    rule_host_sync,
    rule_device_move,
    rule_cpu_tensor,
    rule_data_dependent_shape,
    rule_syncing_op,
    rule_inplace_on_grad,
)


def infer_compute_device(gm: torch.fx.GraphModule) -> str:
    """The device the graph computes on: the accelerator if any input lives on one, else cpu."""
    devices = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            for t in iter_tensors(fake_value(node)):
                devices.add(_device_type(t))
    accel = sorted(d for d in devices if d not in ("cpu", "meta"))
    return accel[0] if accel else "cpu"


def is_training_graph(gm: torch.fx.GraphModule) -> bool:
    """A graph traced with grad mode on and at least one input that requires grad."""
    if not torch.is_grad_enabled():
        return False
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if any(t.requires_grad for t in iter_tensors(fake_value(node))):
                return True
    return False


def _is_host_value(node: torch.fx.Node, ctx: ClassifyContext, reason: Optional[Reason]) -> bool:
    """Does the node's output live on the host (the taint that rule_cpu_tensor follows)?"""
    if reason is None:
        return False
    if reason.rule == Rule.CPU_TENSOR:
        return True
    if reason.rule == Rule.DEVICE_MOVE:
        if node.op == "call_method" and node.target in _TO_HOST_METHODS:
            return True
        if _cpu_literal(node):
            return True
        outs = _node_tensors(node)
        return ctx.compute_device != "cpu" and bool(outs) and all(_device_type(t) == "cpu" for t in outs)
    return False


def classify(gm: torch.fx.GraphModule, config: Config, *, training: Optional[bool] = None,
             compute_device: Optional[str] = None) -> Classification:
    ctx = ClassifyContext(
        config=config,
        compute_device=compute_device or infer_compute_device(gm),
        training=is_training_graph(gm) if training is None else training,
    )
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = fake_value(node)
            if any(t.requires_grad for t in iter_tensors(value)):
                ctx.grad_input_storages |= storage_ids(value)
    verdicts: dict[torch.fx.Node, NodeVerdict] = {}
    for node in compute_nodes(gm):
        reason = None
        if node.op != "get_attr":
            for rule in RULES:
                reason = rule(node, ctx)
                if reason is not None:
                    break
        if _is_host_value(node, ctx, reason):
            ctx.host_nodes.add(node)
        if reason is not None:
            ctx.eager_nodes.add(node)
        verdicts[node] = NodeVerdict(static=reason is None, reason=reason)
    return Classification(verdicts=verdicts, compute_device=ctx.compute_device, training=ctx.training,
                          grad_enabled=torch.is_grad_enabled())
