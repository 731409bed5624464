"""Dynamic shapes: which regions may pad a symbolic size (passes/bucket.py), padded captures and
their counters (simulated graphs on CPU), graphs keyed on the symbols a region depends on, the
least-recently-used graph cache, and the report. GPU runs of the same paths: test_cuda_dynamic.py."""

from __future__ import annotations

import collections
import random
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.passes.pipeline import analyze
from cgbackend.config import Config
from cgbackend.models import build_model
from fx_helpers import trace

SIM = dict(simulate_graphs=True, warmup=1)
SIZES = (2, 4, 8, 16, 32)


def _plans(fn, *args, dims=((0, 0),), config=None):
    """{symbol: SymbolBucketing} of the one static region of ``fn`` with the given (arg, dim) dynamic."""
    for a, d in dims:
        torch._dynamo.mark_dynamic(args[a], d)
    analysis = analyze(trace(fn, *args), config or Config(min_region_ops=1))
    (entry,) = analysis.buckets.regions.values()
    return entry


W = torch.randn(8, 8)


@pytest.mark.parametrize("fn", [
    lambda x: F.gelu(F.linear(x, W)),
    lambda x: F.layer_norm(x @ W, (8,)).softmax(-1),
    lambda x: (x.reshape(-1, 4) * 2).reshape(x.shape[0], 8) + torch.zeros(x.shape[0], 8),
    lambda x: (x @ W) * torch.arange(x.shape[0]).unsqueeze(1) + torch.ones(1, 8).expand(x.shape[0], 8),
], ids=["linear_gelu", "norm_softmax_last", "flatten_and_back_with_zeros", "arange_and_expand_of_size"])
def test_bucketable_regions(fn):
    entry = _plans(fn, torch.randn(6, 8))
    (b,) = entry.symbols.values()
    assert b.bucketable and b.padded, b.why
    assert entry.plan.outputs and entry.plan.pad_inputs


@pytest.mark.parametrize("fn,why", [
    (lambda x: F.softmax(x @ W, dim=0), "softmax runs along the row dimension"),
    (lambda x: (x @ W).sum(0) + 1, "reduces the row dimension"),
    (lambda x: torch.cumsum(x, 0) * 2, "cumsum runs along the row dimension"),
    (lambda x: (x @ W) / x.shape[0], "as a number"),
    (lambda x: (x @ W) * (x.shape[0] - torch.arange(x.shape[0])).unsqueeze(1), "as a number"),
    (lambda x: (x @ W).add_(1).relu_() if False else x.mul_(2).relu(), "writes one of its inputs"),
    (lambda x: (x @ W) / (x @ W).norm(2, 0, keepdim=True), "norm reduces the row dimension"),
    (lambda x: F.softmax((x @ W).unsqueeze(1)).squeeze(1), "softmax runs along the row dimension"),
    (lambda x: F.leaky_relu(x, 0.1, True) * 2, "writes one of its inputs"),
], ids=["softmax_dim0", "sum_dim0", "cumsum_dim0", "divide_by_size", "count_down_from_size", "in_place_input",
        "norm_p_then_dim0", "softmax_implied_dim0", "positional_inplace_flag"])
def test_not_bucketable_regions(fn, why):
    entry = _plans(fn, torch.randn(6, 8))
    (b,) = entry.symbols.values()
    assert not b.bucketable and why in b.why
    assert entry.plan is None


def test_attention_pads_the_batch_but_not_the_sequence():
    def attn(x):
        q = x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(x.shape)

    entry = _plans(attn, torch.randn(3, 5, 8), dims=((0, 0), (0, 1)))
    by_padded = {b.padded: b for b in entry.symbols.values()}
    assert by_padded[True].bucketable
    assert not by_padded[False].bucketable and by_padded[False].op  # names the op that mixes positions
    assert entry.plan.symbol == by_padded[True].symbol


def test_empty_capture_sizes_turn_bucketing_off():
    entry = _plans(lambda x: F.linear(x, W).relu(), torch.randn(6, 8),
                   config=Config(min_region_ops=1, capture_sizes=()))
    assert entry.plan is None and "capture_sizes=()" in next(iter(entry.symbols.values())).why


def _batches(name, model, sizes, seq=16, seed=0):
    rng = random.Random(seed)
    out = []
    for n in sizes:
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        out.append(torch.randint(0, model.tok_emb.num_embeddings, (n, seq), generator=g))
    return out


def _serve(name, sizes, **options):
    """The reference model served at the given batch sizes; the MoE with its dispatch as written
    (static_dispatch off): its dynamic regions sit between the bucketed static ones."""
    model = build_model(name).eval()
    compiled = cgbackend.compile(model, **{**SIM, "static_dispatch": "off", **options})
    kept = []
    with torch.no_grad():
        for x in _batches(name, model, sizes):
            torch._dynamo.mark_dynamic(x, 0)
            out, ref = compiled(x), model(x)
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            kept.append((out, ref))
    for out, ref in kept:  # no later replay overwrote an output handed out earlier
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    return compiled


