"""The rewritten forwards of one compiled model, kept apart from the user's modules.

``cgbackend.compile`` (and ``explain``) rewrite dispatch loops in the model's forwards (source_rewrite.py).
The rewritten bound methods belong to a :class:`LoopForwards` object owned by the compiled
wrapper: they are put in the modules' ``__dict__`` only while a compiled call runs (``with
forwards:``) and what was there before is put back afterwards, also when the call raises. Outside
a compiled call every module runs its own ``forward``, so calling the uncompiled model runs the
user's code. The same bound-method objects are used on every call, so Dynamo's guards on them
hold from one call to the next.

Cost: two dictionary writes per module with a rewritten loop, per call: about 12 us a call for 48
such modules on a 2-core CI machine (tests/moe/test_dispatch_soundness.py times it).
Calls that overlap (a compiled call inside another, or from several threads) install once, for the
outermost, and restore when the last one leaves; an uncompiled call of the same modules made from
another thread meanwhile runs the rewritten code (the same results, as the rewrite is proven).

The first backward through a compiled call whose rewritten loops ran also warns, once, that experts
without tokens then have a zero gradient where eager leaves ``None`` (see docs/design.md).
"""

from __future__ import annotations

import logging
import re
import threading
import types
from typing import Any, Callable, Optional, Sequence

import torch

from . import fold as _fold
from ..common.user_code import warn
from ..config.dispatch_mode import DispatchMode
from .source_rewrite import LoopRewrite, rewrite_function

__all__ = ["LoopForwards", "mark_traced", "survey", "UNROUTED_GRADS_WARNING"]

log = logging.getLogger(__name__)

UNROUTED_GRADS_WARNING = (
    "cgbackend: static dispatch rewrote the dispatch loop at {where}: an expert that receives no token "
    "runs on no rows, so its parameters may get a zero gradient where eager leaves .grad None "
    "(an optimizer then applies weight decay and moment updates to them, as it does under a grouped-GEMM "
    "MoE). This is warned once per compiled model.")

_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def mark_traced(gm: torch.fx.GraphModule, loops: Sequence[LoopRewrite]) -> None:
    """Record on each of ``loops`` whether ``gm`` (a graph Dynamo handed over) has a node from its
    lines; a loop found in one graph stays found."""
    pending = [loop for loop in loops if loop.form and not loop.traced and loop.filename]
    if not pending:
        return
    for loop in pending:
        loop.traced = False
    for node in gm.graph.nodes:
        for m in _FRAME_RE.finditer(node.meta.get("stack_trace") or ""):
            for loop in pending:
                if not loop.traced and loop.holds(m.group("file"), int(m.group("line"))):
                    loop.traced = True


def _own_expert_modules(module: torch.nn.Module) -> bool:
    """Does ``module`` hold its experts as modules of their own: a ModuleList or ModuleDict (at any
    depth) of at least two modules that have parameters?"""
    for child in module.modules():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            members = list(child.values() if isinstance(child, torch.nn.ModuleDict) else child)
            if len(members) >= 2 and all(any(True for _ in m.parameters()) for m in members):
                return True
    return False


def _eager_experts_forward(cls: type) -> Optional[Callable]:
    """transformers' experts classes (``use_experts_implementation``) keep their own eager forward
    behind a dispatching wrapper; that eager forward is what runs for ``"eager"``."""
    forward = cls.__dict__.get("forward")
    inner = getattr(forward, "__wrapped__", None)
    if inner is None or "experts_interface" not in getattr(forward, "__code__", types.CodeType).co_freevars:
        return None
    return inner


def _experts_dispatch(rewritten: Callable, original: Callable) -> Callable:
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if getattr(getattr(self, "config", None), "_experts_implementation", "eager") in ("eager", None):
            return rewritten(self, *args, **kwargs)
        return original(self, *args, **kwargs)
    return forward


def _forwards(model: torch.nn.Module):
    """(module, class, the forward to rewrite, whether it is transformers' eager experts forward)."""
    for module in model.modules():
        cls = type(module)
        eager = _eager_experts_forward(cls)
        fn = eager if eager is not None else getattr(cls, "forward", None)
        if fn is None or fn in (torch.nn.Module.forward,):
            continue
        yield module, cls, fn, eager is not None


def survey(model: torch.nn.Module) -> list[LoopRewrite]:
    """What :class:`LoopForwards` would find, without keeping anything: a record per loop looked at
    (``form`` set where static dispatch would rewrite it). For the report's hints."""
    records: list[LoopRewrite] = []
    seen: set = set()
    for module, _cls, fn, _eager in _forwards(model):
        if "forward" in module.__dict__ or fn in seen:
            continue
        seen.add(fn)
        records.extend(rewrite_function(fn)[1])
    return records


def _read(module: torch.nn.Module, expr: str) -> Any:
    """``self.a.b`` read on ``module``."""
    obj: Any = module
    for part in expr.split(".")[1:]:
        obj = getattr(obj, part, None)
    return obj


