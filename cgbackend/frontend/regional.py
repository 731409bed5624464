"""Regional compilation: a stack of identical layers is traced, analysed and compiled once.

A 48-layer model holds 48 copies of one layer. ``cgbackend.compile`` finds such stacks (an
``nn.ModuleList`` or ``nn.Sequential`` of at least ``regional_min_layers`` modules of one class
whose parameters, buffers and submodules have the same names, shapes and dtypes: the layer's
structure key) that run one after the other, each on the previous one's output (an
``nn.Sequential``, or a ``ModuleList`` its owner's forward iterates as ``for layer in self.layers:
h = layer(h, ...)``: a MoE layer's experts, each called on its own tokens, are no such stack) and,
during each call of the compiled model, gives every layer of a stack a
``forward`` that calls one ``torch.compile``'d function of the layer's forward. Dynamo compiles
that function once, for the first layer, and every later layer passes its guards (with
``inline_inbuilt_nn_modules``, Dynamo's default, a layer's parameters are inputs of the graph, not
constants of it), so the trace, cgbackend's passes and Inductor's compile happen once per stack
whatever its depth. Layers that Dynamo specialises apart (a Python value of their own, such as
``self.layer_idx``; hooks on their submodules) are compiled in groups of their own, each with its
own copy of the function, and checked for hooks on every call (regional_calls.py): regional
compilation never changes what a layer computes, and no layer runs uncompiled unreported. The layers share the compiled graph's regions; each layer captures its own
CUDA graphs there, keyed by its parameters' addresses (runtime/graph_cache.py), and the bounds
that count graphs and call slots scale by the number of layers sharing them
(``RuntimeShared.layer_copies``).

The layer's call is a graph break in the model's own forward: an ``nn.Sequential``'s caller is
compiled up to the stack and after it; the forward that loops over a ``ModuleList`` runs as it is
(a graph break in a loop makes Dynamo give up the frame), and it gets that from the start, on a
copy of its code (``_skipped_forward``: no trace that is thrown away, and no mark on the class's
own code that would split every other compile of the class). So below the threshold one
whole-model graph is kept: it costs one graph launch per call, where a stack costs one per layer
(tens of microseconds of host time each).

The layers' (and the loop's owner's) ``forward`` is set only while a call of the compiled model
runs (Overrides) and restored after, so the user's modules are never changed outside the compiled model's calls.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import logging
import textwrap
import threading
import types
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from .regional_calls import LayerCalls
from .regional_modes import StackModes

__all__ = ["LayerStack", "Overrides", "find_layer_stacks", "regional_overrides", "structure_key"]

log = logging.getLogger(__name__)


def structure_key(module: nn.Module) -> tuple:
    """What must be equal for two layers to share one compiled layer: the class, each submodule's
    name and class, each parameter's and buffer's name, shape, dtype, device and requires_grad, and
    the training flags (Dynamo guards on them)."""
    parts: list = [type(module).__qualname__]
    for name, sub in module.named_modules():
        parts.append(("m", name, type(sub).__qualname__, sub.training))
    for name, p in module.named_parameters():
        parts.append(("p", name, tuple(p.shape), p.dtype, p.device.type, p.requires_grad))
    for name, b in module.named_buffers():
        parts.append(("b", name, tuple(b.shape), b.dtype, b.device.type))
    return tuple(parts)


@dataclasses.dataclass
class LayerStack:
    """``len(layers)`` identical layers at ``path`` (``layers`` in ``model.layers``), compiled once."""

    path: str
    layers: list[nn.Module]
    key: str
    """A short hash of the layers' structure key."""
    owner: Optional[nn.Module] = None
    """The module whose forward loops over the layers (a ``ModuleList``'s); None for an
    ``nn.Sequential``, whose own forward runs them."""
    calls: list = dataclasses.field(default_factory=list)
    """The layers' compiled functions (regional_calls.LayerCalls, one per distinct layer function),
    set by :func:`regional_overrides`."""
    modes: Any = None
    """Whether the stack is compiled layer by layer or with the model now (regional_modes.py)."""

    @property
    def cls(self) -> str:
        return type(self.layers[0]).__qualname__

    def to_dict(self) -> dict[str, Any]:
        groups = [g for calls in self.calls for g in calls.describe()]
        mode = self.modes.describe(self) if self.modes is not None else {"with_model": False, "why": ""}
        return {"path": self.path, "layers": len(self.layers), "class": self.cls, "key": self.key,
                "groups": groups, **mode}

    def describe(self) -> str:
        last = len(self.layers) - 1
        where = f"{self.path}.0-{last}" if self.path else f"0-{last}"
        return (f"{where} ({len(self.layers)} x {self.cls}) share one compiled layer (regional compilation): "
                "traced, analysed and compiled once, graphs captured per layer")


