"""GPU: inference through CUDA graphs matches eager, counters show capture once then replays."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.models import MODEL_NAMES, build_model, make_inputs

from cuda_utils import assert_matches

pytestmark = pytest.mark.cuda

WARMUP = 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_inference_matches_eager_and_replays(name, grad_mode, dtype):
    model = build_model(name, size="tiny", device="cuda", dtype=dtype).eval()
    inputs = make_inputs(name, model, n=8, device="cuda", dtype=dtype)
    # The item model orders rows by argsort of a bf16 score and refines the positive ones: Inductor's
    # roundings (bias added after the product, not in cuBLAS's epilogue) swap near-equal scores, which
    # moves whole rows. Its bf16 rows run eager's kernels (bitwise); fp32 checks it under Inductor.
    options = {"inner": "eager"} if name == "item" and dtype == torch.bfloat16 else {}
    compiled = cgbackend.compile(model, warmup=WARMUP, **options)
    ctx = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    kept = []
    with ctx():
        for i, x in enumerate(inputs):
            ref = model(x)
            out = compiled(x)
            assert_matches(out, ref, dtype, f"{name} call {i}")
            kept.append((out, ref.clone()))
            if i == WARMUP:
                after_capture = cgbackend.stats(compiled)
        for i, (out, ref) in enumerate(kept):  # outputs of earlier calls were not overwritten
            assert_matches(out, ref, dtype, f"{name} kept output {i}")
    st = cgbackend.stats(compiled)
    regions = st["static_regions"]
    assert regions >= 1
    # Every static region captured exactly once, at the first call after warm-up.
    assert after_capture["graphs_captured"] == regions
    assert st["graphs_captured"] == regions, st
    assert st["capture_failures"] == []
    assert st["replays"] == regions * (len(inputs) - WARMUP)
    assert st["eager_calls"] == {"warmup": regions * WARMUP}, st["eager_calls"]
    assert st["copied_by_kind"].get("param", 0) == 0
    # Every output is kept: the capturing call copies, two handout graphs hand theirs out, then
    # both are held and the region's own graph runs and copies (runtime/handout.py).
    assert st["handout_graphs"] == 2 and st["outputs_handed"] == 2, st
    assert st["output_clones"] == len(inputs) - WARMUP - 2


def test_handout_graphs_hand_outputs_over_and_never_overwrite_what_is_held():
    """On the GPU: outputs nobody keeps come from a handout graph without a copy; a view the caller
    keeps of one stays as it was through later calls; results match eager (bitwise: eager kernels)."""
    torch.manual_seed(0)
    model = build_model("dense", size="tiny", device="cuda").eval()
    inputs = make_inputs("dense", model, n=10, device="cuda")
    compiled = cgbackend.compile(model, warmup=1, inner="eager")
    with torch.no_grad():
        for x in inputs[:5]:
            out = compiled(x)
            assert torch.equal(out, model(x))
            del out
        st = cgbackend.stats(compiled)
        assert st["handout_graphs"] == 1 and st["handout_replays"] == 3 and st["output_clones"] == 1, st
        held = compiled(inputs[5])[1:, -3:]
        want = held.clone()
        previous = None
        for x in inputs[6:]:
            out = compiled(x)
            assert torch.equal(out, model(x))
            if previous is not None:
                assert out.untyped_storage().data_ptr() != previous.untyped_storage().data_ptr()
            previous = out
        torch.cuda.synchronize()
        assert torch.equal(held, want), "a replay overwrote a view the caller kept"
    st = cgbackend.stats(compiled)
    assert st["handout_graphs"] == 2 and st["output_clones"] == 1 + 2, st
    assert st["handout_failures"] == []


def test_capture_sizes_share_one_pool_with_the_last_regions_outputs_released():
    """Bucketed bf16 inference of the dense model, seven capture sizes warmed up (largest first):
    their graphs take at most 1.2x the pool of the largest size captured alone (the last region's
    outputs are released after each capture: runtime/loose_outputs.py), and results of every size,
    kept by the caller across calls of other sizes, match eager."""
    import gc
    model = build_model("dense", size="small", device="cuda", dtype=torch.bfloat16).eval()
    vocab = model.tok_emb.num_embeddings
    gen = torch.Generator(device="cuda").manual_seed(3)

    def make(n):
        x = torch.randint(0, vocab, (n, 64), device="cuda", generator=gen)
        torch._dynamo.mark_dynamic(x, 0)
        return (x,)

    sizes = [2, 4, 8, 12, 16, 20, 24]
    alone = cgbackend.warm_up(cgbackend.compile(model, warmup=1), make, sizes[-1:])
    torch._dynamo.reset()
    cgbackend.reset()
    gc.collect()
    torch.cuda.empty_cache()
    compiled = cgbackend.compile(model, warmup=1)
    every = cgbackend.warm_up(compiled, make, sizes)
    assert alone.graphs == 1 and every.graphs == len(sizes)
    assert 0 < every.pool_bytes <= 1.2 * alone.pool_bytes, (every.pool_bytes, alone.pool_bytes)
    mem = cgbackend.stats(compiled)["memory"]
    assert mem["outputs"] == 0 and mem["released"] >= sum(n * 64 * vocab * 2 for n in sizes), mem
    kept = []
    with torch.no_grad():
        for n in (3, 24, 9, 2, 17, 6, 21):
            (x,) = make(n)
            kept.append((compiled(x), model(x), n))
    for out, ref, n in kept:
        assert_matches(out, ref, torch.bfloat16, f"size {n}")
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == len(sizes) and st["replays"] >= 7 and not st["eager_calls"].get("replay_order_hazard")


def test_dense_one_graph_no_copies_but_input():
    model = build_model("dense", size="tiny", device="cuda").eval()
    inputs = make_inputs("dense", model, n=6, device="cuda")
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for x in inputs:
            assert_matches(compiled(x), model(x), torch.float32)  # bitwise with inner="eager", close with Inductor
    st = cgbackend.stats(compiled)
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0
    # Only the token ids are copied (one per replay after the capturing call).
    assert st["copied_by_kind"] == {"user_input": st["copies_made"]}


def test_moe_hand_off_between_graphs_avoids_copies():
    model = build_model("moe", size="tiny", device="cuda").eval()
    inputs = make_inputs("moe", model, n=6, device="cuda")
    compiled = cgbackend.compile(model, warmup=1, static_dispatch="off")  # graphs between dynamic regions
    with torch.no_grad():
        for x in inputs:
            assert_matches(compiled(x), model(x), torch.float32)
    st = cgbackend.stats(compiled)
    assert st["copies_avoided"] > 0
    assert st["copied_by_kind"].get("eager_value", 0) == 0, st["copied_by_kind"]


def test_parameter_replaced_between_calls_is_picked_up():
    model = build_model("dense", size="tiny", device="cuda").eval()
    x = make_inputs("dense", model, n=1, device="cuda")[0]
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
        captured = cgbackend.stats(compiled)["graphs_captured"]
        model.lm_head.weight.data = torch.randn_like(model.lm_head.weight)  # new storage
        assert_matches(compiled(x), model(x), torch.float32, "after p.data = ...")
        assert cgbackend.stats(compiled)["graphs_captured"] == captured + 1
        # In-place load keeps the address: same graph, new values.
        state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        assert_matches(compiled(x), model(x), torch.float32, "after load_state_dict")
        assert cgbackend.stats(compiled)["graphs_captured"] == captured + 1


@torch.library.custom_op("cgbackend_test::hidden_sync", mutates_args=())
def hidden_sync(x: torch.Tensor) -> torch.Tensor:
    # Reads a value back to the host: legal eagerly, illegal while capturing.
    return x * (1.0 + float(x.abs().max().item() > -1.0))


@hidden_sync.register_fake
def _(x):
    return torch.empty_like(x)


_PRIVATE_GEN = {}


@torch.library.custom_op("cgbackend_test::private_noise", mutates_args=())
def private_noise(x: torch.Tensor) -> torch.Tensor:
    # Draws from a generator no graph registered: fine eagerly, fails inside a capture (no sync).
    gen = _PRIVATE_GEN.setdefault(x.device, torch.Generator(device=x.device).manual_seed(0))
    return x + 0.0 * torch.rand(x.shape, device=x.device, generator=gen)


@private_noise.register_fake
def _(x):
    return torch.empty_like(x)


class _OpModel(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        return self.b(F.gelu(self.op(self.a(x)) + 1))


def _assert_out(out, ref, inner):
    if inner == "eager":
        assert torch.equal(out, ref)
    else:  # Inductor's kernels: within tolerance (assert_matches returns whether bitwise)
        assert_matches(out, ref, torch.float32)


@pytest.mark.parametrize("inner", ["eager", "auto"])
def test_host_sync_found_in_warmup_splits_the_region(inner):
    """The region a -> hidden_sync -> gelu, b synchronizes in warm-up: it is split at hidden_sync
    (found by CUDA's sync debug mode), which runs eagerly; the part after it is captured (the part
    before, one linear, is below min_region_ops and runs eagerly too)."""
    model = _OpModel(hidden_sync).cuda().eval()
    xs = [torch.randn(8, 32, device="cuda") for _ in range(8)]
    compiled = cgbackend.compile(model, warmup=1, inner=inner)
    with torch.no_grad():
        for x in xs:
            out, ref = compiled(x), model(x)
            _assert_out(out, ref, inner)
    st = cgbackend.stats(compiled)
    assert st["regions_split"] == 1, st["sync_splits"]
    assert st["sync_splits"][0]["op"].endswith("hidden_sync")
    assert st["capture_failures"] == []
    assert st["graphs_captured"] == 1 and st["replays"] >= 4, st
    assert "host_sync_in_warmup" not in st["eager_calls"]
    assert "split_at_host_sync" in cgbackend.report(compiled).to_text()


class _MaskModel(nn.Module):
    """Builds device constants from Python scalars in its forward (Hugging Face's mask helper)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x):
        h = self.a(x)
        zero = torch.tensor(0.0, device=x.device)  # a host-to-device copy: a sync on every call
        low = torch.full((), -1e4, device=x.device, dtype=x.dtype)
        return self.b(F.gelu(torch.where(h > zero, h, low * 0 + h * 0.1)))


@pytest.mark.parametrize("inner", ["eager", "auto"])
def test_device_constants_from_python_scalars_are_hoisted_and_captured(inner):
    model = _MaskModel().cuda().eval()
    xs = [torch.randn(8, 32, device="cuda") for _ in range(6)]
    compiled = cgbackend.compile(model, warmup=1, inner=inner)
    with torch.no_grad():
        for x in xs:
            out, ref = compiled(x), model(x)
            _assert_out(out, ref, inner)
    st = cgbackend.stats(compiled)
    assert st["constants_hoisted"] == 3, st  # zero, low and low * 0
    assert st["static_regions"] == 1 and st["graphs_captured"] == 1 and st["replays"] == len(xs) - 1, st
    assert st["eager_calls"] == {"warmup": 1}, st["eager_calls"]
    assert st["regions_split"] == 0
    assert st["inner_compiled"] == (1 if inner == "auto" else 0)


def test_constant_moved_to_the_gpu_is_made_once():
    """transformers' sliding-window cache: ``torch.tensor(window)`` on the CPU, then ``.to(device)``
    in every call. The move was a dynamic region (a copy from host memory); now the tensor and its
    move are made once and the model is one static region."""
    def f(x):
        window = torch.tensor(3).to(x.device)
        idx = torch.arange(x.shape[1], device=x.device)
        return torch.where(idx < window, x * 2, x).relu()

    xs = [torch.randn(8, 32, device="cuda") for _ in range(5)]
    compiled = cgbackend.compile(f, warmup=1)
    for x in xs:
        torch.testing.assert_close(compiled(x), f(x))
    st = cgbackend.stats(compiled)
    assert st["constants_hoisted"] == 3, st
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0, st
    assert st["graphs_captured"] == 1 and st["replays"] == len(xs) - 1, st


def test_rotary_inv_freq_from_the_cpu_is_folded_into_one_region():
    """inv_freq recomputed on the CPU in every call and moved to the GPU (a transformers MoE
    model's rotary embedding): made once, so the model is one static region, captured."""
    from test_inner_split import Rotary
    model = Rotary().cuda().eval()
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(6, 16, device="cuda")
            pos = torch.randint(0, 100, (6,), device="cuda")
            torch.testing.assert_close(compiled(x, pos), model(x, pos))
    st = cgbackend.stats(compiled)
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0, st
    assert st["graphs_captured"] == 1 and st["replays"] == 4 and st["constants_hoisted"] == 7, st


def test_constant_moved_to_the_gpu_and_returned_is_made_once_and_copied_out():
    """Mistral's case: the moved sliding-window tensor is an attribute of the cache the model
    returns, so a graph output. It is made once; each call returns a copy of it."""
    def f(x):
        window = torch.tensor(3).to(x.device)
        idx = torch.arange(x.shape[1], device=x.device)
        return torch.where(idx < window, x * 2, x).relu(), window

    xs = [torch.randn(8, 32, device="cuda") for _ in range(5)]
    compiled = cgbackend.compile(f, warmup=1)
    kept = []
    for x in xs:
        out, window = compiled(x)
        ref, ref_window = f(x)
        torch.testing.assert_close(out, ref)
        assert window.device.type == "cuda" and torch.equal(window, ref_window)
        assert all(window.data_ptr() != k.data_ptr() for k in kept)
        kept.append(window)
        window.add_(1)  # the caller's copy: the next call must not see it
    st = cgbackend.stats(compiled)
    assert st["constants_hoisted"] == 3, st
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0, st
    assert st["graphs_captured"] == 1 and st["replays"] == len(xs) - 1, st


@pytest.mark.parametrize("mode", ["auto", "mul", "copy", "clone"])
def test_outputs_copied_out_exactly_by_every_form(mode, monkeypatch):
    """runtime/outputs.copy_out: each form gives tensors equal bit for bit (NaN aside) to the
    sources, with clone()'s dtype and strides, each in its own storage."""
    from cgbackend.runtime import outputs
    if mode == "clone" and outputs._foreach_clone is None:
        pytest.skip("this torch has no _foreach_clone")
    monkeypatch.setattr(outputs, "OUTPUT_COPY", mode)
    tiny = torch.finfo(torch.bfloat16).tiny / 4  # a subnormal
    sources = [
        torch.tensor([-0.0, float("inf"), -float("inf"), tiny, 1.5], device="cuda", dtype=torch.bfloat16),
        torch.randn(8, 6, device="cuda").t(),  # transposed: kept
        torch.tensor([2 ** 62, -2 ** 63, 7], device="cuda", dtype=torch.int64),
        torch.tensor([True, False, True], device="cuda"),
        torch.randint(0, 255, (4, 4), device="cuda", dtype=torch.uint8),
        torch.randn(3, 5, device="cuda", dtype=torch.float16),
    ]
    copies = outputs.copy_out(sources)
    for c, src in zip(copies, sources):
        ref = src.clone()
        assert c.dtype == ref.dtype and c.shape == ref.shape and c.stride() == ref.stride()
        assert torch.equal(c.view(torch.uint8) if c.is_contiguous() else c, ref.view(torch.uint8) if ref.is_contiguous() else ref)
        assert c.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    assert len({c.untyped_storage().data_ptr() for c in copies}) == len(copies)
    assert torch.signbit(copies[0][0]).item()  # -0.0 stays negative


def test_capture_failure_falls_back_with_reason():
    model = _OpModel(private_noise).cuda().eval()
    xs = [torch.randn(8, 32, device="cuda") for _ in range(5)]
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for x in xs:
            assert_matches(compiled(x), model(x), torch.float32)
    st = cgbackend.stats(compiled)
    assert len(st["capture_failures"]) == 1, st["capture_failures"]
    assert "generator" in st["capture_failures"][0]["error"].lower()
    assert st["eager_calls"].get("capture_failed", 0) == len(xs) - 1
    assert st["replays"] == 0
    assert "capture_failed" in cgbackend.report(compiled).to_text()
    # CUDA and its default generator still work after the failed capture.
    torch.cuda.synchronize()
    assert torch.isfinite(torch.randn(4, device="cuda") @ torch.randn(4, 4, device="cuda")).all()
    assert 0.3 < F.dropout(torch.ones(10000, device="cuda"), 0.5).eq(0).float().mean().item() < 0.7


@pytest.mark.parametrize("op, match", [(hidden_sync, "synchronizes"), (private_noise, "capturing region")])
def test_strict_raises(op, match):
    model = _OpModel(op).cuda().eval()
    compiled = cgbackend.compile(model, warmup=1, strict=True)
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=match):
            compiled(x)
            compiled(x)


