"""Static MoE dispatch (cgbackend/moe/) on CPU: every supported pattern is rewritten, the whole
layer becomes one static region, and outputs and gradients equal the original dynamic loop, on
rotating inputs, with experts that get no tokens and with every token routed to one expert.
Simulated graphs run the rewritten model through the capture/replay runtime."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.config import ConfigError, DispatchMode
from cgbackend.models.gpt import GPT, MixtralStyleMoE, SortedMoE
from cgbackend.common.fx_utils import callee_name
from cgbackend.moe.graph_rewrite import rewrite_static_dispatch
from fx_helpers import trace

D, FF, E = 16, 24, 4


class DeepSeekStyleMoE(MixtralStyleMoE):
    """``for e in range(E): idx, top = torch.where(indices == e)``, ``y[idx] += expert(x[idx]) * w``."""

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, ind = torch.topk(F.softmax(self.gate(h), -1), self.top_k)
        y = torch.zeros_like(h)
        for e in range(self.n_experts):
            idx, top = torch.where(ind == e)
            y[idx] += self.experts[e](h[idx]) * w[idx, top, None]
        return y.reshape(x.shape)


class Top1NoWeight(MixtralStyleMoE):
    """1-D selection, no router weight: ``nonzero(as_tuple=True)`` and ``index_add_`` of raw rows."""

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        choice = self.gate(h).argmax(-1)
        y = torch.zeros_like(h)
        for e in range(self.n_experts):
            (idx,) = torch.nonzero(choice == e, as_tuple=True)
            y.index_add_(0, idx, self.experts[e](h[idx]))
        return y.reshape(x.shape)


class MixingExpert(MixtralStyleMoE):
    """An "expert" that normalizes over its tokens: not row-independent, must stay dynamic."""

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, ind = torch.topk(F.softmax(self.gate(h), -1), self.top_k)
        y = torch.zeros_like(h)
        for e in range(self.n_experts):
            idx, top = torch.where(ind == e)
            rows = self.experts[e](h[idx])
            y.index_add_(0, idx, F.softmax(rows, dim=0) * w[idx, top, None])
        return y.reshape(x.shape)


class RoutingEscapes(MixtralStyleMoE):
    """The selected indices are also returned: removing the loop would remove an output."""

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        w, ind = torch.topk(F.softmax(self.gate(h), -1), self.top_k)
        y = torch.zeros_like(h)
        idx, top = torch.where(ind == 0)
        y.index_add_(0, idx, self.experts[0](h[idx]) * w[idx, top, None])
        return y.reshape(x.shape), idx


LAYERS = {
    "mixtral": lambda: MixtralStyleMoE(D, FF, E, 2),
    "sorted": lambda: SortedMoE(D, FF, E, 2),
    "deepseek": lambda: DeepSeekStyleMoE(D, FF, E, 2),
    "top1_nonzero": lambda: Top1NoWeight(D, FF, E, 1),
}
PATTERN = {"mixtral": "where_loop", "sorted": "sorted_split", "deepseek": "where_loop",
           "top1_nonzero": "where_loop"}


def _routed_to(layer: nn.Module, experts: list[int]) -> None:
    """Make the router send every token to ``experts`` (in that order of preference): input
    feature 0 is set to a large constant by _inputs(skewed=True) and dominates the logits."""
    with torch.no_grad():
        layer.gate.weight[:, 0] = 0.0
        for rank, e in enumerate(experts):
            layer.gate.weight[e, 0] = 50.0 - 10.0 * rank


def _inputs(n: int, seed: int, skewed: bool = False, device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 6, D, generator=g).to(device, dtype) for _ in range(n)]
    if skewed:
        for x in xs:
            x[..., 0] = 4.0
    return xs


def _close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    """Largest difference relative to the reference's scale (bf16 rounds per element)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"{what}: error {err:.2e} > {tol:.0e}"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the float64 value's scale."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _check(layer: nn.Module, xs: list[torch.Tensor], tol: float = 1e-5, **options) -> dict:
    ref = copy.deepcopy(layer)
    compiled = cgbackend.compile(layer, static_dispatch="masked_dense", **options)
    return _run(ref, layer, compiled, xs, tol)


