"""Whether each regional stack is compiled layer by layer or with the rest of the model, decided
per call of the compiled model (regional.py installs the layers' forwards this chooses).

Why: regional compilation pays for its one trace per stack with a graph call (and a Dynamo frame,
its guards, the layer's own Python) per layer and call. Where most layers of a stack are compiled
apart anyway (each reads a Python value of its own, as transformers' decoder layers read
``self.layer_idx`` to update their KV cache), there is no trace to save, and that per-layer cost
made a 16-layer Llama decode step several times a 4-layer one's.

How: once every layer of a stack has been called (and so placed in a group, regional_calls.py), a
stack with more than half its layers in groups of their own is compiled with the model from the
next call on: its layers' (and their loop owner's) forwards are no longer installed, Dynamo's
guard on them fails, and it traces the stack inline, as for a model below
``regional_min_layers``. Usually that is seen at the first layer's graph, during the first call
(:meth:`StackModes._ahead`): the values its layer-only guards compare with a constant
(``self.self_attn.layer_idx == 0``), read from every layer, would set most layers apart; the
layers not compiled yet then run as written for the rest of that call instead of each compiling a
graph that the next call throws away. Only a stack whose owner's forward loops over it (a ``ModuleList``): the
loop of an ``nn.Sequential`` stack was given up by Dynamo at the first call (a graph break in a
loop), so without the layers' forwards each layer would be a frame of its own again, on the
layer class's code, which all layers share. Dynamo does not guard empty hook dicts, so the stack's hook key (every
hook dict of its modules that is not empty, and the global ones) is kept: when a hook is
registered (``RemovableHandle``'s counter moved) and the key changed, the stack goes back to
layer-by-layer compilation for good, where every layer call checks its hooks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import torch.nn as nn

from .regional_calls import HANDLES, hook_key

__all__ = ["StackModes"]

Pair = tuple[nn.Module, Callable[..., Any]]


@dataclasses.dataclass
class _Stack:
    stack: Any
    """The regional.LayerStack."""
    pairs: list
    """(layer, forward) of its layers."""
    owner: Optional[nn.Module]
    with_model: bool = False
    settled: bool = False
    """Decided for good: layer by layer (no more hooks changes to watch either) or, while
    ``with_model``, watched for hooks."""
    hooks: tuple = ()
    why: str = ""


class StackModes:
    """The forwards to install at each call (:meth:`select`), one entry per stack."""

    def __init__(self, stacks: list[tuple[Any, list[Pair]]], owners: list[Pair]) -> None:
        self.stacks = [_Stack(stack, pairs, stack.owner) for stack, pairs in stacks]
        self.owners = owners
        self.seen = HANDLES.next_id
        self.active: list[Pair] = self._active()
        for s in self.stacks:
            if s.owner is not None and len(s.stack.calls) == 1 and s.stack.calls[0].checks:
                s.stack.calls[0].ahead = functools.partial(self._ahead, s)

    def __bool__(self) -> bool:
        return bool(self.stacks)

    def select(self) -> list[Pair]:
        """The (module, forward) pairs to install for this call."""
        if HANDLES.next_id != self.seen:
            self.seen = HANDLES.next_id
            self._hooks_moved()
        if not all(s.settled for s in self.stacks):
            self._decide()
        return self.active

    def _decide(self) -> None:
        changed = False
        for s in self.stacks:
            if s.settled:
                continue
            groups = [g for calls in s.stack.calls for g in calls.describe()]
            placed = sum(len(g["layers"]) for g in groups)
            if placed < len(s.stack.layers):
                continue  # a layer not called yet: decided once all were
            s.settled = True
            apart = len(groups) - 1
            if apart * 2 > len(s.stack.layers) and s.owner is not None:
                reasons = sorted({g["why"] for g in groups if g["why"]})
                s.with_model, s.hooks, changed = True, _stack_hooks(s.stack), True
                s.why = (f"{apart} of its {len(s.stack.layers)} layers are compiled apart "
                         f"({'; '.join(reasons)}): compiled with the model from the second call on, one "
                         "trace of the stack instead of a graph call per layer")
        if changed:
            self.active = self._active()

    def _ahead(self, s: _Stack, calls: Any) -> bool:
        """Asked during the first call, before a layer starts a group of its own: where the values
        the first layer's graphs are specialised on (read from the layer: ``self.layer_idx``) set
        more than half the layers apart, the stack is compiled with the model from the next call
        on, and its layers not compiled yet run as written for the rest of this call (their graphs
        would be thrown away at the next)."""
        if s.settled:
            return False
        found = calls.value_classes()
        if found is None:
            return False
        classes, names = found
        if (classes - 1) * 2 <= len(s.stack.layers):
            return False
        s.settled, s.with_model, s.hooks = True, True, _stack_hooks(s.stack)
        s.why = (f"{classes - 1} of its {len(s.stack.layers)} layers would be compiled apart (Dynamo specialises "
                 f"the layer on {', '.join(names)}, {classes} values among its layers): compiled with the model "
                 "from the second call on, one trace of the stack instead of a graph call per layer; at the "
                 "first call, the layers from the second on ran as written")
        self.active = self._active()
        return True

    def _hooks_moved(self) -> None:
        changed = False
        for s in self.stacks:
            if s.with_model and _stack_hooks(s.stack) != s.hooks:
                s.with_model, changed = False, True
                for calls in s.stack.calls:
                    calls.as_written = False
                s.why = ("compiled with the model, then layer by layer again for good: a hook was registered "
                         "on its modules (each layer call checks its hooks; Dynamo's graphs do not)")
        if changed:
            self.active = self._active()

    def _active(self) -> list[Pair]:
        pairs = [p for s in self.stacks if not s.with_model for p in s.pairs]
        layer_by_layer = {id(s.owner) for s in self.stacks if not s.with_model and s.owner is not None}
        pairs += [p for p in self.owners if id(p[0]) in layer_by_layer]
        return pairs

    def describe(self, stack: Any) -> dict[str, Any]:
        """How ``stack`` is compiled now, for the report."""
        s = next(s for s in self.stacks if s.stack is stack)
        return {"with_model": s.with_model, "why": s.why}


def _stack_hooks(stack: Any) -> tuple:
    """The hook keys of every layer of ``stack``, its own hooks included (compiled with the model,
    a layer's ``_call_impl`` is traced too)."""
    return tuple((i, hook_key(layer), bool(layer._forward_hooks or layer._forward_pre_hooks
                                          or layer._backward_hooks or layer._backward_pre_hooks))
                 for i, layer in enumerate(stack.layers))
