"""Input strides never fail a region (runtime/layouts.py): expanded (stride-0) inputs are captured,
a compiled region called with other strides than it was compiled for copies the call's tensors into
its layout, and zero-element outputs of simulated graphs are left alone.

Each case runs as user code, float64, with simulated graphs, against eager: outputs and every
gradient equal, no exception, and the counters say what happened. Compiled regions (inner="inductor")
are where strides matter; inner="eager" runs the same code through eager's kernels."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.runtime.layouts import AdaptedCall, InputLayouts, Layout, input_buffer

F64 = torch.float64
INNERS = ["eager", "inductor"]
MODES = ["inference", "training"]


def _randn(*shape, seed, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(device)


def _loss(out):
    outs = out if isinstance(out, tuple) else (out,)
    return sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype, device=o.device).view(o.shape)).sum()
               for o in outs)


def _run(model, make, n, training, device="cpu", **options):
    """Call the compiled model and eager on ``make(i, device)`` for i < n (leaves that require grad
    in training, and the call's arguments made from them): outputs and every gradient equal."""
    model = model.to(device)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, simulate_graphs=device == "cpu", **options)
    for i in range(n):
        leaves, args = make(i, device)
        ref_leaves, ref_args = make(i, device)
        for t in leaves + ref_leaves:
            t.requires_grad_(training)
        with torch.set_grad_enabled(training):
            out = compiled(*[a() for a in args])
            want = ref(*[a() for a in ref_args])
        torch.testing.assert_close(out, want)
        if training:
            _loss(out).backward()
            _loss(want).backward()
            for a, b in zip(leaves, ref_leaves):
                torch.testing.assert_close(a.grad, b.grad)
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")
                p.grad = q.grad = None
    return {**cgbackend.stats(compiled), "summary": cgbackend.summary(compiled)}


def _clean(st, captured):
    assert st["capture_failures"] == [] and st["inner_fallbacks"] == {}, st
    assert st["graphs_captured"] >= captured and st["replays"] >= 1, st


# ---------------------------------------------------------------- expanded (stride-0) inputs

class MaskedScores(nn.Module):
    """One decode step's scores with an attention mask expanded over the batch."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(15, 15).double()

    def forward(self, x, mask):
        return torch.softmax(self.q(x) + mask, -1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inner", INNERS)
def test_expanded_mask_is_captured(inner, mode):
    def make(i, device):
        x, mask = _randn(8, 15, seed=i), _randn(15, seed=100 + i)
        return [x, mask], [lambda: x, lambda: mask[None].expand(8, 15)]

    st = _run(MaskedScores(), make, 5, mode == "training", inner=inner, warmup=1)
    _clean(st, captured=1)
    assert st["eager_calls"] == {"warmup": 1}, st  # every later call replays
    assert st["replays"] - st["bwd_replays"] == 4 and st["bwd_replays"] == (4 if mode == "training" else 0), st
    assert st["layout_copies"] == 0  # the static buffer takes the example's stride 0


def test_expanded_mask_under_strict():
    """strict=True raises on any fallback: an expanded input is not one."""
    def make(i, device):
        x, mask = _randn(8, 15, seed=i), _randn(15, seed=100 + i)
        return [x], [lambda: x, lambda: mask[None].expand(8, 15)]

    st = _run(MaskedScores(), make, 4, False, inner="inductor", warmup=1, strict=True)
    _clean(st, captured=1)
    assert st["eager_calls"] == {"warmup": 1}, st


def test_capture_failure_names_the_inputs_and_strides(monkeypatch):
    """Were compiled code handed a static buffer in another layout (the old dense buffer, no
    adapting copy), the capture failure names the region's inputs with their strides and the
    strides compiled for, not only Inductor's assertion and its note about custom ops."""
    import cgbackend.runtime.recorder as recorder
    from cgbackend.runtime.layouts import InputLayouts as Plan

    def dense(value, layout):
        return torch.empty(value.shape, dtype=value.dtype, device=value.device), ()

    monkeypatch.setattr(recorder, "input_buffer", dense)
    monkeypatch.setattr(Plan, "adapt", lambda self, args: (args, [], 0))
    model = MaskedScores()
    compiled = cgbackend.compile(model, simulate_graphs=True, inner="inductor", warmup=1)
    for i in range(3):
        x, mask = _randn(8, 15, seed=i), _randn(15, seed=100 + i)
        torch.testing.assert_close(compiled(x, mask[None].expand(8, 15)), model(x, mask[None].expand(8, 15)))
    (failure,) = cgbackend.stats(compiled)["capture_failures"]
    error = failure["error"]
    assert "stride" in error and "inputs:" in error, error
    assert "size (8, 15) stride (15, 1), compiled for stride (0, 1)" in error, error
    assert "custom op" not in error, error  # Inductor's note about fake kernels is not the cause


