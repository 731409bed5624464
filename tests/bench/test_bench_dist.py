"""bench-dist's plan and rows (pure parts; the run itself needs torchrun and GPUs)."""

from __future__ import annotations

from cgbackend.bench.dist import plan, rows_for
from cgbackend.bench.dist_check import Scenario

ROW_FIELDS = {"setup", "model", "mode", "contender", "median_ms", "accuracy_ok", "graphs", "world_size"}


def _result(loss_diff=0.0, grad_diff=0.0):
    return {"losses": {"eager": [2.0, 1.0], "cgbackend": [2.0, 1.0]}, "loss_diff": loss_diff,
            "grad_diff": grad_diff, "grad_scale": 1.0, "graphs": [0, 2, 4, 4], "timing_ms": {"eager": 10.0,
            "cgbackend": 5.0}, "final_eager_calls": {"warmup": 3}, "stats": {"static_regions": 1,
                                                                               "dynamic_regions": 0}}


def test_plan_covers_every_setup_model_and_contender():
    pairs = {(c, s.setup, s.model) for c, s in plan(["ddp", "fsdp2", "ep"], size="tiny", batch=2, seq=16, steps=4)}
    assert pairs == {("cgbackend", "ddp", "dense"), ("cgbackend", "ddp", "moe"),
                     ("cgbackend-static-dispatch", "ddp", "moe"), ("cgbackend", "fsdp2", "dense"),
                     ("cgbackend", "fsdp2", "moe"), ("cgbackend-static-dispatch", "fsdp2", "moe"),
                     ("cgbackend", "ep", "moe-ep"), ("cgbackend-static-dispatch", "ep", "moe-ep")}


def test_rows_have_the_schema_and_judge_accuracy_on_every_rank():
    sc = Scenario("fsdp2", "dense")
    rows = rows_for("cgbackend", sc, [_result(), _result()], "bfloat16", 2, with_eager=True)
    assert [r["contender"] for r in rows] == ["eager", "cgbackend"]
    assert all(ROW_FIELDS <= set(r) for r in rows)
    assert rows[1]["accuracy_ok"] and rows[1]["graphs"] == 4 and rows[1]["graphs_constant_after_warmup"]
    bad = rows_for("cgbackend", sc, [_result(), _result(grad_diff=0.5)], "bfloat16", 2, with_eager=False)
    assert len(bad) == 1 and not bad[0]["accuracy_ok"]
