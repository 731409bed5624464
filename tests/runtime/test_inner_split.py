"""The runtime's inner compiler by default (lazy, per region, counted fallbacks), device
constants from Python scalars hoisted out of regions, and a region split at the op that
synchronizes in warm-up. CPU with simulated graphs; an OpSyncDetector stands in for CUDA's sync
debug mode. GPU versions: tests/runtime/test_cuda_inference.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
import cgbackend.runtime.inner
from cgbackend.config import Config
from cgbackend.runtime.inner import InnerFallback, resolve_inner
from cgbackend.runtime.warmup import OpSyncDetector

from fx_helpers import autograd_cache_check

SIM = dict(simulate_graphs=True, warmup=1)


class MaskModel(nn.Module):
    """Builds device constants from Python scalars inside its forward, as Hugging Face's
    attention-mask helper does (torch.tensor(0.0, device=...))."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        zero = torch.tensor(0.0, device=x.device)
        low = torch.full((), -1e4, device=x.device, dtype=x.dtype)
        h = torch.where(h > zero, h, low * 0 + h * 0.1)
        return self.b(F.gelu(h))


# torch.tensor(python number) reaches the dispatcher as lift_fresh: on CUDA its host-to-device copy
# is what the sync debug mode reports.
TENSOR_FROM_PYTHON = OpSyncDetector([torch.ops.aten.lift_fresh])


def _detect(compiled, detector):
    cgbackend.find_backend(compiled).shared.sync_detector = detector


def _inputs(n, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 16, generator=g, dtype=dtype) for _ in range(n)]


