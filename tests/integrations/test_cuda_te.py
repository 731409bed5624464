"""Transformer Engine modules under cgbackend, on the GPU: TE kernels inside the graphs, FP8
state right. Skips without CUDA or without transformer_engine.

Each test trains (or runs) two copies of one model side by side, eager TE and cgbackend.compile,
on varied inputs, and compares losses, gradients and, for FP8 with delayed scaling, every TE
module's amax history and scale after each step."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn as nn

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")
from transformer_engine.common import recipe as te_recipe  # noqa: E402

import cgbackend  # noqa: E402
from cgbackend.integrations import opaque  # noqa: E402

FP8_OK = te.is_fp8_available() if hasattr(te, "is_fp8_available") else True
_autocast = getattr(te, "autocast", None) or te.fp8_autocast
_AUTOCAST_PARAMS = inspect.signature(_autocast).parameters


def fp8(enabled: bool, recipe=None):
    en = "enabled" if "enabled" in _AUTOCAST_PARAMS else "fp8_enabled"
    rk = "recipe" if "recipe" in _AUTOCAST_PARAMS else "fp8_recipe"
    return _autocast(**{en: enabled, rk: recipe if recipe is not None else te_recipe.DelayedScaling()})


D, FFN, HEADS = 1024, 4096, 16


class TEStack(nn.Module):
    """TE transformer layers between an ordinary embedding projection and head."""

    def __init__(self, layers: int = 4, dropout: float = 0.0, tracker=None) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D, dtype=torch.bfloat16)
        kw = dict(params_dtype=torch.bfloat16, hidden_dropout=dropout, attention_dropout=dropout)
        if tracker is not None:
            kw["get_rng_state_tracker"] = tracker
        self.layers = nn.ModuleList(te.TransformerLayer(D, FFN, HEADS, **kw) for _ in range(layers))
        self.head = nn.Linear(D, D, dtype=torch.bfloat16)

    def forward(self, x, is_first_microbatch=None):
        h = torch.nn.functional.gelu(self.inp(x))
        for layer in self.layers:
            h = layer(h, is_first_microbatch=is_first_microbatch)
        return self.head(h)


class TEMoE(nn.Module):
    """TE dense parts around a dropless top-1 MoE whose experts are te.Linear, called on token
    groups of data-dependent size (padded to a multiple of 16, as FP8 GEMMs need)."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.mlp = te.LayerNormMLP(D, FFN, params_dtype=torch.bfloat16)
        self.router = nn.Linear(D, experts, dtype=torch.bfloat16)
        self.experts = nn.ModuleList(te.Linear(D, D, params_dtype=torch.bfloat16) for _ in range(experts))
        self.proj = te.Linear(D, D, params_dtype=torch.bfloat16)

    def forward(self, x):
        h = x + self.mlp(x)
        choice = self.router(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            rows = h[idx]
            pad = (-rows.shape[0]) % 16
            rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
            out = out.index_add(0, idx, expert(rows)[: idx.shape[0]])
        return h + self.proj(out)


def _te_modules(model):
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    return [(n, m) for n, m in model.named_modules() if isinstance(m, TransformerEngineBaseModule)]


def _fp8_state(model):
    out = {}
    for name, m in _te_modules(model):
        meta = getattr(m, "fp8_meta", None) or {}
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            if state is not None and getattr(state, "amax_history", None) is not None:
                out[f"{name}.{key}"] = (state.amax_history.clone(), state.scale.clone())
    return out


def _inputs(n, shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) * scale * (1 + 0.25 * i)
            for i in range(n)]