def find_layer_stacks(model: nn.Module, min_layers: int) -> list[LayerStack]:
    """The outermost stacks of at least ``min_layers`` structurally identical layers in ``model``
    (none when ``min_layers`` is 0). A stack inside a layer of another stack is left to it."""
    if min_layers <= 0:
        return []
    stacks: list[LayerStack] = []
    taken: set[int] = set()
    modules = dict(model.named_modules())
    for path, container in modules.items():
        if id(container) in taken or not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        layers = list(container.children())
        if len(layers) < max(min_layers, 2):
            continue
        owner = None
        if not isinstance(container, nn.Sequential):
            parent_path, _, attr = path.rpartition(".")
            if not path or not chained_loop(modules[parent_path], attr):
                continue
            owner = modules[parent_path]
        key = structure_key(layers[0])
        if any(type(layer) is not type(layers[0]) or structure_key(layer) != key for layer in layers[1:]):
            continue
        if "forward" in layers[0].__dict__ or type(layers[0]).forward is nn.Module.forward:
            continue  # a forward set on the instance, or none: not a plain layer
        digest = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
        stacks.append(LayerStack(path, layers, digest, owner))
        for layer in layers:
            for sub in layer.modules():
                taken.add(id(sub))
    return stacks


def chained_loop(owner: nn.Module, attr: str) -> bool:
    """Does ``owner``'s forward iterate ``self.<attr>`` (also sliced, or under ``enumerate`` /
    ``zip``) and feed each layer's output to the next (``h = layer(h, ...)``, or ``out = layer(h)``
    then ``h = out[0]``)? Proven from the source; False when it cannot be read."""
    try:
        source = textwrap.dedent(inspect.getsource(type(owner).forward))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return False
    for loop in ast.walk(tree):
        if isinstance(loop, ast.For):
            layer = _layer_name(loop, attr)
            if layer is not None and _chains(loop.body, layer):
                return True
    return False


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    while isinstance(node, ast.Subscript):  # self.layers[: n]
        node = node.value
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _layer_name(loop: ast.For, attr: str) -> Optional[str]:
    """The loop variable bound to the stack's layers, if the loop iterates ``self.<attr>``."""
    it, target = loop.iter, loop.target
    if _is_self_attr(it, attr) and isinstance(target, ast.Name):
        return target.id
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and isinstance(target, ast.Tuple):
        if it.func.id == "enumerate" and len(it.args) == 1 and _is_self_attr(it.args[0], attr) \
                and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
            return target.elts[1].id
        if it.func.id == "zip":
            for arg, elt in zip(it.args, target.elts):
                if _is_self_attr(arg, attr) and isinstance(elt, ast.Name):
                    return elt.id
    return None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _targets(stmt: ast.stmt) -> set[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    return set().union(*(_names(t) for t in targets))


def _chains(body: list[ast.stmt], layer: str) -> bool:
    """A statement of the loop body calls the layer and binds a name it passed to it, directly or
    through the names the call's result was bound to."""
    results: set[str] = set()
    args: set[str] = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or node.value is None:
                continue
            calls = [c for c in ast.walk(node.value) if isinstance(c, ast.Call) and _calls_layer(c, layer)]
            for call in calls:
                args |= set().union(*(_names(a) for a in call.args), *(_names(k.value) for k in call.keywords))
            bound = _targets(node)
            if calls:
                results |= bound
                if bound & args:
                    return True
            elif _names(node.value) & results and bound & args:
                return True
    return False


def _calls_layer(call: ast.Call, layer: str) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id == layer) or (
        isinstance(f, ast.Attribute) and f.attr in ("forward", "__call__") and isinstance(f.value, ast.Name)
        and f.value.id == layer)


