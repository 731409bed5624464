"""Inputs keep eager semantics when regions read them through static copies (runtime/inputs.py):
overlapping inputs, views of inputs across eager writes, autograd's saved-tensor and
inference-tensor checks, in-place buffer updates, padding values, and errors during a capture.

Every case runs through both entry points (``cgbackend.compile`` and
``torch.compile(backend=cgbackend.backend(...))``), float64, over at least five calls with different
inputs, against eager. Cases 1, 3 and 6 also run with real CUDA graphs (``cuda`` marker)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.passes.pipeline import analyze
from cgbackend.config import Config
from fx_helpers import trace

F64 = torch.float64
ENTRIES = ["compile", "torch"]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _compiled(fn, entry, device="cpu", **options):
    opts = dict(warmup=1, simulate_graphs=device == "cpu", **options)
    if entry == "compile":
        return cgbackend.compile(fn, **opts)
    return torch.compile(fn, backend=cgbackend.backend(**opts))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, device="cpu"):
    return torch.randn(*shape, generator=_gen(seed), dtype=F64).to(device)


# ---------------------------------------------------------------- 1. overlapping inputs

def _overlap_fn(a, b):
    y = (a.sin() * 2 + b.cos()).relu()
    a.add_(1)
    return (b * y).exp() + b.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_overlapping_input_views_written_in_place(entry, device):
    c = _compiled(_overlap_fn, entry, device)
    for i in range(6):
        base = _randn(10, seed=i, device=device) * 0.1
        ref_base = base.clone()
        out = c(base[:8], base[2:])
        ref = _overlap_fn(ref_base[:8], ref_base[2:])
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(base, ref_base)  # b's copy-back must not erase a's write
    st = cgbackend.stats(c)
    assert st["eager_calls"].get("aliased_inputs", 0) >= 1
    # Separate inputs still replay.
    for i in range(4):
        a, b = _randn(8, seed=10 + i, device=device), _randn(8, seed=20 + i, device=device)
        ra, rb = a.clone(), b.clone()
        torch.testing.assert_close(c(a, b), _overlap_fn(ra, rb))
        torch.testing.assert_close(a, ra)
    st = cgbackend.stats(c)
    assert st["replays"] >= 3 and st["capture_failures"] == []


# ---------------------------------------------------------------- 2. views of inputs after eager writes

def _view_after_write(x, mask):
    v = x.view(-1)
    y = (x.sin() * 2).cos() + 1
    x.index_fill_(0, torch.nonzero(mask).flatten(), 0.0)
    return (v * 3 + y.view(-1)).exp()


@pytest.mark.parametrize("entry", ENTRIES)
def test_view_of_input_sees_an_eager_write_between_regions(entry):
    c = _compiled(_view_after_write, entry)
    for i in range(6):
        x = _randn(6, 4, seed=i)
        mask = torch.rand(6, generator=_gen(100 + i)) > 0.5
        rx = x.clone()
        out, ref = c(x, mask), _view_after_write(rx, mask)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x, rx)
    st = cgbackend.stats(c)
    assert st["replays"] >= 4 and set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]


def _view_after_write_train(x, mask, w):
    v = x.view(-1)
    y = (x.sin() @ w).sin()
    x.index_fill_(0, torch.nonzero(mask).flatten(), 0.0)
    return (v * 3 + y.reshape(-1)).exp().sum()


@pytest.mark.parametrize("entry", ENTRIES)
def test_view_of_input_sees_an_eager_write_between_regions_in_training(entry):
    c = _compiled(_view_after_write_train, entry)
    for i in range(6):
        x = _randn(6, 4, seed=i)
        mask = torch.rand(6, generator=_gen(100 + i)) > 0.5
        w = _randn(4, 4, seed=200 + i).requires_grad_(True)
        rx, rw = x.clone(), w.detach().clone().requires_grad_(True)
        out, ref = c(x, mask, w), _view_after_write_train(rx, mask, rw)
        torch.testing.assert_close(out, ref)
        out.backward()
        ref.backward()
        torch.testing.assert_close(w.grad, rw.grad)
        torch.testing.assert_close(x, rx)
    st = cgbackend.stats(c)
    assert st["fwd_replays"] >= 4 and set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]


# ---------------------------------------------------------------- 3. saved tensors written in place

def _write_saved(x, w):
    y = (x @ w).relu()
    x.add_(1)
    return (y * x.sum()).sum()


def _uses_saved(x, w):
    return ((x @ w).relu() * 2).sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_in_place_write_to_a_saved_tensor_raises_every_call(entry, device):
    c = _compiled(_write_saved, entry, device)
    for i in range(5):
        x = _randn(4, 3, seed=i, device=device)
        w = _randn(3, 5, seed=50 + i, device=device).requires_grad_(True)
        loss = c(x, w)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert cgbackend.stats(c)["fwd_replays"] >= 3  # the graphed path raised, not only eager calls


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_write_between_forward_and_backward_raises_and_untouched_calls_match(entry, device):
    c = _compiled(_uses_saved, entry, device)
    for i in range(6):
        x = _randn(4, 3, seed=i, device=device)
        w = _randn(3, 5, seed=50 + i, device=device).requires_grad_(True)
        rw = w.detach().clone().requires_grad_(True)
        loss = c(x, w)
        if i % 2:
            x.mul_(2)  # eager raises at backward: x was saved for w's gradient
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
            continue
        ref = _uses_saved(x.clone(), rw)
        torch.testing.assert_close(loss, ref)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(w.grad, rw.grad)
    assert cgbackend.stats(c)["fwd_replays"] >= 4


@pytest.mark.parametrize("entry", ENTRIES)
def test_saved_tensor_checks_raise_only_where_eager_does(entry):
    """Batch norm saves its running statistics and updates them in place without a version bump:
    two forwards before one backward are fine eagerly, and must stay fine (the simulated capture
    used to bump their version when it put them back)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4)).double()
    ref = copy.deepcopy(model)
    c = _compiled(model, entry)
    for i in range(5):
        x, x2 = _randn(8, 4, seed=i), _randn(8, 4, seed=100 + i)
        loss = c(x).pow(2).sum() + c(x2).pow(2).sum()
        ref_loss = ref(x).pow(2).sum() + ref(x2).pow(2).sum()
        torch.testing.assert_close(loss, ref_loss)
        loss.backward()
        ref_loss.backward()
        torch.testing.assert_close(model[0].weight.grad, ref[0].weight.grad)
        torch.testing.assert_close(model[1].running_mean, ref[1].running_mean)
    assert cgbackend.stats(c)["fwd_replays"] >= 6