def test_device_constants_are_hoisted_and_the_region_is_captured_whole():
    model = MaskModel().double().eval()
    compiled = cgbackend.compile(copy.deepcopy(model), **SIM)
    _detect(compiled, TENSOR_FROM_PYTHON)
    with torch.no_grad():
        for x in _inputs(5):
            assert torch.equal(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    assert st["constants_hoisted"] == 3, st  # zero, low and low * 0
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0
    assert st["graphs_captured"] == 1 and st["replays"] == 4
    assert st["eager_calls"] == {"warmup": 1}
    assert st["regions_split"] == 0
    # The report names them.
    runtime = cgbackend.report(compiled).graphs[0].runtime
    assert sorted(c["op"] for c in runtime["constants"]) == ["full", "operator.mul", "tensor"]


def test_constants_written_in_place_or_returned_as_views_stay_in_their_region():
    """A constant written in place, or returned as a view, is made in its region on every call; one
    returned as it is (transformers' cache returns its moved sliding-window tensor) is hoisted and
    each call returns a copy of it, which the caller may write."""
    def f(x):
        acc = torch.zeros(4, 16, dtype=x.dtype, device=x.device)
        acc.add_(x)  # written: must be made fresh each call
        ret = torch.ones(3, dtype=x.dtype, device=x.device)  # returned: hoisted, copied out
        viewed = torch.full((2, 3), 7.0, dtype=x.dtype, device=x.device)  # a view returned: stays
        keep = torch.scalar_tensor(2.0, dtype=x.dtype, device=x.device)  # hoisted
        return (acc * keep).relu() + 1, ret, viewed[1]

    compiled = cgbackend.compile(f, **SIM)
    kept = []
    for x in _inputs(5, seed=1):
        out, ret, row = compiled(x)
        ref, ref_ret, ref_row = f(x)
        assert torch.equal(out, ref) and torch.equal(ret, ref_ret) and torch.equal(row, ref_row)
        assert all(ret.data_ptr() != k.data_ptr() for k in kept)  # a tensor of its own each call
        kept.append(ret)
        ret.add_(5)  # must not leak into the next call
        row.add_(5)
    assert all(torch.equal(k, torch.full((3,), 6.0, dtype=torch.float64)) for k in kept)
    st = cgbackend.stats(compiled)
    assert st["constants_hoisted"] == 2, st
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0 and st["replays"] == 4, st
    runtime = cgbackend.report(compiled).graphs[0].runtime
    assert sorted((c["op"], c["returned"]) for c in runtime["constants"]) == [
        ("ones", True), ("scalar_tensor", False)], runtime["constants"]


def test_conversions_of_constants_are_constants():
    """A constant made on one device or in one dtype and converted (transformers' sliding-window
    cache: ``torch.tensor(window)`` on the CPU, then ``.to(device)``) is made once, conversion
    included; a conversion of an input, or one whose result is written, stays in its region."""
    def f(x):
        window = torch.tensor(3).to(x.device)  # hoisted, and so is the move
        scale = torch.tensor(2).to(x.dtype)  # hoisted, and so is the conversion
        half = torch.tensor(0.5).double()  # hoisted, and so is the conversion
        acc = torch.tensor(1.0).double()  # the source is hoisted, the conversion (a new tensor) is not:
        acc.add_(x.sum())  # it is written
        idx = torch.arange(x.shape[1], device=x.device)  # hoisted
        masked = torch.where(idx < window, x * scale, x * half)
        return masked + acc, x.to(torch.float32)  # a conversion of the input: per call

    compiled = cgbackend.compile(f, **SIM)
    for x in _inputs(4, seed=2):
        out, as32 = compiled(x)
        ref, ref32 = f(x)
        assert torch.equal(out, ref) and torch.equal(as32, ref32)
    st = cgbackend.stats(compiled)
    assert st["constants_hoisted"] == 8, st
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0 and st["replays"] == 3
    runtime = cgbackend.report(compiled).graphs[0].runtime
    ops = sorted(c["op"] for c in runtime["constants"])
    assert ops == ["Tensor.double", "Tensor.to", "Tensor.to", "arange"] + ["tensor"] * 4, ops


class Rotary(nn.Module):
    """A rotary embedding that recomputes ``inv_freq`` from Python numbers on the CPU in every call
    and moves it to the input's device (as a transformers MoE model does)."""

    def __init__(self, dim=16, base=10000.0):
        super().__init__()
        self.dim, self.base = dim, base
        self.lin = nn.Linear(dim, dim)

    def forward(self, x, pos):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        inv_freq = inv_freq.to(device=x.device, dtype=x.dtype)
        freqs = pos[:, None].to(x.dtype) * inv_freq[None, :]  # the positions are an input: per call
        emb = torch.cat((freqs, freqs), dim=-1)
        return self.lin(x * emb.cos() + x.flip(-1) * emb.sin())


def _rotary_equals_eager(model, calls, seed):
    """Compile a rotary model (float64), run it on varied inputs bitwise against eager; the compiled
    model and its stats."""
    model = model.double().eval()
    compiled = cgbackend.compile(copy.deepcopy(model), **SIM)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(6, 16, generator=g, dtype=torch.float64)
            pos = torch.randint(0, 100, (6,), generator=g)
            assert torch.equal(compiled(x, pos), model(x, pos))
    return compiled, cgbackend.stats(compiled)


def test_arithmetic_on_constants_is_folded():
    """inv_freq's whole chain (arange, float, divide, power, reciprocal, move, index) is made once per
    compiled graph: no dynamic region, one graph; what reads the input stays in the region."""
    compiled, st = _rotary_equals_eager(Rotary(), calls=5, seed=3)
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0, st
    assert st["graphs_captured"] == 1 and st["replays"] == 4, st
    runtime = cgbackend.report(compiled).graphs[0].runtime
    ops = sorted(c["op"] for c in runtime["constants"])
    assert ops == ["Tensor.float", "Tensor.to", "arange", "operator.getitem", "operator.pow", "operator.truediv",
                   "operator.truediv"], ops
    assert st["constants_hoisted"] == len(ops)


class IndexedRotary(Rotary):
    """PhiMoE's form of the rotary embedding: the CPU-made ``inv_freq`` is indexed with
    ``[None, :, None]`` and expanded before it moves to the input's device."""

    def forward(self, x, pos):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        inv_freq = inv_freq[None, :, None].float().expand(1, -1, 1).to(x.device)
        freqs = (inv_freq @ pos[None, None, :].to(inv_freq.dtype)).transpose(1, 2)[0]
        emb = torch.cat((freqs, freqs), dim=-1).to(x.dtype)
        return self.lin(x * emb.cos() + x.flip(-1) * emb.sin())


def test_indexing_a_constant_with_written_indices_is_folded():
    """``inv_freq[None, :, None].float().expand(...)``: the index, the conversion and the expand of
    a constant are constants too (on a GPU run they were a dynamic region of CPU work)."""
    compiled, st = _rotary_equals_eager(IndexedRotary(), calls=4, seed=4)
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0 and st["replays"] == 3, st
    ops = {c["op"] for c in cgbackend.report(compiled).graphs[0].runtime["constants"]}
    assert {"operator.getitem", "Tensor.expand", "Tensor.to"} <= ops, ops


def test_folding_stops_at_inputs_and_writes():
    """Arithmetic that reads an input, or whose result is written in place, stays in its region."""
    def f(x):
        scale = torch.arange(4, dtype=x.dtype) * 2.0  # folded
        mixed = torch.arange(4, dtype=x.dtype) + x.sum()  # reads the input: per call
        acc = torch.ones(4, dtype=x.dtype) * 3.0  # written below: per call
        acc.add_(x[0])
        return x * scale + mixed + acc

    compiled = cgbackend.compile(f, **SIM)
    for x in _inputs(4, seed=5):
        x = x[:, :4].contiguous()
        assert torch.equal(compiled(x), f(x))
    runtime = cgbackend.report(compiled).graphs[0].runtime
    ops = sorted(c["op"] for c in runtime["constants"])
    # scale's arange and its product; mixed's and acc's factories (their arithmetic is per call)
    assert ops == ["arange", "arange", "ones", "operator.mul"], ops
    assert cgbackend.stats(compiled)["replays"] == 3


class HiddenSync(nn.Module):
    """A region whose middle op synchronizes with the host without the classifier knowing."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = F.gelu(self.a(x)) * 2
        s = torch.ops.cgbackend_test.cpu_scale(h)
        return self.b(F.gelu(s) + 1)


@torch.library.custom_op("cgbackend_test::cpu_scale", mutates_args=())
def cpu_scale(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + x.abs().max().item())


@cpu_scale.register_fake
def _(x):
    return torch.empty_like(x)


def _cpu_scale_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _cpu_scale_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad / (1 + x.abs().max())  # the scale as a constant: a test op, same formula both ways


cpu_scale.register_autograd(_cpu_scale_backward, setup_context=_cpu_scale_setup)


SCALE_SYNCS = OpSyncDetector([torch.ops.cgbackend_test.cpu_scale])


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_region_is_split_at_the_op_that_synchronizes(train):
    base = HiddenSync().double().train(train)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, **SIM)
    _detect(compiled, SCALE_SYNCS)
    for step, x in enumerate(_inputs(6, seed=2)):
        if not train:
            with torch.no_grad():
                assert torch.equal(compiled(x), ref(x)), step
            continue
        x = x.requires_grad_(True)
        x2 = x.detach().clone().requires_grad_(True)
        for model in (ref, mine):
            model.zero_grad()
        compiled(x).pow(2).mean().backward()
        ref(x2).pow(2).mean().backward()
        assert torch.equal(x.grad, x2.grad), step
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad), step
    st = cgbackend.stats(compiled)
    assert st["regions_split"] == 1, st
    split = st["sync_splits"][0]
    assert split["op"].endswith("cpu_scale") and "test_inner_split.py" in split["source"]
    assert [p.split(" ")[1] for p in split["parts"]] == ["(static)", "(dynamic)", "(static)"]
    # Call 1: the whole region warms up and the op is found; call 2: each part warms up;
    # calls 3..6: both parts replay.
    assert st["eager_calls"] == {"warmup": 3}, st["eager_calls"]
    assert st["graphs_captured"] == 2 * (2 if train else 1)
    assert st["replays"] == 2 * 4 * (2 if train else 1)
    assert "host_sync_in_warmup" not in st["eager_calls"]
    text = cgbackend.report(compiled).to_text()
    assert "split_at_host_sync" in text


def test_compiled_code_that_synchronizes_falls_back_then_splits():
    """inner="inductor", warmup=1: the one warm-up call runs the compiled code, which cannot say
    which op synchronized; the region keeps eager's kernels (counted), warms up once more eagerly,
    and that call finds the op and splits the region; its parts are compiled by Inductor."""
    model = HiddenSync().double().eval()
    compiled = cgbackend.compile(copy.deepcopy(model), inner="inductor", **SIM)
    _detect(compiled, SCALE_SYNCS)
    with torch.no_grad():
        for x in _inputs(6, seed=5):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-9, atol=1e-9)
    st = cgbackend.stats(compiled)
    assert st["inner_fallbacks"] == {InnerFallback.HOST_SYNC: 1}, st["inner_fallbacks"]
    assert st["regions_split"] == 1
    assert st["inner_compiled"] == 2  # the two static parts
    assert st["graphs_captured"] == 2 and "host_sync_in_warmup" not in st["eager_calls"]


def test_strict_raises_at_the_synchronizing_op():
    compiled = cgbackend.compile(HiddenSync().double().eval(), strict=True, **SIM)
    _detect(compiled, SCALE_SYNCS)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"synchronizes with the host at cgbackend_test.cpu_scale \(node s, test_inner_split.py:\d+"):
        compiled(_inputs(1)[0])


# ------------------------------------------------------------------ inner compiler


@pytest.mark.parametrize("options, device, expected", [
    ({}, "cpu", "eager"),
    ({"simulate_graphs": True}, "cuda", "eager"),
    ({"capture": False}, "cuda", "eager"),
    ({"inner": "eager"}, "cuda", "eager"),
    ({"inner": "inductor"}, "cpu", "inductor"),
])
def test_auto_uses_eager_kernels_where_nothing_is_captured(options, device, expected):
    assert resolve_inner(Config.from_options(options, environ={}), device) == expected


def test_auto_is_inductor_for_captured_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_inner(Config.from_options({"inner": "auto"}, environ={}), "cuda") == "inductor"
    assert resolve_inner(Config.from_options({"inner": "auto", "warmup": 0}, environ={}), "cuda") == "eager"
    assert resolve_inner(Config.from_options({}, environ={}), "cuda") == "inductor"  # the default is "auto"


def _dense():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16)).double()


def test_regions_compile_lazily_only_when_they_reach_capture(monkeypatch):
    compiled_modules = []
    real = cgbackend.runtime.inner.inductor_compile

    def counting(module):
        compiled_modules.append(module)
        return real(module)

    monkeypatch.setattr(cgbackend.runtime.inner, "inductor_compile", counting)
    model = _dense().eval()
    compiled = cgbackend.compile(copy.deepcopy(model), inner="inductor", simulate_graphs=True, warmup=3)
    xs = _inputs(5, seed=3)
    with torch.no_grad():
        for i, x in enumerate(xs):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-9, atol=1e-9)
            st = cgbackend.stats(compiled)
            # Compiled at the first warm-up call, once.
            assert st["inner_compiled"] == 1, (i, st["inner_compiled"])
    assert len(compiled_modules) == 1
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == 1 and st["replays"] == 2 and st["inner_fallbacks"] == {}
    assert cgbackend.report(compiled).graphs[0].runtime["regions"]["g0.S0"]["inner"]["state"] == "compiled"


def test_capture_false_compiles_nothing(monkeypatch):
    monkeypatch.setattr(cgbackend.runtime.inner, "inductor_compile", lambda m: pytest.fail("compiled"))
    compiled = cgbackend.compile(_dense().eval(), inner="inductor", capture=False, warmup=1)
    with torch.no_grad():
        for x in _inputs(3):
            compiled(x)
    assert cgbackend.stats(compiled)["inner_compiled"] == 0


def _broken_compile(module):
    raise NotImplementedError("lowering for this op is missing")


def _broken_first_call(module):
    def call(*args):
        raise RuntimeError("triton kernel failed to load")
    return call


@pytest.mark.parametrize("compiler, reason", [(_broken_compile, InnerFallback.COMPILE_FAILED),
                                              (_broken_first_call, InnerFallback.FIRST_CALL_FAILED)])
def test_inductor_failure_runs_eager_kernels_with_counted_reason(monkeypatch, compiler, reason):
    monkeypatch.setattr(cgbackend.runtime.inner, "inductor_compile", compiler)
    model = _dense().eval()
    compiled = cgbackend.compile(copy.deepcopy(model), inner="inductor", **SIM)
    with torch.no_grad():
        for x in _inputs(4, seed=4):
            assert torch.equal(compiled(x), model(x))  # eager's kernels: bitwise
    st = cgbackend.stats(compiled)
    assert st["inner_fallbacks"] == {reason: 1}, st["inner_fallbacks"]
    assert st["inner_compiled"] == 0
    assert st["inner_failures"][0]["region"] == "g0.S0"
    assert st["graphs_captured"] == 1 and st["replays"] == 3  # still captured
    text = cgbackend.report(compiled).to_text()
    assert reason in text


def test_inductor_failure_raises_under_strict(monkeypatch):
    monkeypatch.setattr(cgbackend.runtime.inner, "inductor_compile", _broken_compile)
    compiled = cgbackend.compile(_dense().eval(), inner="inductor", strict=True, **SIM)
    with torch.no_grad(), pytest.raises(RuntimeError, match="inductor_compile_failed"):
        compiled(_inputs(1)[0])


class _TwoBranches(nn.Module):
    """Two independent small pointwise chains after one matmul: what combo kernels launch as one."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)

    def forward(self, x):
        h = self.a(x)
        q, k = h.split(16, dim=-1)
        return torch.sin(q) * 2 + 1, torch.cos(k) - 3


def _spy_patches(monkeypatch, fail_combo=False):
    import torch._inductor.compile_fx as cfx
    real = cfx.compile_fx
    seen, seen_ops = [], []

    def spy(gm, example_inputs, **kw):
        patches = kw.get("config_patches")
        if patches is not None and "triton.cudagraphs" in patches:  # cgbackend's call, not the inner one
            seen.append(dict(patches))
            seen_ops.append([n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")])
            if fail_combo and patches.get("combo_kernels"):
                raise RuntimeError("combo kernels are not supported here")
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen, seen_ops


@pytest.mark.parametrize("fail_combo", [False, True])
def test_inference_regions_get_combo_kernels_training_regions_do_not(monkeypatch, fail_combo):
    """Inductor's combo kernels for regions compiled without gradients only; where a compile fails
    with them, the region is compiled without them (not left to eager's kernels). Outputs (and the
    training call's gradients) equal eager's on varied inputs."""
    pytest.importorskip("torch._inductor.config")
    seen, _ = _spy_patches(monkeypatch, fail_combo)
    torch.manual_seed(0)
    model = _TwoBranches().double()
    compiled = cgbackend.compile(copy.deepcopy(model), inner="inductor", **SIM)
    with torch.no_grad():
        for x in _inputs(3, seed=5):
            for got, want in zip(compiled(x), model(x)):
                torch.testing.assert_close(got, want)
    inference = list(seen)
    assert inference and inference[0].get("combo_kernels") is True, inference
    if fail_combo:
        assert len(inference) == 2 and "combo_kernels" not in inference[1], inference
    stats = cgbackend.stats(compiled)
    assert stats["inner_compiled"] == 1 and not stats["inner_fallbacks"], stats
    assert stats["replays"] >= 1

    seen.clear()
    train = cgbackend.compile(copy.deepcopy(model), inner="inductor", **SIM)
    for x in _inputs(3, seed=6):
        x = x.requires_grad_()
        out = train(x)
        (out[0].sum() + out[1].pow(2).sum()).backward()
        ref_x = x.detach().clone().requires_grad_()
        ref = model(ref_x)
        (ref[0].sum() + ref[1].pow(2).sum()).backward()
        torch.testing.assert_close(x.grad, ref_x.grad)
    assert seen and all("combo_kernels" not in p for p in seen), seen


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 12)

    def forward(self, x):
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, 4, dim=-1)
        return weights / weights.sum(-1, keepdim=True), experts


@pytest.mark.parametrize("grad", [False, True])
def test_topk_by_keys_picks_the_same_experts_in_the_same_order(monkeypatch, grad):
    """A router's topk compiled as k picks of the largest key (inference regions under Inductor;
    training regions keep topk): the same indices, in the same (descending) order, and the same
    values as eager's topk, batch after batch (random routers: no ties); gradients equal eager's."""
    pytest.importorskip("torch._inductor.config")
    _, ops = _spy_patches(monkeypatch)
    torch.manual_seed(0)
    model = _Router().double()
    mine = copy.deepcopy(model)
    compiled = cgbackend.compile(mine, inner="inductor", **SIM)
    scale = torch.arange(1.0, 5.0, dtype=torch.float64)
    with torch.set_grad_enabled(grad):
        for x in _inputs(4, seed=7):
            mine.zero_grad()
            model.zero_grad()
            (w, e), (rw, re) = compiled(x), model(x)
            assert torch.equal(e, re)
            torch.testing.assert_close(w, rw)
            if grad:
                (w * scale).sum().backward()
                (rw * scale).sum().backward()
                for (name, p), (_, q) in zip(mine.named_parameters(), model.named_parameters()):
                    torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)  # float32 softmax
    stats = cgbackend.stats(compiled)
    assert stats["inner_compiled"] == 1 and not stats["inner_fallbacks"] and stats["replays"] >= 2, stats
    assert ops, ops
    if grad:
        assert all(torch.amax not in o for o in ops) and any(torch.topk in o for o in ops), ops
    else:
        assert all(torch.topk not in o for o in ops) and all(o.count(torch.amax) == 4 for o in ops), ops