def _enable_fold(record: LoopRewrite, modules: list[torch.nn.Module], fold: bool) -> None:
    """Switch the fold of ``record``'s loop on when every module that runs it holds experts of
    one structure (fold.spec_of), at least fold.MIN_EXPERTS of them, and tensors where it reads
    rows; else record why (fold.REASONS, which the record's report shows)."""
    why = "" if fold else f"static_dispatch is none of {', '.join(map(str, DispatchMode.grouped_modes()))}"
    spec, owners = None, []
    experts, *tables = record.fold_reads
    for module in modules:
        rows = [_read(module, t) for t in tables]
        for t, value in zip(tables, rows):
            if not isinstance(value, torch.Tensor):
                why = why or f"{t} is not a tensor"
        if experts:
            owner = _read(module, experts)
            owners.append(owner)
            mine, reason = _fold.spec_of(owner)
            n = len(owner) if isinstance(owner, torch.nn.ModuleList) else 0
        else:
            mine, reason = _fold.Spec(), ""
            n = min((int(v.shape[0]) for v in rows if isinstance(v, torch.Tensor)), default=0)
        why = why or reason
        if spec is not None and mine != spec:
            why = why or "the modules that run this loop hold experts of different structures"
        spec = mine
        if n < _fold.MIN_EXPERTS:
            why = why or (f"{n} experts: below {_fold.MIN_EXPERTS} the unrolled trace is cheap and leaves every "
                          "form to the cost model")
    if not modules:
        why = why or "no module runs this loop"
    if why or spec is None:
        _fold.disable(record.fold_key, why)
    else:
        _fold.enable(record.fold_key, spec, owners)


class LoopForwards:
    """The rewritten forwards of ``model``'s modules, installed only inside ``with self:``.

    ``records`` holds every loop looked at (rewritten or left as written, with the reason). A
    module whose instance already has its own ``forward`` (set by the user or another wrapper) is
    left alone, at compile time and at every call."""

    def __init__(self, model: torch.nn.Module, mode: DispatchMode) -> None:
        """``mode``: the static_dispatch option; loops are folded only where it builds the grouped
        forms (``DispatchMode.builds_grouped``)."""
        self.records: list[LoopRewrite] = []
        self._dicts: list[dict] = []
        """The ``__dict__`` of each module that gets a rewritten forward, and that bound method."""
        self._bound: list[types.MethodType] = []
        cache: dict[Any, Optional[Callable]] = {}
        folds: dict[int, list[torch.nn.Module]] = {}  # fold key -> the modules that run its loop
        folded: dict[Any, list[int]] = {}
        runners: dict[Any, list[torch.nn.Module]] = {}  # rewritten function -> the modules that run it
        records_of: dict[Any, list[LoopRewrite]] = {}
        for module, cls, fn, eager in _forwards(model):
            if "forward" in module.__dict__:
                continue
            if fn not in cache:
                new, recs = rewrite_function(fn)
                if new is not None and eager:
                    new = _experts_dispatch(new, cls.forward)
                cache[fn] = new
                self.records.extend(recs)
                records_of[fn] = recs
                folded[fn] = [r.fold_key for r in recs if r.fold_key]
            if cache[fn] is not None:
                self._dicts.append(module.__dict__)
                self._bound.append(types.MethodType(cache[fn], module))
                for key in folded[fn]:
                    folds.setdefault(key, []).append(module)
                runners.setdefault(fn, []).append(module)
        for fn, modules in runners.items():  # experts stored stacked get a gradient in eager too
            own = any(_own_expert_modules(m) for m in modules)
            for r in records_of[fn]:
                r.own_expert_params = own
        for r in self.records:
            if r.fold_key:
                _enable_fold(r, folds.get(r.fold_key, []), mode.builds_grouped)
        for r in self.records:
            if r.form:
                log.info("cgbackend: %s loop at %s rewritten to a fixed-length loop", r.form, r.source)
            else:
                log.debug("cgbackend: loop at %s left as it is: %s", r.source, r.reason)
        self._lock = threading.Lock()
        self._depth = 0
        self._installed: list[dict] = []
        self._warned = not any(r.form and r.own_expert_params for r in self.records)
        """Only rewritten skip-loops over experts with parameters of their own change gradients."""

    def __bool__(self) -> bool:
        return bool(self._dicts)

    def function_of(self, module: torch.nn.Module) -> Optional[Callable[..., Any]]:
        """The rewritten plain function ``module`` runs during compiled calls, or None."""
        for d, method in zip(self._dicts, self._bound):
            if d is module.__dict__:
                return method.__func__
        return None

    def __enter__(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                # A module whose instance got its own forward after compiling keeps it (setdefault).
                self._installed = [d for d in self._dicts if "forward" not in d]
                for d, method in zip(self._dicts, self._bound):
                    d.setdefault("forward", method)

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for d in self._installed:
                    d.pop("forward", None)
                self._installed = []

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` with the rewritten forwards installed; until the warning about gradients of
        experts without tokens was given, the outputs carry a hook that gives it at their backward."""
        with self:
            out = fn(*args)
        if not self._warned and torch.is_grad_enabled() and self._changed_gradients():
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._warn_once)
        return out

    def _changing(self) -> list[LoopRewrite]:
        """The rewritten loops that change gradients: traced (run by a compiled call), over experts
        with parameters of their own."""
        return [r for r in self.records if r.form and r.own_expert_params and r.traced]

    def _changed_gradients(self) -> bool:
        return bool(self._changing())

    def _warn_once(self, grad: torch.Tensor) -> None:
        if self._warned:
            return
        self._warned = True
        loops = self._changing()
        message = UNROUTED_GRADS_WARNING.format(where=", ".join(r.source for r in loops))
        log.info("%s", message)  # one notice: the warning (a log line too would print it twice)
        # At the user's backward call; from autograd's own thread, at the first such loop.
        warn(message, UserWarning, fallback=(loops[0].filename, loops[0].lines[0]) if loops else None)
