"""Folded expert loops (moe/fold*.py): Dynamo traces one expert of a proven loop and the
grouped form runs all of them; every loop it cannot prove is traced unrolled, as before.

Each test checks outputs (and, in training, every gradient) against the model run eagerly on
varied batches, and what Dynamo traced: the number of selections (``torch.where``) in the graph
that reaches the static-dispatch pass, one per layer when folded and one per expert when not."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
import cgbackend.passes.pipeline as pipeline
from cgbackend.models.layers import Expert
from cgbackend.moe import fold

from fx_helpers import autograd_cache_check
from log_helpers import records_of
from moe_helpers import RoutedExperts

D, FF, E, K = 8, 12, 4, 2

pytestmark = pytest.mark.skipif(not fold.supported(), reason="this torch cannot restart a trace from a backend")


@pytest.fixture(autouse=True)
def fold_small_loops(monkeypatch):
    """Models of 4 experts, folded as loops of 16 and more are by default."""
    monkeypatch.setattr(fold, "MIN_EXPERTS", 2)


class LoopLayer(RoutedExperts):
    """Mixtral's eager loop over every expert, as user code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, selected = self.route(h)
        final = torch.zeros_like(h)
        mask = F.one_hot(selected, num_classes=self.n_experts).permute(2, 1, 0)
        for e in range(self.n_experts):
            idx, top_x = torch.where(mask[e])
            out = self.experts[e](h[top_x]) * weights[top_x, idx, None]
            final.index_add_(0, top_x, out)
        return final.reshape(x.shape)