def _run(ref: nn.Module, layer: nn.Module, compiled, xs: list[torch.Tensor], tol: float = 1e-5) -> dict:
    """Outputs, input gradients and every parameter gradient of ``compiled`` equal ``ref``'s on
    ``xs``; the stats and report after them."""
    for x in xs:
        xr, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_r, out_c = ref(xr), compiled(xc)
        _close(out_c, out_r, tol, "output")
        g = torch.randn_like(out_r)
        out_r.backward(g)
        out_c.backward(g)
        _close(xc.grad, xr.grad, tol, "input gradient")
        for (name, a), (_, b) in zip(ref.named_parameters(), layer.named_parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if a.grad is not None:
                _close(b.grad, a.grad, tol, name)
        ref.zero_grad(set_to_none=True)
        layer.zero_grad(set_to_none=True)
    return {"stats": dict(cgbackend.stats(compiled)), "report": cgbackend.report(compiled)}


ROUTINGS = {"all_to_one": [0], "two_of_four": [2, 1]}


def _random_then_skewed(name: str) -> dict:
    """The layer ``name`` compiled once (masked dense): run on random batches, then with its router
    (in the layer and its eager twin alike) sending every token to the experts of each of ROUTINGS
    in turn, on skewed batches. The results after each run, and the experts the router picked for
    the first skewed batch."""
    torch.manual_seed(0)
    layer = LAYERS[name]()
    ref = copy.deepcopy(layer)
    compiled = cgbackend.compile(layer, static_dispatch="masked_dense")
    runs = {"random": _run(ref, layer, compiled, _inputs(4, seed=1))}
    for routing, experts in ROUTINGS.items():
        for m in (layer, ref):
            _routed_to(m, experts)
        xs = _inputs(3, seed=2, skewed=True)
        with torch.no_grad():  # the router really does what the test says
            top = torch.topk(layer.gate(xs[0].reshape(-1, D)), layer.top_k, dim=-1).indices
        runs[routing] = {**_run(ref, layer, compiled, xs), "top": top, "top_k": layer.top_k}
    return runs


@pytest.fixture(scope="module")
def layer_runs():
    """_random_then_skewed per layer, run once for the tests that read it."""
    return functools.cache(_random_then_skewed)


@pytest.mark.parametrize("name", list(LAYERS))
def test_pattern_rewritten_and_equal_to_the_loop(name, layer_runs):
    result = layer_runs(name)["random"]
    report = result["report"]
    rewrites = report.graphs[0].dispatch["rewrites"]
    assert rewrites and {r["pattern"] for r in rewrites} == {PATTERN[name]}
    assert all(r["form"] == "masked_dense" and r["source"] for r in rewrites)
    assert report.summary["dynamic_regions"] == 0 and report.summary["static_regions"] == 1
    assert report.graphs[0].dispatch["skipped"] == []


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_experts_without_tokens_and_everything_to_one_expert(name, routing, layer_runs):
    """The layers of the test above, compiled once: their routers then sending every token to one
    expert, or to two of the four (the others get none); outputs and gradients equal the loop's."""
    experts = ROUTINGS[routing]
    result = layer_runs(name)[routing]
    top = result["top"]  # the router really does what the test says
    assert set(top[:, 0].tolist()) == {experts[0]}  # one expert gets every token
    if result["top_k"] == len(experts):  # and the others none
        assert set(top.flatten().tolist()) == set(experts)
    assert result["report"].summary["dynamic_regions"] == 0


def test_graph_of_the_rewrite_has_no_data_dependent_op():
    torch.manual_seed(0)
    layer = MixtralStyleMoE(D, FF, E, 2)
    gm = trace(layer, torch.randn(2, 6, D))
    result = rewrite_static_dispatch(gm, DispatchMode.MASKED_DENSE)
    assert len(result.rewrites) == E
    names = {str(n.target) for n in gm.graph.nodes}
    for op in ("nonzero", "index_add_", "_assert_scalar"):
        assert not any(op in t for t in names), op
    assert not any(callee_name(n) == "where" and len(n.args) == 1 for n in gm.graph.nodes)
    for n in gm.graph.nodes:  # every new node carries a fake value of static shape
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor):
            assert all(isinstance(s, int) for s in v.shape), n


def test_not_row_independent_expert_stays_dynamic_with_the_reason():
    torch.manual_seed(0)
    layer = MixingExpert(D, FF, E, 2)
    result = _check(layer, _inputs(2, seed=3))
    dispatch = result["report"].graphs[0].dispatch
    assert dispatch["rewrites"] == []
    assert len(dispatch["skipped"]) == E
    assert all("not proven row-independent" in s["reason"] and "softmax" in s["reason"]
               for s in dispatch["skipped"])
    assert result["report"].summary["dynamic_regions"] >= 1
    text = result["report"].to_text()
    assert "static dispatch left dynamic: where_loop" in text


def test_routing_used_elsewhere_stays_dynamic():
    torch.manual_seed(0)
    layer = RoutingEscapes(D, FF, E, 2)
    ref = copy.deepcopy(layer)
    compiled = cgbackend.compile(layer, static_dispatch="masked_dense")
    x = torch.randn(2, 6, D)
    (y, idx), (yr, idxr) = compiled(x), ref(x)
    torch.testing.assert_close(y, yr)
    assert torch.equal(idx, idxr)
    skipped = cgbackend.report(compiled).graphs[0].dispatch["skipped"]
    assert len(skipped) == 1 and "output of the graph" in skipped[0]["reason"]


