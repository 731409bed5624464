"""Folded expert loops: Dynamo traces one expert of a dispatch loop instead of every one.

Unrolled, a loop over E experts puts E copies of the expert body in the trace, each with its own
data-dependent sizes, and Dynamo's cost grows faster than E (fake-tensor ops slow down as unbacked
sizes accumulate: on a 2-core CPU, one layer of 64 experts traced in 9.6 s and one of 128 in 30 s).
When the experts are proven to compute the same function of their rows with their own
parameters, the loop is rewritten (fold_syntax.py) so that, while Dynamo traces, it runs the body
for the first expert only, between two markers; the graph pass (fold_graph.py) then turns that
one unit into the grouped form over all E experts, reading every expert's parameters from the
lists :func:`inputs` hands it. Run eagerly, the loop runs as written.

What is proven, and where:

* the loop's syntax (fold_syntax.py): the body uses the expert id only to pick the expert
  (``self.experts[e]``), a row of a parameter table (``self.w[e]``) or the routing selection, and
  leaves nothing behind after an iteration (loop_proof.py);
* the experts' structure, once per compile (:func:`spec_of`): one module tree repeated E times,
  same classes, the same plain attributes, parameters of one shape each, no buffers, no instance
  forwards, and forwards that write no Python state;
* again at every trace, by the graph pass (:func:`recheck`), with no hook set on any expert or
  globally. Dynamo guards the parameters it is handed (graph inputs), not their modules' other
  state: a change to an expert's plain attributes or hooks after a trace is seen at the next trace,
  as torch.compile itself does not guard module hooks. Inference traces take expert 0's
  parameters only (:func:`inputs`); the runtime checks the others at every call
  (expert_layout.LayoutCheck);
* by the graph pass: the one traced unit matches the grouped form, and each expert parameter is
  used only as a linear layer's weight or bias. Otherwise the fold is switched off for that loop and
  Dynamo restarts the trace (:func:`decline`), which then unrolls the loop as before.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import logging
import textwrap
import weakref
from typing import Any, Optional

import torch

__all__ = ["Spec", "spec_of", "inputs", "begin", "end", "row", "expert", "decline", "supported"]

log = logging.getLogger(__name__)

MIN_EXPERTS = 16
"""Loops over fewer experts are traced unrolled: cheap to trace (one layer of 16 experts in about
5 s on a 2-core CPU, of 128 in 30 s), and every form stays open to the cost model without a second
trace (a folded loop where the cost model picks another form is traced again, unrolled)."""

_keys = itertools.count(1)
_ENABLED: dict[int, bool] = {}
_SPECS: dict[int, "Spec"] = {}
_OWNERS: dict[int, list] = {}
_BLOCKED: dict[int, bool] = {}
"""Loops whose experts' parameters were one block of each name when enabled (see :func:`enable`)."""
REASONS: dict[int, str] = {}
"""Why a loop's fold was switched off (by the structure check or the graph pass), by key."""


def new_key() -> int:
    return next(_keys)


# ----------------------------------------------------------------------------- restarting a trace

def _restart_type() -> Optional[type]:
    """The exception a backend can raise to make Dynamo trace the frame again: Dynamo re-raises
    ``TensorifyScalarRestartAnalysis`` from a backend and restarts on any ``RestartAnalysis``
    (torch 2.11 and 2.13; feature-tested on the name the backend call catches). Without it
    (another torch), folding stays off."""
    exc = getattr(torch._dynamo.exc, "TensorifyScalarRestartAnalysis", None)
    if exc is None or not issubclass(exc, getattr(torch._dynamo.exc, "RestartAnalysis", ())):
        return None
    try:
        from torch._dynamo.output_graph import OutputGraph
    except ImportError:
        return None
    for name in ("_call_user_compiler", "call_user_compiler"):
        code = getattr(getattr(OutputGraph, name, None), "__code__", None)
        if code is not None and "TensorifyScalarRestartAnalysis" in code.co_names:
            return exc
    return None


_DECLINED: list = []
"""The FoldDeclined class, made at the first use (importing Dynamo at cgbackend's import would add
half a second to every process that never compiles)."""


def _declined() -> Optional[type]:
    if not _DECLINED:
        restart = _restart_type()
        if restart is not None:
            for fn in (begin, end, row):
                torch._dynamo.allow_in_graph(fn)
            _DECLINED.append(type("FoldDeclined", (restart,), {"__doc__": (
                "Raised by the graph pass: the folded loop cannot take the grouped form; its fold is "
                "off and Dynamo traces the frame again, unrolling the loop.")}))
        else:
            _DECLINED.append(None)
    return _DECLINED[0]


def supported() -> bool:
    return _declined() is not None


def _forget_speculation() -> None:
    """The restarted trace takes another path through the loop (unrolled): Dynamo's log of the
    decisions made before a graph break would not match it, so it is cleared."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        InstructionTranslator.current_tx().speculation_log.clear()
    except (AttributeError, ImportError):
        pass


def decline(key: int, why: str) -> None:
    """Switch the fold of loop ``key`` off and restart Dynamo's trace of the frame."""
    _ENABLED[key] = False
    REASONS[key] = why
    log.info("cgbackend: the folded expert loop (fold %d) is traced unrolled instead: %s", key, why)
    _forget_speculation()
    raise _declined()(why)


