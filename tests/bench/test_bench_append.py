"""``bench --append``: rows of several runs in one results file, each naming its run."""
from cgbackend.bench.render import merge_runs, render_markdown


def _results(command, date, rows):
    meta = {"device": "GPU", "torch": "2.11", "cuda": "13.0", "cgbackend": "0.1", "date": date,
            "command": command, "settings": {}, "timing": "events"}
    return {"meta": meta, "rows": rows}


def _row(model, contender, median, tokens=None):
    return {"model": model, "mode": "infer", "contender": contender, "tokens": tokens, "median_ms": median,
            "floor_ms": None, "best_stock": None, "p10_ms": None, "p90_ms": None, "ratio_to_eager": None,
            "ratio_to_best_stock": None, "ratio_to_floor": None, "peak_mem_bytes": None, "compile_s": None,
            "graphs": None, "graph_breaks": None, "error": None, "family": "shape", "accuracy_ok": None}


def test_append_keeps_other_rows_and_replaces_the_same_ones():
    first = _results("bench --models dense", "d1", [_row("dense", "eager", 1.0), _row("dense", "cgbackend", 0.5)])
    second = _results("bench --models moe-128e", "d2", [_row("moe-128e", "eager", 9.0, 64),
                                                         _row("moe-128e", "eager", 20.0, 512)])
    merged = merge_runs(first, second)
    assert [(r["model"], r["tokens"], r["run"]) for r in merged["rows"]] == [
        ("dense", None, 0), ("dense", None, 0), ("moe-128e", 64, 1), ("moe-128e", 512, 1)]
    assert [r["command"] for r in merged["meta"]["runs"]] == ["bench --models dense", "bench --models moe-128e"]
    # a third run that measures dense's cgbackend again replaces that row only
    third = _results("bench --models dense --contenders cgbackend", "d3", [_row("dense", "cgbackend", 0.4)])
    merged = merge_runs(merged, third)
    by_key = {(r["model"], r["contender"], r["tokens"]): r for r in merged["rows"]}
    assert by_key[("dense", "cgbackend", None)]["median_ms"] == 0.4 and by_key[("dense", "cgbackend", None)]["run"] == 2
    assert by_key[("dense", "eager", None)]["run"] == 0 and len(merged["rows"]) == 4
    text = render_markdown(merged)
    assert "B. d2, GPU, torch 2.11: `bench --models moe-128e`" in text
    assert "## moe-128e / infer / 512 tokens (run B)" in text and "## dense / infer (run A)" in text


def test_a_run_replacing_every_row_leaves_one_run():
    first = _results("a", "d1", [_row("dense", "eager", 1.0)])
    merged = merge_runs(first, _results("b", "d2", [_row("dense", "eager", 2.0)]))
    assert [r["command"] for r in merged["meta"]["runs"]] == ["b"] and merged["rows"][0]["run"] == 0
    assert "- command: `b`" in render_markdown(merged)
