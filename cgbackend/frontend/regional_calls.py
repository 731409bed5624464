"""Which compiled function each layer of a regional stack calls (regional.py): layers grouped by
what Dynamo specialises them on, hooks checked on every call, uncompiled calls counted.

Why: a stack's layers may share one compiled function only where its graphs hold for each of
them. Dynamo guards on the Python values it reads from a layer (``self.layer_idx`` for a KV-cache
update or a depth-scaled residual, a block's DropPath rate): on one shared function, each layer
with a value of its own is a recompile, and at Dynamo's recompile limit (8) every later layer runs
uncompiled for the rest of the process. And Dynamo does not guard on an empty hook dict: a hook
registered on one layer's submodule (steering, ablation, probing) would be missed by graphs traced
on a layer without hooks, and a hook registered later by every graph traced before it.

How: each group of a stack calls a ``torch.compile`` of its own copy of the layer function's code
(Dynamo's graphs, guards and recompile limit belong to a code object). A layer joins a group at
its first call when it is judged like the group's first layer: same hook key (below), and each of
the group's compiled graphs, its guards checked on this call's arguments, accepts the layer
exactly when it accepts the group's first layer in its place (Dynamo's own guard check, private
API, feature-tested; where this torch lacks it, layers are grouped by the plain Python values of
their modules instead). A layer that no group takes starts a group of its own; the report names
the value Dynamo specialised on. Layers that differ in nothing Dynamo reads stay one group, one
trace for the whole stack.

A layer's hook key names which of its submodules' forward, pre-forward and backward hook dicts are
not empty (and whether the global ones are). Every hook registration makes a ``RemovableHandle``,
whose class counter then moves: a call compares that counter with the one its layer last saw (one
attribute read) and computes the key again only when it moved. A hook removed later is Dynamo's to
see: it guards on the length of a hook dict that was not empty when traced.

A call during which no compiled graph of the instance ran was run by Dynamo without the backend
(its group's function at the recompile limit, say): counted and reported (uncompiled.py).
"""

from __future__ import annotations

import inspect
import re
import types
import weakref
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.utils.hooks

from .uncompiled import recompile_limit

__all__ = ["HANDLES", "LayerCalls", "hook_key"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
HANDLES = torch.utils.hooks.RemovableHandle
"""Its ``next_id`` moves at every hook registration (module, global, tensor)."""


def hook_key(layer: nn.Module) -> tuple:
    """Which hook dicts of ``layer``'s submodules (the layer's own hooks run outside the compiled
    function) and of torch's global module hooks are not empty."""
    key: list = [(i, name) for i, sub in enumerate(layer.modules()) if i
                 for name in _HOOK_DICTS if getattr(sub, name, None)]
    module = torch.nn.modules.module
    key += [name for name in _GLOBAL_HOOKS if getattr(module, name, None)]
    return tuple(key)


def _plain_values(layer: nn.Module) -> tuple:
    """The plain Python values (numbers, strings, None, tuples of them) of ``layer``'s modules:
    what Dynamo may specialise on, for a torch without a guard check."""
    plain = (int, float, bool, str, type(None))
    out = []
    for i, sub in enumerate(layer.modules()):
        for name, value in vars(sub).items():
            if isinstance(value, plain) or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value)):
                out.append((i, name, value))
    return tuple(out)


def _cache_entries(fn: Callable[..., Any]) -> Optional[list]:
    """Dynamo's compiled entries of ``fn``'s code; None where this torch cannot list them."""
    get = getattr(getattr(torch._dynamo, "eval_frame", None), "_debug_get_cache_entry_list", None)
    if get is None:
        return None
    try:
        return list(get(fn.__code__))
    except Exception:  # a torch whose cache entries cannot be read
        return None


def _checker(entry: Any) -> Optional[Callable[[dict], Any]]:
    manager = getattr(entry, "guard_manager", None)
    return getattr(manager, "check", None)


class _Group:
    """Layers sharing one compiled function."""

    __slots__ = ("fn", "compiled", "first", "hooks", "values", "layers", "why")

    def __init__(self, fn: Callable[..., Any], compiled: Callable[..., Any], first: nn.Module, hooks: tuple,
                 values: Optional[tuple], why: str) -> None:
        self.fn, self.compiled, self.first, self.hooks, self.values = fn, compiled, first, hooks, values
        self.layers: list[int] = []
        self.why = why


class _Slot:
    """One layer: its group, and the hook registration counter it last checked its key at."""

    __slots__ = ("layer", "index", "group", "seen")

    def __init__(self, layer: nn.Module, index: int) -> None:
        self.layer, self.index, self.group, self.seen = layer, index, None, -1


