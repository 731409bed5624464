"""Experts in the grouped-GEMM form: stacked weights and one ``torch._grouped_mm`` per weight.

:func:`grouped_experts` is the dispatch both grouped MoE layers run (this module's
:class:`GroupedGPTMoE` and ``realsize.GroupedMoE``): the routed copies of the tokens sorted by expert
on the device, group ends from a device-side count and ``cumsum`` (no host sync, so every shape is
fixed), one ``torch._grouped_mm`` per expert weight (``w1``, ``w3``: ``[E, ffn, hidden]``; ``w2``:
``[E, hidden, ffn]``), the weighted copies put back in token order and summed over the top-k. This is
the layout of transformers' ``grouped_mm`` experts and of torchtitan's MoE. The expert sizes must be
multiples of 8 (16-byte strides in bf16).

:func:`grouped_gpt` turns a GPT whose feed-forward layers are ``MixtralStyleMoE`` (a per-expert
``ModuleList`` and a loop) into the same model with :class:`GroupedGPTMoE` layers, the same weights
stacked. :func:`loop_name` names a stacked weight's expert slice the way the loop model names the
expert's own parameter, so gradients compare one to one (the stacked gradient equals
``torch.stack`` of the per-expert gradients).
"""

from __future__ import annotations

import copy
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt import GPT, MixtralStyleMoE

__all__ = ["STACKED", "StackedExperts", "GroupedGPTMoE", "grouped_experts", "grouped_gpt", "stacked_params",
           "loop_name"]

STACKED = ("w1", "w2", "w3")
"""The stacked expert weights, named as each loop expert (``layers.Expert``) names its Linear."""


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on tokens ``h`` ``[n, c]`` routed to ``selected`` ``[n, k]`` with ``weights``
    ``[n, k]`` (in ``h``'s dtype): ``[n, c]``, the weighted sum of each token's k expert outputs."""
    n_experts, top_k, c = w1.shape[0], selected.shape[-1], h.shape[-1]
    flat = selected.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // top_k
    counts = torch.zeros(n_experts, dtype=torch.int32, device=h.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = h[token]
    a = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offsets)
    g = torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offsets)
    y = torch._grouped_mm(F.silu(a) * g, w2.transpose(-2, -1), offs=offsets)
    y = y * weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(y).index_copy(0, order, y)
    return unsorted.view(-1, top_k, c).sum(dim=1)


class StackedExperts(nn.Module):
    """A MoE layer whose experts are the stacked weights ``w1``, ``w3`` ``[E, ffn, hidden]`` and
    ``w2`` ``[E, hidden, ffn]`` (uninitialized: filled from a loop model's experts)."""

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, ffn))

    def run_experts(self, h: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        return grouped_experts(h, weights, selected, self.w1, self.w2, self.w3)

    def load_experts(self, loop_experts: nn.ModuleList) -> None:
        """Copy the loop model's per-expert weights into the stacked ones."""
        with torch.no_grad():
            for w in STACKED:
                getattr(self, w).copy_(torch.stack([getattr(e, w).weight for e in loop_experts]))


class GroupedGPTMoE(StackedExperts):
    """``MixtralStyleMoE`` (same router: float softmax, top-k, renormalized) with grouped experts."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int) -> None:
        super().__init__(d_model, d_ff, n_experts, top_k)
        self.gate = nn.Linear(d_model, n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = x.reshape(-1, c)
        probs = F.softmax(self.gate(h), dim=1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        return self.run_experts(h, weights, selected).reshape(b, t, c)


def grouped_gpt(model: GPT) -> GPT:
    """A copy of ``model`` with every ``MixtralStyleMoE`` replaced by a :class:`GroupedGPTMoE` holding
    the same weights (experts stacked); on ``model``'s device and dtype, in its training mode."""
    out = copy.deepcopy(model)
    for block in out.layers:
        loop = block.ffn
        if not isinstance(loop, MixtralStyleMoE):
            continue
        first = loop.experts[0].w1.weight
        d_ff, d_model = first.shape
        grouped = GroupedGPTMoE(d_model, d_ff, loop.n_experts, loop.top_k).to(device=first.device,
                                                                              dtype=first.dtype)
        with torch.no_grad():
            grouped.gate.weight.copy_(loop.gate.weight)
        grouped.load_experts(loop.experts)
        grouped.train(loop.training)
        block.ffn = grouped
    return out


def stacked_params(model: nn.Module) -> Iterator[tuple[str, str, str]]:
    """(parameter name, owner module name, weight) of every stacked expert weight in ``model``."""
    for owner, module in model.named_modules():
        if isinstance(module, StackedExperts):
            for w in STACKED:
                yield (f"{owner}.{w}" if owner else w), owner, w


def loop_name(owner: str, expert: int, weight: str) -> str:
    """The loop model's name of expert ``expert``'s ``weight`` under the MoE module ``owner``."""
    return f"{owner}.experts.{expert}.{weight}.weight" if owner else f"experts.{expert}.{weight}.weight"
