"""Opaque module calls: modules Dynamo cannot trace become one graph node each.

Transformer Engine wraps its modules' eager paths in ``torch.compiler.disable``, so Dynamo breaks the
graph at every TE module, and under any backend that module's kernels run eagerly between compiled
graphs. ``install(model)`` replaces the ``forward`` of each supported module instance (outermost
first) by a small function Dynamo traces, which calls a second function Dynamo puts into the graph
as it is (``torch.compiler.allow_in_graph``). That call takes the module's inputs and, as the
keyword ``_cg_params``, its parameters: they become graph inputs like any other parameter, so a
static region that holds the call reads them in place and autograd computes their gradients through
the region's forward and backward graphs.

Traced with fake tensors the call returns outputs shaped by its family's rule (``Family.fake``); run
for real it calls the module's own forward. So the module's kernels run wherever the region runs:
captured into the region's CUDA graph, replayed, or eagerly with a counted reason. A family also
supplies the runtime hooks a region holding its modules needs (``RegionHooks``: extra graph key,
capture context, per-replay bookkeeping); ``integrations/te.py`` is the Transformer Engine family.

Nothing here imports Transformer Engine: a family is looked at only when its package is already
imported (a model built from TE modules has imported it).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch

from ..common.fx_utils import iter_tensors

__all__ = ["Family", "RegionHooks", "OpaqueInfo", "InstallResult", "install", "uninstall",
           "opaque_info", "region_hooks", "register_family", "families", "is_fake_call"]

_ATTR = "__cgbackend_opaque__"


class RegionHooks:
    """What a static region holding opaque calls of one family needs from its runner.

    The defaults do nothing; a family overrides what its modules need."""

    def key(self) -> tuple:
        """Extra key parts: state the calls read that is not among the region's inputs (a graph
        captured under one value must not replay under another)."""
        return ()

    def capturing(self) -> ContextManager[None]:
        """Entered around each capture of the region (forward and backward)."""
        return contextlib.nullcontext()

    def generators(self) -> Sequence[Any]:
        """Extra CUDA generators the calls draw random numbers from, registered with each graph."""
        return ()

    def before_forward(self) -> Any:
        """Before each forward replay; what it returns comes back to ``after_backward``."""
        return None

    def after_backward(self, token: Any) -> None:
        """After the backward of a forward replay (graph replay or eager)."""

    def quiet_backward(self) -> ContextManager[None]:
        """Around an eager backward through a captured forward's autograd graph."""
        return contextlib.nullcontext()


