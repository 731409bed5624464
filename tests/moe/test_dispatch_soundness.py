"""Static dispatch is sound: each loop form below is user code whose meaning a careless rewrite
changes. Every case either equals eager (outputs and every gradient, float64, simulated graphs) or
is left as written with its reason in the report's loop records.

Routing is skewed so that some experts receive no token: that is where skipping an expert and
running it on zero rows differ."""

from __future__ import annotations

import copy
import time
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.models.layers import Expert
from moe_helpers import RoutedExperts, SqrtExpert

D, FF, E, K = 8, 12, 4, 2
ROUTED = [1, 3]
"""The experts every token goes to (``_skewed``); experts 0 and 2 receive none."""


class _MoE(RoutedExperts):
    def __init__(self, n_experts: int = E, top_k: int = K) -> None:
        super().__init__(D, FF, n_experts, top_k)


# ----------------------------------------------------------------------------- the user code

class CountsActiveExperts(_MoE):
    """Counting active experts: ``n += 1`` per expert that ran, then ``out / n``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        counts = torch.bincount(ind.flatten(), minlength=self.n_experts).tolist()
        out = torch.zeros_like(h)
        n = 0
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ind == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
            n += 1
        return (out / n).reshape(x.shape)


class CollectsPerExpert(_MoE):
    """Collecting a value per expert that ran: ``used.append(...)``, then ``torch.stack(used)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        used = []
        mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            slot, tok = torch.where(mask[e])
            y = self.experts[e](h[tok]) * w[tok, slot, None]
            out.index_add_(0, tok, y)
            used.append(y.pow(2).mean())
        return out.reshape(x.shape) + torch.stack(used).mean()


