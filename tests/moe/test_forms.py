"""Dispatch loops as real code writes them.

Each form is unchanged user-style code: iterating the experts that received tokens (a nonzero()
result, as transformers 5's eager experts do), skipping experts by counts read with .tolist(), and
transformers' own Mixtral / Qwen2-MoE / OLMoE with set_experts_implementation("eager"). With static
dispatch the whole MoE layer sits in one static region (no graph break, no dynamic region), in the
masked-dense and in the grouped form, and outputs and every gradient equal eager's in float64, on
rotating inputs, with experts that get no token and with every token on one expert. Forms that the
rewrite cannot prove stay as written, with the reason, and run as plain torch.compile runs them.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from moe_helpers import RoutedExperts
from cuda_utils import assert_matches  # before Inductor loads a module of the same name

D, FF, E, K = 16, 24, 4, 2


class _MoE(RoutedExperts):
    def __init__(self, n_experts: int = E, top_k: int = K) -> None:
        super().__init__(D, FF, n_experts, top_k)


class HitLoopMoE(_MoE):
    """transformers 5's eager loop: iterate the experts that received tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        with torch.no_grad():
            expert_mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            top_pos, token_idx = torch.where(expert_mask[expert_idx])
            rows = self.experts[expert_idx](h[token_idx]) * w[token_idx, top_pos, None]
            out.index_add_(0, token_idx, rows.to(out.dtype))
        return out.reshape(x.shape)