class _Combined(RegionHooks):
    def __init__(self, parts: list[RegionHooks]) -> None:
        self.parts = parts

    def key(self) -> tuple:
        return tuple(p.key() for p in self.parts)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.capturing())
            yield

    def generators(self) -> Sequence[Any]:
        return [g for p in self.parts for g in p.generators()]

    def before_forward(self) -> Any:
        return [p.before_forward() for p in self.parts]

    def after_backward(self, token: Any) -> None:
        for p, t in zip(reversed(self.parts), reversed(token or [None] * len(self.parts))):
            p.after_backward(t)

    @contextlib.contextmanager
    def quiet_backward(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for p in self.parts:
                stack.enter_context(p.quiet_backward())
            yield


class Family:
    """A set of module classes made opaque, with their shape rules and runtime hooks."""

    name = "opaque"
    package = ""
    """Looked at only when this top-level package is imported ("" = always)."""
    falsy_kwargs: tuple[str, ...] = ()
    """Call keywords that, when set to a true value, leave that call to the module's own forward."""

    def kind(self, module: torch.nn.Module) -> Optional[str]:
        """Short class name ("te.Linear") if this family owns the module, else None."""
        raise NotImplementedError

    def unsupported(self, module: torch.nn.Module) -> Optional[str]:
        """Why this module (of this family) cannot be an opaque call, or None."""
        raise NotImplementedError

    def fake(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        """The call's outputs as fake tensors, from fake inputs."""
        raise NotImplementedError

    def kernels(self, module: torch.nn.Module) -> int:
        """Rough kernel launches of one call (forward), for the partitioner's size rule."""
        return 8

    def role(self, module: torch.nn.Module) -> Optional[str]:
        """Region role the call suggests (passes/label.py), or None to decide by name."""
        return None

    def hooks(self, modules: list[torch.nn.Module]) -> Optional[RegionHooks]:
        return None


@dataclass
class OpaqueInfo:
    """Attached to the function that stands for one module in the graph."""

    path: str
    kind: str
    family: Family
    module_ref: "weakref.ReferenceType[torch.nn.Module]"

    @property
    def module(self) -> Optional[torch.nn.Module]:
        return self.module_ref()

    def describe(self) -> str:
        return f"{self.path or '<model>'} ({self.kind})"


@dataclass
class InstallResult:
    wrapped: list[OpaqueInfo] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    """Modules of a family left to their own forward: {"module", "kind", "reason"}."""

    def to_dict(self) -> dict[str, Any]:
        return {"wrapped": [{"module": i.path, "kind": i.kind} for i in self.wrapped],
                "skipped": list(self.skipped)}


_FAMILIES: list[Family] = []
_KEEP_ALIVE: list[Callable[..., Any]] = []
_LAZY: list[tuple[str, str]] = [("transformer_engine", "cgbackend.integrations.te")]
"""(package, cgbackend module that registers its family on import)."""


def register_family(family: Family) -> None:
    if not any(type(f) is type(family) for f in _FAMILIES):
        _FAMILIES.append(family)


def unregister_family(family: Family) -> None:
    _FAMILIES[:] = [f for f in _FAMILIES if f is not family]


def families() -> list[Family]:
    """The families whose package is imported (registering lazy ones on first sight)."""
    for package, module_name in _LAZY:
        if package in sys.modules and module_name not in sys.modules:
            __import__(module_name)
    return [f for f in _FAMILIES if not f.package or f.package in sys.modules]


def is_fake_call(args: Any, kwargs: Any) -> bool:
    """True when the call is being traced (fake tensors), not run."""
    fake_cls = _fake_tensor_class()
    first = next(iter_tensors((args, kwargs)), None)
    return first is not None and fake_cls is not None and isinstance(first, fake_cls)


def _fake_tensor_class() -> Optional[type]:
    try:
        from torch._subclasses.fake_tensor import FakeTensor  # private: feature-tested
    except ImportError:  # pragma: no cover - every supported torch has it
        return None
    return FakeTensor


def fake_requires_grad(out: torch.Tensor, args: tuple, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mark a fake output as autograd would the real one."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*iter_tensors(args), *params)):
        out.requires_grad_(True)
    return out


def _make_call(module: torch.nn.Module, family: Family, info: OpaqueInfo,
               own_forward: Callable[..., Any]) -> Callable[..., Any]:
    """The instance forward for ``module``: Dynamo traces it and records one call of an
    allow_in_graph function in the graph."""
    ref = weakref.ref(module)

    def call(*args: Any, _cg_params: tuple = (), **kwargs: Any) -> Any:
        mod = ref()
        if mod is None:
            raise RuntimeError(f"cgbackend: module {info.describe()} no longer exists")
        if is_fake_call(args, kwargs):
            return family.fake(mod, args, kwargs)
        with _parameters_swapped(mod, _cg_params):
            return own_forward(*args, **kwargs)

    call.__name__ = call.__qualname__ = "opaque_" + info.kind.replace(".", "_")
    setattr(call, _ATTR, info)
    torch.compiler.allow_in_graph(call)
    _KEEP_ALIVE.append(call)  # Dynamo remembers allowed functions by id: never let one be reused
    falsy = family.falsy_kwargs

    def forward(*args: Any, **kwargs: Any) -> Any:  # traced by Dynamo: keep it plain
        for name in falsy:
            if kwargs.get(name):
                return own_forward(*args, **kwargs)
        return call(*args, _cg_params=tuple(module.parameters()), **kwargs)

    setattr(forward, _ATTR, info)
    return forward


@contextlib.contextmanager
def _parameters_swapped(module: torch.nn.Module, params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run the module on ``params`` where they are not its own parameters.

    A region's training capture hands its code leaf aliases of the parameters (region.py:
    autograd then builds the capture's own nodes), and an opaque module reads its parameters itself:
    for the gradients to reach the aliases, the module must read them."""
    swapped = []
    if params:
        for (name, own), new in zip(module.named_parameters(), params):
            if own is new:
                continue
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            swapped.append((owner, leaf, own))
            owner._parameters[leaf] = new
    try:
        yield
    finally:
        for owner, leaf, own in swapped:
            owner._parameters[leaf] = own


def install(model: torch.nn.Module) -> InstallResult:
    """Make each module of a known family in ``model`` one opaque graph call (outermost only).

    Idempotent; ``uninstall`` undoes it. Modules a family cannot handle keep their forward and are
    listed in ``skipped`` with the reason (Dynamo then breaks the graph at them as before)."""
    result = InstallResult()
    fams = families()
    if not fams or not isinstance(model, torch.nn.Module):
        return result
    done: list[str] = []  # paths of modules already decided: their submodules are theirs
    for path, module in model.named_modules():
        if any(p == "" or path == p or path.startswith(p + ".") for p in done):
            continue
        family, kind = next(((f, k) for f in fams for k in [f.kind(module)] if k is not None), (None, None))
        if family is None:
            continue
        done.append(path)
        current = module.__dict__.get("forward")
        existing = getattr(current, _ATTR, None)
        if existing is not None:
            result.wrapped.append(existing)
            continue
        reason = family.unsupported(module)
        if reason is not None:
            result.skipped.append({"module": path or "<model>", "kind": kind, "reason": reason})
            continue
        info = OpaqueInfo(path, kind, family, weakref.ref(module))
        own = module.forward  # bound method (or the user's own instance forward)
        module.__dict__["_cgbackend_own_forward"] = current
        module.forward = _make_call(module, family, info, own)
        result.wrapped.append(info)
    return result


def uninstall(model: torch.nn.Module) -> int:
    """Give every wrapped module in ``model`` its forward back; returns how many."""
    n = 0
    for module in model.modules():
        current = module.__dict__.get("forward")
        if getattr(current, _ATTR, None) is None:
            continue
        own = module.__dict__.pop("_cgbackend_own_forward", None)
        if own is None:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = own
        n += 1
    return n


def opaque_info(node: torch.fx.Node) -> Optional[OpaqueInfo]:
    if node.op != "call_function":
        return None
    return getattr(node.target, _ATTR, None)


def region_hooks(nodes: Sequence[torch.fx.Node]) -> Optional[RegionHooks]:
    """The hooks a region holding these nodes needs, one per family present; None if none."""
    by_family: dict[int, tuple[Family, list[torch.nn.Module]]] = {}
    for node in nodes:
        info = opaque_info(node)
        if info is None or info.module is None:
            continue
        fam, mods = by_family.setdefault(id(info.family), (info.family, []))
        if all(m is not info.module for m in mods):
            mods.append(info.module)
    parts = [h for fam, mods in by_family.values() for h in [fam.hooks(mods)] if h is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else _Combined(parts)