class Overrides:
    """Instance ``forward`` attributes set only while a call of the compiled model runs: installed
    on entry, the modules' own state restored on exit (also on an exception). Re-entrant per
    thread; the same callables every call, so Dynamo's guards see the same objects. ``modes``
    (regional_modes.StackModes) chooses, per call, the pairs of the stacks compiled layer by layer."""

    def __init__(self, pairs: list[tuple[nn.Module, Callable[..., Any]]], modes: Any = None) -> None:
        self.pairs = pairs
        self.modes = modes
        self._local = threading.local()

    def __bool__(self) -> bool:
        return bool(self.pairs)

    def __enter__(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        pairs = self.modes.select() if self.modes is not None else self.pairs
        saved = []
        for module, fn in pairs:
            d = module.__dict__
            saved.append((module, d.get("forward", _MISSING)))
            d["forward"] = fn
        self._local.saved = saved

    def __exit__(self, *exc: Any) -> None:
        self._local.depth -= 1
        if self._local.depth:
            return
        for module, old in self._local.saved:
            if old is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = old
        self._local.saved = None


_MISSING = object()


def regional_overrides(stacks: list[LayerStack], backend: Callable[..., Any], *, dynamic: Optional[bool],
                       forward_of: Callable[[nn.Module], Callable[..., Any]]) -> Overrides:
    """For every layer of ``stacks``: (layer, the forward it gets during a call). ``forward_of``
    gives the plain function a module runs (its class's ``forward``, or a rewritten one); the
    layers running one function share its compiled functions, grouped by what Dynamo specialises
    them on (regional_calls.py). The owner of a stack its forward loops over gets a forward too
    (:func:`_skipped_forward`). The stacks whose layers are mostly compiled apart are compiled with
    the model after their first call (regional_modes.py)."""
    per_stack = []
    owners: list[nn.Module] = []
    for stack in stacks:
        if stack.owner is not None and all(stack.owner is not o for o in owners):
            owners.append(stack.owner)
        calls: dict[Any, LayerCalls] = {}
        pairs = []
        for index, layer in enumerate(stack.layers):
            fn = forward_of(layer)
            if fn not in calls:
                calls[fn] = LayerCalls(fn, backend, dynamic, stack.path)
            pairs.append((layer, calls[fn].forward_for(layer, index)))
        stack.calls = list(calls.values())
        per_stack.append((stack, pairs))
    owner_pairs = []
    for owner in owners:
        skipped = _skipped_forward(forward_of(owner))
        if skipped is not None:
            owner_pairs.append((owner, types.MethodType(skipped, owner)))
    modes = StackModes(per_stack, owner_pairs)
    for stack in stacks:
        stack.modes = modes
    return Overrides([p for _, pairs in per_stack for p in pairs] + owner_pairs, modes if stacks else None)


def _skipped_forward(fn: Callable[..., Any]) -> Optional[Callable[..., Any]]:
    """A copy of ``fn`` with a code object of its own, which Dynamo skips (runs as it is) while it
    still compiles the frames it calls; None where this torch has no way to say so.

    The owner's loop calls each layer through a graph break, and a graph break in a loop makes
    Dynamo give up the whole frame: it would trace the forward up to the loop first (wrapping the
    whole stack's modules: about 3 s for 48 MoE layers, in every process, cache or not), then mark
    the forward's code to be skipped from then on. That mark is global, on the class's code
    object: every other compile of that class in the process (``torch.compile`` of another copy
    of the model) would then run that forward as it is too, one graph per layer, even where it
    had already been compiled whole. On a copy of the code, the skip is decided up front and stays
    with this compiled model."""
    skip_code = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
    fn = getattr(fn, "__func__", fn)
    if skip_code is None or not isinstance(fn, types.FunctionType):
        return None
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    skip_code(copy.__code__)
    copy._torchdynamo_disable = True  # type: ignore[attr-defined]  # a caller being traced breaks here
    return copy