# ---------------------------------------------------------------- 4. in-place buffer updates

class _Acc(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("acc", torch.zeros(4, dtype=F64))

    def forward(self, x):
        v = self.lin(x).relu().sum(0)
        self.acc += v
        return self.acc * 2 + v


@pytest.mark.parametrize("entry", ENTRIES)
def test_in_place_buffer_update_keeps_the_buffer(entry):
    torch.manual_seed(0)
    model = _Acc()
    ref_model = copy.deepcopy(model)
    held, ptr = model.acc, model.acc.data_ptr()
    c = _compiled(model, entry)
    with torch.no_grad():
        for i in range(8):
            x = _randn(3, 4, seed=i)
            torch.testing.assert_close(c(x), ref_model(x))
            assert model.acc is held and model.acc.data_ptr() == ptr
            torch.testing.assert_close(held, ref_model.acc)
    st = cgbackend.stats(c)
    assert st["graphs_captured"] == 1 and st["replays"] == 7
    assert set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]


class _AccTrain(_Acc):
    def forward(self, x):
        y = self.lin(x).relu()
        self.acc += y.detach().sum(0)
        return (y * self.acc).sum()


@pytest.mark.parametrize("entry", ENTRIES)
def test_in_place_buffer_update_keeps_the_buffer_in_training(entry):
    torch.manual_seed(0)
    model = _AccTrain()
    ref_model = copy.deepcopy(model)
    held, ptr = model.acc, model.acc.data_ptr()
    c = _compiled(model, entry)
    for i in range(8):
        x = _randn(3, 4, seed=i)
        loss, ref = c(x), ref_model(x)
        torch.testing.assert_close(loss, ref)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(model.lin.weight.grad, ref_model.lin.weight.grad)
        assert model.acc is held and model.acc.data_ptr() == ptr
        torch.testing.assert_close(held, ref_model.acc)
    st = cgbackend.stats(c)
    assert st["fwd_graphs"] == 1 and st["fwd_replays"] == 7
    assert set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]


# ---------------------------------------------------------------- 5. inference tensors in training

@pytest.mark.parametrize("entry", ENTRIES)
def test_inference_tensor_in_a_training_call_raises_every_call(entry):
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).double()
    ref_lin = copy.deepcopy(lin)

    def f(x):
        return (lin(x).relu() * x).sum()

    def ref_f(x):
        return (ref_lin(x).relu() * x).sum()

    c = _compiled(f, entry)
    for i in range(10):
        x = _randn(3, 4, seed=i)
        if i % 2:
            with torch.inference_mode():
                x = x.clone()
            with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
                c(x).backward()
            continue
        lin.zero_grad()
        ref_lin.zero_grad()
        loss, ref = c(x), ref_f(x)
        torch.testing.assert_close(loss, ref)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(lin.weight.grad, ref_lin.weight.grad)
    st = cgbackend.stats(c)
    assert st["eager_calls"]["inference_tensor_input"] >= 4
    assert st["fwd_replays"] >= 3


