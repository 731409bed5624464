"""passes/gather.py: rewrites of eager-region modules, checked for exact equality."""

from __future__ import annotations

import copy

import pytest
import torch

from cgbackend.passes.gather import rewrite_gathers
from fx_helpers import trace as _trace


def _rewritten(fn, args, rewrite):
    gm = _trace(fn, *args)
    mine = copy.deepcopy(gm)
    return gm, mine, rewrite(mine)


def test_single_index_gathers_become_index_select_with_equal_values_and_grads():
    def fn(h, mask, w):
        idx, top = torch.where(mask)
        a = h[top]
        b = h[None, top]
        c = w[top, idx, None]
        return (a * 2).sum() + b.sum() + (c * 3).sum()

    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(6, 2, requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 0, 1, 1], [0, 1, 0, 0, 1, 0]], dtype=torch.bool)
    gm, mine, n = _rewritten(fn, (h, mask, w), rewrite_gathers)
    assert n == 3
    targets = {getattr(node.target, "__name__", "") for node in mine.graph.nodes}
    assert {"_take_rows", "_take_pairs"} <= targets
    # Dynamo orders graph inputs by first use: mask, h, w.
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["l_mask_", "l_h_", "l_w_"]
    ref = gm(mask, h, w)[0]
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = mine(mask, h2, w2)[0]
    assert torch.equal(out, ref)
    ref.backward()
    out.backward()
    assert torch.equal(h.grad, h2.grad) and torch.equal(w.grad, w2.grad)


@pytest.mark.parametrize("case", ["maybe_negative", "bool_mask", "two_dim_index"])
def test_gathers_left_alone_when_not_provably_equal(case):
    def maybe_negative(h, i):
        return h[i - 1].sum()

    def bool_mask(h, i):
        return h[h[:, 0] > 0].sum()

    def two_dim_index(h, i):
        return h[i.view(2, 2)].sum()

    fn = {"maybe_negative": maybe_negative, "bool_mask": bool_mask, "two_dim_index": two_dim_index}[case]
    h, i = torch.randn(6, 4), torch.tensor([0, 3, 2, 5])
    _, mine, n = _rewritten(fn, (h, i), rewrite_gathers)
    assert n == 0


def test_no_gather_rewrite_under_deterministic_algorithms():
    def fn(h, mask):
        return h[torch.where(mask)[0]].sum()

    h, mask = torch.randn(6, 4), torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool)
    gm = _trace(fn, h, mask)
    torch.use_deterministic_algorithms(True)
    try:
        assert rewrite_gathers(copy.deepcopy(gm)) == 0
    finally:
        torch.use_deterministic_algorithms(False)
