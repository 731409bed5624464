"""Outputs that eager returns as views stay views (issue 22): of an input, a parameter, a buffer,
another output, or of one tensor the model does not return. Checked over 5 calls, after capture,
in no_grad, inference_mode and grad mode, against the model run eagerly; writes through the
returned views must reach what eager's reach. CPU with simulated graphs; the same check with real
CUDA graphs carries the ``cuda`` marker."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn

import cgbackend

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode, "grad": contextlib.nullcontext}


class Views(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.p = nn.Parameter(torch.randn(4, 8))
        self.register_buffer("cache", torch.zeros(6, 8))

    def forward(self, x):
        y = self.l(x).relu().mul(3).sin()
        self.cache[:4].add_(y.detach())
        z = y * 2
        # x[1:], p[0], cache[:n]: views of user-visible memory; y.view(-1): of another output;
        # z.view(-1) and z[1:].t(): of one tensor the model does not return.
        return y, x[1:], self.p[0], y.view(-1), self.cache[: x.shape[0]], z.view(-1), z[1:].t()


NAMES = ("y", "x[1:]", "p[0]", "y.view(-1)", "cache[:n]", "z.view(-1)", "z[1:].t()")


def _layout(t: torch.Tensor, base: torch.Tensor) -> tuple:
    """Shape, strides and offset relative to ``base``, and whether it lies in base's memory."""
    same = t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    return tuple(t.shape), t.stride(), t.storage_offset() - base.storage_offset(), same


def _check(outs, x, model) -> list:
    """The aliasing facts eager shows, as data."""
    y, xv, pv, yv, cv, zv, zt = outs
    return [_layout(xv, x), _layout(pv, model.p), _layout(yv, y), _layout(cv, model.cache),
            _layout(zt, zv), zv.untyped_storage().data_ptr() == zt.untyped_storage().data_ptr()]


def _run_views(mode: str, device: str, dtype: torch.dtype, **options) -> dict:
    torch.manual_seed(0)
    ref_model = Views().to(device, dtype)
    model = copy.deepcopy(ref_model)
    compiled = cgbackend.compile(model, warmup=1, **options)
    ctx = MODES[mode]
    kept, kept_ref = [], []
    for call in range(5):
        x = torch.randn(4, 8, device=device, dtype=dtype)
        x_ref = x.clone()
        with ctx():
            outs = compiled(x)
            ref = ref_model(x_ref)
            for name, o, r in zip(NAMES, outs, ref):
                torch.testing.assert_close(o, r, msg=f"call {call}: {name}")
            assert _check(outs, x, model) == _check(ref, x_ref, ref_model), f"call {call}: aliasing differs"
            if mode == "grad":
                w = torch.linspace(-1, 1, 32, device=device, dtype=dtype)
                for o, m in ((outs, model), (ref, ref_model)):
                    (o[0].sum() + (o[3] * w).sum() + o[2].pow(2).sum() + o[5].pow(2).sum()).backward()
                for (name, a), b in zip(model.named_parameters(), ref_model.parameters()):
                    torch.testing.assert_close(a.grad, b.grad, msg=f"call {call}: grad of {name}")
            with torch.no_grad() if mode == "grad" else contextlib.nullcontext():
                # Writes through the returned views reach the input, the parameter and the other
                # outputs as they do eagerly.
                for o in (outs, ref):
                    o[1].mul_(0.5)
                    o[2].mul_(0.5)
                    o[3][:3].fill_(7.0)
                    o[6][0].fill_(-3.0)
            torch.testing.assert_close(x, x_ref, msg=f"call {call}: input after writing x[1:]")
            torch.testing.assert_close(model.p, ref_model.p, msg=f"call {call}: p after writing p[0]")
            for name, o, r in zip(NAMES, outs, ref):
                torch.testing.assert_close(o, r, msg=f"call {call}: {name} after the writes")
        kept.append(outs[4])
        kept_ref.append(ref[4])
    # A view of the buffer kept from an earlier call follows the buffer, as eagerly.
    for call, (k, r) in enumerate(zip(kept, kept_ref)):
        torch.testing.assert_close(k, r, msg=f"cache view kept from call {call}")
    torch.testing.assert_close(model.cache, ref_model.cache)
    return cgbackend.stats(compiled)


@pytest.mark.parametrize("mode", list(MODES))
def test_returned_views_alias_like_eager(mode):
    st = _run_views(mode, "cpu", torch.float64, simulate_graphs=True)
    assert st["replays"] >= 4, st  # the checks ran on replays, not only on eager warm-up calls
    assert st["output_alias_lost"] == 0
    # Per call: x[1:], p[0], cache[:n], y.view(-1) rebuilt, z's two views as one block.
    assert st["output_views"] == 4 * 5 + 2 * 4  # z's views come from eager memory in the warm-up call


@pytest.mark.cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_returned_views_alias_like_eager_cuda(mode):
    st = _run_views(mode, "cuda", torch.float32)
    assert st["graphs_captured"] >= 1 and st["replays"] >= 4, st
    assert st["output_alias_lost"] == 0
    assert st["output_views"] == 4 * 5 + 2 * 4  # z's views come from eager memory in the warm-up call
