"""The Transformer Engine rows in the bench results file: benchmarks/te_bench.py --append puts a run
per FP8 recipe in its ``te`` section, RESULTS.md renders it, and a later bench --append keeps it."""

from __future__ import annotations

import copy

from cgbackend.bench.render import merge_runs, render_markdown, render_te


def _run(recipe: str, cg_peak: int) -> dict:
    mib = 2 ** 20
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "transformer_engine": "2.20.2",
            "date": "2026-11-27", "command": f"python benchmarks/te_bench.py --fp8 {recipe} --append latest.json",
            "layers": 4, "seq": 128, "batch": 4, "fp8": recipe, "steps": 50}
    rows = []
    for name, ms, peak, held in (("eager", 21.5, 400, 204), ("te-graphed-per-layer", 3.383, 354, 329),
                                 ("cgbackend", 2.545, cg_peak, 346)):
        rows.append({"contender": name, "loss_rel_err": 0.0, "grad_rel_err": 1.5e-3, "accuracy_ok": True,
                     "median_ms": ms, "p10_ms": ms, "peak_mem_over_baseline_bytes": peak * mib,
                     "held_mem_over_baseline_bytes": held * mib, "vs_eager": ms / 21.5, "vs_te_graphed": ms / 3.383,
                     "peak_vs_te_graphed": peak / 354})
    return {"meta": meta, "rows": rows}


def _bench() -> dict:
    meta = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "cuda": "13.0", "date": "2026-11-27",
            "command": "python -m cgbackend bench", "settings": {}, "contenders": {}, "models": {}, "runs": []}
    return {"meta": meta, "rows": []}


def test_te_section_renders_every_recipe_and_contender():
    te = {"delayed": _run("delayed", 488), "off": _run("off", 397)}
    text = render_te(te, level="##")
    assert text.startswith("## Transformer Engine training step")
    assert "| DelayedScaling | cgbackend | 2.545 | 0.118 | 0.752 | 488 | 1.379 | 346 | 0.0e+00 / 1.5e-03 | yes |" in text
    assert "| off (bf16) | te-graphed-per-layer | 3.383 |" in text
    assert text.count("| cgbackend |") == 2 and "`python benchmarks/te_bench.py --fp8 off --append latest.json`" in text


def test_te_section_is_in_results_md_and_survives_a_bench_append():
    old = dict(_bench(), te={"current": _run("current", 484)})
    assert "## Transformer Engine training step" in render_markdown(old)
    new = _bench()
    new["rows"] = []
    merged = merge_runs(copy.deepcopy(old), new)
    assert merged["te"] == old["te"]
    assert "## Transformer Engine training step" not in render_markdown(_bench())