class InlineHitLoopMoE(_MoE):
    """The loop iterates the nonzero() result directly and reads the id with int()."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0).bool()
        for e in mask.any(dim=2).any(dim=1).nonzero():
            e = int(e)
            slot, tok = torch.where(mask[e])
            out[tok] += self.experts[e](h[tok]) * w[tok, slot, None]
        return out.reshape(x.shape)


class CountSkipMoE(_MoE):
    """Counts read on the host, experts without tokens skipped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        counts = torch.bincount(ind.flatten(), minlength=self.n_experts).tolist()
        out = torch.zeros_like(h)
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ind == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class HitLoopTensorUse(_MoE):
    """The body uses the nonzero() row as a tensor: not rewritten (the reason is reported)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
        for e in mask.sum(dim=(1, 2)).gt(0).nonzero():
            slot, tok = torch.where(mask[e].squeeze(0))
            out.index_add_(0, tok, self.experts[e.item()](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


USER_FORMS = {"hit_loop": HitLoopMoE, "inline_hit_loop": InlineHitLoopMoE, "count_skip": CountSkipMoE}
LOOP_FORM = {"hit_loop": "hit_loop", "inline_hit_loop": "hit_loop", "count_skip": "count_skip"}


def _route_all_to(layer: nn.Module, experts: list[int]) -> None:
    with torch.no_grad():
        layer.gate.weight[:, 0] = 0.0
        for rank, e in enumerate(experts):
            layer.gate.weight[e, 0] = 50.0 - 10.0 * rank


def _batches(n: int, seed: int, skewed: bool = False, dtype=torch.float64, device="cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(3, 5, D, generator=g, dtype=torch.float64) for _ in range(n)]
    for x in xs:
        if skewed:
            x[..., 0] = 4.0
    return [x.to(device, dtype) for x in xs]


def _grads_equal(ref: nn.Module, model: nn.Module, tol: float) -> None:
    """Every gradient equal. An expert the loop skipped (no token routed to it) was never called
    eagerly, so its gradient is None there; the rewritten loop runs it on no rows, so the gradient
    is exactly zero, on every call (documented in the README)."""
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        if a.grad is None and b.grad is not None and name.startswith(("experts.", "model.layers.")):
            assert not b.grad.any(), name
            continue
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=tol, atol=tol, msg=name)


def _beside_eager(model: nn.Module, **options) -> tuple[nn.Module, object]:
    """An eager twin of ``model`` (a deep copy) and ``model`` compiled with simulated graphs and
    ``options``."""
    return copy.deepcopy(model), cgbackend.compile(model, simulate_graphs=True, warmup=1, **options)


def _assert_same(model: nn.Module, xs: list[torch.Tensor], tol: float = 1e-9, **options) -> dict:
    ref, compiled = _beside_eager(model, **options)
    return _same_run(ref, model, compiled, xs, tol)


def _same_run(ref: nn.Module, model: nn.Module, compiled, xs: list[torch.Tensor], tol: float = 1e-9) -> dict:
    """Outputs, input gradients and every parameter gradient of ``compiled`` equal ``ref``'s on
    ``xs``; the stats and report after them."""
    for x in xs:
        xr, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_r, out_c = ref(xr), compiled(xc)
        torch.testing.assert_close(out_c, out_r, rtol=tol, atol=tol)
        g = torch.randn_like(out_r)
        out_r.backward(g)
        out_c.backward(g)
        torch.testing.assert_close(xc.grad, xr.grad, rtol=tol, atol=tol)
        _grads_equal(ref, model, tol)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return {"stats": dict(cgbackend.stats(compiled)), "report": cgbackend.report(compiled)}


def _one_static_region(result: dict, form: str) -> None:
    report, stats = result["report"], result["stats"]
    assert report.graph_breaks == [] and report.summary["graphs"] == 1
    assert stats["dynamic_regions"] == 0 and stats["static_regions"] == 1
    assert stats["replays"] > 0 and stats["trace_fallbacks"] == 0
    forms = {r["form"] for g in report.graphs for r in g.dispatch["rewrites"]}
    assert forms == {form}, report.to_text()
    assert all(not g.dispatch["skipped"] for g in report.graphs)


def _skewed_run(ref: nn.Module, model: nn.Module, compiled, experts: list[int]) -> dict:
    """The router of ``model`` and of its eager twin set to send every token to ``experts``, then
    skewed batches run as _same_run runs them; with the experts the router picked for the first."""
    for m in (model, ref):
        _route_all_to(m, experts)
    xs = _batches(4, seed=2, skewed=True)
    with torch.no_grad():
        top = model.route(xs[0].reshape(-1, D))[1]
    return {**_same_run(ref, model, compiled, xs), "top": top}


def _random_then_two_of_four(name: str, form: str) -> dict:
    """The loop ``name`` (top-2 of four experts) compiled once in ``form``: run on random batches,
    then with every token routed to experts 3 and 0 (experts 1 and 2 get none)."""
    torch.manual_seed(0)
    model = USER_FORMS[name]().double()
    ref, compiled = _beside_eager(model, static_dispatch=form)
    random = _same_run(ref, model, compiled, _batches(5, seed=1))
    return {"random": random, "two_of_four": _skewed_run(ref, model, compiled, [3, 0])}


@pytest.fixture(scope="module")
def user_loop_runs():
    """_random_then_two_of_four per loop and form, run once for the tests that read it."""
    return functools.cache(_random_then_two_of_four)


@pytest.mark.parametrize("form", ["masked_dense", "grouped"])
@pytest.mark.parametrize("name", list(USER_FORMS))
def test_user_loop_forms_become_one_static_region(name, form, user_loop_runs):
    result = user_loop_runs(name, form)["random"]
    _one_static_region(result, form)
    loops = result["report"].loop_rewrites
    assert [r["form"] for r in loops] == [LOOP_FORM[name]] and loops[0]["source"].startswith("test_forms.py:")


@pytest.mark.parametrize("form", ["masked_dense", "grouped"])
@pytest.mark.parametrize("experts", [[1], [3, 0]], ids=["all_to_one", "two_of_four"])
@pytest.mark.parametrize("name", list(USER_FORMS))
def test_empty_experts_and_every_token_on_one(name, experts, form, user_loop_runs):
    """Every token on one expert (top-1: a model of its own), or on two of the four (the model of
    the test above, compiled once: its router set after the random batches, and the skewed calls
    replay the same graph); outputs and every gradient equal the loop's."""
    if len(experts) == 2:
        run = user_loop_runs(name, form)
        result = run["two_of_four"]
        assert result["stats"]["replays"] > run["random"]["stats"]["replays"]
    else:
        torch.manual_seed(0)
        model = USER_FORMS[name](top_k=len(experts)).double()
        ref, compiled = _beside_eager(model, static_dispatch=form)
        result = _skewed_run(ref, model, compiled, experts)
    assert set(result["top"].flatten().tolist()) == set(experts)  # the routing really is that skewed
    _one_static_region(result, form)


