"""The notice that static dispatch gives experts without tokens a zero gradient (moe/loop_forwards.py):
one warning, at the user's own line, no second copy as a log line, and only where it applies: not
for experts stored stacked in one parameter (eager gives those a gradient too), not for a loop the
model never ran (its experts took another path), which the report says too."""

from __future__ import annotations

import logging
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from log_helpers import records_of
from moe_helpers import RoutedExperts

D, FF, E, K = 8, 12, 4, 2


class OwnExperts(RoutedExperts):
    """Each expert a module with parameters of its own: eager leaves an unrouted one's .grad None."""

    def __init__(self) -> None:
        super().__init__(D, FF, E, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            slot, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class StackedExperts(nn.Module):
    """The experts' weights stacked in one parameter, read by expert id in the same loop."""

    def __init__(self, grouped: bool = False) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.grouped = E, K, grouped
        self.gate = nn.Linear(D, E, bias=False)
        self.w = nn.Parameter(torch.randn(E, D, D) / D ** 0.5)

    def route(self, h):
        w, ind = torch.topk(F.softmax(self.gate(h), -1), self.top_k)
        return w / w.sum(-1, keepdim=True), ind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grouped:  # another path for the same experts, as transformers' grouped_mm is
            h = x.reshape(-1, D)
            w, ind = self.route(h)
            y = torch.einsum("nd,edf->nef", h, self.w)
            picked = y.gather(1, ind[..., None].expand(-1, -1, D))
            return (picked * w[..., None]).sum(1).reshape(x.shape)
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            slot, tok = torch.where(mask[e])
            out.index_add_(0, tok, h[tok] @ self.w[e] * w[tok, slot, None])
        return out.reshape(x.shape)


def _train(model: nn.Module, steps: int = 2):
    """A few training steps of ``cgbackend.compile(model)``: (its warnings, cgbackend's log records)."""
    torch.manual_seed(0)
    compiled = cgbackend.compile(model, warmup=1)
    with warnings.catch_warnings(record=True) as seen, records_of("cgbackend", logging.INFO) as records:
        warnings.simplefilter("always")
        for _ in range(steps):
            compiled(torch.randn(2, 5, D)).sum().backward()  # the user's line the notice names
    notices = [w for w in seen if "no token" in str(w.message)]
    return notices, [r for r in records if "no token" in r.getMessage()], compiled


def test_the_notice_is_one_warning_at_the_users_line():
    notices, records, _ = _train(OwnExperts())
    assert len(notices) == 1, [str(w.message) for w in notices]
    assert os.path.basename(notices[0].filename) == os.path.basename(__file__), notices[0].filename
    assert "backward()" in open(__file__).read().splitlines()[notices[0].lineno - 1]
    assert all(r.levelno < logging.WARNING for r in records)  # not printed a second time


def test_no_notice_for_experts_stored_stacked():
    notices, _, compiled = _train(StackedExperts())
    report = cgbackend.report(compiled)
    assert [r["form"] for r in report.loop_rewrites] == ["hit_loop"] and report.summary["dispatch_rewrites"]
    assert notices == []
    assert "unrouted_expert_grads" not in report.summary and "zero gradient" not in report.to_text()


def test_a_loop_the_model_never_runs_is_reported_so():
    model = StackedExperts(grouped=True)
    report = cgbackend.explain(model, torch.randn(2, 5, D), training=False)
    (loop,) = report.loop_rewrites
    assert loop["form"] == "hit_loop" and loop["traced"] is False
    text = report.to_text()
    assert "rewritten, but no graph Dynamo traced runs it" in text
    assert "rewritten before tracing" not in text and "traced unrolled" not in text
    notices, _, _ = _train(StackedExperts(grouped=True))
    assert notices == []