@pytest.mark.parametrize("options, rewritten", [({}, True), ({"static_dispatch": "off"}, False)],
                         ids=["default", "off"])
def test_on_by_default_off_on_request_and_bad_mode_rejected(options, rewritten):
    assert cgbackend.Config().static_dispatch is DispatchMode.AUTO  # parsed once, into its typed value
    assert cgbackend.Config().to_dict()["static_dispatch"] == "auto"
    assert cgbackend.Config(static_dispatch="off").replace(warmup=1).static_dispatch is DispatchMode.OFF
    with pytest.raises(ConfigError, match="static_dispatch"):
        cgbackend.backend(static_dispatch="sometimes")
    torch.manual_seed(0)
    layer = MixtralStyleMoE(D, FF, E, 2)
    compiled = cgbackend.compile(layer, **options)
    x = torch.randn(2, 6, D)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x))
    report = cgbackend.report(compiled)
    assert bool(report.graphs[0].dispatch["rewrites"]) == rewritten
    assert (report.summary["dynamic_regions"] == 0) == rewritten


def test_report_names_the_rewrite_with_source_line(layer_runs):
    result = layer_runs("mixtral")["random"]  # MixtralStyleMoE, masked dense
    text = result["report"].to_text()
    assert "static dispatch rewritten: where_loop -> masked_dense at gpt.py:" in text
    assert f"x{E}" in text
    assert result["report"].to_dict()["summary"]["dispatch_rewrites"] == E