def test_small_batch_form_equals_the_loop():
    """static_dispatch="small_batch": the grouped form's routing with each row's products taken
    alone (the same routing whatever loop shape it came from: the grouped tests cover those);
    outputs and every gradient equal the loop's on varied batches, then with every token on two
    experts (the other two get none: the router set in place after the varied batches, the same
    graph replays)."""
    torch.manual_seed(0)
    model = HitLoopMoE().double()
    ref, compiled = _beside_eager(model, static_dispatch="small_batch")
    varied = _same_run(ref, model, compiled, _batches(4, seed=1))
    _one_static_region(varied, "small_batch")
    result = _skewed_run(ref, model, compiled, [3, 0])
    assert set(result["top"].flatten().tolist()) == {3, 0}  # the routing really is that skewed
    assert result["stats"]["replays"] > varied["stats"]["replays"]
    _one_static_region(result, "small_batch")
    figures = [r["figures"] for g in result["report"].graphs for r in g.dispatch["rewrites"]]
    assert [f["grouped_mm"] for f in figures] == ["per-row products (small-batch form: no grouping)"], figures


def test_auto_rewrites_on_cpu_and_counts_form_runs_without_static_dispatch():
    torch.manual_seed(0)
    model = CountSkipMoE().double()
    _one_static_region(_assert_same(model, _batches(4, seed=3), static_dispatch="auto"), "masked_dense")
    # Without static dispatch: Dynamo cannot trace the .tolist() of a data-dependent length with
    # capture_scalar_outputs on; cgbackend.compile traces as plain torch.compile does (a graph
    # break there), counted and in the report, instead of failing.
    torch._dynamo.reset()
    result = _assert_same(CountSkipMoE().double(), _batches(4, seed=4), static_dispatch="off")
    assert result["stats"]["trace_fallbacks"] == 1
    assert any("data-dependent" in n and ".tolist()" in n for n in result["report"].notes)
    assert result["report"].loop_rewrites == []


def test_counts_form_under_torch_compile_by_name():
    torch.manual_seed(0)
    model = CountSkipMoE().double()
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend=cgbackend.backend(simulate_graphs=True))
    for x in _batches(3, seed=5):
        torch.testing.assert_close(compiled(x), ref(x))


def test_loop_that_cannot_be_proven_stays_as_written_with_the_reason():
    torch.manual_seed(0)
    model = HitLoopTensorUse().double()
    result = _assert_same(model, _batches(3, seed=6), static_dispatch="auto")
    loops = result["report"].loop_rewrites
    assert len(loops) == 1 and loops[0]["form"] == "" and "uses the nonzero() row as a tensor" in loops[0]["reason"]
    assert "dispatch loop left as written" in result["report"].to_text()


def test_loop_rewrite_is_undone_by_explain_and_kept_off_without_static_dispatch():
    model = HitLoopMoE().double()
    report = cgbackend.explain(model, torch.randn(2, 3, D, dtype=torch.float64),
                               options={"static_dispatch": "auto"})
    assert [r["form"] for r in report.loop_rewrites] == ["hit_loop"]
    assert report.summary["dynamic_regions"] == 0 and report.summary["graph_breaks"] == 0
    assert "forward" not in model.__dict__  # explain leaves the user's module as it was
    default = cgbackend.explain(model, torch.randn(2, 3, D, dtype=torch.float64))
    assert default.loop_rewrites == report.loop_rewrites  # static dispatch is on by default
    plain = cgbackend.explain(model, torch.randn(2, 3, D, dtype=torch.float64), options={"static_dispatch": "off"})
    assert plain.loop_rewrites == [] and plain.summary["graph_breaks"] >= 1


# ----------------------------------------------------------------------------- transformers

transformers = pytest.importorskip("transformers")


def _hf(kind: str, dtype=torch.float64, device="cpu", layers: int = 2):
    torch.manual_seed(0)
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2))
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
            shared_expert_intermediate_size=40, decoder_sparse_step=1))
    else:
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
            **common, num_experts=4, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None))
    model.set_experts_implementation("eager")
    return model.to(device, dtype)