def _rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _train_side_by_side(build, inputs, recipe, steps_checked, options=None, kwargs_of=None):
    torch.manual_seed(0)
    ref = build().cuda()
    model = copy.deepcopy(ref)
    compiled = cgbackend.compile(model, warmup=1, **(options or {}))
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-3)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step, x in enumerate(inputs):
        kw = kwargs_of(step) if kwargs_of else {}
        with fp8(recipe is not None, recipe):
            out_ref = ref(x, **kw)
        loss_ref = out_ref.float().pow(2).mean()
        loss_ref.backward()
        with fp8(recipe is not None, recipe):
            out = compiled(x, **kw)
        loss = out.float().pow(2).mean()
        loss.backward()
        # FP8 on: TE's own kernels in the graphs, equal to eager. FP8 off: TE's torch.compile'd
        # bias/GELU/dropout helpers run unfused in the graphs (te.py), so bf16 rounding differs.
        tol = 1e-3 if recipe is not None else 1e-2
        assert abs(loss.item() - loss_ref.item()) <= tol * abs(loss_ref.item()) + 1e-6, (step, loss, loss_ref)
        total = sum(q.grad.float().norm() ** 2 for q in ref.parameters() if q.grad is not None) ** 0.5
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                # Relative to the parameter's gradient, floored at 1e-4 of the whole gradient: the
                # attention key bias has a gradient of zero in exact arithmetic (~1e-8 here).
                err = (p.grad.float() - q.grad.float()).norm() / torch.maximum(q.grad.float().norm(), 1e-4 * total)
                assert err < 2e-2, (step, name, err.item())
        got, want = _fp8_state(model), _fp8_state(ref)
        assert got.keys() == want.keys()
        if recipe is not None and isinstance(recipe, te_recipe.DelayedScaling):
            assert want, "FP8 delayed scaling left no amax history"
        for key in want:
            for a, b in zip(got[key], want[key]):
                assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=1e-6), (step, key)
        opt.step(); opt_ref.step()
        opt.zero_grad(); opt_ref.zero_grad()
    st = cgbackend.stats(compiled)
    assert not st["capture_failures"], st["capture_failures"]
    return compiled, st


needs_fp8 = pytest.mark.skipif(not FP8_OK, reason="FP8 not available on this GPU")


@needs_fp8
def test_te_stack_fp8_delayed_scaling_training_matches_eager():
    inputs = _inputs(5, (128, 4, D), seed=1)
    compiled, st = _train_side_by_side(TEStack, inputs, te_recipe.DelayedScaling(), 5)
    report = cgbackend.report(compiled)
    calls = [c for r in report.regions() for c in r.opaque]
    assert len(calls) == 4 and all(c["graphed"] for c in calls), calls
    assert st["fwd_graphs"] >= 1 and st["bwd_graphs"] >= 1
    assert st["fwd_replays"] >= 4 and st["bwd_replays"] >= 4
    assert set(st["eager_calls"]) <= {"warmup"}, st["eager_calls"]
    # The TE region cannot compute its forward again (opaque calls): its saved activations, FP8
    # weight copies among them, are loosened into its backward graph (runtime/saved.py).
    mem = st["memory"]
    assert st["saved_released"] >= 1 and mem["saved"] == 0 and mem["released"] > 4 * D * FFN, mem


@needs_fp8
def test_te_stack_current_scaling_training_matches_eager():
    recipe = getattr(te_recipe, "Float8CurrentScaling", None)
    if recipe is None:
        pytest.skip("this TE has no current-scaling recipe")
    _train_side_by_side(lambda: TEStack(layers=2), _inputs(4, (128, 4, D), seed=2), recipe(), 4)


def test_te_stack_bf16_training_matches_eager():
    _, st = _train_side_by_side(lambda: TEStack(layers=2), _inputs(4, (128, 4, D), seed=3), None, 4)
    assert st["bwd_replays"] >= 3
    assert st["saved_released"] >= 1 and st["memory"]["saved"] == 0, st["memory"]



def test_te_backward_that_keeps_the_graph_replays_it():
    """``loss.backward(retain_graph=True)``, one per step: TE's backward consumes its own context, so
    the TE region's captured forward runs backward once (at the capture) and these backwards replay
    the graph, equal to eager TE's. A second backward through one forward raises, as TE's eager
    backward cannot run twice either."""
    torch.manual_seed(0)
    ref = TEStack(layers=2).cuda()
    model = copy.deepcopy(ref)
    compiled = cgbackend.compile(model, warmup=1)
    for step, x in enumerate(_inputs(5, (128, 4, D), seed=6)):
        for fn, m in ((ref, ref), (compiled, model)):
            m.zero_grad(set_to_none=True)
            fn(x).float().pow(2).mean().backward(retain_graph=True)
        total = sum(q.grad.float().norm() ** 2 for q in ref.parameters()) ** 0.5
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            err = (p.grad.float() - q.grad.float()).norm() / torch.maximum(q.grad.float().norm(), 1e-4 * total)
            assert err < 2e-2, (step, name, err.item())
    st = cgbackend.stats(compiled)
    assert st["saved_released"] >= 1 and st["bwd_replays"] >= 3, st
    assert "retained_graph_backward" not in st["eager_calls"], st["eager_calls"]
    out = compiled(_inputs(1, (128, 4, D), seed=7)[0])
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()


