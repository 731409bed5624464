"""Ties, wins and losses: per-block paired ratios, the ``--twin`` instance and the verdict."""

from __future__ import annotations

import json

import pytest

from cgbackend import bench
from cgbackend.bench import cases, render, settings, timing
from cgbackend.bench.verdict import block_ratios, put_verdicts, twin_spread, verdict


def test_verdict_on_synthetic_ratios():
    assert verdict(0.97, [0.95, 1.02, 0.99]) == "tie"  # the blocks' interval holds 1
    assert verdict(0.90, [0.88, 0.93, 0.91]) == "faster"  # every block below 1
    assert verdict(1.10, [1.05, 1.12, 1.09]) == "slower"  # every block above 1
    assert verdict(0.96, [0.95, 0.97], spread=0.05) == "tie"  # blocks below 1, but within the twin's spread
    assert verdict(0.90, [0.89, 0.91], spread=0.05) == "faster"
    assert verdict(1.03, None, spread=0.05) == "tie"  # no blocks (sequential timing): the spread alone
    assert verdict(1.08, None, spread=0.05) == "slower"
    assert verdict(0.9, None) is None and verdict(None, [0.9]) is None  # nothing to judge by


def _row(name, ids, medians, median=None):
    return {"contender": name, "error": None, "median_ms": median or sorted(medians)[len(medians) // 2],
            "block_ids": ids, "block_medians_ms": medians}


def test_block_ratios_pair_blocks_and_twin_spread():
    eager = _row("eager", [0, 1, 2, 5, 6], [2.0, 4.0, 2.0, 2.0, 2.0])
    cg = _row("cgbackend", [5, 6], [1.0, 1.5])  # timed in a later group beside eager (blocks 5, 6)
    twin = _row("cgbackend:twin", [5, 6], [1.1, 1.5])
    assert block_ratios(cg, eager) == [0.5, 0.75]
    assert block_ratios(twin, cg) == pytest.approx([1.1, 1.0])
    assert block_ratios({"contender": "old"}, eager) is None  # rows of older runs have no blocks
    assert twin_spread([eager, cg, twin]) == pytest.approx(0.1)
    assert twin_spread([eager, cg]) is None
    group = [eager, cg, twin]
    for r in group:
        r["ratio_to_eager"] = r["median_ms"] / eager["median_ms"]
    put_verdicts(group, {"eager": eager, "grouped": None})
    assert cg["ratio_to_eager_blocks"] == [0.5, 0.75] and cg["verdict_eager"] == "faster"
    assert eager["verdict_eager"] == "tie" and cg["harness_spread"] == pytest.approx(0.1)
    assert cg["verdict_grouped"] is None and cg["ratio_to_grouped_blocks"] is None


def test_twin_timed_in_the_same_alternating_blocks(tmp_path, monkeypatch):
    order: list = []
    real = cases.Runner.step

    def step(self, index=None):
        order.append(self.contender.name)
        return real(self, index)

    monkeypatch.setattr(cases.Runner, "step", step)
    monkeypatch.setattr(cases, "_eager_floor", lambda *a, **k: (None, None))  # no floor on CPU
    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--models", "dense", "--modes", "infer", "--twin", "cgbackend",
                       "--iters", "10", "--acc-batches", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["meta"]["settings"]["twins"] == ["cgbackend"]
    rows = {r["contender"]: r for r in results["rows"]}
    assert list(rows) == ["eager", "cgbackend", "cgbackend:twin"]
    twin, cg, eager = rows["cgbackend:twin"], rows["cgbackend"], rows["eager"]
    assert twin["error"] is None and twin["median_ms"] > 0 and twin["compile_s"] is not None
    # Timed after all three were prepared, block by block: eager's, cgbackend's, the twin's, 5 times.
    timed = order[-30:]
    assert [timed[i] for i in range(0, 30, 2)] == ["eager", "cgbackend", "cgbackend:twin"] * 5
    for r in (eager, cg, twin):
        assert r["block_ids"] == list(range(timing.TIMING_ROUNDS))
        assert len(r["block_medians_ms"]) == timing.TIMING_ROUNDS
        assert len(r["ratio_to_eager_blocks"]) == timing.TIMING_ROUNDS
        assert r["verdict_eager"] in ("faster", "slower", "tie")
    spread = max(abs(t / c - 1) for t, c in zip(twin["block_medians_ms"], cg["block_medians_ms"]))
    assert all(r["harness_spread"] == pytest.approx(spread) for r in rows.values())
    assert eager["verdict_eager"] == "tie"
    table = render.render_table(results)
    assert "harness spread" in table and f"({cg['verdict_eager']})" in table
    assert f"({cg['verdict_eager']})" in render.render_markdown(results)


def test_twin_in_help_and_checked():
    assert "--twin" in settings.build_parser().format_help()
    with pytest.raises(settings.UsageError, match="--twin"):
        settings.resolve_settings(settings.build_parser().parse_args(["--smoke", "--twin", "nope"]))
    args = settings.build_parser().parse_args(["--smoke", "--twin", "cgbackend,eager", "--twin", "cgbackend"])
    assert settings.resolve_settings(args).twins == ("cgbackend", "eager")
