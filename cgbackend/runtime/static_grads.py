"""The static gradients a backward replay produces, given to autograd as fresh aliases and
reclaimed before the next backward replay rewrites them.

Autograd's AccumulateGrad keeps such an alias as ``param.grad`` instead of copying it, so ``.grad``
accumulates as eagerly. Whether anything still holds them is read from their storages' use counts
(held.HeldStorages): a few calls, however many parameters (a MoE layer's experts are hundreds of
gradients on a few storages). Until reclaimed, an entry is in ``handed`` (RuntimeShared.handed),
and its backward graph counts as live for the replay-order rule (pool.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .entries import TrainEntry
from .stats import Counters

__all__ = ["give_grads", "reclaim_grads", "reclaim_all"]


def give_grads(entry: TrainEntry, leaves: list[torch.Tensor], handed: dict[int, Any]) -> tuple:
    """Fresh aliases of the static gradients for autograd (which may keep them as ``.grad``
    without a copy); whether any is still held is read from the storages' counts
    (``entry.held``, whose baseline is taken before the first aliases exist)."""
    if entry.held is None:
        # No use counts to tell whether an alias is still held: give the buffers themselves, which
        # autograd copies because we hold them.
        return entry.static_grad_ins
    entry.held.mark_once()
    out = tuple(None if g is None else g.detach() for g in entry.static_grad_ins)
    entry.handed = True
    entry.leaves = leaves
    if id(entry) not in handed:
        # Until reclaimed, the gradients are live data of the backward graph: the replay-order
        # rule then keeps graphs captured before it from running over them.
        handed[id(entry)] = entry
        entry.pool.acquire(entry.bwd_index)
    return out


def reclaim_grads(entry: TrainEntry, leaves: list[torch.Tensor], handed: dict[int, Any],
                  counters: Counters) -> bool:
    """Before a backward replay rewrites the static gradients: may it?

    The last backward gave out aliases of them. A ``.grad`` still aliasing one gets its own copy
    now; if anything else still holds one (``torch.autograd.grad`` results, a saved ``.grad``),
    return False: this backward must not overwrite it. The leaves are looked at only when the
    storages are held (a training loop that sets ``.grad`` to None between steps never does)."""
    if not entry.handed:
        return True
    if not entry.held.free():
        for leaf in leaves:
            grad = leaf.grad
            if grad is not None and grad.data_ptr() in entry.grad_ptrs:
                leaf.grad = grad.clone()
                counters.copies_made += 1
                counters.copied_by_kind["grad_reclaimed"] += 1
            del grad
        if not entry.held.free():
            return False
    entry.handed = False
    entry.leaves = []
    if handed.pop(id(entry), None) is not None:
        entry.pool.release(entry.bwd_index)
    return True


def reclaim_all(handed: dict[int, Any], counters: Counters) -> None:
    """Before any replay of a new call: give each .grad still aliasing a static gradient its own
    memory, and release the gradients nobody holds any more."""
    for entry in list(handed.values()):
        reclaim_grads(entry, entry.leaves, handed, counters)