def test_expanded_buffer_holds_one_slice():
    mask = _randn(1, 1, 64, 64, seed=0).expand(8, 4, 64, 64)
    buf, dims = input_buffer(mask, Layout.of(mask))
    assert buf.stride() == mask.stride() and dims == (0, 1)
    assert buf.untyped_storage().nbytes() == 64 * 64 * 8  # one mask, not 32


# ---------------------------------------------------------------- same shape, other strides

def _conv():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1)).double()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inner", INNERS)
def test_channel_slice_after_contiguous_input(inner, mode):
    """Dynamo traces the second layout with symbolic strides; Inductor compiles that graph's region
    for one of them, and the other is copied into it."""
    def make(i, device):
        if i % 2 == 0:
            x = _randn(2, 2, 6, 6, seed=i)
            return [x], [lambda: x]
        big = _randn(2, 4, 6, 6, seed=i)
        return [big], [lambda: big[:, ::2]]

    st = _run(_conv(), make, 8, mode == "training", inner=inner, warmup=2)
    _clean(st, captured=2)
    assert set(st["eager_calls"]) == {"warmup"}, st
    if inner == "inductor":
        assert st["layout_copies"] >= 1, st  # a warm-up call of the compiled code, copied
        assert "copied into a compiled layout" in st["summary"], st["summary"]


# ---------------------------------------------------------------- zero-element outputs

class Tokens(nn.Module):
    """A feed-forward block over the flattened tokens, returning them too."""

    def __init__(self):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6)).double()

    def forward(self, x):
        h = x.flatten(0, 1)
        return self.ff(h) + h, h


def test_zero_token_batch_in_training():
    def make(i, device):
        x = _randn([5, 5, 0, 5, 0, 3][i], 2, 6, seed=i)
        torch._dynamo.mark_dynamic(x, 0)
        return [x], [lambda: x]

    st = _run(Tokens(), make, 6, True, warmup=0)
    _clean(st, captured=2)
    assert st["eager_calls"] == {}, st


# ---------------------------------------------------------------- every layout in turn

def _layouts(i, device):
    """Contiguous, transposed, channel-sliced and expanded inputs of shape (2, 2, 6, 6)."""
    kind = i % 4
    if kind == 0:
        x = _randn(2, 2, 6, 6, seed=i, device=device)
        return [x], [lambda: x]
    if kind == 1:
        x = _randn(2, 2, 6, 6, seed=i, device=device)
        return [x], [lambda: x.transpose(2, 3)]
    if kind == 2:
        x = _randn(2, 4, 6, 6, seed=i, device=device)
        return [x], [lambda: x[:, ::2]]
    x = _randn(2, 1, 6, 6, seed=i, device=device)
    return [x], [lambda: x.expand(2, 2, 6, 6)]


@pytest.mark.parametrize("mode", MODES)
def test_every_layout_in_turn(mode):
    st = _run(_conv(), _layouts, 12, mode == "training", inner="inductor", warmup=1)
    _clean(st, captured=4)
    assert set(st["eager_calls"]) == {"warmup"}, st


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_every_layout_in_turn_cuda(mode):
    st = _run(_conv(), _layouts, 12, mode == "training", device="cuda", inner="inductor", warmup=1)
    _clean(st, captured=4)
    assert set(st["eager_calls"]) == {"warmup"}, st
    assert st["replays"] >= 4, st


# ---------------------------------------------------------------- the adapter on its own

def test_adapted_call_copies_into_the_compiled_layout_and_back():
    """Compiled code that asserts its strides gets each input in its layout; an input the region
    writes is copied back; a tensor a stride-0 layout cannot hold runs the FX module."""
    seen = []

    def compiled(x, m):
        assert x.stride() == (12, 1) and m.stride() == (0, 1), (x.stride(), m.stride())
        seen.append(m.untyped_storage().nbytes())
        x.add_(m)
        return x * 2

    class Counters:
        layout_copies = 0

    def module(x, m):
        x.add_(m)
        return x * 2

    layouts = InputLayouts({0: Layout((0, 1), (), (12, 1)), 1: Layout((1,), (0,), (0, 1))}, written=(0,))
    call = AdaptedCall(compiled, module, layouts, Counters())
    base = _randn(12, 5, seed=0)
    x, m = base.t(), _randn(12, seed=1)[None].expand(5, 12)
    want = x + m
    out = call(x, m)
    torch.testing.assert_close(x, want)  # written back into the transposed caller's tensor
    torch.testing.assert_close(out, want * 2)
    assert call.counters.layout_copies == 1 and seen == [12 * 8]
    dense = _randn(5, 12, seed=2)
    assert not layouts.hold([x, dense])
    torch.testing.assert_close(call(x.clone(), dense), (x + dense) * 2)  # eager's kernels
    assert len(seen) == 1