class AuxPerExpert(_MoE):
    """An auxiliary term accumulated over the experts that ran: ``aux = aux + ...``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        counts = torch.bincount(ind.flatten(), minlength=self.n_experts).tolist()
        out = torch.zeros_like(h)
        aux = h.new_zeros(())
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ind == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
            aux = aux + self.experts[e].w1.weight.pow(2).mean()
        return out.reshape(x.shape) + aux


class IdsRebound(_MoE):
    """The ids are counted, then rebound, then compared in the loop: the counts are not theirs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        counts = torch.bincount(ind.flatten(), minlength=self.n_experts).tolist()
        ind = (ind + 1) % self.n_experts
        out = torch.zeros_like(h)
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ind == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class ReadsAccumulator(_MoE):
    """Each expert reads the tensor the experts accumulate into: expert e sees earlier experts' rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, ind = self.route(x.reshape(-1, D))
        h = x.reshape(-1, D).clone()
        for e in range(self.n_experts):
            tok, slot = torch.where(ind == e)
            h.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return h.reshape(x.shape)


class SignRouted(nn.Module):
    """Tokens with a positive first feature go to the sqrt expert (1), the others to a SwiGLU (0)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, 2, bias=False)
        self.experts = nn.ModuleList([Expert(D, FF), SqrtExpert(D)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        ind = (h[:, :1] > 0).long()
        w = F.softmax(self.gate(h), -1).gather(1, ind)
        out = torch.zeros_like(h)
        for e in range(2):
            tok, slot = torch.where(ind == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class ScaledPerExpert(_MoE):
    """A per-expert scale over the expert's rows (``amax()``): not row-independent, so the graph
    rewrite leaves it dynamic; an expert without tokens must still be skipped."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        counts = torch.bincount(ind.flatten(), minlength=self.n_experts).tolist()
        out = torch.zeros_like(h)
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ind == e)
            y = self.experts[e](h[tok])
            scale = y.abs().amax()
            out.index_add_(0, tok, y / scale * w[tok, slot, None])
        return out.reshape(x.shape)


class ItemOfId(_MoE):
    """``e = e[0]`` keeps the expert id a tensor, and the body calls ``e.item()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            e = e[0]
            slot, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e.item()](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class HitLoop(_MoE):
    """transformers' eager loop over the experts that received tokens; the rewrite is sound."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        out = torch.zeros_like(h)
        with torch.no_grad():
            mask = F.one_hot(ind, num_classes=self.n_experts).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = e[0]
            slot, tok = torch.where(mask[e])
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


class CountsWeightedIds(_MoE):
    """Counts only the valid tokens (``weights=valid``) and skips experts that no valid token
    reached: an expert only padding reached is skipped, and the padding rows stay zero."""

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, D)
        w, ind = self.route(h)
        counts = torch.bincount(ind.flatten(), weights=valid.repeat_interleave(K), minlength=self.n_experts).tolist()
        out = torch.zeros_like(h)
        for e in range(self.n_experts):
            if counts[e] == 0:
                continue
            tok, slot = torch.where(ind == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])
        return out.reshape(x.shape)


# ----------------------------------------------------------------------------- helpers

def _skewed(model: nn.Module) -> None:
    """Every token to experts ROUTED (input feature 0 is large, see _batches)."""
    with torch.no_grad():
        model.gate.weight[:, 0] = 0.0
        for rank, e in enumerate(ROUTED):
            model.gate.weight[e, 0] = 50.0 - 10.0 * rank


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(2, 5, D, generator=g, dtype=torch.float64) for _ in range(n)]
    for x in xs:
        x[..., 0] = 4.0
    return xs


def _model(cls: type, skewed: bool = True) -> nn.Module:
    torch.manual_seed(0)
    model = cls().double()
    if skewed:
        _skewed(model)
    return model


def _grads(model: nn.Module) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def _assert_same(model: nn.Module, xs: list[torch.Tensor], none_as_zero: bool = False, **options) -> dict:
    """Outputs, input gradients and every parameter gradient equal eager's (a parameter eager
    leaves None is exactly zero instead where ``none_as_zero``)."""
    ref = copy.deepcopy(model)
    options = {"simulate_graphs": True, "warmup": 1, "inner": "eager", "static_dispatch": "masked_dense",
               **options}
    compiled = cgbackend.compile(model, **options)
    for x in xs:
        xr, xc = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        out_r, out_c = ref(xr), compiled(xc)
        torch.testing.assert_close(out_c, out_r, rtol=1e-9, atol=1e-9)
        g = torch.randn_like(out_r)
        out_r.backward(g)
        out_c.backward(g)
        torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-9, atol=1e-9)
        mine = _grads(model)
        for name, a in _grads(ref).items():
            b = mine[name]
            if a is None and none_as_zero and name.startswith("experts."):
                assert b is not None and torch.count_nonzero(b) == 0, name
                continue
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9, msg=name)
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return {"stats": cgbackend.stats(compiled), "report": cgbackend.report(compiled), "compiled": compiled}


def _left_as_written(result: dict, *words: str) -> dict:
    loops = result["report"].loop_rewrites
    assert len(loops) == 1 and loops[0]["form"] == "", loops
    assert all(w in loops[0]["reason"] for w in words), loops[0]["reason"]
    return loops[0]


# ----------------------------------------------------------------------------- the cases

def test_counter_of_active_experts_leaves_the_loop_as_written():
    result = _assert_same(_model(CountsActiveExperts), _batches(2))
    _left_as_written(result, "n", "before the loop")


def test_values_appended_per_expert_leave_the_loop_as_written():
    result = _assert_same(_model(CollectsPerExpert), _batches(2))
    _left_as_written(result, "used.append")


def test_auxiliary_term_accumulated_per_expert_leaves_the_loop_as_written():
    result = _assert_same(_model(AuxPerExpert), _batches(2))
    _left_as_written(result, "aux", "before the loop")


def test_ids_rebound_between_count_and_loop_leave_the_loop_as_written():
    result = _assert_same(_model(IdsRebound), _batches(2))
    _left_as_written(result, "ind", "between")


def test_expert_reading_the_accumulator_takes_masked_dense_not_grouped():
    result = _assert_same(_model(ReadsAccumulator, skewed=False), _batches(3), static_dispatch="grouped")
    rewrites = [r for g in result["report"].graphs for r in g.dispatch["rewrites"]]
    assert len(rewrites) == E and {r["form"] for r in rewrites} == {"masked_dense"}, rewrites
    assert all("read the tensor they accumulate into" in r["why"] for r in rewrites), rewrites


def test_masked_dense_gradients_of_unrouted_non_finite_rows_are_zero():
    torch.manual_seed(0)
    model = SignRouted().double()
    g = torch.Generator().manual_seed(3)
    xs = []
    for _ in range(3):
        x = torch.randn(2, 6, D, generator=g, dtype=torch.float64).abs() + 0.1
        x[:, ::2] = -5.0  # half the tokens: not finite under the sqrt expert, routed to the other
        xs.append(x)
    result = _assert_same(model, xs)
    assert {r["form"] for g in result["report"].graphs for r in g.dispatch["rewrites"]} == {"masked_dense"}


def test_graph_rewrite_declining_a_rewritten_loop_keeps_its_skip():
    result = _assert_same(_model(ScaledPerExpert), _batches(3))
    loops = result["report"].loop_rewrites
    assert [(r["form"], r["kept_skips"]) for r in loops] == [("count_skip", E)], loops
    skipped = [s for g in result["report"].graphs for s in g.dispatch["skipped"]]
    assert len(skipped) == E and all(s["loop"] == loops[0]["source"] for s in skipped), skipped
    assert all("row-independent" in s["reason"] for s in skipped), skipped
    assert result["stats"]["trace_fallbacks"] == 0 and result["report"].graph_breaks == []


def test_expert_id_used_as_a_tensor_leaves_the_loop_as_written():
    result = _assert_same(_model(ItemOfId), _batches(2))
    _left_as_written(result, "e.item()")


def test_compiling_leaves_the_users_modules_as_they_are():
    model = _model(HitLoop)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch="masked_dense", simulate_graphs=True, warmup=1,
                                 inner="eager")

    def untouched() -> None:
        for m in model.modules():
            assert "forward" not in m.__dict__, type(m).__name__
            assert m.forward.__func__ is type(m).forward, type(m).__name__

    untouched()
    for x in _batches(3):
        torch.testing.assert_close(compiled(x), ref(x))
        untouched()
        torch.testing.assert_close(model(x), ref(x))  # the user's own code, uncompiled
    report = cgbackend.report(compiled)
    assert [r["form"] for r in report.loop_rewrites] == ["hit_loop"]
    assert report.summary["dynamic_regions"] == 0 and report.graph_breaks == []
    assert len(report.graphs) == 1  # the same bound methods every call: Dynamo's guards held
    with pytest.raises(RuntimeError):
        compiled(torch.randn(2, 5, D + 1, dtype=torch.float64))
    untouched()


def test_rewritten_forwards_cost_microseconds_per_call():
    """Putting the rewritten forwards on the modules for a call and taking them off again."""
    from cgbackend.config import DispatchMode
    from cgbackend.moe.loop_forwards import LoopForwards
    model = nn.Sequential(*(HitLoop() for _ in range(48)))
    forwards = LoopForwards(model, DispatchMode.MASKED_DENSE)
    assert bool(forwards) and all("forward" not in m.__dict__ for m in model.modules())
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            forwards.call(time.perf_counter)
        best = min(best, (time.perf_counter() - start) / 200)
    assert best < 100e-6, f"{best * 1e6:.1f} us per call for 48 modules"  # about 12 us on a 2-core CI machine
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_experts_without_tokens_get_zero_gradients_with_one_warning():
    model = _model(HitLoop)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = _assert_same(model, _batches(3), none_as_zero=True)
    zero = [w for w in seen if "no token" in str(w.message)]
    assert len(zero) == 1, [str(w.message) for w in seen]
    assert result["report"].summary["unrouted_expert_grads"] == "zero"
    assert "zero gradient" in result["report"].to_text()


def test_weighted_counts_keep_the_skip():
    """Padding (valid = 0) routed to experts 0 and 2, which no valid token reaches: eager skips
    them and leaves the padding rows at zero."""
    model = _model(CountsWeightedIds)
    with torch.no_grad():
        model.gate.weight[0, 1], model.gate.weight[2, 1] = 50.0, 40.0
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, inner="eager", static_dispatch="masked_dense")
    valid = torch.ones(10, dtype=torch.float64)
    valid[8:] = 0.0
    for x in _batches(3):
        x[1, 3:, 0], x[1, 3:, 1] = 0.0, 4.0  # the last two tokens: padding, routed by feature 1
        torch.testing.assert_close(compiled(x, valid), ref(x, valid), rtol=1e-9, atol=1e-9)
    _left_as_written({"report": cgbackend.report(compiled)}, "weights=", "zero count")


def _dbrx_experts():
    transformers = pytest.importorskip("transformers")
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN
    config = transformers.DbrxConfig(d_model=D, n_heads=2, n_layers=1, max_seq_len=32, vocab_size=32,
                                     attn_config={"kv_n_heads": 1},
                                     ffn_config={"ffn_hidden_size": FF, "moe_num_experts": E, "moe_top_k": K})
    torch.manual_seed(0)
    ffn = DbrxFFN(config).double()
    for p in ffn.parameters():
        nn.init.normal_(p, std=0.2)
    return ffn


@pytest.mark.parametrize("training", [False, True], ids=["infer", "train"])
def test_hit_loop_over_a_mask_wider_than_the_experts(training):
    """transformers' DBRX: ``one_hot(ids, num_experts + 1)``, so the hit test has a class no expert
    answers to; the traced loop runs over the experts only (one more id would index the expert
    weights past their end)."""
    ffn = _dbrx_experts().train(training)
    ref = copy.deepcopy(ffn)
    compiled = cgbackend.compile(ffn, simulate_graphs=True, warmup=1, inner="eager")
    for x in _batches(3):
        xr, xc = x.clone().requires_grad_(training), x.clone().requires_grad_(training)
        out_c, out_r = compiled(xc), ref(xr)
        torch.testing.assert_close(out_c, out_r, rtol=1e-9, atol=1e-9)
        if training:
            out_c.pow(2).sum().backward()
            out_r.pow(2).sum().backward()
            torch.testing.assert_close(xc.grad, xr.grad, rtol=1e-9, atol=1e-9)
            for (name, p), q in zip(ffn.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-9, msg=name)
                p.grad = q.grad = None
    report = cgbackend.report(compiled)
    assert [r["form"] for r in report.loop_rewrites] == ["hit_loop"], report.loop_rewrites
    rewrites = [r for g in report.graphs for r in g.dispatch["rewrites"]]
    assert len(rewrites) == E, rewrites  # one unit per expert, none for the extra class
    assert cgbackend.stats(compiled)["trace_fallbacks"] == 0


# ----------------------------------------------------------------------------- the proof, case by case

_HEAD = """def forward(self, x):
    h = x.reshape(-1, 8)
    w, ind = self.route(h)
    out = torch.zeros_like(h)
    counts = torch.bincount(ind.flatten(), minlength=4).tolist()
"""
_LOOP = """    for e in range(4):
        if counts[e] == 0:
            continue
        tok, slot = torch.where(ind == e)
"""

PROOF_CASES = {
    # name: (code before the loop, loop body after the selection, code after the loop, rewritten?)
    "accumulate": ("", "out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, slot, None])", "", True),
    "temporaries": ("", "y = self.experts[e](h[tok])\n        y = y * w[tok, slot, None]\n"
                    "        out[tok] += y", "", True),
    "fresh list": ("", "parts = []\n        parts.append(h[tok])\n        out.index_add_(0, tok, parts[0])", "", True),
    "two loops, own temporaries": ("", "y = h[tok]\n        out.index_add_(0, tok, y)",
                                   "for e in range(2):\n        y = out[e]\n        out[e] = y * 2", True),
    "selection rebound": ("", "tok = torch.arange(h.shape[0])\n        out.index_add_(0, tok, h[tok])", "", False),
    "write not indexed": ("", "out.add_(h[tok].sum())", "", False),
    "attribute": ("", "self.last = e", "", False),
    "print": ("", "print(e)", "", False),
    "break": ("", "out.index_add_(0, tok, h[tok])\n        break", "", False),
    "global": ("", "global G\n        G = e", "", False),
    "loop variable after": ("", "out.index_add_(0, tok, h[tok])", "out = out * e", False),
    "temporary after": ("", "y = h[tok]\n        out.index_add_(0, tok, y)", "out = out + y.sum()", False),
    "conditional binding": ("", "if e > 1:\n            y = h[tok]\n        out.index_add_(0, tok, y)", "", False),
    "ids written": ("", "ind.index_fill_(0, tok, 0)", "", False),
    "ids mutated before": ("    ind.add_(0)\n", "out.index_add_(0, tok, h[tok])", "", False),
    "counts in a branch": (None, "out.index_add_(0, tok, h[tok])", "", False),
}


@pytest.mark.parametrize("name", list(PROOF_CASES))
def test_proof_of_the_loop_body(name):
    import linecache
    from cgbackend.moe.source_rewrite import rewrite_function
    before, body, after, sound = PROOF_CASES[name]
    head = _HEAD if before is not None else _HEAD.replace("    counts = ", "    if x.numel():\n        counts = ")
    text = head + (before or "") + _LOOP + f"        {body}\n" + (f"    {after}\n" if after else "") + "    return out\n"
    filename = f"<cgbackend-proof-{name}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"torch": torch}
    exec(compile(text, filename, "exec"), namespace)
    new, records = rewrite_function(namespace["forward"])
    assert len(records) == 1 and bool(records[0].form) == sound, (records, text)
    assert records[0].form or records[0].reason


@pytest.mark.parametrize("count, sound", [
    ("torch.bincount(ind.flatten(), minlength=4)", True),
    ("torch.bincount(ind.flatten(), None, 4)", True),
    ("ind.flatten().bincount(minlength=4)", True),
    ("torch.bincount(ind.flatten(), torch.ones(8), 4)", False),
    ("torch.bincount(ind.flatten(), weights=torch.ones(8), minlength=4)", False),
    ("ind.flatten().bincount(torch.ones(8))", False),
])
def test_proof_reads_the_counts_weights_by_bincounts_signature(count, sound):
    import linecache
    from cgbackend.moe.source_rewrite import rewrite_function
    text = (_HEAD.replace("torch.bincount(ind.flatten(), minlength=4)", count) + _LOOP
            + "        out.index_add_(0, tok, h[tok])\n    return out\n")
    filename = f"<cgbackend-proof-{count}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"torch": torch}
    exec(compile(text, filename, "exec"), namespace)
    new, records = rewrite_function(namespace["forward"])
    assert len(records) == 1 and bool(records[0].form) == sound, (records, text)
    assert sound or "weights=" in records[0].reason, records[0].reason
