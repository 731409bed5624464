"""The MoE layer that the static-dispatch tests write their dispatch loops on: a gate, a list of
experts and the renormalized top-k routing; each test module writes the loop itself (``forward``),
as user code, since the loop rewrite reads that source."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from cgbackend.models.layers import Expert


def top_k_routing(gate: nn.Linear, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights (renormalized over the top ``k``) and expert ids of each row of ``h``."""
    w, ind = torch.topk(F.softmax(gate(h), -1), k)
    return w / w.sum(-1, keepdim=True), ind


class RoutedExperts(nn.Module):
    """``n_experts`` SwiGLU experts of width ``ff`` on ``d`` features, routed top-``top_k``."""

    def __init__(self, d: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d, ff) for _ in range(n_experts))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k_routing(self.gate, h, self.top_k)


class SqrtExpert(nn.Module):
    """An expert that is not finite on a row with a feature below -3: the soundness tests route it
    only rows it is finite on, so running it on rows it was not sent would show as NaN."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w1(torch.sqrt(x + 3))