# ---------------------------------------------------------------- 6. padding values

class _Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4).double()
        self.lin = nn.Linear(4, 4).double()
        self.off = 1

    def forward(self, ids):
        return self.lin(self.emb(ids - self.off)).relu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("entry", ENTRIES)
def test_padding_rows_never_hold_values_real_rows_do_not(entry, device):
    torch.manual_seed(0)
    model = _Shifted().to(device).eval()
    c = _compiled(model, entry, device)
    sizes = (3, 5, 6, 7, 9, 10, 11, 13)
    with torch.no_grad():
        for i, n in enumerate(sizes):
            ids = torch.randint(1, 11, (n,), generator=_gen(i)).to(device)  # ids - 1 in [0, 10)
            torch._dynamo.mark_dynamic(ids, 0)
            # float64 tolerance: on a GPU a padded product may take another kernel than eager's.
            torch.testing.assert_close(c(ids), model(ids))
    st = cgbackend.stats(c)
    assert st["capture_failures"] == [] and "capture_failed" not in st["eager_calls"]
    assert 1 <= st["graphs_captured"] < len(sizes) - 1  # padded: fewer graphs than sizes
    assert st["replays"] >= 4


def test_arange_over_the_padded_size_read_as_an_index_is_not_bucketed():
    pos = nn.Embedding(6, 8).double()

    def f(x):
        return (x + pos(torch.arange(x.shape[0]))).relu() * 2

    x = _randn(5, 8, seed=0)
    torch._dynamo.mark_dynamic(x, 0)
    analysis = analyze(trace(f, x), Config(min_region_ops=1))
    (entry,) = analysis.buckets.regions.values()
    (b,) = entry.symbols.values()
    assert not b.bucketable and "arange" in b.why and b.op == "embedding", b


@pytest.mark.parametrize("entry", ENTRIES)
def test_positions_from_arange_run_exactly(entry):
    pos = nn.Embedding(6, 4).double()

    def f(x):
        return (x + pos(torch.arange(x.shape[0]))).relu() * 2

    c = _compiled(f, entry)
    with torch.no_grad():
        for i, n in enumerate((3, 5, 6, 4, 5, 6)):
            x = _randn(n, 4, seed=i)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(c(x), f(x), rtol=0, atol=0)
    st = cgbackend.stats(c)
    assert st["capture_failures"] == [] and st["replays"] >= 2


# ---------------------------------------------------------------- 7. errors during a capture attempt

@pytest.mark.parametrize("entry", ENTRIES)
def test_an_error_of_the_call_during_capture_is_raised_and_the_region_captures_later(entry):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4).double()

    def f(ids):
        return (emb(ids) * 2).relu().sum(-1)

    c = _compiled(f, entry)
    bad_calls = (1, 3)
    with torch.no_grad():
        for i in range(8):
            ids = torch.randint(0, 10, (5,), generator=_gen(i))
            if i in bad_calls:
                ids[2] = 12
                with pytest.raises(IndexError):
                    c(ids)
                continue
            torch.testing.assert_close(c(ids), f(ids), rtol=0, atol=0)
    st = cgbackend.stats(c)
    assert st["capture_failures"] == [] and "capture_failed" not in st["eager_calls"]
    assert st["eager_calls"]["call_raised"] == len(bad_calls)
    assert st["graphs_captured"] == 1 and st["replays"] >= 2


# ---------------------------------------------------------------- helpers of runtime/inputs.py

def test_fill_padding_copies_the_last_row_block_into_every_padding_row():
    from cgbackend.runtime.inputs import fill_padding
    v = torch.arange(2 * 3 * 4).view(6, 4)  # two rows of a 3*s-sized dimension
    buf = torch.zeros(15, 4, dtype=v.dtype)
    fill_padding(buf, v, 0, 3)
    assert torch.equal(buf, torch.cat([v, v[3:6].repeat(3, 1)]))
    v2 = torch.arange(10).view(2, 5)
    buf2 = torch.zeros(2, 8, dtype=v2.dtype)
    fill_padding(buf2, v2, 1, 1)
    assert torch.equal(buf2, torch.cat([v2, v2[:, 4:].expand(2, 3)], dim=1))


def test_overlap_finds_shared_ranges_only():
    from cgbackend.runtime.inputs import overlap
    base = torch.zeros(10)
    assert overlap([base[:8], base[2:]], [0], [1]) == (0, 1)
    assert overlap([base[:5], base[5:]], [0], [1]) is None
    assert overlap([base[:5], torch.zeros(5)], [0], [1]) is None
    assert overlap([base, base.view(2, 5)[1]], [1], [0]) == (1, 0)
