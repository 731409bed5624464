"""Dynamic shapes on the GPU: padded (bucketed) captures, symbol-keyed captures, the LRU graph
cache with real CUDA graphs and one shared pool, and training with a dynamic batch (exact keys)."""

from __future__ import annotations

import random

import pytest
import torch

import cgbackend
from cgbackend.config import Config
from cgbackend.models import build_model
from cuda_utils import assert_matches, lm_loss

pytestmark = pytest.mark.cuda

DTYPES = [torch.float32, torch.bfloat16]


def _tokens(model, n, seq, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.tok_emb.num_embeddings, (n, seq), generator=g).cuda()


def _bucket(n, ladder=Config().capture_sizes):
    return next(b for b in ladder if b >= n)


def _check_calls(compiled, model, sizes, seq, dtype, seed):
    """Call ``compiled`` with a batch of each size (fresh tokens); every output matches eager, and
    still does after all later calls (no replay overwrote one handed out earlier)."""
    kept = []
    with torch.no_grad():
        for i, n in enumerate(sizes):
            x = _tokens(model, n, seq, seed=seed + i)
            out, ref = compiled(x), model(x)
            assert_matches(out, ref, dtype, f"call {i} (batch {n})")
            kept.append((out, ref))
    for i, (out, ref) in enumerate(kept):
        assert_matches(out, ref, dtype, f"call {i} re-checked")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["dense", "moe"])
def test_serving_loop_on_gpu(name, dtype):
    """60 calls, batch 1..40 drawn at random: every output matches eager (and still does after all
    later replays); graphs stay within (capture sizes hit) x (static regions); nothing but warm-up
    runs eagerly."""
    model = build_model(name, size="small", device="cuda", dtype=dtype).eval()
    # the MoE dispatch as written: its dynamic regions between padded static ones (static
    # dispatch's one region per layer is keyed on exact sizes, not padded)
    compiled = cgbackend.compile(model, warmup=1, static_dispatch="off")
    rng = random.Random(3)
    sizes = [rng.randint(1, 40) for _ in range(60)]
    _check_calls(compiled, model, sizes, 32, dtype, seed=0)
    st = cgbackend.stats(compiled)
    hit = {_bucket(n) for n in sizes}
    assert st["graphs_captured"] <= len(hit) * st["static_regions"]
    assert set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]
    assert st["graphs_evicted"] == 0 and not st["capture_failures"]
    report = cgbackend.report(compiled)
    assert report.summary["bucketed_regions"] >= 1
    padded = [r for g in report.graphs for r in g.runtime["regions"].values() if r["bucketed"]]
    assert padded and all(r["graphs"] <= len(hit) for r in padded)


def test_lru_eviction_with_real_graphs_keeps_results_right():
    model = build_model("moe", size="small", device="cuda").eval()
    compiled = cgbackend.compile(model, warmup=1, capture_sizes=(), max_graphs_per_region=2)
    _check_calls(compiled, model, [3, 5, 7, 3, 5, 7, 9, 3, 9, 5, 7, 3], 16, torch.float32, seed=100)
    st = cgbackend.stats(compiled)
    assert st["graphs_evicted"] > 0
    runtime = [r for g in cgbackend.report(compiled).graphs for r in g.runtime["regions"].values()]
    assert all(r["held"] <= 2 for r in runtime)
    assert "graph_limit" not in st["eager_calls"] and not st["capture_failures"]


def test_training_with_a_dynamic_batch_matches_eager():
    """Training calls are never padded (their saved activations have the exact size): graphs keyed
    on the exact batch; loss and every gradient match eager."""
    torch.manual_seed(0)
    model = build_model("dense", size="tiny", device="cuda").train()
    ref_model = build_model("dense", size="tiny", device="cuda").train()
    ref_model.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=cgbackend.backend(warmup=1))
    for i, n in enumerate([3, 5, 3, 5, 6, 3, 5, 6]):
        x = _tokens(model, n, 16, seed=200 + i)
        torch._dynamo.mark_dynamic(x, 0)
        loss = lm_loss(compiled(x), x)
        ref = lm_loss(ref_model(x), x)
        loss.backward()
        ref.backward()
        assert_matches(loss.detach(), ref.detach(), torch.float32, f"loss {i}")
        for (pn, p), q in zip(model.named_parameters(), ref_model.parameters()):
            assert_matches(p.grad, q.grad, torch.float32, f"grad {pn} step {i}")
        for m in (model, ref_model):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 1e-2 * p.grad
            m.zero_grad(set_to_none=True)
    st = cgbackend.stats(compiled)
    assert st["bwd_graphs"] >= 3 and st["replays"] > 0


def test_expert_graphs_after_graph_breaks_stay_bounded():
    """torch.compile(backend="cgbackend") without dynamic-output capture: Dynamo breaks at each
    expert's where(), and the expert graph sees a new row count every call. Its graph cache must
    not churn without bound: at most max_graphs_per_region graphs held for each expert whose
    parameters the graph serves (runtime/sharing.py), evictions capped, the rest eager with a
    counted reason; results stay right."""
    model = build_model("moe", size="small", device="cuda").eval()
    compiled = torch.compile(model, backend=cgbackend.backend(warmup=1, max_graphs_per_region=4))
    with torch.no_grad():
        for i in range(12):
            x = _tokens(model, 2 + i % 5, 16, seed=300 + i)
            assert_matches(compiled(x), model(x), torch.float32, f"call {i}")
    st = cgbackend.stats(compiled)
    graphs = cgbackend.report(compiled).graphs
    runtime = [(r, g.runtime["layers_sharing"]) for g in graphs for r in g.runtime["regions"].values()]
    assert all(1 <= n <= 2 * 8 for _, n in runtime)  # at most every expert of the model's two layers
    assert all(r["held"] <= 4 * n and r["evicted"] <= 2 * 4 * n for r, n in runtime)
    assert st["graphs_evicted"] <= sum(2 * 4 * n for _, n in runtime)


def test_inductor_inner_pads_too():
    """inner="inductor": the region's code is compiled once for the symbolic batch and replayed at
    the padded sizes; outputs match eager, one graph per capture size hit."""
    model = build_model("dense", size="small", device="cuda", dtype=torch.bfloat16).eval()
    compiled = cgbackend.compile(model, warmup=1, inner="inductor")
    sizes = [3, 7, 12, 30, 5, 9, 17, 3, 30, 12, 7, 17, 9, 5]
    _check_calls(compiled, model, sizes, 32, torch.bfloat16, seed=400)
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] <= len({_bucket(n) for n in sizes}) * st["static_regions"]
    assert set(st["eager_calls"]) == {"warmup"} and not st["capture_failures"]
    assert cgbackend.report(compiled).summary["bucketed_regions"] >= 1