def _hf_run(ref, model, compiled, batches, tol=1e-9) -> dict:
    """Outputs and every gradient of ``compiled`` equal ``ref``'s on ``batches``; the stats and
    report after them."""
    for ids in batches:
        out_r, out_c = ref(ids).logits, compiled(ids).logits
        torch.testing.assert_close(out_c, out_r, rtol=tol, atol=tol)
        g = torch.randn_like(out_r)
        out_r.backward(g)
        out_c.backward(g)
        _grads_equal(ref, model, tol)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return {"stats": dict(cgbackend.stats(compiled)), "report": cgbackend.report(compiled)}


def _hf_same(model, batches, tol=1e-9, **options) -> dict:
    ref, compiled = _beside_eager(model, **options)
    return _hf_run(ref, model, compiled, batches, tol)


def _hf_router(model, kind: str):
    for layer in model.model.layers:
        yield layer.mlp.gate


def _hf_layers(kind: str) -> int:
    # Mixtral with two layers: the second layer's rewritten loop joins the same region. The other
    # families with one: each claim is about the layer's structure, and Dynamo traces each layer
    # again (about 3 s a layer on a CPU).
    return 2 if kind == "mixtral" else 1


def _random_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (2, 7), generator=g) for _ in range(4)]


def _grouped_then_every_token_on_one(kind: str) -> dict:
    """transformers' ``kind`` compiled once with static_dispatch="grouped": run on random batches,
    then, with the router weights of expert 2 made to dominate every token's logits (in the model
    and its eager twin alike), on more batches. Outputs and every gradient equal eager's in both
    runs; the stats and report after each."""
    model = _hf(kind, layers=_hf_layers(kind))
    ref, compiled = _beside_eager(model, static_dispatch="grouped")
    random = _hf_run(ref, model, compiled, _random_batches())
    with torch.no_grad():  # the router weight of expert 2 dominates every token's logits
        for m in (model, ref):
            for gate in _hf_router(m, kind):
                gate.weight.zero_()
                gate.weight[2] = 1.0
                gate.weight[1] = 0.5
            m.model.embed_tokens.weight.abs_()
    g = torch.Generator().manual_seed(8)
    skewed = _hf_run(ref, model, compiled, [torch.randint(0, 64, (2, 7), generator=g) for _ in range(3)])
    return {"random": random, "skewed": skewed}


@pytest.fixture(scope="module")
def grouped_runs():
    """_grouped_then_every_token_on_one per family, run once for the tests that read it."""
    return functools.cache(_grouped_then_every_token_on_one)


@pytest.mark.parametrize("form", ["masked_dense", "grouped"])
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe"])
def test_transformers_eager_experts_are_one_static_region(kind, form, grouped_runs):
    if form == "grouped" and kind in ("mixtral", "olmoe"):
        result = grouped_runs(kind)["random"]  # the same compile and batches, shared with the test below
    else:
        result = _hf_same(_hf(kind, layers=_hf_layers(kind)), _random_batches(), static_dispatch=form)
    _one_static_region(result, form)
    assert [r["form"] for r in result["report"].loop_rewrites] == ["hit_loop"]


def test_transformers_olmoe_in_the_small_batch_form():
    """transformers' OLMoE (eager experts: a loop over the hit experts reading weight tables) in the
    small-batch form: one static region, outputs and gradients equal eager's."""
    model = _hf("olmoe", layers=1)
    g = torch.Generator().manual_seed(9)
    batches = [torch.randint(0, 64, (2, 5), generator=g) for _ in range(2)]
    result = _hf_same(model, batches, static_dispatch="small_batch")
    _one_static_region(result, "small_batch")
    assert [r["form"] for r in result["report"].loop_rewrites] == ["hit_loop"]


@pytest.mark.parametrize("kind", ["mixtral", "olmoe"])
def test_transformers_every_token_on_one_expert(kind, grouped_runs):
    """The grouped form of the test above, its router then sending every token to expert 2 (every
    token of the first layer: its input is the normalized, positive embeddings): the same graph
    replays (no new trace), outputs and gradients equal eager's."""
    run = grouped_runs(kind)
    skewed, before = run["skewed"], run["random"]["stats"]
    _one_static_region(skewed, "grouped")
    assert skewed["stats"]["replays"] > before["replays"]  # the calls with that routing replayed