class _Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)

    def forward(self, x):
        return F.dropout(self.lin(x).abs() + 1.0, p=0.5, training=self.training)


def test_dropout_draws_fresh_mask_each_replay():
    model = _Dropper().cuda().train()
    x = torch.randn(64, 256, device="cuda")
    compiled = cgbackend.compile(model, warmup=1)
    masks = []
    with torch.no_grad():
        for _ in range(5):
            masks.append(compiled(x) == 0)
    assert cgbackend.stats(compiled)["replays"] == 4
    for a, b in zip(masks[1:], masks[2:]):
        assert not torch.equal(a, b), "two replays drew the same dropout mask"
    for m in masks[1:]:
        assert 0.45 < m.float().mean().item() < 0.55


def test_output_outlives_later_calls_and_shapes():
    model = build_model("moe", size="tiny", device="cuda").eval()
    compiled = cgbackend.compile(model, warmup=1)
    xs = make_inputs("moe", model, n=4, device="cuda")
    with torch.no_grad():
        outs = [compiled(x) for x in xs]
        refs = [model(x) for x in xs]
        # A different batch size: a new signature, never a replay of the old graph.
        other = make_inputs("moe", model, batch=3, seq=16, n=2, device="cuda", seed=9)
        for x in other:
            assert_matches(compiled(x), model(x), torch.float32)
    for o, r in zip(outs, refs):
        assert_matches(o, r, torch.float32)


