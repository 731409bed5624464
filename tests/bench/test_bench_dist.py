"""bench-dist's pure parts: the plan, the rows, the alternating timing, the isolated memory
procedure, the gradient comparison of the grouped form, and the rendered section (the run itself
needs torchrun; tests/integrations/test_distributed.py spawns two CPU ranks through the same runner)."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from cgbackend.bench.dist import plan, rows_for
from cgbackend.bench.dist_accuracy import _rows, grouped_grad_diff
from cgbackend.bench.dist_models import Scenario
from cgbackend.bench.dist_timing import isolated_peaks, slowest_steps, summary, time_alternating
from cgbackend.bench.render import merge_runs, multigpu_key, render_markdown, render_multigpu
from cgbackend.bench.timing import TIMING_ROUNDS

ROW_FIELDS = {"setup", "model", "layers", "tokens_per_rank", "mode", "contender", "median_ms", "p10_ms", "p90_ms",
              "vs_eager", "vs_grouped_inductor", "accuracy_ok", "loss_rel_err", "grad_rel_err", "graphs",
              "graphs_per_step", "graphs_constant_after_warmup", "eager_calls", "options", "peak_mb", "peak_vs_eager", "reserved_mb",
              "alloc_after_fwd_mb", "inner_fallbacks", "static_regions", "dynamic_regions", "world_size"}


def test_the_sequence_defaults_to_what_the_size_holds_and_a_longer_one_is_refused():
    (tiny, _), = plan(["ddp"], size="tiny", batch=2, seq=None, steps=4, models=["dense"])
    (bench, _), = plan(["ddp"], size="bench", batch=2, seq=None, steps=4, models=["dense"])
    assert (tiny.seq, bench.seq) == (64, 128)  # the tiny models' max_seq is 64
    with pytest.raises(ValueError, match="max_seq"):
        plan(["ep"], size="tiny", batch=2, seq=128, steps=4)


def test_plan_covers_every_setup_model_and_contender():
    got = {(s.setup, s.model, c) for s, names in plan(["ddp", "fsdp2", "ep"], size="bench", batch=4, seq=128, steps=4)
           for c in names}
    moe = {"eager", "cgbackend", "grouped-inductor"}
    want = ({("ddp", "dense", c) for c in ("eager", "cgbackend")} | {("ddp", "moe", c) for c in moe}
            | {("fsdp2", "dense", c) for c in ("eager", "cgbackend")} | {("fsdp2", "moe", c) for c in moe}
            | {("fsdp2", "moe-128e", c) for c in moe} | {("ep", "moe-ep", c) for c in ("eager", "cgbackend")})
    assert got == want
    for sc, names in plan(["ddp", "fsdp2", "ep"], size="bench", batch=4, seq=128, steps=4):
        assert names[0] == "eager" and sc.options == ()  # default options only
    (big, _), = plan(["fsdp2"], size="bench", batch=4, seq=128, steps=4, models=["moe-128e"])
    assert (big.layers, big.batch, big.seq, big.tokens_per_rank) == (16, 1, 2048, 2048)
    (tiny, _), = plan(["fsdp2"], size="tiny", batch=2, seq=16, steps=4, models=["moe-128e"])
    assert (tiny.layers, tiny.tokens_per_rank) == (16, 16)


def test_plan_names_ep_dispatch_variants_and_filters_contenders():
    (ep, names), = plan(["ep"], size="tiny", batch=2, seq=16, steps=4, ep_dispatch=["capacity"])
    assert names == ("eager", "cgbackend", "cgbackend-capacity") and ep.local_dispatch == "loop"
    (_, names), = plan(["fsdp2"], size="tiny", batch=2, seq=16, steps=4, models=["moe"],
                       contenders=["grouped-inductor"])
    assert names == ("eager", "grouped-inductor")
    with pytest.raises(ValueError, match="unknown setup"):
        plan(["tp"], size="tiny", batch=2, seq=16, steps=4)


def _rank(times_scale=1.0, grad_diff=0.0, peak=1000.0, grouped_error=None, timed_calls=None):
    eager = {"contender": "eager", "losses": [2.0, 1.0], "times_ms": [10.0 * times_scale] * 5,
             "memory": {"peak_mb": peak, "reserved_mb": peak + 10, "alloc_after_fwd_mb": 600.0, "resident_before_mb": None}}
    cg = {"contender": "cgbackend", "losses": [2.0, 1.0], "loss_diff": 0.0, "grad_diff": grad_diff, "grad_scale": 1.0,
          "graphs": [0, 2, 4, 4], "graphs_after_timing": 4, "eager_calls": [{}, {}, {}, {}],
          "final_eager_calls": {"warmup": 3}, "eager_calls_timed": timed_calls or {},
          "stats": {"static_regions": 1, "dynamic_regions": 0}, "times_ms": [4.0, 5.0 * times_scale, 5.0, 6.0, 5.0],
          "memory": {"peak_mb": 0.8 * peak, "reserved_mb": peak, "alloc_after_fwd_mb": 500.0, "resident_before_mb": 2.0}}
    grouped = ({"contender": "grouped-inductor", "error": grouped_error} if grouped_error else
               {"contender": "grouped-inductor", "losses": [2.0, 1.0], "loss_diff": 1e-3, "grad_diff": 1e-2,
                "grad_scale": 1.0, "times_ms": [8.0] * 5, "memory": {"peak_mb": 0.9 * peak}})
    return {"rank": 0, "scenario": "fsdp2:moe", "contenders": {"eager": eager, "cgbackend": cg,
                                                              "grouped-inductor": grouped}}


def test_rows_have_the_schema_ratios_and_the_slowest_rank():
    sc = Scenario("fsdp2", "moe", size="bench", batch=4, seq=128)
    rows = rows_for(sc, [_rank(), _rank(times_scale=2.0, peak=1200.0)], "bfloat16", 2)
    assert [r["contender"] for r in rows] == ["eager", "cgbackend", "grouped-inductor"]
    assert all(ROW_FIELDS <= set(r) for r in rows)
    eager, cg, grouped = rows
    assert eager["median_ms"] == 20.0 and eager["accuracy_ok"] is None  # rank 1's slower steps
    assert cg["median_ms"] == 5.0 and cg["p10_ms"] <= cg["median_ms"] <= cg["p90_ms"]
    assert cg["vs_eager"] == 0.25 and cg["vs_grouped_inductor"] == 0.625 and grouped["vs_grouped_inductor"] == 1.0
    assert cg["accuracy_ok"] and cg["graphs"] == 4 and cg["graphs_constant_after_warmup"]
    assert cg["options"] == {} and eager["options"] is None and cg["eager_calls"] == {"warmup": 3}
    assert (cg["layers"], cg["tokens_per_rank"], cg["world_size"]) == (4, 512, 2)
    assert cg["peak_mb"] == 960.0 and cg["peak_vs_eager"] == 0.8 and eager["peak_mb"] == 1200.0
    assert grouped["accuracy_ok"] and grouped["graphs"] is None


def test_accuracy_is_judged_on_every_rank_and_graphs_must_hold_through_timing():
    sc = Scenario("fsdp2", "moe")
    rows = rows_for(sc, [_rank(), _rank(grad_diff=0.5)], "bfloat16", 2)
    assert not rows[1]["accuracy_ok"] and rows[1]["grad_rel_err"] == 0.5
    moved = _rank()
    moved["contenders"]["cgbackend"]["graphs_after_timing"] = 6
    assert not rows_for(sc, [_rank(), moved], "bfloat16", 2)[1]["graphs_constant_after_warmup"]
    hazard = rows_for(sc, [_rank(), _rank(timed_calls={"replay_order_hazard": 5})], "bfloat16", 2)[1]
    assert hazard["eager_calls_timed"] == {"replay_order_hazard": 5}


def test_a_failed_contender_is_its_own_row_and_a_skipped_one_is_not_a_failure():
    sc = Scenario("ddp", "moe")
    rows = rows_for(sc, [_rank(), _rank(grouped_error="RuntimeError: boom")], "bfloat16", 2)
    assert rows[2]["error"] == "RuntimeError: boom" and rows[2]["accuracy_ok"] is False
    assert rows[1]["accuracy_ok"] and rows[1]["vs_grouped_inductor"] is None
    skipped = _rank()
    skipped["contenders"]["grouped-inductor"] = {"contender": "grouped-inductor", "skipped": "no grouped_mm"}
    row = rows_for(sc, [skipped, skipped], "bfloat16", 2)[2]
    assert row["error"] == "skipped: no grouped_mm" and row["accuracy_ok"] is None


def test_timed_steps_alternate_in_blocks_with_every_step_aligned():
    events = []
    clock = iter(range(10 ** 6))
    times = time_alternating(["eager", "cgbackend", "grouped"], lambda n: events.append(n), 10,
                             before=lambda: events.append("|"), after=lambda: events.append("."),
                             clock=lambda: float(next(clock)))
    steps = [e for e in events if e not in "|."]
    assert events[:3] == ["|", "eager", "."] and len(events) == 3 * len(steps)
    assert {n: len(t) for n, t in times.items()} == {"eager": 10, "cgbackend": 10, "grouped": 10}
    runs = [steps[0]]
    for name in steps[1:]:
        if name != runs[-1]:
            runs.append(name)
    # each block runs every contender once in a row; the first contender rotates from block to block
    assert len(runs) == 3 * TIMING_ROUNDS
    assert runs[:6] == ["eager", "cgbackend", "grouped", "cgbackend", "grouped", "eager"]


def test_slowest_rank_steps_and_summary():
    assert slowest_steps([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]
    s = summary([float(v) for v in range(1, 12)])
    assert (s["median_ms"], s["p10_ms"], s["p90_ms"]) == (6.0, 2.0, 10.0)
    assert summary([])["median_ms"] is None


class _Model:
    pass


def test_memory_is_read_with_one_contender_alive():
    alive: dict = {}

    def make(name):
        m = _Model()
        alive[name] = weakref.ref(m)
        return m

    live = {n: make(n) for n in ("eager", "cgbackend", "grouped")}
    built, freed, seen = [], [], []

    def build(name):
        built.append(name)
        return make(name)

    def measure(name, model):
        gc.collect()
        seen.append(name)
        assert [n for n, ref in alive.items() if ref() is not None] == [name]
        return {"peak_mb": float(len(seen))}

    def free(model):
        freed.append(model)
        freed.clear()  # the procedure drops its own references

    out = isolated_peaks(["eager", "cgbackend", "grouped"], keep="eager", live=live, build=build,
                         measure=measure, free=free)
    assert seen == ["eager", "cgbackend", "grouped"] and built == ["cgbackend", "grouped"] and not live
    assert out == {"eager": {"peak_mb": 1.0}, "cgbackend": {"peak_mb": 2.0}, "grouped": {"peak_mb": 3.0}}


def test_grouped_gradients_compare_expert_by_expert():
    from cgbackend.models import build_model
    from cgbackend.models.grouped import grouped_gpt, loop_name, stacked_params
    loop = build_model("moe", size="tiny", n_layers=1)
    grouped = grouped_gpt(loop)
    gen = torch.Generator().manual_seed(0)
    for p in loop.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    by_name = dict(loop.named_parameters())
    stacked = {name: (owner, w) for name, owner, w in stacked_params(grouped)}
    for name, p in grouped.named_parameters():
        if name in stacked:
            owner, w = stacked[name]
            p.grad = torch.stack([by_name[loop_name(owner, e, w)].grad for e in range(p.shape[0])])
        else:
            p.grad = by_name[name].grad.clone()
    diff, scale = grouped_grad_diff(grouped, loop, "test")
    assert diff == 0.0 and scale > 0
    grouped.layers[0].ffn.w2.grad[3, 0, 0] += 0.25
    assert grouped_grad_diff(grouped, loop, "test")[0] == pytest.approx(0.25)
    loop.layers[0].ffn.experts[1].w1.weight.grad = None
    with pytest.raises(AssertionError, match="no gradient on the loop side"):
        grouped_grad_diff(grouped, loop, "test")


class _Mesh:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def get_local_rank(self):
        return self._rank


class _Sharded:
    """A stand-in for a DTensor gradient sharded on dim 0 (torch.chunk's split)."""

    def __init__(self, rows, world, rank, local_rows, placement):
        self.shape, self.device_mesh, self.placements = (rows, 4), _Mesh(world, rank), (placement,)
        self._local = torch.zeros(local_rows, 4)

    def to_local(self):
        return self._local


def test_local_rows_of_a_sharded_gradient():
    from torch.distributed.tensor import Replicate, Shard
    assert _rows(_Sharded(5, 2, 1, 2, Shard(0))) == slice(3, 5)
    assert _rows(_Sharded(6, 2, 0, 3, Shard(0))) == slice(0, 3)
    assert _rows(_Sharded(6, 2, 0, 3, Replicate())) is None
    assert _rows(torch.zeros(3)) is None


def _section(command="torchrun --nproc-per-node 2 -m cgbackend bench-dist", date="2026-11-28"):
    rows = rows_for(Scenario("fsdp2", "moe", size="bench", batch=4, seq=128), [_rank(), _rank()], "bfloat16", 2)
    rows += rows_for(Scenario("ep", "moe-ep", size="bench", batch=4, seq=128),
                     [{"contenders": {k: v for k, v in _rank()["contenders"].items() if k != "grouped-inductor"}}] * 2,
                     "bfloat16", 2)
    meta = {"command": command, "device": "NVIDIA H200", "torch": "2.11.0+cu130", "cuda": "13.0", "date": date,
            "world_size": 2, "dtype": "bfloat16", "compare_steps": 20, "timed_steps": 30, "timing_blocks": 5}
    return {"meta": meta, "rows": rows}


def test_multigpu_section_renders_one_row_per_setup_model_and_contender():
    text = render_multigpu(_section(), level="##")
    assert text.startswith("## Multi-GPU training (bench-dist)")
    assert "run A: 2026-11-28, NVIDIA H200, torch 2.11.0+cu130: `torchrun --nproc-per-node 2 -m cgbackend bench-dist`" in text
    assert ("| fsdp2 | moe | 4 | 512 | cgbackend | 5.00 (4.40-5.60) | 0.50 | 0.62 | ok 0.0e+00 / 0.0e+00 | "
            "4 (constant) | warmup 3 | 800 (1000) | 0.80 | 500 | A |  |") in text
    assert "| ep | moe-ep (loop) | 4 | 512 | eager | 10.00 (10.00-10.00) | 1.00 | - | reference |" in text
    assert text.count("| fsdp2 | moe |") == 3 and text.count("| ep | moe-ep (loop) |") == 2


def test_multigpu_section_merges_runs_and_results_md_keeps_every_section():
    first = _section()
    second = _section(command="torchrun --nproc-per-node 2 -m cgbackend bench-dist --models moe-ep", date="d2")
    second["rows"] = [r for r in second["rows"] if r["model"] == "moe-ep"]
    merged = merge_runs(copy.deepcopy(first), second, key=multigpu_key)
    assert len(merged["rows"]) == 5 and [r["run"] for r in merged["rows"]] == [0, 0, 0, 1, 1]
    bench = {"meta": {"device": "GPU", "torch": "2.11", "cuda": "13.0", "date": "d0", "command": "bench",
                      "settings": {}, "timing": "events"}, "rows": [],
             "serving": {"meta": {"device": "GPU", "torch": "2.11", "date": "d", "command": "serve-bench", "calls": 1,
                                  "max_batch": 8, "seq": 16, "dtype": "bf16", "size": "tiny"}, "rows": []},
             "multigpu": merged}
    text = render_markdown(bench)
    assert "# Benchmark results" in text and "Serving loop" in text and "## Multi-GPU training (bench-dist)" in text
    assert "- run B: d2, NVIDIA H200" in text
    # a later bench --append keeps the section
    later = merge_runs(copy.deepcopy(bench), {"meta": dict(bench["meta"], command="bench 2"), "rows": []})
    assert later["multigpu"] == merged


def test_a_failed_scenario_gives_every_contender_a_row_with_the_schema():
    from cgbackend.bench.dist import error_rows
    rows = error_rows(Scenario("fsdp2", "moe-128e", layers=16, batch=1, seq=2048), ("eager", "cgbackend"),
                      "RuntimeError: out of memory", 2)
    assert [r["contender"] for r in rows] == ["eager", "cgbackend"]
    assert all(ROW_FIELDS <= set(r) and r["accuracy_ok"] is False and r["layers"] == 16 for r in rows)