@needs_fp8
def test_te_moe_fp8_training_matches_eager():
    inputs = _inputs(5, (512, D), seed=4)
    compiled, st = _train_side_by_side(TEMoE, inputs, te_recipe.DelayedScaling(), 5)
    report = cgbackend.report(compiled)
    calls = {c["module"]: c for r in report.regions() for c in r.opaque}
    assert calls["mlp"]["graphed"] and calls["proj"]["graphed"]
    assert not any(calls[f"experts.{e}"]["graphed"] for e in range(4))
    assert all("data-dependent" in calls[f"experts.{e}"]["why"] for e in range(4))
    assert st["fwd_replays"] >= 8


@needs_fp8
def test_is_first_microbatch_weight_caching_matches_eager():
    # Three micro-batches per step, weights updated after the third: is_first_microbatch=True
    # quantizes and caches the FP8 weights, False reuses them (one Dynamo graph per value).
    inputs = _inputs(9, (128, 4, D), seed=5)
    _train_side_by_side(lambda: TEStack(layers=2), inputs, te_recipe.DelayedScaling(), 9,
                        kwargs_of=lambda step: {"is_first_microbatch": step % 3 == 0})


@pytest.mark.parametrize("fp8_on", [False, pytest.param(True, marks=needs_fp8)])
def test_te_stack_inference_matches_eager(fp8_on):
    torch.manual_seed(0)
    ref = TEStack().cuda().eval()
    model = copy.deepcopy(ref)
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for x in _inputs(5, (128, 4, D), seed=6):
            with fp8(fp8_on):
                want = ref(x)
            with fp8(fp8_on):
                got = compiled(x)
            assert _rel(got, want) < 1e-2
    st = cgbackend.stats(compiled)
    assert st["replays"] >= 4 and not st["capture_failures"]


def test_dropout_with_te_rng_tracker():
    from transformer_engine.pytorch.distributed import CudaRNGStatesTracker
    tracker = CudaRNGStatesTracker()
    tracker.add("model-parallel-rng", 1234)
    torch.manual_seed(0)
    model = TEStack(layers=2, dropout=0.1, tracker=lambda: tracker).cuda()
    compiled = cgbackend.compile(model, warmup=1)
    x = _inputs(1, (128, 4, D), seed=7)[0]
    outs = []
    for _ in range(4):
        out = compiled(x)
        out.float().pow(2).mean().backward()
        outs.append(out.detach().clone())
    st = cgbackend.stats(compiled)
    assert not st["capture_failures"], st["capture_failures"]
    assert st["fwd_replays"] >= 2
    # Each replay draws new dropout masks: the same input gives different outputs.
    assert not torch.equal(outs[2], outs[3]) and not torch.equal(outs[1], outs[2])
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # Without dropout (eval) the graphed model is deterministic.
    model.eval()
    with torch.no_grad():
        evals = [compiled(x).clone() for _ in range(4)]  # warm-up, capture, replays
    assert torch.equal(evals[2], evals[3])


def test_report_without_opaque_modules_shows_graph_breaks():
    model = TEMoE().cuda()
    x = _inputs(1, (512, D), seed=8)[0]
    on = cgbackend.explain(model, x)
    assert on.summary["graph_breaks"] == 0 and on.summary["opaque_calls_graphed"] == 2
    assert on.summary["opaque_calls_eager"] == 4
    opaque.uninstall(model)
    off = cgbackend.explain(model, x, options={"opaque_modules": False})
    assert off.summary["graph_breaks"] >= 1 and off.summary["opaque_calls_graphed"] == 0