class TwoLayers(nn.Module):
    def __init__(self, layer: type = LoopLayer, **kw) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(D, FF, E, K, **kw) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class TableLayer(nn.Module):
    """transformers' form: the experts' weights as tables read by expert id, a loop over the hit
    experts with a sentinel expert skipped by id."""

    def __init__(self, d: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.up = nn.Parameter(torch.randn(n_experts, ff, d) / d ** 0.5)
        self.down = nn.Parameter(torch.randn(n_experts, d, ff) / ff ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        w, ind = torch.topk(F.softmax(self.gate(h), -1), self.top_k)
        final = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(ind, num_classes=self.n_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            if e == self.n_experts:
                continue
            pos, tok = torch.where(mask[e])
            cur = F.linear(F.gelu(F.linear(h[tok], self.up[e])), self.down[e])
            final.index_add_(0, tok, cur * w[tok, pos, None])
        return final.reshape(x.shape)


def _wheres(monkeypatch) -> list[int]:
    """The number of torch.where nodes of each graph that reaches static dispatch."""
    seen: list[int] = []
    real = pipeline.rewrite_static_dispatch

    def counting(gm, mode, loops=()):
        seen.append(sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.where))
        return real(gm, mode, loops)
    monkeypatch.setattr(pipeline, "rewrite_static_dispatch", counting)
    return seen


def _batches(n: int, seed: int, new_shape: bool = False) -> list[torch.Tensor]:
    """``n`` batches of other values (the routing changes), the last of another shape if asked."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 9 if new_shape and i == n - 1 else 6, D, generator=g, dtype=torch.float64)
            for i in range(n)]


def _check(model: nn.Module, train: bool, replays: bool = True, new_shape: bool = False,
           static_dispatch: str = "grouped", batches: int = 4, **options):
    """Compile ``model``, run ``batches`` varied batches; outputs (and gradients) equal eager's, and
    the calls after warm-up replay graphs. Returns the report."""
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch=static_dispatch, **options)
    for x in _batches(batches, seed=3, new_shape=new_shape):
        with torch.set_grad_enabled(train):
            want = model(x)
            if train:
                want.square().sum().backward()
                grads = [p.grad.clone() for p in model.parameters()]
                model.zero_grad(set_to_none=True)
            got = compiled(x)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
            if train:
                got.square().sum().backward()
                for p, g in zip(model.parameters(), grads):
                    torch.testing.assert_close(p.grad, g, rtol=1e-10, atol=1e-10)
                model.zero_grad(set_to_none=True)
    assert cgbackend.stats(compiled)["replays"] >= 1 or not replays
    return cgbackend.report(compiled)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_folded_loop_traces_one_expert_and_equals_eager(monkeypatch, train):
    torch.manual_seed(0)
    model = TwoLayers().double()
    wheres = _wheres(monkeypatch)
    report = _check(model, train, new_shape=True)
    assert wheres == [2, 2], wheres  # one expert per layer traced, not 2 x 4; a graph per batch shape
    assert [r["fold"] for r in report.loop_rewrites] == ["folded"]
    rewrites = [r for g in report.to_dict()["graphs"] for r in g["dispatch"]["rewrites"]]
    assert len(rewrites) >= 2 and {(r["form"], r["experts"]) for r in rewrites} == {("grouped", E)}
    assert all("one expert traced for 4" == r["figures"]["folded"] for r in rewrites)


@pytest.mark.parametrize("form", ["grouped", "small_batch"])
def test_parameter_tables_and_a_skipped_sentinel_fold(monkeypatch, form):
    torch.manual_seed(1)
    model = nn.Sequential(TableLayer(D, FF, E, K)).double()
    wheres = _wheres(monkeypatch)
    report = _check(model, train=True, static_dispatch=form)
    assert set(wheres) == {1}, wheres
    assert [(r["form"], r["fold"]) for r in report.loop_rewrites] == [("hit_loop", "folded")]
    rewrites = [r for g in report.to_dict()["graphs"] for r in g["dispatch"]["rewrites"]]
    assert rewrites and {r["form"] for r in rewrites} == {form}, rewrites


class ScaledExpert(Expert):
    """An expert whose parameter scales its output: not the weight of a linear layer."""

    def __init__(self, d: int, ff: int) -> None:
        super().__init__(d, ff)
        self.scale = nn.Parameter(torch.rand(1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class ScaledLayer(LoopLayer):
    def __init__(self, d: int, ff: int, n_experts: int, top_k: int) -> None:
        super().__init__(d, ff, n_experts, top_k)
        self.experts = nn.ModuleList(ScaledExpert(d, ff) for _ in range(n_experts))


def test_a_fold_the_graph_pass_cannot_build_is_traced_unrolled(monkeypatch):
    """The per-expert scale is not a linear weight: the pass declines, Dynamo traces again with the
    loop unrolled, and the result is still eager's."""
    torch.manual_seed(2)
    model = TwoLayers(ScaledLayer).double()
    wheres = _wheres(monkeypatch)
    report = _check(model, train=True)
    assert wheres == [2, 2 * E], wheres  # folded, declined, traced unrolled
    (loop,) = report.loop_rewrites
    assert "scale" in loop["fold"] and "not as the weight of a linear layer" in loop["fold"], loop


class CountingExpert(Expert):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


class TemperedExpert(Expert):
    def __init__(self, d: int, ff: int, t: float) -> None:
        super().__init__(d, ff)
        self.t = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) / self.t


class ListLayer(LoopLayer):
    def __init__(self, d: int, ff: int, n_experts: int, top_k: int, make=None) -> None:
        super().__init__(d, ff, n_experts, top_k)
        self.experts = nn.ModuleList(make(e) for e in range(n_experts))


@pytest.mark.parametrize("make, reason", [
    (lambda e: CountingExpert(D, FF), "writes self.calls"),
    (lambda e: TemperedExpert(D, FF, 1.0 + e), "other attribute values"),
    (lambda e: TemperedExpert(D, FF, 2.0) if e else Expert(D, FF), "differ"),
], ids=["side-effect", "attribute", "class"])
def test_experts_that_are_not_one_structure_are_not_folded(monkeypatch, make, reason):
    torch.manual_seed(3)
    model = TwoLayers(ListLayer, make=make).double()
    wheres = _wheres(monkeypatch)
    # An expert that writes self.calls makes every call trace anew (the count is a constant of each
    # graph, nothing replays): two batches of other values show each new trace equals eager.
    writes = reason.startswith("writes")
    report = _check(model, train=False, replays=not writes, batches=2 if writes else 4)
    assert set(wheres) == {2 * E}, wheres
    (loop,) = report.loop_rewrites
    assert reason in loop["fold"], loop


class IdLayer(LoopLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, sel = self.route(h)
        acc = torch.zeros_like(h)
        for e in range(E):
            t, i = torch.where(sel == e)
            acc.index_add_(0, t, self.experts[e](h[t]) * w[t, i, None] * (e + 1))
        return acc.reshape(x.shape)


def test_a_loop_that_uses_the_expert_id_as_a_number_is_not_folded(monkeypatch):
    torch.manual_seed(4)
    model = TwoLayers(IdLayer).double()
    wheres = _wheres(monkeypatch)
    report = _check(model, train=False)
    assert set(wheres) == {2 * E}, wheres
    assert "uses e otherwise" in report.loop_rewrites[0]["fold"]


def test_a_hook_on_an_expert_is_honoured(monkeypatch):
    """A forward hook on one expert (set before compiling) keeps the loop unrolled, so it runs."""
    torch.manual_seed(5)
    model = TwoLayers().double()
    calls = []
    model.layers[0].experts[3].register_forward_hook(lambda m, a, out: calls.append(1))
    wheres = _wheres(monkeypatch)
    # The hook's Python effect runs eagerly and every call traces anew (nothing replays): two
    # batches of other values.
    report = _check(model, train=False, replays=False, batches=2)
    assert set(wheres) == {2 * E} and "expert 3's module has hooks" in report.loop_rewrites[0]["fold"], (
        wheres, report.loop_rewrites)
    assert calls


def test_loops_over_few_experts_are_traced_unrolled(monkeypatch):
    torch.manual_seed(9)
    monkeypatch.setattr(fold, "MIN_EXPERTS", E + 1)
    model = TwoLayers().double()
    wheres = _wheres(monkeypatch)
    report = _check(model, train=False)
    assert set(wheres) == {2 * E} and "4 experts: below 5" in report.loop_rewrites[0]["fold"]


def test_static_dispatch_masked_dense_never_folds(monkeypatch):
    torch.manual_seed(6)
    model = TwoLayers().double()
    wheres = _wheres(monkeypatch)
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="masked_dense")
    with torch.no_grad():
        for x in _batches(2, seed=7):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)
    assert wheres and set(wheres) == {2 * E}
    assert "static_dispatch is none of auto, grouped, small_batch" in cgbackend.report(compiled).loop_rewrites[0]["fold"]


