"""transformers' own MoE code in the bench (tiny scale, CPU: the rows' logic, no timing claims), and
rows of several GPUs side by side in one results file."""

from __future__ import annotations

import json

import pytest
import torch

from cgbackend import bench
from cgbackend.bench.render import merge_runs, render_markdown
from cgbackend.models.realsize import grouped_mm_unsupported


def _run(tmp_path, *args):
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", *args, "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    return results, {(r["model"], r["mode"], r["contender"], r["tokens"]): r for r in results["rows"]}


def test_hf_qwen3_moe_rows(tmp_path):
    """transformers' Qwen3-MoE stack on hidden states at a token count (--tokens: the row group's
    count): cgbackend one static region judged against float64, routing flips from the first router,
    and transformers' grouped_mm experts from the same weights; every row names its device. One
    count: each costs two traces of the stack, and a sweep's row groups (one per count, ratios within
    each) are the bench loop's, the same for every family (test_bench_smoke's token sweep)."""
    pytest.importorskip("transformers")
    reason = grouped_mm_unsupported("cpu", torch.bfloat16)
    results, rows = _run(tmp_path, "--models", "hf-qwen3-moe-128e", "--modes", "infer", "--dtype", "bf16",
                         "--tokens", "32", "--contenders", "eager,cgbackend,hf-grouped-mm-reduce-overhead",
                         "--batches", "2", "--warmup", "2", "--iters", "3")
    assert {(r["tokens"], r["contender"]) for r in results["rows"]} == {
        (32, c) for c in ("eager", "cgbackend", "hf-grouped-mm-reduce-overhead")}
    device = results["meta"]["device"]
    row = rows[("hf-qwen3-moe-128e", "infer", "cgbackend", 32)]
    assert row["error"] is None and row["accuracy_ok"], (row["error"], row.get("ref64_err"))
    assert row["family"] == "hf" and row["device"] == device
    st = row["backend_stats"]
    assert (st["static_regions"], st["dynamic_regions"]) == (1, 0), st
    assert row["routing_flip_frac"] is not None
    grouped = rows[("hf-qwen3-moe-128e", "infer", "hf-grouped-mm-reduce-overhead", 32)]
    if reason is not None:
        assert grouped["skip_reason"] == reason
    else:
        assert grouped["error"] is None and grouped["accuracy_ok"], grouped["error"]
        assert row["ratio_to_grouped"] == pytest.approx(row["median_ms"] / grouped["median_ms"])
    assert "hf-qwen3-moe-128e / infer / 32 tokens" in render_markdown(results)


@pytest.mark.parametrize("family", ["phimoe", "granitemoe"])
def test_zoo_phimoe_and_granitemoe_infer(tmp_path, family):
    """The zoo's PhiMoE and GraniteMoE (their routers at their own paths) with eager experts: cgbackend
    matches the float64 rule in inference, with its routing flips counted."""
    pytest.importorskip("transformers")
    model = f"zoo-{family}-eager-experts"
    _, rows = _run(tmp_path, "--models", model, "--modes", "infer", "--scale", "tiny", "--contenders",
                   "eager,cgbackend", "--batch", "2", "--seq", "8", "--batches", "2", "--acc-batches", "2",
                   "--warmup", "2", "--iters", "3")
    row = rows[(model, "infer", "cgbackend", None)]
    assert row["error"] is None and row["accuracy_ok"], (row["error"], row.get("ref64_err"))
    assert row["routing_flip_frac"] is not None and row["backend_stats"]["static_regions"] >= 1


def _results(device, command, rows, device_in_rows=True):
    meta = {"device": device, "torch": "2.11", "cuda": "13.0", "cgbackend": "0.1", "date": command,
            "command": command, "settings": {}, "timing": "events"}
    if device_in_rows:
        rows = [dict(r, device=device) for r in rows]
    return {"meta": meta, "rows": rows}


def _row(contender, median, tokens=512):
    return {"model": "moe-128e", "mode": "infer", "contender": contender, "tokens": tokens, "median_ms": median,
            "floor_ms": None, "best_stock": None, "p10_ms": None, "p90_ms": None, "ratio_to_eager": None,
            "ratio_to_best_stock": None, "ratio_to_floor": None, "peak_mem_bytes": None, "compile_s": None,
            "graphs": None, "graph_breaks": None, "error": None, "family": "shape", "accuracy_ok": None}


def test_append_replaces_only_rows_of_the_same_device():
    """A file written before rows named their device (the H100's), then an H200 run of the same rows:
    both stand; an H200 run again replaces the H200 rows only; the tables name the device."""
    h100 = _results("NVIDIA H100 80GB HBM3", "a", [_row("eager", 10.0), _row("cgbackend", 5.0)],
                    device_in_rows=False)
    merged = merge_runs(h100, _results("NVIDIA H200", "b", [_row("eager", 9.0), _row("cgbackend", 4.5)]))
    by = {(r["device"], r["contender"]): r for r in merged["rows"]}
    assert len(merged["rows"]) == 4
    assert by[("NVIDIA H100 80GB HBM3", "cgbackend")]["median_ms"] == 5.0
    assert by[("NVIDIA H200", "cgbackend")]["median_ms"] == 4.5
    merged = merge_runs(merged, _results("NVIDIA H200", "c", [_row("cgbackend", 4.0)]))
    by = {(r["device"], r["contender"]): r for r in merged["rows"]}
    assert len(merged["rows"]) == 4 and by[("NVIDIA H200", "cgbackend")]["median_ms"] == 4.0
    assert by[("NVIDIA H200", "eager")]["median_ms"] == 9.0 and by[("NVIDIA H100 80GB HBM3", "eager")]["median_ms"] == 10.0
    assert [r["command"] for r in merged["meta"]["runs"]] == ["a", "b", "c"]
    text = render_markdown(merged)
    assert "- device: NVIDIA H100 80GB HBM3, NVIDIA H200" in text
    h100_at, h200_at = (text.index("## moe-128e / infer / 512 tokens / NVIDIA H100 80GB HBM3"),
                        text.index("## moe-128e / infer / 512 tokens / NVIDIA H200"))
    assert h100_at < h200_at  # the same model and size on the two devices, one table after the other


def test_one_device_titles_stay_plain():
    text = render_markdown(_results("NVIDIA H200", "a", [_row("eager", 9.0)]))
    assert "## moe-128e / infer / 512 tokens\n" in text and "- device: NVIDIA H200" in text