def test_transformers_hit_loop_in_the_masked_dense_form_is_bucketed():
    """transformers' Mixtral (eager experts) at changing batch sizes, masked-dense form: the rewrite
    leaves the model's ``expert_mask.sum(...) > 0`` (which experts were hit) with no reader; the row
    proof skips what nothing reads (passes/bucket.py ``_live``) and takes the form whole, so the
    model is one bucketed region: one graph per capture size, outputs equal eager's."""
    model = _hf("mixtral", layers=1).eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="masked_dense")
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for n in (3, 4, 5, 7, 8, 6, 2, 2):  # capture sizes 4, 4, 8, 8, 8, 8, 2, 2
            ids = torch.randint(0, 64, (n, 7), generator=g)
            torch._dynamo.mark_dynamic(ids, 0)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-9, atol=1e-9)
    st = cgbackend.stats(compiled)
    assert cgbackend.report(compiled).summary["bucketed_regions"] == 1
    assert st["graphs_captured"] == 3 and st["eager_calls"] == {"warmup": 3}, st


@pytest.fixture(scope="module")
def mixtral_without_static_dispatch() -> dict:
    """transformers' Mixtral compiled with static_dispatch="off", run (outputs and gradients equal to
    eager's) on two batches; shared by the tests of that setting (each trace of the model with its
    graph breaks takes seconds a layer on the CPU: one layer holds the loop they look at)."""
    g = torch.Generator().manual_seed(5)
    return _hf_same(_hf("mixtral", layers=1), [torch.randint(0, 64, (2, 7), generator=g) for _ in range(2)],
                    static_dispatch="off")


def test_transformers_without_static_dispatch_keeps_its_graph_break(mixtral_without_static_dispatch):
    """static_dispatch off: the model is left as written (Dynamo breaks the graph at the loop)."""
    report = mixtral_without_static_dispatch["report"]
    assert report.loop_rewrites == [] and report.graph_breaks


def test_explain_hint_names_static_dispatch_for_a_loop_it_rewrites(mixtral_without_static_dispatch):
    """Without static dispatch, the graph break at transformers' loop over the hit experts gets a
    hint naming static_dispatch="auto" (the loop rewrite proves this loop); a loop it cannot prove
    gets the range(E) hint with the rewrite's reason."""
    model = _hf("mixtral", layers=1)
    with torch.no_grad():
        report = cgbackend.explain(model, torch.randint(0, 64, (2, 7)), options={"static_dispatch": "off"})
    loop = [h for h in report.hints if h["kind"] == "data_dependent_loop"]
    assert len(loop) == 1 and loop[0]["option"] == {"option": "static_dispatch", "value": "auto"}, report.hints
    assert "hit_loop" in loop[0]["message"] and not list(model.modules())[0].__dict__.get("forward")
    # The same hint in the report of a model compiled without static dispatch, after it ran.
    after_run = mixtral_without_static_dispatch["report"]
    after = [h for h in after_run.hints if h["kind"] == "data_dependent_loop"]
    assert [h["option"] for h in after] == [{"option": "static_dispatch", "value": "auto"}] and after_run.loop_rewrites == []
    torch.manual_seed(0)
    with torch.no_grad():
        report = cgbackend.explain(HitLoopTensorUse().double(), _batches(1, seed=2)[0],
                                   options={"static_dispatch": "off"})
    loop = [h for h in report.hints if h["kind"] == "data_dependent_loop"]
    assert len(loop) == 1 and loop[0]["option"] is None and "range(E)" in loop[0]["message"]
    assert "leaves it as written" in loop[0]["message"], loop[0]["message"]