class BreakingExpert(Expert):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return super().forward(x)


def test_a_graph_break_inside_the_traced_expert_runs_the_loop_as_written():
    """Dynamo gives up on a frame with a graph break inside a loop and runs it eagerly: the loop then
    runs as written. (The fold helper asked from that eager frame would itself be traced by Dynamo as
    a frame of its own and say "fold": the folded branch then ran one expert, eagerly.)"""
    torch.manual_seed(7)
    model = TwoLayers(ListLayer, make=lambda e: BreakingExpert(D, FF)).double()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="grouped")
    with torch.no_grad():
        for x in _batches(3, seed=8):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)
    assert cgbackend.stats(compiled)["replays"] >= 1  # the experts' own frames are compiled and captured


def _inputs_and_checks(monkeypatch) -> list[tuple[int, int]]:
    """Per graph that reaches static dispatch: (graph inputs, layout checks the pass registered)."""
    seen: list[tuple[int, int]] = []
    real = pipeline.rewrite_static_dispatch

    def counting(gm, mode, loops=()):
        result = real(gm, mode, loops)
        seen.append((sum(1 for n in gm.graph.nodes if n.op == "placeholder"), len(result.layout_checks)))
        return result
    monkeypatch.setattr(pipeline, "rewrite_static_dispatch", counting)
    return seen