class LayerCalls:
    """The compiled functions of the layers of one stack that run ``fn``."""

    def __init__(self, fn: Callable[..., Any], backend: Any, dynamic: Optional[bool], path: str) -> None:
        self.fn = getattr(fn, "__func__", fn)
        self.backend = backend
        self.dynamic = dynamic
        self.path = path
        self.groups: list[_Group] = []
        self.slots: list[_Slot] = []
        self.signature = inspect.signature(self.fn)
        self.checks = _cache_entries(self.fn) is not None
        self.ahead: Optional[Callable[[LayerCalls], bool]] = None
        """Set by regional_modes.StackModes: asked before a layer starts a group of its own; True
        when the stack is to be compiled with the model from the next call on."""
        self.as_written = False
        """Layers not placed yet run as written (the stack is compiled with the model from the next
        call on: a graph of their own now would be thrown away)."""

    # ------------------------------------------------------------------ per call

    def forward_for(self, layer: nn.Module, index: int) -> Callable[..., Any]:
        """The ``forward`` ``layer`` (number ``index`` of the stack) gets during a call."""
        slot = _Slot(layer, index)
        self.slots.append(slot)
        counters = self.backend.shared.counters
        handles = HANDLES
        place = self._place
        fn = self.fn

        def forward(*args: Any, **kwargs: Any) -> Any:
            group = slot.group
            if group is None or slot.seen != handles.next_id:
                group = place(slot, args, kwargs)
                if group is None:  # compiled with the model from the next call on
                    return fn(layer, *args, **kwargs)
            before = counters.graph_calls
            out = group.compiled(layer, *args, **kwargs)
            if counters.graph_calls == before:
                self._ran_uncompiled(slot, group)
            return out

        # Dynamo, tracing the model's forward, stops at this call (a graph break) instead of
        # inlining the layer; the compiled layer function it calls is compiled on its own (its own
        # torch.compile context turns Dynamo back on inside). Disabled recursively: with
        # recursive=False Dynamo looks at this wrapper's frame on every call, finds nothing to
        # compile and skips it, about 0.4 ms of host time per layer call.
        return torch._dynamo.disable(forward)

    # ------------------------------------------------------------------ placing a layer

    def _place(self, slot: _Slot, args: tuple, kwargs: dict) -> Optional[_Group]:
        seen = HANDLES.next_id
        hooks = hook_key(slot.layer)
        group = slot.group
        if group is None or group.hooks != hooks:
            if group is not None:
                group.layers.remove(slot.index)
            group = self._group_for(slot.layer, hooks, args, kwargs)
            if group is None:
                slot.group = None
                return None
            group.layers.append(slot.index)
            slot.group = group
        slot.seen = seen
        return group

    def _group_for(self, layer: nn.Module, hooks: tuple, args: tuple, kwargs: dict) -> Optional[_Group]:
        """The group ``layer`` joins or starts; None where the layer is to run as written (the
        stack is compiled with the model from the next call on, :attr:`ahead`)."""
        if self.as_written:
            return None
        values = None if self.checks else _plain_values(layer)
        why = ""
        for group in self.groups:
            if group.hooks != hooks:
                continue
            if values is not None:
                if group.values == values:
                    return group
                continue
            differs = self._differs(group, layer, args, kwargs)
            if differs is None:
                return group
            why = why or differs
        if not why:
            why = ("hooks on its submodules" if hooks and self.groups else "the Python values of its modules"
                   if values is not None and self.groups else "")
        elif self.ahead is not None and hooks == self.groups[0].hooks and self.ahead(self):
            self.as_written = True
            return None
        return self._new_group(layer, hooks, values, why)

    def _differs(self, group: _Group, layer: nn.Module, args: tuple, kwargs: dict) -> Optional[str]:
        """None when every compiled graph of ``group`` judges ``layer`` as it judges the group's
        first layer: each guard that reads only the layer gives the same answer on both, and the
        whole guard set, on these arguments, passes or fails alike; else what told them apart."""
        entries = _cache_entries(group.fn)
        if not entries:
            return None
        for entry in entries:
            for code, text in _layer_guards(entry):
                if _evaluate(entry, code, layer) != _evaluate(entry, code, group.first):
                    return "Dynamo specialises the layer on " + _readable(text)
        try:
            mine = self._locals(layer, args, kwargs)
            theirs = self._locals(group.first, args, kwargs)
        except TypeError:
            return "arguments the layer function does not bind"
        for entry in entries:
            check = _checker(entry)
            if check is None:
                return "a compiled graph whose guards cannot be checked"
            try:
                if bool(check(mine)) != bool(check(theirs)):
                    return _failed_guard(entry, mine, theirs)
            except Exception:  # a guard that cannot be evaluated outside Dynamo's frame
                return "a compiled graph whose guards cannot be checked"
        return None

    def _locals(self, layer: nn.Module, args: tuple, kwargs: dict) -> dict:
        bound = self.signature.bind(layer, *args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def _new_group(self, layer: nn.Module, hooks: tuple, values: Optional[tuple], why: str) -> _Group:
        fn = self.fn
        copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        copy.__qualname__ = fn.__qualname__
        copy.__dict__.update(fn.__dict__)
        compiled = torch.compile(copy, backend=self.backend, dynamic=self.dynamic)
        group = _Group(copy, compiled, layer, hooks, values, why)
        self.groups.append(group)
        return group

    def value_classes(self) -> Optional[tuple[int, list[str]]]:
        """Into how many classes the values the first group's graphs compare with a constant, read
        from the layer only (``L['self'].attn.layer_idx == 0``), split the layers of this function
        (each class needs a graph of its own), and the names of those that differ among them; None where none is read."""
        if not self.groups:
            return None
        entries = _cache_entries(self.groups[0].fn) or []
        parts = [(entry, code, text) for entry in entries for code, text in _layer_values(entry)]
        if not parts:
            return None
        values = [tuple(repr(_evaluate(entry, code, slot.layer, plain=True)) for entry, code, _ in parts)
                  for slot in self.slots]
        names = {_readable(text) for i, (_, _, text) in enumerate(parts) if len({v[i] for v in values}) > 1}
        return len(set(values)), sorted(names)

    # ------------------------------------------------------------------ uncompiled calls

    def _ran_uncompiled(self, slot: _Slot, group: _Group) -> None:
        entries = _cache_entries(group.fn)
        if entries is not None and len(entries) >= recompile_limit():
            why = (f"its layer function was compiled {len(entries)} times, Dynamo's recompile limit, and this "
                   "call matched none of those graphs (TORCH_LOGS=recompiles names what changes)")
        elif entries == []:
            why = "Dynamo compiled no graph of its layer function (a frame it skips)"
        else:
            why = "no graph of the instance ran during the layer's call: Dynamo ran the layer function as it is"
        where = f"{self.path}.{slot.index}" if self.path else str(slot.index)
        self.backend.uncompiled.note(where, why)

    # ------------------------------------------------------------------ report

    def describe(self) -> list[dict[str, Any]]:
        """The groups: the layers of each and what set it apart from the groups before it."""
        return [{"layers": sorted(g.layers), "why": g.why} for g in self.groups if g.layers]


_SELF = "L['self']"
_OTHER_LOCAL = re.compile(r"L\['(?!self')")
_GUARD_CODE: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()


def _layer_guards(entry: Any) -> list[tuple[Any, str]]:
    """(compiled code, text) of the guards of ``entry`` that read the layer and no other argument
    (``L['self'].layer_idx == 0``), as Dynamo printed them; empty where this torch does not keep
    them (GuardManagerWrapper.code_parts, private API). Compiled once per guard manager."""
    manager = getattr(entry, "guard_manager", None)
    if manager is None:
        return []
    kept = _GUARD_CODE.get(manager)
    if kept is None:
        kept = []
        for part in getattr(manager, "code_parts", None) or ():
            text = str(part)
            if _SELF in text and not _OTHER_LOCAL.search(text):
                try:
                    kept.append((compile(text, "<guard>", "eval"), text))
                except SyntaxError:
                    continue
        _GUARD_CODE[manager] = kept
    return kept


def _layer_values(entry: Any) -> list[tuple[Any, str]]:
    """(compiled code, text) of the values that the layer-only guards of ``entry`` compare with a
    constant (``L['self'].attn.layer_idx`` of ``L['self'].attn.layer_idx == 0``)."""
    out = []
    for _, text in _layer_guards(entry):
        match = _EQUALS.match(text.split("#")[0].strip())
        if match is None:
            continue
        try:
            out.append((compile(match.group(1), "<guard>", "eval"), match.group(1)))
        except SyntaxError:
            continue
    return out


def _evaluate(entry: Any, code: Any, layer: nn.Module, plain: bool = False) -> Any:
    """A guard's value for ``layer`` in the layer's place; an exception's type where it raises (a
    helper Dynamo keeps elsewhere: the same for every layer)."""
    manager = entry.guard_manager
    scope = dict(getattr(manager, "global_scope", None) or {})
    scope.update(getattr(manager, "closure_vars", None) or {})
    scope["L"] = {"self": layer}
    try:
        value = eval(code, scope)  # noqa: S307 - Dynamo's own guard expressions
        return value if plain else bool(value)
    except Exception as exc:  # noqa: BLE001
        return type(exc)


def _readable(guard: str) -> str:
    """``L['self']._modules['attn'].layer_idx == 0`` -> ``self.attn.layer_idx``."""
    guard = _MODULES.sub(r".\1", guard.split("#")[0].strip().replace(_SELF, "self"))
    return _COMPARED.split(guard)[0]


def _failed_guard(entry: Any, mine: dict, theirs: dict) -> str:
    """The guard of ``entry`` that tells the two layers apart, in Dynamo's words."""
    verbose = getattr(getattr(entry, "guard_manager", None), "check_verbose", None)
    for local in (mine, theirs):
        try:
            parts = verbose(local).verbose_code_parts if verbose is not None else []
        except Exception:  # a guard that cannot be evaluated outside Dynamo's frame
            parts = []
        if parts:
            return "Dynamo specialises the layer on " + _readable(str(parts[0]))
    return "Dynamo's guards tell the layers apart"


_EQUALS = re.compile(r"^(L\['self'\][\w.\[\]']*) == [^=]+$")
_MODULES = re.compile(r"\._modules\['([^']+)'\]")
_COMPARED = re.compile(r" (?:==|!=|is not|is) ")