def enable(key: int, spec: "Spec", owners: list) -> None:
    """Fold loop ``key``, whose expert lists (``owners``) all have structure ``spec``."""
    from .expert_layout import consecutive
    _SPECS[key] = spec
    _OWNERS[key] = [weakref.ref(o) for o in owners]
    # Inference traces read the experts from one block only where cgbackend.compile laid them out
    # as one (explain does not move parameters: its traces take every expert's, as compile's did).
    _BLOCKED[key] = first_only() and all(
        consecutive([param_of(expert, parts, name).data for expert in experts])
        for experts in owners for parts, name in spec.params)
    _ENABLED[key] = supported()
    if not supported():
        REASONS[key] = "this torch cannot restart a trace from a backend"


def disable(key: int, why: str) -> None:
    _ENABLED[key] = False
    REASONS[key] = why


# ----------------------------------------------------------------------------- the experts' structure

_PLAIN = (int, float, bool, str, type(None), torch.dtype)
_STATE = {"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
          "_is_full_backward_hook"}
_MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "add",
             "discard", "popitem", "__setitem__", "__setattr__", "register_buffer", "register_parameter"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One expert's structure: its submodules (path, plain attributes compared across experts) and
    parameters (module path, name), in order. ``()`` experts: a loop that reads parameter tables only."""
    modules: tuple[tuple[str, tuple[str, ...]], ...] = ()
    params: tuple[tuple[tuple[str, ...], str], ...] = ()
    """(the module's path as attribute names, the parameter's name)"""


def _forward_writes(cls: type) -> str:
    """Why ``cls.forward`` may change Python state ('' when it writes none): classes of torch.nn are
    trusted; others are read for attribute, item, global and mutating-method writes."""
    if cls.__module__.startswith("torch.nn."):
        return ""
    fn = getattr(cls, "forward", None)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return f"{cls.__name__}.forward has no source to check"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Subscript)) and isinstance(node.ctx, (ast.Store, ast.Del)):
            return f"{cls.__name__}.forward writes {ast.unparse(node)} (line {node.lineno})"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return f"{cls.__name__}.forward declares {', '.join(node.names)} {type(node).__name__.lower()}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            return f"{cls.__name__}.forward calls {ast.unparse(node.func)} (line {node.lineno})"
    return ""


def _plain_attrs(m: torch.nn.Module) -> tuple[str, ...]:
    return tuple(k for k, v in m.__dict__.items() if k not in _STATE and "hook" not in k
                 and not k.startswith("_state_dict") and not k.startswith("_load_state_dict"))


def spec_of(experts: Any) -> tuple[Optional[Spec], str]:
    """The structure every expert of ``experts`` shares, or (None, why not)."""
    if not isinstance(experts, torch.nn.ModuleList) or len(experts) < 2:
        return None, "the experts are not a ModuleList of two or more"
    kind = type(experts)
    if kind.__getitem__ is not torch.nn.ModuleList.__getitem__ or kind.__iter__ is not torch.nn.ModuleList.__iter__:
        # The fold reads expert e as slice e of the list's block, laid out in the list's order.
        return None, f"the expert list ({kind.__name__}) orders its experts in a way of its own"
    first = dict(experts[0].named_modules())
    mods, params = [], []
    for path, m in first.items():
        if "forward" in m.__dict__:
            return None, f"expert 0's {path or 'module'} has a forward of its own instance"
        if m._buffers:
            return None, f"expert 0's {path or 'module'} has buffers ({', '.join(m._buffers)})"
        if _hooked(m):
            return None, f"expert 0's {path or 'module'} has hooks"
        why = _forward_writes(type(m))
        if why:
            return None, why
        attrs = _plain_attrs(m)
        for a in attrs:
            if not isinstance(m.__dict__[a], _PLAIN):
                return None, f"expert 0's {path or 'module'}.{a} is a {type(m.__dict__[a]).__name__}, not a plain value"
        mods.append((path, attrs))
        params += [(path, n) for n in m._parameters]
    for e, expert in enumerate(experts):
        mine = dict(expert.named_modules())
        if list(mine) != list(first):
            return None, f"expert {e}'s submodules differ from expert 0's"
        for (path, attrs), (_, m0) in zip(mods, first.items()):
            m = mine[path]
            if _hooked(m):
                return None, f"expert {e}'s {path or 'module'} has hooks"
            if type(m) is not type(m0) or _plain_attrs(m) != attrs or m._buffers or "forward" in m.__dict__:
                return None, f"expert {e}'s {path or 'module'} differs from expert 0's"
            if any(m.__dict__[a] != m0.__dict__[a] or type(m.__dict__[a]) is not type(m0.__dict__[a]) for a in attrs):
                return None, f"expert {e}'s {path or 'module'} has other attribute values than expert 0's"
            if list(m._parameters) != list(m0._parameters):
                return None, f"expert {e}'s {path or 'module'} has other parameters than expert 0's"
            for n, p in m._parameters.items():
                p0 = m0._parameters[n]
                if (p is None) != (p0 is None) or p is not None and (
                        p.shape != p0.shape or p.dtype != p0.dtype or p.device != p0.device
                        or p.requires_grad != p0.requires_grad):
                    return None, f"expert {e}'s {path + '.' if path else ''}{n} differs in shape or kind from expert 0's"
    return Spec(tuple(mods), tuple((tuple(path.split(".")) if path else (), n) for path, n in params
                                   if first[path]._parameters[n] is not None)), ""


# ----------------------------------------------------------------------------- traced by Dynamo

def _hooked(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _global_hooks() -> bool:
    from torch.nn.modules import module as _m
    return bool(_m._global_forward_hooks or _m._global_forward_pre_hooks or _m._global_backward_hooks
                or _m._global_backward_pre_hooks)


def inputs(key: int, experts: Any) -> Optional[tuple]:
    """While Dynamo traces a folded loop: the experts' parameters, one tuple per parameter of the
    spec; ``()`` for a loop without an expert list. None when the fold is off or the loop is not
    traced: the loop then runs unrolled, or as written.

    With gradients on, each tuple holds every expert's parameter (Dynamo passes each as a graph
    input: autograd accumulates each expert's gradient into its own). Without, only expert 0's:
    the graph reads all E from its block (layout.block_view), so a call fetches, guards and keys
    one parameter per name instead of E, and the runtime checks on each call that the other
    experts' parameters still are the block's slices (expert_layout.LayoutCheck)."""
    if not torch.compiler.is_compiling() or not _ENABLED.get(key, False):
        return None
    if experts is None:
        return ()
    which = experts if torch.is_grad_enabled() or not _BLOCKED.get(key, False) else [expert(experts, 0)]
    out = []
    for parts, name in _SPECS[key].params:
        out.append(tuple(param_of(expert, parts, name) for expert in which))
    return tuple(out)


_FIRST_ONLY: list = [None]
"""Whether Dynamo keeps graph inputs' real values, which inference traces that take expert 0's
parameters only need (see :func:`enable`): found by :func:`first_only` when a loop is enabled, not
at import (it imports Dynamo)."""


def first_only() -> bool:
    """Dynamo records each graph input's real value on its placeholder (``meta["grapharg"].example``):
    the graph pass finds the expert list of a folded loop traced for expert 0 only through it."""
    if _FIRST_ONLY[0] is None:
        try:
            from torch._dynamo.variables.builder import GraphArg
            _FIRST_ONLY[0] = isinstance(getattr(GraphArg, "example", None), property)
        except ImportError:
            _FIRST_ONLY[0] = False
    return _FIRST_ONLY[0]


def real_input(node: Any) -> Any:
    """The real value Dynamo traced placeholder ``node`` with (None when it kept none)."""
    arg = getattr(node, "meta", {}).get("grapharg")
    try:
        return arg.example if arg is not None else None
    except Exception:
        return None


def owners(key: int) -> list:
    """The expert lists loop ``key`` runs over that are still alive."""
    return [o for o in (ref() for ref in _OWNERS.get(key, ())) if o is not None]


def expert(experts: torch.nn.ModuleList, e: int) -> torch.nn.Module:
    """``experts[e]``, as the traced iteration of a folded loop picks its expert: read from the list's
    module dict by its key. Dynamo indexing a ModuleList guards every module in it, and those guards
    run before every call of the graph (256 for two layers of 128 experts, a third of the model's
    guard time); the key reads one. ModuleList keys are the indices as strings (a list with an
    indexing of its own is not folded: :func:`spec_of`)."""
    return experts._modules[str(e)]


def param_of(expert: torch.nn.Module, parts: tuple[str, ...], name: str) -> torch.Tensor:
    m = expert
    for part in parts:
        m = getattr(m, part)
    return getattr(m, name)


def recheck(key: int) -> str:
    """At each trace (the graph pass): why the modules that run loop ``key`` no longer hold experts
    of the structure it was enabled for, or ''. Checked here rather than while Dynamo traces, so it
    adds no guard per expert: like torch.compile, which does not guard module hooks, a change to an
    expert made after a trace is seen at the next one."""
    if _global_hooks():
        return "a global module hook is set"
    for ref in _OWNERS.get(key, ()):
        experts = ref()
        if experts is None:
            continue
        spec, why = spec_of(experts)
        if spec != _SPECS.get(key):
            return why or "the experts' structure changed since compiling"
    return ""


def begin(key: int) -> torch.Tensor:
    """Marks where the traced expert's iteration starts (consumed by the graph pass)."""
    return torch.zeros(())


def end(key: int, runs: Any, params: Any) -> torch.Tensor:
    """Marks where it ends: ``runs`` are the experts the loop runs (Python ints), ``params`` what
    :func:`inputs` returned."""
    return torch.zeros(())


def row(table: torch.Tensor, e: Any) -> torch.Tensor:
    """``table[e]``, a row of a parameter table read by expert id, as one node of the graph."""
    return table[e]
