"""The grouped-GEMM form of the GPT MoE model (cgbackend/models/grouped.py) computes the loop model's
function from the same weights, and its stacked expert gradients are the loop model's per-expert
gradients stacked."""

from __future__ import annotations

import pytest
import torch

from cgbackend.models import build_model
from cgbackend.models.grouped import GroupedGPTMoE, grouped_gpt, loop_name, stacked_params
from cgbackend.models.realsize import grouped_mm_unsupported


@pytest.fixture
def fp32_grouped_mm():
    reason = grouped_mm_unsupported("cpu", torch.float32)
    if reason is not None and "fails on cpu" in reason:
        pytest.skip(reason)


def test_grouped_gpt_equals_the_loop_model_with_stacked_gradients(fp32_grouped_mm):
    loop = build_model("moe", size="tiny", seed=3)
    grouped = grouped_gpt(loop)
    assert all(isinstance(b.ffn, GroupedGPTMoE) for b in grouped.layers)
    assert sum(p.numel() for p in grouped.parameters()) == sum(p.numel() for p in loop.parameters())
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):  # two batches: different routing
        x = torch.randint(0, 128, (2, 16), generator=gen)
        loop.zero_grad(set_to_none=True)
        grouped.zero_grad(set_to_none=True)
        out_l, out_g = loop(x), grouped(x)
        torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-5)
        out_l.pow(2).mean().backward()
        out_g.pow(2).mean().backward()
        ref = {n: p.grad for n, p in loop.named_parameters()}
        stacked = {name: (owner, w) for name, owner, w in stacked_params(grouped)}
        assert len(stacked) == 3 * len(loop.layers)
        for name, p in grouped.named_parameters():
            if name in stacked:
                owner, w = stacked[name]
                expected = torch.stack([ref[loop_name(owner, e, w)] for e in range(p.shape[0])])
                torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=name)
            else:
                torch.testing.assert_close(p.grad, ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_dense_gpt_has_nothing_to_group():
    dense = build_model("dense", size="tiny")
    assert not list(stacked_params(grouped_gpt(dense)))
