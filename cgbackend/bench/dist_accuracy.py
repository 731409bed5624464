"""Gradients of a distributed contender against eager's, on every rank.

:func:`grad_diff` compares two models of the same structure shard by shard (FSDP2's local shards
line up). :func:`grouped_grad_diff` compares a grouped-GEMM model with the loop model it was made
from: each stacked expert weight's gradient, gathered whole once (FSDP2 shards the stacked weight
over the experts, the loop model each expert's weight over its rows), is compared expert by expert
with the loop model's gradient of that expert (its local rows under FSDP2): the stacked gradient
must equal ``torch.stack`` of the per-expert ones. Every other parameter compares shard by shard.

Both return the largest absolute difference and the largest absolute gradient of the reference,
and hold no gradient past the call: a harness that kept ``.grad`` tensors between steps would be a
user holding gradients, which the runtime must then not overwrite (it runs such calls eagerly).
The maxima accumulate on the device and are read once.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

__all__ = ["grad_diff", "grouped_grad_diff", "local"]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


class _Max:
    """Running maxima of |a - b| and |b| on the device, read once."""

    def __init__(self) -> None:
        self.diff: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None

    def add(self, a: torch.Tensor, b: torch.Tensor, where: str) -> None:
        if a.shape != b.shape:
            raise AssertionError(f"{where}: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
        if not b.numel():
            return
        diff = (a.double() - b.double()).abs().max()
        scale = b.double().abs().max()
        self.diff = diff if self.diff is None else torch.maximum(self.diff, diff)
        self.scale = scale if self.scale is None else torch.maximum(self.scale, scale)

    def read(self) -> tuple[float, float]:
        return (0.0 if self.diff is None else float(self.diff), 0.0 if self.scale is None else float(self.scale))


def grad_diff(model: nn.Module, ref: nn.Module, where: str) -> tuple[float, float]:
    """(largest |gradient difference|, largest |reference gradient|) of two models of one structure."""
    ga, gb = _grads(model), _grads(ref)
    if set(ga) != set(gb):
        raise AssertionError(f"{where}: gradients of {sorted(set(ga) ^ set(gb))} exist on one side only")
    acc = _Max()
    for name in ga:
        acc.add(local(ga[name]), local(gb[name]), f"{where}: {name}")
    return acc.read()


def _rows(g: Any) -> Optional[slice]:
    """The rows of the whole tensor that a DTensor gradient sharded on dim 0 over a 1-D mesh holds
    here (torch.chunk's split, as FSDP2 shards); None for any other layout."""
    placements = getattr(g, "placements", None)
    if placements is None or len(placements) != 1 or not placements[0].is_shard(0):
        return None
    mesh = g.device_mesh
    n, world, rank = g.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    stop = min(start + chunk, n)
    return slice(start, stop) if stop - start == g.to_local().shape[0] else None


def grouped_grad_diff(grouped: nn.Module, ref: nn.Module, where: str) -> tuple[float, float]:
    """:func:`grad_diff` of a grouped-GEMM model against the loop model of the same weights. Collective
    under FSDP2 (each stacked gradient is gathered whole): every rank calls it at the same step."""
    from ..models.grouped import loop_name, stacked_params
    stacked = {name: (owner, w) for name, owner, w in stacked_params(grouped)}
    ga, gb = _grads(grouped), _grads(ref)
    seen: set[str] = set()
    acc = _Max()
    for name, g in ga.items():
        if name not in stacked:
            if name not in gb:
                raise AssertionError(f"{where}: gradient of {name} exists on the grouped side only")
            seen.add(name)
            acc.add(local(g), local(gb[name]), f"{where}: {name}")
            continue
        owner, w = stacked[name]
        whole = g.full_tensor() if hasattr(g, "full_tensor") else g
        for e in range(whole.shape[0]):
            expert = loop_name(owner, e, w)
            if expert not in gb:
                raise AssertionError(f"{where}: {expert} has no gradient on the loop side")
            seen.add(expert)
            theirs = gb[expert]
            rows = _rows(theirs)
            if rows is None and hasattr(theirs, "full_tensor"):
                acc.add(whole[e], theirs.full_tensor(), f"{where}: {expert}")
            else:
                acc.add(whole[e] if rows is None else whole[e][rows], local(theirs), f"{where}: {expert}")
        del whole
    missing = set(gb) - seen
    if missing:
        raise AssertionError(f"{where}: gradients of {sorted(missing)[:4]} exist on the loop side only")
    return acc.read()