@pytest.mark.parametrize("ffn", ["moe", "moe_sort"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_whole_model_is_one_graph_under_simulated_capture(ffn, train):
    torch.manual_seed(0)
    model = GPT(vocab=64, d_model=32, n_layers=2, n_heads=4, max_seq=32, ffn=ffn, n_experts=4, top_k=2)
    ref = copy.deepcopy(model)
    model.train(train)
    ref.train(train)
    compiled = cgbackend.compile(model, static_dispatch="masked_dense", simulate_graphs=True, warmup=1)
    g = torch.Generator().manual_seed(5)
    for step in range(5):
        idx = torch.randint(0, 64, (2, 12), generator=g)
        if train:
            loss_r = ref(idx).float().logsumexp(-1).mean()
            loss_c = compiled(idx).float().logsumexp(-1).mean()
            loss_r.backward()
            loss_c.backward()
            torch.testing.assert_close(loss_c, loss_r, atol=1e-5, rtol=1e-5)
            for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
                torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-5, msg=n)
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                torch.testing.assert_close(compiled(idx), ref(idx), atol=1e-5, rtol=1e-5)
    stats = cgbackend.stats(compiled)
    assert stats["static_regions"] == 1 and stats["dynamic_regions"] == 0
    assert stats["graphs_captured"] == (2 if train else 1)
    assert {k: v for k, v in stats["eager_calls"].items() if k != "warmup"} == {}
    assert stats["replays"] >= 4


# ----------------------------------------------------------------------------- GPU

@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", [None, [0], [2, 1]], ids=["random", "all_to_one", "two_of_four"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_on_gpu_captured_and_equal(name, experts, dtype):
    torch.manual_seed(0)
    layer = LAYERS[name]().to("cuda", dtype)
    if experts:
        _routed_to(layer, experts)
    xs = _inputs(6, seed=7, skewed=bool(experts), device="cuda", dtype=dtype)
    result = _check(layer, xs, tol=1e-4 if dtype == torch.float32 else 3e-2, warmup=1)
    st = result["stats"]
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0
    assert st["graphs_captured"] == 2  # forward and backward of the one region
    assert st["eager_calls"] == {"warmup": 1}, st["eager_calls"]
    assert st["replays"] == 2 * (len(xs) - 1)  # forward and backward graphs


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ffn", ["moe", "moe_sort"])
def test_reference_models_on_gpu_are_one_graph(ffn, dtype):
    from cgbackend.models import build_model, make_inputs
    name = "moe" if ffn == "moe" else "moe_sort"
    model = build_model(name, size="tiny", device="cuda", dtype=dtype)
    ref = copy.deepcopy(model)
    inputs = make_inputs(name, model, n=8, device="cuda", dtype=dtype)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    infer = cgbackend.compile(copy.deepcopy(model).eval(), static_dispatch="auto", warmup=2)
    ref.eval()
    exact = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        kept = []
        for x in inputs:
            out = infer(x)
            kept.append((out, out.clone(), ref(x), exact(x)))
    off = []
    for i, (out, first, r, r64) in enumerate(kept):
        assert torch.equal(out, first), f"call {i}: a later replay overwrote its output"
        if dtype == torch.float32:
            _close(out, r, tol, f"inference call {i}")
            continue
        # bf16: Inductor's code rounds otherwise than eager's, and where a token's top-k choice is
        # near a tie that can flip it (tests/moe/test_routing_flips.py): each call is judged
        # against float64 (at most 2x eager-bf16's own error), and a call off by a flip is counted.
        err, eager_err = ((t.double() - r64).abs().max().item() for t in (out, r))
        if err > 2 * eager_err:
            off.append(f"call {i}: error {err:.2e}, eager's {eager_err:.2e}")
    assert len(off) <= 2, off  # at most 2 of 8 calls with a flipped choice
    st = cgbackend.stats(infer)
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0
    assert st["graphs_captured"] == 1 and st["replays"] == len(inputs) - 2
    assert st["eager_calls"] == {"warmup": 2}

    train_ref = copy.deepcopy(model).train()
    mine = copy.deepcopy(model).train()
    exact = copy.deepcopy(model).double().train()
    compiled = cgbackend.compile(mine, static_dispatch="auto", warmup=2)
    opt_c = torch.optim.SGD(mine.parameters(), lr=1e-2)
    off = []
    for step, x in enumerate(inputs[:5]):
        with torch.no_grad():  # eager and float64 take the weights mine has after its SGD steps
            for other in (train_ref, exact):
                for a, b in zip(other.parameters(), mine.parameters()):
                    a.copy_(b)
        grads = []
        for m, fn in ((exact, exact), (train_ref, train_ref), (mine, compiled)):
            m.zero_grad(set_to_none=True)
            out = fn(x)
            loss = F.cross_entropy(out.flatten(0, 1).to(torch.float64 if m is exact else torch.float32), x.flatten())
            loss.backward()
            grads.append([loss.detach()] + [p.grad for p in m.parameters()])
        want, eager, got = grads
        if dtype == torch.float32:
            for a, b in zip(eager, got):
                _close(b, a, tol, f"step {step}")
        else:
            # bf16 against float64, as the inference calls above: at most 2x eager-bf16's own error
            # on each loss and gradient, or the step counts as one with a flipped choice.
            floor = torch.finfo(torch.bfloat16).eps / 2
            ratio = max(_rel(b, w) / max(_rel(a, w), floor) for w, a, b in zip(want, eager, got))
            if ratio > 2:
                off.append(f"step {step}: {ratio:.1f}x eager's error")
        # Holding mine's gradients into the next step would keep its graphs from replaying over
        # them (replay_order_hazard), as it should.
        del grads, want, eager, got
        opt_c.step()
    assert len(off) <= 1, off  # at most 1 of 5 steps with a flipped choice
    st = cgbackend.stats(compiled)
    assert st["dynamic_regions"] == 0 and st["graphs_captured"] == 2
    assert {k: v for k, v in st["eager_calls"].items() if k != "warmup"} == {}


def test_dunder_method_spelling_of_torch_2_11_is_matched():
    """Dynamo in torch 2.11 records ``ind == e`` as the method ``__eq__`` (2.13: operator.eq)."""
    import operator
    torch.manual_seed(0)
    gm = trace(DeepSeekStyleMoE(D, FF, E, 2), torch.randn(2, 6, D))
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (operator.eq, torch.eq):
            n.op, n.target = "call_method", "__eq__"
    gm.recompile()
    result = rewrite_static_dispatch(gm, DispatchMode.MASKED_DENSE)
    assert len(result.rewrites) == E and result.skipped == []


def test_auto_leaves_a_loop_dynamic_above_the_row_limit(monkeypatch):
    from cgbackend.moe import form_choice as dispatch
    monkeypatch.setattr(dispatch, "_AUTO_MAX_ROWS", 8)  # the test's 12 tokens are over it
    torch.manual_seed(0)
    gm = trace(MixtralStyleMoE(D, FF, E, 2), torch.randn(2, 6, D))
    result = rewrite_static_dispatch(gm, DispatchMode.AUTO)
    assert result.rewrites == [] and len(result.skipped) == E
    assert all("exceed the masked-dense limit of 8" in s.reason for s in result.skipped)
    assert rewrite_static_dispatch(gm, DispatchMode.MASKED_DENSE).rewrites  # an explicit form overrides it


def test_explain_cli_reports_the_rewrites(capsys):
    from cgbackend.cli import main
    assert main(["explain", "--demo", "moe", "--option", "static_dispatch=auto", "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    rewrites = [r for g in report["graphs"] for r in g["dispatch"]["rewrites"]]
    assert rewrites and all(r["source"].startswith("gpt.py:") and r["module_path"].endswith("ffn")
                            for r in rewrites)
    assert report["summary"]["dynamic_regions"] == 0
