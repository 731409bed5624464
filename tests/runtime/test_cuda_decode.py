"""MoE decode on the GPU: after warm-up, a decode step (one token per sequence through a transformers
MoE model and its StaticCache, default options) is graph replays only, with no host synchronization
anywhere in the step (CUDA's sync debug mode set to raise); fed eager's tokens, its bf16 logits are
within twice eager's own error against a float64 copy of the same weights."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import cgbackend

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("name", ["hf-mixtral-eager-experts", "hf-olmoe-eager-experts"])
def test_moe_decode_steps_replay_without_a_host_sync(name):
    pytest.importorskip("transformers")
    from cgbackend.bench.accuracy import rel_err
    from cgbackend.bench.decode import DecodeStep, make_static_cache
    from cgbackend.bench.models import DECODE_SHAPES, build_hf

    shape = DECODE_SHAPES["tiny"]
    batch, prompt_len, steps = 4, shape["prompt"], 10
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = build_hf(name, types.SimpleNamespace(scale="tiny", seed=0, dtype=dtype)).to(device)
    twin = build_hf(name, types.SimpleNamespace(scale="tiny", seed=0, dtype=dtype)).to(device)
    model64 = copy.deepcopy(twin).double()
    runs = {}
    for label, m in (("eager", twin), ("fp64", model64), ("cgbackend", model)):
        wide = torch.float64 if label == "fp64" else dtype
        step = DecodeStep(m, make_static_cache(m, prompt_len + steps + 1, batch, device, wide))
        fn = cgbackend.compile(step) if label == "cgbackend" else step
        g = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, shape["vocab"], (batch, prompt_len), generator=g).to(device)
        logits = [step.prefill(prompt)]
        try:
            with torch.no_grad():
                for i in range(steps):
                    # the others are fed eager's tokens (teacher forcing): logits compare step by step
                    ids = logits[-1].argmax(-1, keepdim=True) if label == "eager" else runs["eager"][1][i]
                    positions = torch.full((batch, 1), prompt_len + i, device=device, dtype=torch.long)
                    if label == "cgbackend" and i == 4:  # warm-up and captures are over
                        torch.cuda.synchronize()
                        torch.cuda.set_sync_debug_mode("error")
                    logits.append(fn(ids, positions).clone())
        finally:
            torch.cuda.set_sync_debug_mode(0)
        runs[label] = (logits, [lg.argmax(-1, keepdim=True) for lg in logits])
    stats = cgbackend.stats(fn)
    assert stats["capture_failures"] == [] and set(stats["eager_calls"]) <= {"warmup"}, stats
    assert stats["replays"] >= steps - 4 and stats["graphs_captured"] >= 1, stats
    # teacher-forced (each step fed eager's token): the float64 rule of the bench (accuracy.py)
    ref = torch.cat(runs["fp64"][0][1:])
    mine = rel_err(torch.cat(runs["cgbackend"][0][1:]), ref)
    eagers = rel_err(torch.cat(runs["eager"][0][1:]), ref)
    assert mine <= 2 * max(eagers, torch.finfo(dtype).eps), (mine, eagers)
