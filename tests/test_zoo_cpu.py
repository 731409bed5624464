"""Hugging Face models (small configs, random weights) under cgbackend on CPU with simulated graphs:
every region is captured and replayed by the same runtime code as on a GPU, results equal eager.
The GPU run of the same zoo (benchmarks/zoo.py) produced benchmarks/ZOO.md."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "cg_zoo", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "zoo.py")
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

MOE = {"mixtral", "qwen2_moe", "olmoe"}


@pytest.mark.parametrize("mode", ["infer", "train"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "mixtral", "qwen2_moe", "olmoe"])
def test_hugging_face_model_matches_eager(name, mode):
    args = argparse.Namespace(device="cpu", simulate=True, batches=3, warmup=1, time=False, iters=0, tol=1e-5)
    row = zoo.run_one(name, mode, args)
    assert row["error"] is None, row["error"]
    assert row["match"], row
    assert row["eager_after_warmup"] == {}, row["eager_after_warmup"]
    static, dynamic = (int(v) for v in row["regions"].split("/"))
    assert row["graphs"] == static * (2 if mode == "train" else 1)
    if name in MOE:
        assert dynamic >= 1 and 0 < row["static_op_fraction"] < 1  # the expert dispatch stays eager
    else:
        assert dynamic == 0 and row["static_op_fraction"] == 1.0


def _zoo_args(device: str, dtype: str = "float32", **kw) -> argparse.Namespace:
    base = dict(device=device, simulate=device == "cpu", batches=3, warmup=1, time=False, iters=0,
                tol=None if device == "cuda" else 1e-5, dtype=dtype, static_dispatch="auto")
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("mode", ["infer", "train"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_hugging_face_moe_with_static_dispatch_is_one_graph(name, mode):
    """Their default experts implementation under torch.compile in fp32 runs transformers'
    grouped_mm_fallback (a loop over offsets.tolist()); the rewrite makes it static."""
    row = zoo.run_one(name, mode, _zoo_args("cpu"))
    assert row["error"] is None, row["error"]
    assert row["match"], row
    assert row["regions"] == "1/0", row
    assert row["dispatch_rewrites"] > 0 and row["dispatch_left_dynamic"] == 0
    assert row["graphs"] == (2 if mode == "train" else 1)
    assert row["eager_after_warmup"] == {}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["infer", "train"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_hugging_face_moe_with_static_dispatch_on_gpu(name, mode, dtype):
    row = zoo.run_one(name, mode, _zoo_args("cuda", dtype, batches=4))
    assert row["error"] is None, row["error"]
    assert row["match"], row
    assert row["regions"] == "1/0", row
    assert row["graphs"] == (2 if mode == "train" else 1)
    assert row["eager_after_warmup"] == {}


def _dynamic_batch_run(name: str, device: str, calls: int = 10, **options):
    """Hugging Face model, batch sizes drawn from 2..12 (marked dynamic): every call's logits match
    eager; returns the compiled model."""
    import random

    import torch

    import cgbackend
    torch.manual_seed(0)
    model = zoo.ZOO[name][1]().to(device).eval()
    compiled = cgbackend.compile(model, warmup=1, **options)
    rng = random.Random(0)
    with torch.no_grad():
        for i in range(calls):
            x = torch.randint(0, 512, (rng.randint(2, 12), 16), generator=torch.Generator().manual_seed(i))
            x = x.to(device)
            torch._dynamo.mark_dynamic(x, 0)
            out, ref = compiled(input_ids=x).logits, model(input_ids=x).logits
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return compiled


@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hugging_face_dynamic_batch_is_padded(name):
    """The batch is padded in Hugging Face models too: the mask builder's arange(batch) and
    expand(batch, ...) are row sources, GPT-2's addmm is row-wise, the empty cache before its first
    update is skipped by cat. Mixtral's routing sort keeps its own regions exact."""
    import cgbackend
    compiled = _dynamic_batch_run(name, "cpu", simulate_graphs=True)
    report = cgbackend.report(compiled)
    assert report.summary["bucketed_regions"] >= (1 if name != "mixtral" else 2)
    st = cgbackend.stats(compiled)
    assert st["replays"] > 0 and not st["capture_failures"]
    # Mixtral's padded regions sit between exact-keyed ones: when a newer exact graph's outputs
    # are live, the padded graph is captured again after it instead of running eagerly.
    assert set(st["eager_calls"]) == {"warmup"}
    assert (st["graphs_recaptured"] > 0) == (name == "mixtral")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gpt2", "llama", "mixtral"])
def test_hugging_face_dynamic_batch_on_gpu(name):
    import cgbackend
    compiled = _dynamic_batch_run(name, "cuda", calls=14)
    st = cgbackend.stats(compiled)
    assert st["replays"] > 0 and not st["capture_failures"]
    assert cgbackend.report(compiled).summary["bucketed_regions"] >= 1