def test_moe_graph_count_constant_over_200_rotating_calls():
    """Bench size (d_model 512, 4 layers, 8 experts top-2, 4 x 128 tokens, bf16), routing changing
    every call: after warm-up, no new graphs while replays grow."""
    model = build_model("moe", size="bench", device="cuda", dtype=torch.bfloat16).eval()
    inputs = make_inputs("moe", model, batch=4, seq=128, n=64, device="cuda", seed=21)
    compiled = cgbackend.compile(model)  # default warm-up (3)
    routes = set()
    with torch.no_grad():
        for i in range(4):
            compiled(inputs[i])
        after_capture = cgbackend.stats(compiled)
        for i in range(200):
            x = inputs[i % len(inputs)]
            out = compiled(x)
            if i % 16 == 0:
                assert_matches(out, model(x), torch.bfloat16, f"call {i}")
                block = model.layers[0]  # the first router's choices for this batch
                emb = model.tok_emb(x) + model.pos_emb(torch.arange(x.shape[1], device="cuda"))
                h = block.norm2(emb + block.attn(block.norm1(emb)))
                chosen = torch.topk(block.ffn.gate(h.reshape(-1, h.shape[-1])), 2).indices
                routes.add(tuple(torch.bincount(chosen.flatten(), minlength=8).tolist()))
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == after_capture["graphs_captured"] == st["static_regions"]
    assert st["replays"] == after_capture["replays"] + 200 * st["static_regions"]
    assert len(routes) > 1, "routing never changed: the inputs did not rotate"