@pytest.mark.skipif(not fold.first_only(), reason="this torch keeps no real value of a graph input")
@pytest.mark.parametrize("regional", [0, 2], ids=["whole", "per-layer"])
def test_inference_takes_expert_0s_parameters_and_checks_the_block_each_call(monkeypatch, regional):
    """Without gradients the graph takes each expert parameter of expert 0 only (3 per layer, not
    3 x E) and reads the others from its block; a parameter's data or object replaced after the
    compile is seen at the next call (laid out as one block again, logged), and results stay eager's,
    also where one compiled layer serves both layers (regional compilation: the check follows the
    layer whose parameters the call gets). With gradients every expert's parameter is an input
    (autograd accumulates each one's gradient)."""
    torch.manual_seed(8)
    model = TwoLayers().double()
    seen = _inputs_and_checks(monkeypatch)
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="grouped",
                                 regional_min_layers=regional)
    xs = _batches(6, seed=9)
    with torch.no_grad(), records_of("cgbackend.moe.expert_layout") as logged:
        for x in xs[:2]:
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)
        # x, and per layer: the gate, and expert 0's w1, w2, w3 (one layer's graph when regional)
        assert seen == ([(1 + 2 * (1 + 3), 2 * 3)] if not regional else [(1 + 1 + 3, 3)]), seen
        expert = model.layers[0].experts[3]
        expert.w2.weight.data = torch.randn_like(expert.w2.weight)  # .data replaced
        torch.testing.assert_close(compiled(xs[2]), model(xs[2]), rtol=1e-10, atol=1e-10)
        model.layers[1].experts[2].w1.weight = nn.Parameter(torch.randn_like(expert.w1.weight))  # object replaced
        torch.testing.assert_close(compiled(xs[3]), model(xs[3]), rtol=1e-10, atol=1e-10)
        model.layers[1].experts[0].w3.weight.data = torch.randn_like(expert.w3.weight)  # expert 0's own
        torch.testing.assert_close(compiled(xs[4]), model(xs[4]), rtol=1e-10, atol=1e-10)
    assert sum("no longer one block" in r.getMessage() for r in logged) == 3
    assert len(seen) == 1  # no new trace: the checks caught every change
    # Expert 3's .data is checked after the launch (the call ran again); the replaced object (a
    # registration) and expert 0's own .data (the address the graph reads the block from) before.
    assert cgbackend.stats(compiled)["layout_reruns"] == 1
    with torch.no_grad():
        model.layers[0].experts[1].w1.weight = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="no longer share one shape"):
            compiled(xs[5])
    if regional:
        return
    seen.clear()
    _check(TwoLayers().double(), train=True)
    assert seen and all(inputs == 1 + 2 * (1 + 3 * E) and checks == 0 for inputs, checks in seen), seen