def _bucket(n, ladder=Config().capture_sizes):
    return next(b for b in ladder if b >= n)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_serving_loop_pads_to_buckets(name):
    """Batch sizes 2..20 in random order: outputs equal eager, and each static region holds one
    graph per capture size hit, not one per batch size."""
    rng = random.Random(1)
    sizes = [rng.randint(2, 20) for _ in range(40)]
    compiled = _serve(name, sizes)
    st = cgbackend.stats(compiled)
    regions = st["static_regions"]
    calls = collections.Counter(_bucket(n) for n in sizes)
    captured = sum(1 for c in calls.values() if c >= 2)  # warmup=1: the second call captures
    assert len(set(sizes)) > len(calls) and captured >= 4
    assert st["graphs_captured"] == regions * captured
    assert st["eager_calls"] == {"warmup": regions * len(calls)}  # nothing else ran eagerly
    assert st["replays"] == regions * (len(sizes) - len(calls))
    runtime = cgbackend.report(compiled).graphs[0].runtime["regions"]
    assert all(r["bucketed"] for r in runtime.values())
    assert all(r["held"] == captured and r["evicted"] == 0 for r in runtime.values())


@pytest.mark.parametrize("name,form", [("moe", "grouped"), ("moe", "masked_dense"), ("moe_sort", "masked_dense")])
def test_moe_with_static_dispatch_is_one_bucketed_region(name, form):
    """The MoE layer in a static dispatch form (the grouped form sorts its (token, slot) pairs by
    expert; the masked-dense form reads each expert's first routed row for the tokens it masks
    out) is taken whole by the row proof (rowdep.ROW_BLOCK): the model is one static region,
    padded to the capture sizes, one graph per capture size hit; padding rows are routed, computed
    and dropped, and every output equals eager's at its own batch size. The sorted dispatch's
    masked-dense form is a block of its own; the Mixtral-style loop's units share one."""
    rng = random.Random(4)
    sizes = [rng.randint(2, 20) for _ in range(20)]
    compiled = _serve(name, sizes, static_dispatch=form)
    st = cgbackend.stats(compiled)
    calls = collections.Counter(_bucket(n) for n in sizes)
    captured = sum(1 for c in calls.values() if c >= 2)  # warmup=1: the second call captures
    assert len(set(sizes)) > len(calls) and captured >= 4
    assert (st["static_regions"], st["dynamic_regions"]) == (1, 0), st
    assert st["graphs_captured"] == captured and st["eager_calls"] == {"warmup": len(calls)}
    (graph,) = cgbackend.report(compiled).graphs
    assert {r["form"] for r in graph.dispatch["rewrites"]} == {form}
    runtime = graph.runtime["regions"]
    assert all(r["bucketed"] for r in runtime.values())


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["auto", "masked_dense"])
def test_moe_with_static_dispatch_is_bucketed_on_gpu(form):
    """The same on a GPU with CUDA graphs and Inductor's kernels (float32): one graph per capture
    size hit, each output, kept across calls of other sizes, equal to eager's."""
    torch.manual_seed(0)
    model = build_model("moe", device="cuda").eval()
    compiled = cgbackend.compile(model, warmup=1, static_dispatch=form)
    rng = random.Random(6)
    sizes = [rng.randint(2, 20) for _ in range(16)]
    kept = []
    with torch.no_grad():
        for x in _batches("moe", model, sizes):
            x = x.cuda()
            torch._dynamo.mark_dynamic(x, 0)
            kept.append((compiled(x), model(x)))
    for out, ref in kept:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    st = cgbackend.stats(compiled)
    calls = collections.Counter(_bucket(n) for n in sizes)
    assert st["graphs_captured"] == sum(1 for c in calls.values() if c >= 2), st
    assert st["eager_calls"] == {"warmup": len(calls)} and not st["capture_failures"], st
    assert cgbackend.report(compiled).summary["bucketed_regions"] == 1


def test_padded_moe_hands_padded_outputs_over_in_place():
    """Bucketed regions read the previous region's padded output where it lies: the only copies are
    the token ids (the user's input) once per replay of the first region."""
    sizes = [5, 6, 7, 5, 6, 7, 8]  # one bucket: a warm-up call, a capture, then 5 replays
    compiled = _serve("moe", sizes)
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == st["static_regions"]
    assert st["copied_by_kind"] == {"user_input": len(sizes) - 2}
    assert st["copies_avoided"] > 0


