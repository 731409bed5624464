"""Where the graphs' memory goes: per graph entry, per region, per captured size and in all.

Two figures per entry, kept apart because they answer different questions:

* **held**: bytes of tensors the entry keeps allocated between calls, by what they are:
  ``inputs`` (the static buffers caller tensors are copied into), ``outputs`` (its static outputs;
  views of its inputs excluded), ``saved`` (what a training forward's autograd graph keeps for the
  backward, beyond its inputs and outputs: zero once released, runtime/backward.py, or loosened,
  runtime/saved.py) and ``grads``
  (a training entry's incoming-gradient buffers, except those lying in an output's memory,
  counted there; and the gradients its backward graph writes, which autograd hands out as
  ``.grad``). The CUDA caching allocator counts these as allocated.
* **reserved**: how much the pool's reserved memory grew while the entry's graphs were captured
  (their temporaries and outputs; 0 with simulated graphs). It stays reserved while the graphs
  live; ``released`` says how much of a training entry's saved activations and static inputs
  (runtime/backward.py), or of its outputs that take their incoming gradient (runtime/tangents.py),
  or of the last region's inference outputs (runtime/loose_outputs.py; outputs of either kind:
  ``released_outputs``; static inputs: ``released_inputs``), lies there, no longer allocated
  (their blocks are the graphs' to reuse).

Each tensor is counted once, by its storage, in the first kind that holds it (inputs, outputs,
grads): the figures of an entry add up to its ``held``, the entries' to their region's, and the
regions' to the total.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..common.fx_utils import iter_tensors
from .entries import Entry

__all__ = ["KINDS", "entry_memory", "add_up", "memory_of", "released_kinds"]

KINDS = ("inputs", "outputs", "saved", "grads")
"""The parts of ``held``, in the order a storage is attributed to them."""


def _storages(values: Iterable[Any], seen: set[int]) -> int:
    total = 0
    for t in iter_tensors(list(values)):
        if not t.numel() or t.layout != torch.strided:
            continue
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


def entry_memory(entry: Entry) -> dict[str, int]:
    """The bytes one graph entry holds, by kind, with ``held`` (their sum), ``reserved``,
    ``released``, ``released_outputs`` and ``released_inputs`` (module docstring)."""
    out = dict.fromkeys(KINDS, 0)
    if entry.static_ins is None:  # released (evicted) entry
        out.update(held=0, reserved=0, released=0, released_outputs=0, released_inputs=0)
        return out
    seen: set[int] = set()
    # Parameters and other graphs' outputs are read in place: they belong to the model or to another graph.
    released_in = getattr(entry, "released_in", {})  # a training entry's (runtime/backward.py)
    released_inputs = sum(released_in.values())
    out["inputs"] = _storages((entry.static_ins[p] for p in entry.copy_pos if p not in released_in), seen)
    views = entry.input_views.views if entry.input_views is not None else {}
    released = entry.out_released
    # A training entry's outputs holding their incoming gradient, once released (tangents.py).
    released_out = getattr(entry, "released_out", {})
    released_outputs = entry.out_released + sum(released_out.values())
    if not released:
        out["outputs"] = _storages((o for i, o in enumerate(entry.outputs or ())
                                    if i not in views and i not in released_out), seen)
    if hasattr(entry, "bwd_graph"):  # a training entry
        if entry.released:
            released += entry.saved_bytes
        else:
            out["saved"] = entry.saved_bytes
        released += released_inputs + sum(released_out.values())
        grad_outs = [g for i, g in zip(getattr(entry, "diff_out", ()), entry.static_grad_outs or ())
                     if i not in released_out]
        grads_in = list(entry.static_grad_ins or ())
        if getattr(entry, "loose_from", -1) >= 0:  # its parameters' gradients went back to the pool
            loose = set(entry.weight_grads)
            grads_in = [g for k, g in enumerate(grads_in) if k not in loose]
        out["grads"] = _storages(grad_outs + grads_in, seen)
    out["held"] = sum(out[k] for k in KINDS)
    out["reserved"] = entry.nbytes
    out["released"] = released
    out["released_outputs"] = released_outputs
    out["released_inputs"] = released_inputs
    return out


def add_up(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    """The sum of memory dicts, key by key."""
    total = dict.fromkeys(KINDS + ("held", "reserved", "released", "released_outputs", "released_inputs"), 0)
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0) + value
    return total


def released_kinds(mem: dict[str, int]) -> dict[str, int]:
    """What ``released`` of a memory dict is made of, by name, for the report texts: saved
    activations, training static inputs and last-region outputs (the kinds with bytes only)."""
    outputs, inputs = mem.get("released_outputs", 0), mem.get("released_inputs", 0)
    parts = {"saved activations": mem.get("released", 0) - outputs - inputs, "static inputs": inputs,
             "outputs": outputs}
    return {k: v for k, v in parts.items() if v}


def memory_of(entries: Iterable[Entry]) -> dict[str, Any]:
    """What the graph entries ``entries`` hold and reserved, in all, and per capture size of the
    bucketed ones (``by_size``); each entry measured once."""
    parts, sizes = [], {}
    for e in entries:
        part = entry_memory(e)
        parts.append(part)
        if e.size is not None:
            sizes.setdefault(e.size, []).append(part)
    out: dict[str, Any] = add_up(parts)
    out["by_size"] = {size: add_up(group) for size, group in sorted(sizes.items())}
    return out