def test_grouped_form_under_inductor_reads_the_expert_block_without_a_copy(monkeypatch):
    """inner="inductor": the experts' stacked weights are a view of the block the layout made, taken
    outside what Inductor compiles (traced with fake tensors it would be a torch.stack, a copy of
    every expert's weights per call). Outputs and gradients still equal eager's."""
    import torch._inductor.compile_fx as cfx
    from cgbackend.moe.expert_layout import stacked_view

    seen = []
    real = cfx.compile_fx

    def spy(gm, example_inputs, **kw):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return real(gm, example_inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch.manual_seed(0)
    model = HitLoopMoE().double()
    result = _assert_same(model, _batches(3, seed=4), tol=1e-7, static_dispatch="grouped", inner="inductor")
    _one_static_region(result, "grouped")
    assert result["stats"]["inner_compiled"] == 1 and not result["stats"]["inner_fallbacks"]
    assert seen  # compile_fx calls itself once more with its config patches applied
    assert all(stacked_view not in ops and torch.stack not in ops for ops in seen), seen
    # The gathered rows that the gate and up products both read are made once (one clone), not
    # once per product.
    assert all(ops.count(torch.clone) == 1 for ops in seen), [ops.count(torch.clone) for ops in seen]


def test_rows_indexed_as_transformers_does_are_gathered_straight_into_their_own_tensor(monkeypatch):
    """``hidden[None, top_x].reshape(-1, hidden_dim)`` (transformers' form, and the real-size
    models'): the grouped form gathers the rows as ``hidden[tokens]``, one tensor of their own that
    the gate and up products both read. A view there, or a clone of it (Inductor drops the clone
    as a no-op), is realized once per product: the rows written twice. The rows per expert are
    counted in int32. Inductor is not run here: the spy hands the module back; outputs still equal
    eager's."""
    import operator

    import torch._inductor.compile_fx as cfx
    from cgbackend.common.fx_utils import fake_value
    from cgbackend.models.realsize import RealConfig, RealModel

    seen = []

    def spy(gm, example_inputs, **kw):
        seen.append(gm)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", spy)
    cfg = RealConfig(hidden=16, heads=2, kv_heads=1, head_dim=8, layers=1, ffn=8, experts=4, top_k=2, max_pos=64)
    torch.manual_seed(3)
    model = RealModel(cfg, return_routing=False).double().eval()
    compiled = cgbackend.compile(model, static_dispatch="grouped", inner="inductor", simulate_graphs=True,
                                 warmup=1)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 8, 16, generator=gen, dtype=torch.float64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-9, atol=1e-9)
    assert len(seen) == 1
    nodes = list(seen[0].graph.nodes)
    assert not [n for n in nodes if n.target is torch.clone]
    # the rows: one 2-D gather read by both products (here the bmm stand-in: h.unsqueeze(1) twice)
    rows = [n for n in nodes if n.target is operator.getitem and len(n.users) == 2
            and all(u.op == "call_method" and u.target == "unsqueeze" for u in n.users)]
    assert len(rows) == 1 and not isinstance(rows[0].args[1], tuple), rows
    # the rows per expert are counted in int32: Inductor lowers that scatter_add into its own kernel
    # on a GPU (Triton's atomic add has no int64; int64 counts ran ATen's scatter kernel)
    counts = [n for n in nodes if n.target == "scatter_add"]
    assert [fake_value(n).dtype for n in counts] == [torch.int32], counts


# ----------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@pytest.mark.parametrize("form", ["masked_dense", "grouped", "small_batch", "auto"])
@pytest.mark.parametrize("name", list(USER_FORMS))
def test_user_loop_forms_on_gpu(name, form):
    torch.manual_seed(0)
    model = USER_FORMS[name]().to("cuda", torch.bfloat16)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch=form)
    for i, x in enumerate(_batches(6, seed=9, dtype=torch.bfloat16, device="cuda")):
        xr, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_r, out_c = ref(xr), compiled(xc)
        assert_matches(out_c, out_r, torch.bfloat16)
        out_r.float().pow(2).mean().backward()
        out_c.float().pow(2).mean().backward()
        assert_matches(xc.grad, xr.grad, torch.bfloat16, "input grad")
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            if a.grad is not None:
                assert_matches(b.grad, a.grad, torch.bfloat16, n)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    stats = cgbackend.stats(compiled)
    assert stats["dynamic_regions"] == 0 and stats["graphs_captured"] > 0 and stats["replays"] > 0, stats


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe"])
def test_transformers_eager_experts_on_gpu(kind):
    model = _hf(kind, dtype=torch.bfloat16, device="cuda").eval()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch="grouped")
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for _ in range(6):
            ids = torch.randint(0, 64, (4, 16), generator=g).cuda()
            assert_matches(compiled(ids).logits, ref(ids).logits, torch.bfloat16)
    stats = cgbackend.stats(compiled)
    assert stats["dynamic_regions"] == 0 and stats["graphs_captured"] > 0 and stats["replays"] > 0, stats
    forms = {r["form"] for gr in cgbackend.report(compiled).graphs for r in gr.dispatch["rewrites"]}
    assert forms == {"grouped"}