def test_sizes_above_the_largest_capture_size_are_captured_exactly():
    sizes = [3, 5, 6, 6, 5, 3]  # each size: a warm-up call, then a capture
    compiled = _serve("dense", sizes, capture_sizes=(4,))
    st = cgbackend.stats(compiled)
    # 3 pads to 4; 5 and 6 are above the ladder and get a graph each.
    assert st["graphs_captured"] == 3


def test_a_region_that_does_not_depend_on_the_changed_size_keeps_its_one_graph():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
            self.mid = nn.ReLU()  # kept eager (dynamic_modules): a dynamic region between the two
            self.b = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

        def forward(self, x, y):
            fixed = self.a(y)
            return self.b(self.mid(x) * 2), fixed

    model = TwoInputs().eval()
    compiled = cgbackend.compile(model, capture_sizes=(), dynamic_modules=("mid",), **SIM)
    y = torch.randn(4, 8)
    with torch.no_grad():
        for n in (3, 5, 7, 3, 5, 7, 9):
            x = torch.randn(n, 8)
            torch._dynamo.mark_dynamic(x, 0)
            out, ref = compiled(x, y), model(x, y)
            torch.testing.assert_close(out, ref)
    graph = cgbackend.report(compiled).graphs[-1]
    keyed = {r.id.split(".")[-1]: set(r.buckets) for r in graph.regions if r.kind == "static"}
    runtime = graph.runtime["regions"]
    graphs = {name.split(".")[-1]: r["graphs"] for name, r in runtime.items()}
    fixed_region = next(k for k, syms in keyed.items() if not syms)
    sized_region = next(k for k, syms in keyed.items() if syms)
    assert graphs[fixed_region] == 1
    assert graphs[sized_region] == 3  # 3, 5, 7 exactly (bucketing off); 9 came once: warm-up only


def test_lru_cache_evicts_and_keep_falls_back_with_reason():
    sizes = [3, 5, 7, 3, 5, 7, 3]
    compiled = _serve("dense", sizes, capture_sizes=(), max_graphs_per_region=2)
    st = cgbackend.stats(compiled)
    assert st["graphs_evicted"] >= 1
    runtime = next(iter(cgbackend.report(compiled).graphs[0].runtime["regions"].values()))
    assert runtime["held"] == 2 and runtime["evicted"] == st["graphs_evicted"]
    assert "graph_limit" not in st["eager_calls"]

    compiled = _serve("dense", sizes, capture_sizes=(), max_graphs_per_region=2, graph_cache="keep")
    st = cgbackend.stats(compiled)
    assert st["graphs_evicted"] == 0 and st["graphs_captured"] == 2
    assert st["eager_calls"]["graph_limit"] == 1  # the second call of size 7 (the first warmed up)
    text = str(cgbackend.report(compiled))
    assert "graph_limit" in text


def test_report_shows_keyed_symbols_and_why_not_bucketable():
    model = build_model("dense").eval()
    x = torch.randint(0, 128, (4, 16))
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    report = cgbackend.explain(model, x)
    text = str(report)
    assert "graphs keyed on:" in text and "padded to capture_sizes" in text
    assert "not bucketable" in text and re.search(r"\(\w+ at \w+\.py:\d+ in \w+\)", text)
    static = [r for g in report.graphs for r in g.regions if r.kind == "static"]
    buckets = [b for r in static for b in r.buckets.values()]
    assert any(b["padded"] for b in buckets) and any(not b["bucketable"] and b["source"] for b in buckets)
    assert report.summary["bucketed_regions"] >= 1
    assert '"buckets"' in report.to_json()


def test_a_cache_its_signatures_churn_through_stops_evicting():
    """Sizes cycling through more signatures than the bound: after 2 x bound evictions the region
    keeps its graphs and runs new signatures eagerly (reason graph_cache_thrashing), reported."""
    sizes = [3, 5, 7, 9, 11] * 4
    compiled = _serve("dense", sizes, capture_sizes=(), max_graphs_per_region=2)
    st = cgbackend.stats(compiled)
    assert st["graphs_evicted"] == 4
    assert st["eager_calls"]["graph_cache_thrashing"] > 0
    runtime = next(iter(cgbackend.report(compiled).graphs[0].runtime["regions"].values()))
    assert runtime["thrashing"] and runtime["held"] == 2
    assert "stopped evicting" in str(cgbackend.report(compiled))


def test_batch_padded_while_the_sequence_changes_exactly():
    """Both dimensions symbolic: the batch is padded, the sequence (attention over it) is keyed
    exactly; a new sequence length never reuses a buffer made for another."""
    model = build_model("dense").eval()
    compiled = cgbackend.compile(model, **SIM)
    calls = [(3, 16), (5, 16), (3, 24), (6, 24), (5, 16), (7, 24), (3, 20), (4, 20), (6, 16)]
    with torch.no_grad():
        for i, (n, t) in enumerate(calls):
            x = torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(i))
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    st = cgbackend.stats(compiled)
    assert st["replays"] > 0 and set(st["eager_calls"]) == {"warmup"}