def _fake_traced(module, *args):
    """``module`` traced by torch.fx, each node carrying its fake value as Dynamo's graphs do
    (``val`` and ``example_value``)."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    gm = torch.fx.symbolic_trace(module)
    FakeTensorProp(gm).propagate(*args)
    for node in gm.graph.nodes:
        node.meta["example_value"] = node.meta.get("val")
    return gm


def _topk_rewritten(x, k, dim=-1, largest=True):
    """``torch.topk(x, k, dim, largest)`` run through the region rewrite (topk_by_keys), on a graph
    carrying Dynamo's kind of fake values."""
    from cgbackend.runtime.inner import topk_by_keys

    class One(nn.Module):
        def forward(self, x):
            w, i = torch.topk(x, k, dim=dim, largest=largest)
            return w, i

    gm = _fake_traced(One(), x)
    assert topk_by_keys(gm) == 1
    assert not any(n.target is torch.topk for n in gm.graph.nodes)
    _assert_cacheable(gm)
    return gm(x)


def _assert_cacheable(gm):
    """Every node passes AOT autograd's cache check (a refused node makes a second process compile
    the region again)."""
    refusals = autograd_cache_check()
    if refusals is not None:
        assert not refusals(gm.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_topk_by_keys_returns_what_topk_returns(dtype):
    """Values equal topk's and in its order; the indices are a stable sort's first k (with ties,
    -0.0 against 0.0 included, the lower index first; NaN above every number, or after every number
    where ``largest=False``). Both directions, several dims, k from 1 to the whole width, rows of
    infinities."""
    g = torch.Generator().manual_seed(3)
    cases = (((5, 12), -1, 4), ((3, 7, 6), 1, 2), ((9,), 0, 9), ((4, 128), -1, 8), ((6, 5), 1, 1))
    for shape, dim, k in cases:
        for largest in (True, False):
            for trial in range(3):
                x = torch.randn(*shape, generator=g)
                x = torch.where(torch.rand(*shape, generator=g) < 0.3, torch.round(x), x)  # ties
                special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan")])
                pick = torch.randint(0, len(special), shape, generator=g)
                x = torch.where(torch.rand(*shape, generator=g) < 0.2 * trial, special[pick], x).to(dtype)
                v, i = _topk_rewritten(x, k, dim, largest)
                rv, _ = torch.topk(x, k, dim=dim, largest=largest)
                sv, si = torch.sort(x, dim=dim, descending=largest, stable=True)
                assert torch.equal(i, si.narrow(dim, 0, k)), (shape, dim, k, largest, trial)
                assert torch.allclose(v, rv, equal_nan=True) and torch.allclose(v, sv.narrow(dim, 0, k), equal_nan=True)
                assert v.dtype == x.dtype and i.dtype == torch.int64 and v.is_contiguous() and i.is_contiguous()


def test_topk_kept_where_selection_would_not_pay_or_could_not_stand_in():
    """Wide dimensions (a vocabulary), large k, integer or float64 values, and a result used other
    than by indexing keep ``torch.topk``."""
    from cgbackend.runtime.inner import TOPK_SELECT_MAX_K, TOPK_SELECT_MAX_WIDTH, topk_by_keys

    class Many(nn.Module):
        def forward(self, a, b, c, d):
            w, i = torch.topk(a, 4)
            wide = torch.topk(b, 4).values
            ints = torch.topk(c, 2)[1]
            many = torch.topk(a, TOPK_SELECT_MAX_K + 1)[0]
            doubles = torch.topk(d, 2)[1]
            return w, i, wide, ints, many, doubles

    args = (torch.randn(3, 32), torch.randn(3, TOPK_SELECT_MAX_WIDTH + 1), torch.randint(0, 9, (3, 8)),
            torch.randn(3, 8, dtype=torch.float64))
    gm = _fake_traced(Many(), *args)
    assert topk_by_keys(gm) == 1
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.amax) == 4 and targets.count(torch.topk) == 4
    got, want = gm(*args), Many()(*args)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
