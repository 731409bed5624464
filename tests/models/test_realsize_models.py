"""The real-size benchmark models (cgbackend/models/realsize.py): the hand-written grouped-GEMM form
computes the loop form's function from the same weights, gradients included."""

from __future__ import annotations

import pytest
import torch

from cgbackend.models.realsize import (SHAPES, RealModel, grouped_from, grouped_mm_unsupported, load_weights,
                                       make_hidden_inputs, named_grads)


def _route_all_alike(model: RealModel) -> None:
    """A zero gate: every token ties on every expert, so all go to the same top-k experts and the
    other experts get no token."""
    with torch.no_grad():
        for layer in model.layers:
            layer.mlp.gate.weight.zero_()


@pytest.mark.parametrize("name", ["moe-dsv2lite-shape", "moe-mixtral-shape"])
@pytest.mark.parametrize("routing", ["random", "same_experts"])
def test_grouped_form_equals_loop_form(name, routing):
    reason = grouped_mm_unsupported("cpu", torch.float32)
    if reason is not None and "fails on cpu" in reason:
        pytest.skip(reason)
    cfg = SHAPES[name]["tiny"]
    torch.manual_seed(0)
    loop = RealModel(cfg)
    if routing == "same_experts":
        _route_all_alike(loop)
    grouped = grouped_from(loop)
    x = make_hidden_inputs(cfg, tokens=64, n=1, device="cpu", dtype=torch.float32, seed=3)[0]
    out_l, sel_l = loop(x)
    out_g, sel_g = grouped(x)
    assert torch.equal(sel_l, sel_g)
    if routing == "same_experts":
        assert (sel_l.sort(-1).values == sel_l[:, :1].sort(-1).values).all()
    torch.testing.assert_close(out_g, out_l, rtol=1e-5, atol=1e-5)
    out_l.pow(2).mean().backward()
    out_g.pow(2).mean().backward()
    ref = {n: p.grad for n, p in loop.named_parameters()}
    got = dict(named_grads(grouped))
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


def test_load_weights_restores_the_stacked_experts():
    cfg = SHAPES["moe-mixtral-shape"]["tiny"]
    torch.manual_seed(0)
    loop = RealModel(cfg)
    grouped = grouped_from(loop)
    with torch.no_grad():
        for p in grouped.parameters():
            p.add_(1.0)
    load_weights(grouped, loop)
    moe = grouped.layers[0].mlp
    assert torch.equal(moe.w2[3], loop.layers[0].mlp.experts[3].w2.weight)
    assert torch.equal(grouped.layers[1].attn.q_proj.weight, loop.layers[1].attn.q_proj.weight)


def test_token_counts_split_into_sequences():
    cfg = SHAPES["dense-llama8b-shape"]["tiny"]
    xs = make_hidden_inputs(cfg, tokens=512, n=2, device="cpu", dtype=torch.float32, seed=0, max_seq=128)
    assert [tuple(x.shape) for x in xs] == [(4, 128, cfg.hidden)] * 2
    assert not torch.equal(xs[0], xs[1])
    with pytest.raises(ValueError, match="multiple"):
        make_hidden_inputs(cfg, tokens=200, n=1, device="cpu", dtype=torch.float32, seed=0, max_seq=128)