_MEMORY_SCRIPT = r"""
import copy, json, torch, cgbackend
from cgbackend.bench.accuracy import rel_err
from cgbackend.models import build_model, make_inputs
from cgbackend.runtime import capture

capture.POOLED_WORKSPACES = {pooled}
model = build_model("moe", size="bench", device="cuda", dtype=torch.bfloat16).eval()
xs = make_inputs("moe", model, batch=4, seq=128, n=16, device="cuda", seed=5)

def fresh():
    torch.cuda.synchronize()
    capture.clear_blas_workspaces()  # each side pays for the cuBLAS workspaces it makes
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()

with torch.no_grad():
    # Compile once first: with an empty Inductor cache the first compile's peak was 43 MiB higher
    # (96.5 against 53 MB eager on an H100; a second run, cache warm, within 15%): memory of the
    # compile, not of the graphs. The measured compile below finds its kernels in the caches.
    first = cgbackend.compile(copy.deepcopy(model))
    for x in xs[:4]:
        first(x)
    del first
    base = fresh()
    refs = [model(x) for x in xs]
    eager = torch.cuda.max_memory_allocated() - base
    refs = [r.cpu() for r in refs]
    compiled = cgbackend.compile(model)
    base = fresh()
    outs = [compiled(x) for x in xs]
    graphed = torch.cuda.max_memory_allocated() - base
    # Accuracy by the harness's rule: error against a float64 run of the same weights at most 2x
    # eager-bf16's own (Inductor rounds differently and flips a few tokens' experts, as eager-bf16
    # does against float64).
    model64 = copy.deepcopy(model).double()
    refs64 = [model64(x).cpu() for x in xs]
    err = max(rel_err(o.cpu(), r) for o, r in zip(outs, refs64))
    eager_err = max(rel_err(r, r64) for r, r64 in zip(refs, refs64))
st = cgbackend.stats(compiled)
print(json.dumps({{"eager": eager, "graphed": graphed, "err": err, "eager_err": eager_err, "graphs": st["graphs_captured"],
                  "regions": st["static_regions"], "replays": st["replays"]}}))
"""


def _peak_memory(pooled: bool) -> dict:
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT.format(pooled=pooled)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_moe_inference_peak_memory_within_15_percent_of_eager():
    """The memory target on the MoE reference model (bench size, bf16, 4 x 128 tokens,
    routing changing every call), in a fresh process. Each graph's cuBLAS workspace is a
    temporary in the graph pool, not a second workspace kept for the capture stream (32 MiB on
    Hopper) next to the eager stream's."""
    new = _peak_memory(pooled=True)
    assert new["graphs"] == new["regions"] >= 1 and new["replays"] > 0, new
    assert new["err"] <= 2 * new["eager_err"], new
    assert new["graphed"] <= 1.15 * new["eager"], new
    # The measurement sees the difference: the capture stream's own workspace (8 MiB before
    # Hopper, 32 MiB on it) comes back with the old behaviour.
    old = _peak_memory(pooled=False)
    assert old["graphed"] - new["graphed"] >= 8 * 2**20, (old, new)