class CountingLayers(TwoLayers):
    """A graph that writes one of its inputs (a buffer counting calls): running it twice would count
    twice, so its layout checks are made before the launch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return super().forward(x) * self.calls


@pytest.mark.skipif(not fold.first_only(), reason="this torch keeps no real value of a graph input")
def test_a_graph_that_writes_an_input_checks_the_block_before_it_runs(monkeypatch):
    torch.manual_seed(12)
    seen = _inputs_and_checks(monkeypatch)
    model = CountingLayers().double()
    twin = CountingLayers().double()
    twin.load_state_dict(model.state_dict())
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="grouped")
    xs = _batches(4, seed=13)
    with torch.no_grad():
        for i, x in enumerate(xs):
            if i == 2:
                for m in (model, twin):
                    m.layers[1].experts[2].w2.weight.data = torch.full_like(m.layers[1].experts[2].w2.weight, 0.25)
            torch.testing.assert_close(compiled(x), twin(x), rtol=1e-10, atol=1e-10)
    assert model.calls.item() == twin.calls.item() == len(xs)
    assert seen and all(checks == 2 * 3 for _, checks in seen), seen  # folded: the block is checked
    st = cgbackend.stats(compiled)
    assert st["layout_reruns"] == 0 and st["replays"] >= 1, st


def test_explain_folds_an_inference_trace_as_compile_does():
    """explain moves no parameter: its inference trace hands over every expert's parameters (the
    block path is for experts cgbackend.compile laid out as one block) and still folds."""
    torch.manual_seed(10)
    model = TwoLayers().double()
    with torch.no_grad():
        report = cgbackend.explain(model, _batches(1, seed=11)[0], options={"static_dispatch": "grouped"})
    assert [r["fold"] for r in report.loop_rewrites] == ["folded"], report.loop_rewrites
    assert (report.summary["static_regions"], report.summary["dynamic_regions"]) == (1, 0)


@pytest.mark.skipif(not fold.first_only(), reason="this torch keeps no real value of a graph input")
def test_the_graph_inductor_gets_from_an_inference_fold_is_cacheable(monkeypatch):
    """Every node of the region that Inductor compiles passes AOTAutograd's cache check, the block's
    rows included (a node without Dynamo's fake value made the cache bypass it: a second process
    compiled every layer again). Inductor itself is not run: the spy hands the module back."""
    refusals = autograd_cache_check()
    if refusals is None:
        pytest.skip("this torch has no AOTAutograd cache check")
    import torch._inductor.compile_fx as cfx
    refused, rows = [], []

    def spy(gm, example_inputs, **kw):
        refused.extend(refusals(gm.graph.nodes))
        rows.extend(n.name for n in gm.graph.nodes if n.op == "placeholder" and n.meta.get("cgb_row"))
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", spy)
    torch.manual_seed(12)
    model = TwoLayers().double()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="grouped",
                                 inner="inductor")
    with torch.no_grad():
        for x in _batches(3, seed=13):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)
    assert rows and not refused, (rows, refused)
    assert cgbackend.stats(compiled)["inner_compiled"] >= 1


@pytest.mark.skipif(not fold.first_only(), reason="this torch keeps no real value of a graph input")
def test_an_inference_fold_guards_expert_0_only_and_a_list_that_lost_an_expert_fails_as_eager(monkeypatch):
    """Dynamo indexing a ModuleList guards every module in it, and guards run before every call:
    the traced iteration picks its expert by the list's key, so an inference trace's guards name
    expert 0 of each list and no other expert. A list that lost an expert still sends the call back
    to Dynamo, which then meets what eager code meets: an index past the list's end."""
    torch.manual_seed(14)
    model = TwoLayers().double()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="grouped")
    xs = _batches(3, seed=15)
    torch._logging.set_logs(guards=True)
    try:
        with torch.no_grad(), records_of("torch._dynamo.guards.__guards") as logged:
            for x in xs[:2]:
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-10, atol=1e-10)
    finally:
        torch._logging.set_logs()
    guards = "\n".join(r.getMessage() for r in logged)
    if "_modules['experts']" not in guards:
        pytest.skip("this torch logs no guard tree")
    assert "_modules['experts']._modules['0']" in guards
    assert not any(f"_modules['experts']._modules['{e}']" in guards for e in range(1, E)), guards
    del model.layers[1].experts[E - 1]
    with torch.no_grad():
        with pytest.raises(IndexError):
            model(xs[2])
        with pytest.raises(IndexError):
            compiled(xs[2])


class ReversedList(nn.ModuleList):
    """A list that indexes its experts from the end: the loop's ``self.experts[e]`` means that."""

    def __getitem__(self, idx):
        return super().__getitem__(len(self) - 1 - idx)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_an_expert_list_with_an_indexing_of_its_own_is_indexed_as_written(train):
    torch.manual_seed(16)
    model = TwoLayers().double()
    for layer in model.layers:
        layer.experts = ReversedList(list(layer.experts))
    report = _check(model, train=train)
    assert all("orders its experts in a way of its own" in loop["fold"] for loop in report.loop_rewrites)
