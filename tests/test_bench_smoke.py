"""The benchmark harness end to end on CPU (``--smoke``), in-process."""

from __future__ import annotations

import json
import numbers

import pytest
import torch

from cgbackend import bench

MODELS = ("dense", "moe")
MODES = ("infer", "train")
CONTENDERS = ("eager", "cgbackend", "cgbackend-static-dispatch")


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def test_smoke_run_writes_complete_results(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = bench.main(["--smoke", "--out", str(out)])
    assert code == 0

    results = json.loads(out.read_text())
    meta, rows = results["meta"], results["rows"]
    for key in ("device", "torch", "date", "command"):
        assert meta[key]
    assert meta["device_type"] == "cpu"

    by_key = {(r["model"], r["mode"], r["contender"]): r for r in rows}
    assert len(by_key) == len(rows)
    for model in MODELS:
        for mode in MODES:
            for contender in CONTENDERS:
                row = by_key[(model, mode, contender)]
                assert row["error"] is None, row["error"]
                assert row["median_ms"] > 0
                assert row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
                assert _is_number(row["ratio_to_eager"])
                assert _is_number(row["ratio_to_best_stock"])
                # No kernel-time floor without CUDA, so no ratio to it.
                assert row["floor_ms"] is None and row["ratio_to_floor"] is None
                assert row["peak_mem_bytes"] is None
                assert _is_number(row["compile_s"]) and row["compile_s"] >= 0
                assert row["accuracy_ok"] is True, (row["accuracy_err"], row["accuracy_worst"])
                assert row["graph_breaks"] == 0
            assert by_key[(model, mode, "eager")]["ratio_to_eager"] == pytest.approx(1.0)
            cg = by_key[(model, mode, "cgbackend")]
            assert cg["graphs"] == 0  # nothing can be captured on CPU
            assert cg["backend_stats"]["nothing_captured_reason"] == "no_cuda"
            sd = by_key[(model, mode, "cgbackend-static-dispatch")]["backend_stats"]
            if model == "moe":  # the dispatch loop was rewritten: nothing dynamic is left
                assert cg["backend_stats"]["dynamic_regions"] >= 1
                assert sd["dynamic_regions"] == 0 and sd["static_regions"] >= 1

    printed = capsys.readouterr().out
    assert "dense / infer" in printed and "moe / train" in printed

    markdown = bench.render_markdown(results)
    assert meta["command"] in markdown
    assert "## moe / train" in markdown and "| cgbackend" in markdown


def test_failing_contender_is_recorded_not_fatal(tmp_path, monkeypatch):
    def boom(model):
        raise RuntimeError("compiler exploded")

    monkeypatch.setitem(bench.CONTENDERS, "boom", bench.Contender("boom", boom, stock=False))
    out = tmp_path / "bench.json"
    code = bench.main(["--smoke", "--models", "dense", "--modes", "infer", "--contenders",
                       "eager,boom,reduce-overhead", "--out", str(out)])
    assert code == 0
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["boom"]["error"] == "RuntimeError: compiler exploded"
    assert rows["boom"]["error_stage"] == "compile"
    assert rows["boom"]["median_ms"] is None and rows["boom"]["ratio_to_eager"] is None
    if not torch.cuda.is_available():
        assert rows["reduce-overhead"]["error"] == "needs CUDA"
    assert rows["eager"]["error"] is None and rows["eager"]["median_ms"] > 0


def test_accuracy_failure_is_never_a_win():
    def row(contender, median, ok):
        return {"model": "moe", "mode": "infer", "contender": contender, "median_ms": median,
                "accuracy_ok": ok, "error": None, "floor_ms": 1.0}

    rows = [row("eager", 10.0, True), row("inductor", 8.0, False), row("cgbackend", 4.0, False),
            row("cgbackend-inductor", 5.0, True)]
    bench.add_ratios(rows)
    by = {r["contender"]: r for r in rows}
    assert by["eager"]["best_stock"] == "eager"  # inductor failed accuracy
    assert by["cgbackend"]["ratio_to_best_stock"] is None and by["cgbackend"]["beats_best_stock"] is False
    assert by["cgbackend-inductor"]["ratio_to_best_stock"] == pytest.approx(0.5)
    assert by["cgbackend-inductor"]["beats_best_stock"] is True
    assert by["cgbackend"]["ratio_to_eager"] == pytest.approx(0.4)
    assert by["cgbackend"]["ratio_to_floor"] == pytest.approx(4.0)


def test_usage_errors_exit_2(tmp_path, capsys):
    assert bench.main(["--smoke", "--models", "nope", "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_serving_loop_smoke_on_cpu(tmp_path):
    """The serving-loop harness end to end at tiny sizes (eager and cgbackend; no GPU: graphs are
    blocked, so only the plumbing and the accuracy check run)."""
    from cgbackend.serving import run
    out = tmp_path / "serving.json"
    md = tmp_path / "serving.md"
    results = run(["--size", "tiny", "--calls", "6", "--max-batch", "5", "--seq", "8", "--dtype", "fp32",
                   "--models", "dense,moe", "--device", "cpu", "--out", str(out), "--markdown", str(md)])
    rows = results["rows"]
    assert [(r["model"], r["contender"]) for r in rows] == [
        ("dense", "eager"), ("dense", "cgbackend"), ("moe", "eager"), ("moe", "cgbackend")]
    assert all("error" not in r for r in rows)
    assert all(r["accuracy_ok"] for r in rows if r["contender"] == "cgbackend")
    assert all(r["graph_bound"] >= r["graphs_captured"] for r in rows if r["contender"] == "cgbackend")
    assert out.exists() and "| dense | cgbackend |" in md.read_text()


def test_relative_error_never_hides_a_nan_or_a_shape_mismatch():
    """The accuracy check of both harnesses (bench and serve-bench): a NaN output is an infinite
    error, not one that max() skips."""
    import math

    import torch

    from cgbackend.bench import rel_err
    ref = torch.tensor([1.0, -2.0])
    assert rel_err(torch.tensor([1.0, -1.0]), ref) == 0.5
    assert rel_err(torch.tensor([float("nan"), -2.0]), ref) == math.inf
    assert rel_err(torch.ones(3), ref) == math.inf
    assert rel_err(torch.tensor([0.5, 0.0]), torch.zeros(2)) == 0.5  # absolute when ref is zero