def test_a_padded_input_is_keyed_on_its_other_sizes_too():
    """x [s0, s1, 8] through a row-wise MLP: s0 is padded, s1 exact. s1 reaches the region only as
    a size of x (no number input carries it), and a new s1 must still get its own graph."""
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for n, t in [(3, 4), (3, 4), (3, 5), (3, 5), (2, 5), (3, 4)]:
            x = torch.randn(n, t, 8)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), model(x))
    entry = next(iter(cgbackend.report(compiled).graphs[0].regions))
    assert sum(b["padded"] for b in entry.buckets.values()) == 1
    assert cgbackend.stats(compiled)["graphs_captured"] == 2  # (bucket 4, t=4) and (bucket 4, t=5)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_dynamic_true_pads_too(name):
    """compile(dynamic=True): every size symbolic from the first call (floats too: Dynamo passes
    float attributes as inputs, read back with .item() in an eager region). Batch and sequence vary;
    outputs match eager and the batch is still padded."""
    model = build_model(name).eval()
    compiled = cgbackend.compile(model, dynamic=True, **SIM)
    with torch.no_grad():
        for i, (n, t) in enumerate([(3, 16), (5, 16), (6, 16), (3, 16), (7, 24), (5, 24), (6, 24)]):
            x = torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(i))
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    st = cgbackend.stats(compiled)
    assert st["compiled_graphs"] == 1 and st["replays"] > 0
    assert set(st["eager_calls"]) == {"warmup"}
    assert cgbackend.report(compiled).summary["bucketed_regions"] >= 1


def test_sizes_above_max_capture_size_run_the_compiled_code_without_a_graph():
    """max_capture_size: a call above it runs without a capture (counted by its reason, also under
    strict), one at or below it pads to its capture size as before; outputs equal eager's."""
    sizes = [3, 3, 6, 6, 6, 5, 3, 9]  # capture sizes (4, 8): 3 -> 4 captured; 5, 6, 9 above 4
    compiled = _serve("dense", sizes, capture_sizes=(4, 8), max_capture_size=4, strict=True)
    st = cgbackend.stats(compiled)
    regions = st["static_regions"]
    assert st["graphs_captured"] == regions  # size 4 only
    assert st["eager_calls"] == {"warmup": regions, "above_max_capture_size": 5 * regions}
    assert st["captured_sizes"] == {4: 0}  # simulated graphs reserve nothing
    runtime = cgbackend.report(compiled).graphs[0].runtime["regions"]
    assert all(r["captured_sizes"] == [4] for r in runtime.values())
    assert "(sizes 4 captured)" in cgbackend.report(compiled).to_text()


def test_warm_up_captures_every_size_before_the_first_request():
    """cgbackend.warm_up runs each size until it is captured and says what each took; the requests
    after it replay those graphs only (no warm-up call, no capture), at sizes that pad to them."""
    model = build_model("dense").eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=2, capture_sizes=(2, 4, 8))
    vocab = model.tok_emb.num_embeddings
    gen = torch.Generator().manual_seed(3)

    def make(n):
        x = torch.randint(0, vocab, (n, 16), generator=gen)
        torch._dynamo.mark_dynamic(x, 0)
        return (x,)

    done = cgbackend.warm_up(compiled, make, sizes=[2, 4, 8])
    st = cgbackend.stats(compiled)
    regions = st["static_regions"]
    # largest first (the smaller sizes' graphs fit in the memory it leaves in the pool)
    assert [r["size"] for r in done.sizes] == [8, 4, 2] and all(r["graphs"] == regions for r in done.sizes)
    assert done.graphs == st["graphs_captured"] == 3 * regions and done.pool_bytes == 0
    assert sorted(st["captured_sizes"]) == [2, 4, 8]
    assert "warm-up: 3 sizes" in str(done)
    with torch.no_grad():
        for n in (7, 2, 3, 8):  # (size 1 is a graph of its own: Dynamo specializes sizes 0 and 1)
            (x,) = make(n)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    after = cgbackend.stats(compiled)
    assert after["graphs_captured"] == st["graphs_captured"] and after["eager_calls"] == st["eager_calls"]
    assert after["replays"] == st["replays"] + 4 * regions
    with pytest.raises(ValueError, match="positive integers"):
        cgbackend.warm_up(compiled, make, sizes=[0])
    with pytest.raises(TypeError, match="tuple of arguments"):
        cgbackend.warm_up(compiled, lambda n: make(n)[0], sizes=[2])
