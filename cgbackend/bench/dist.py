"""``python -m cgbackend bench-dist``: training steps under DDP, FSDP2 and expert parallelism.

Run with torchrun, one process per GPU::

    torchrun --nproc-per-node 2 -m cgbackend bench-dist [--setups ddp,fsdp2,ep] [--models ...] [--size bench]

Per scenario (setup x model, dist_models.Scenario) every contender runs in one process on every
rank (dist_run): built from the same seed, ``--steps`` steps side by side on the same batches with
the loss and every gradient compared with eager's, ``--iters`` timed steps of each in alternating
blocks, then each one's peak memory with no other contender resident. Rank 0 writes ``--out``
(``{"meta": {...}, "rows": [...]}``, one row per setup, model and contender: :func:`rows_for`), and
with ``--append`` stores the run in the ``multigpu`` section of a bench results file
(benchmarks/results/latest.json), which RESULTS.md renders. Without torchrun's environment it runs
one process on the CPU (gloo, simulated graphs): a smoke run of the code, not a benchmark. NVLink
multicast stays off (cgbackend.distributed.NVLS_ENV).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .dist_check import init_process
from .dist_models import GROUPED_MODELS, MOE_128E_LAYERS, MOE_128E_TOKENS, SETUPS, Scenario, n_layers
from .dist_run import CONTENDERS, PEAK_STEPS, WARM_STEPS, contender, run_contenders
from .dist_timing import slowest_steps, summary
from .timing import TIMING_ROUNDS
from ..distributed import NVLS_ENV, set_nvls_env

__all__ = ["main", "plan", "rows_for", "error_rows", "table", "TOLERANCE", "ROW_FIELDS"]

log = logging.getLogger(__name__)

TOLERANCE = {"bfloat16": (2e-2, 5e-2), "float16": (2e-2, 5e-2), "float32": (1e-4, 1e-3), "float64": (1e-9, 1e-9)}
"""dtype -> (relative loss difference, gradient difference relative to the largest gradient)."""


ROW_FIELDS = ("setup", "model", "layers", "tokens_per_rank", "mode", "world_size", "contender", "median_ms", "p10_ms",
              "p90_ms", "timed_steps", "vs_eager", "vs_grouped_inductor", "accuracy_ok", "loss_rel_err", "grad_rel_err",
              "graphs", "graphs_per_step", "graphs_constant_after_warmup", "eager_calls", "eager_calls_timed",
              "inner_fallbacks", "static_regions", "dynamic_regions", "options", "peak_mb", "peak_vs_eager",
              "reserved_mb", "reserved_vs_eager", "alloc_after_fwd_mb", "resident_before_mb", "memory_error", "error")
"""Every row's fields (benchmarks/README.md describes them); moe-ep rows add ``local_dispatch``."""


def plan(setups: Sequence[str], *, size: str, batch: int, seq: Optional[int], steps: int,
         models: Optional[Sequence[str]] = None,
         contenders: Optional[Sequence[str]] = None, ep_dispatch: Sequence[str] = ()
         ) -> list[tuple[Scenario, tuple[str, ...]]]:
    """(scenario, contenders) of every chosen setup and model: eager and cgbackend everywhere,
    grouped-inductor for the models with a grouped form, ``cgbackend-<d>`` for each ``ep_dispatch``
    variant of the expert-parallel model. ``contenders`` keeps only those (eager always runs)."""
    out = []
    for setup in setups:
        if setup not in SETUPS:
            raise ValueError(f"unknown setup {setup!r}; choose from {', '.join(SETUPS)}")
        for model in SETUPS[setup]:
            if models is not None and model not in models:
                continue
            names = ["eager", "cgbackend"]
            if model in GROUPED_MODELS:
                names.append("grouped-inductor")
            if model == "moe-ep":
                names += [f"cgbackend-{d}" for d in ep_dispatch]
            if contenders is not None:
                names = [n for n in names if n == "eager" or n in contenders]
            shape = dict(batch=batch, seq=_gpt_seq(size, seq))
            if model == "moe-128e":
                shape = (dict(batch=1, seq=seq or DEFAULT_SEQ) if size == "tiny"
                         else dict(zip(("batch", "seq"), MOE_128E_TOKENS)))
                shape["layers"] = MOE_128E_LAYERS
            out.append((Scenario(setup, model, size=size, steps=steps, **shape), tuple(names)))
    return out


DEFAULT_SEQ = 128
"""``--seq`` when not given (capped at the GPT models' ``max_seq``)."""


def _gpt_seq(size: str, seq: Optional[int]) -> int:
    """The GPT models' sequence length: ``seq``, or DEFAULT_SEQ capped at the size's ``max_seq``."""
    from ..models import SIZES
    longest = SIZES[size]["max_seq"]
    if seq is None:
        return min(DEFAULT_SEQ, longest)
    if seq > longest:
        raise ValueError(f"--seq {seq} is longer than the {size} models' max_seq ({longest})")
    return seq


def _accuracy(rec: dict, eager_losses: list, dtype: str) -> tuple[bool, float, float]:
    loss_tol, grad_tol = TOLERANCE[dtype]
    scale = max(abs(v) for v in eager_losses) or 1.0
    loss_rel = rec["loss_diff"] / scale
    grad_rel = rec["grad_diff"] / max(rec["grad_scale"], 1e-30)
    return loss_rel <= loss_tol and grad_rel <= grad_tol, loss_rel, grad_rel


def _max_calls(parts: list[Optional[dict]]) -> Optional[dict]:
    """Eager calls by reason, the most of any rank."""
    if all(p is None for p in parts):
        return None
    out: dict[str, int] = {}
    for part in parts:
        for k, v in (part or {}).items():
            out[k] = max(out.get(k, 0), v)
    return out


def _max(values: list) -> Any:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def _row(name: str, recs: list[dict], eager: list[dict], sc: Scenario, dtype: str, base: dict) -> dict:
    """The row of one contender from every rank's record of it (``eager``: eager's records)."""
    spec = contender(name)
    row: dict[str, Any] = {**dict.fromkeys(ROW_FIELDS), **base, "contender": name,
                           "options": dict(sc.options) if spec.compiler == "cgbackend" else None}
    if sc.model == "moe-ep":
        row["local_dispatch"] = spec.local_dispatch or sc.local_dispatch
    skipped = next((r["skipped"] for r in recs if r.get("skipped")), None)
    error = next((r["error"] for r in recs if r.get("error")), None)
    if skipped or error:
        row["error"] = f"skipped: {skipped}" if skipped else error
        row["accuracy_ok"] = None if skipped else False
        return row
    if all(r.get("times_ms") for r in recs):
        steps = slowest_steps([r["times_ms"] for r in recs])
        row.update(summary(steps), timed_steps=len(steps))
    if name != "eager":
        checks = [_accuracy(r, e["losses"], dtype) for r, e in zip(recs, eager)]
        row.update(accuracy_ok=all(c[0] for c in checks), loss_rel_err=max(c[1] for c in checks),
                   grad_rel_err=max(c[2] for c in checks))
    if spec.compiler == "cgbackend":
        graphs = [r["graphs"] for r in recs]
        warm = len(graphs[0]) // 2
        row.update(graphs=max(g[-1] for g in graphs) if graphs[0] else 0, graphs_per_step=graphs[0],
                   graphs_constant_after_warmup=all(len(set(g[warm:])) <= 1 and r.get("graphs_after_timing", g[-1])
                                                    == g[-1] for g, r in zip(graphs, recs)),
                   eager_calls=_max_calls([r.get("final_eager_calls") for r in recs]),
                   eager_calls_timed=_max_calls([r.get("eager_calls_timed") for r in recs]),
                   inner_fallbacks=_max_calls([r["stats"].get("inner_fallbacks") or {} for r in recs]),
                   static_regions=recs[0]["stats"]["static_regions"],
                   dynamic_regions=recs[0]["stats"]["dynamic_regions"])
    for key in ("peak_mb", "reserved_mb", "alloc_after_fwd_mb", "resident_before_mb"):
        row[key] = _max([(r.get("memory") or {}).get(key) for r in recs])
    row["memory_error"] = next((r["memory_error"] for r in recs if r.get("memory_error")), None)
    return row


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 4) if a is not None and b else None


def rows_for(sc: Scenario, per_rank: list[dict], dtype: str, world: int) -> list[dict]:
    """Rows of one scenario from every rank's run_contenders result (pure): a step's time is its
    slowest rank's; accuracy holds on every rank; memory is the rank with most."""
    base = {"setup": sc.setup, "model": sc.model, "layers": n_layers(sc), "tokens_per_rank": sc.tokens_per_rank,
            "mode": "train", "world_size": world}
    names = list(per_rank[0]["contenders"])
    eager = [r["contenders"]["eager"] for r in per_rank]
    rows = [_row(name, [r["contenders"][name] for r in per_rank], eager, sc, dtype, base) for name in names]
    by_name = {r["contender"]: r for r in rows}
    for row in rows:
        row["vs_eager"] = _ratio(row["median_ms"], by_name["eager"]["median_ms"])
        row["peak_vs_eager"] = _ratio(row["peak_mb"], by_name["eager"]["peak_mb"])
        row["reserved_vs_eager"] = _ratio(row["reserved_mb"], by_name["eager"]["reserved_mb"])
        if sc.model in GROUPED_MODELS and "grouped-inductor" in by_name:
            row["vs_grouped_inductor"] = _ratio(row["median_ms"], by_name["grouped-inductor"]["median_ms"])
    return rows


def error_rows(sc: Scenario, names: Sequence[str], error: str, world: int) -> list[dict]:
    """The rows of a scenario that failed as a whole."""
    base = {"setup": sc.setup, "model": sc.model, "layers": n_layers(sc), "tokens_per_rank": sc.tokens_per_rank,
            "mode": "train", "world_size": world, "accuracy_ok": False, "error": error}
    return [{**dict.fromkeys(ROW_FIELDS), **base, "contender": name} for name in names]


def _command(argv: Sequence[str], world: int) -> str:
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        return shlex.join(["torchrun", "--nproc-per-node", str(world), "-m", "cgbackend", "bench-dist", *argv])
    return shlex.join(["python", "-m", "cgbackend", "bench-dist", *argv])


def _meta(args: argparse.Namespace, world: int, backend: str, device: torch.device) -> dict[str, Any]:
    return {
        "command": _command(args.argv, world),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "world_size": world, "backend": backend, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": args.dtype, "size": args.size, "batch_per_rank": args.batch, "seq": args.seq,
        "compare_steps": args.steps, "timed_steps": args.iters, "timing_blocks": TIMING_ROUNDS,
        "warm_steps_before_timing": WARM_STEPS, "peak_steps": args.peak_steps,
        "simulated_graphs": backend == "gloo",
        "env": {k: os.environ.get(k) for k in NVLS_ENV},
        "timing": "per step: ranks aligned (barrier) and the device synchronized, then perf_counter around "
                  "zero_grad, forward, loss, backward and the SGD step, synchronized; a step's time is its "
                  "slowest rank's",
        "memory": "each contender alone on the device (the others freed, built again from the seed), after "
                  "its warm-up: peak allocated (reserved) over the measured steps, and allocated right after "
                  "the forward",
        "contenders": {name: c.description for name, c in CONTENDERS.items()},
        "setups": {
            "ddp": "DistributedDataParallel(model), then the contender's compile; gradients all-reduced by DDP",
            "fsdp2": "fully_shard on each block and on the root, then the contender's compile",
            "ep": "experts split over the ranks; tokens exchanged with all_to_all_single, splits read "
                  "with .tolist(); router, attention and norms replicated (not all-reduced)",
        },
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cgbackend bench-dist", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="ddp,fsdp2,ep", help="comma-separated: ddp, fsdp2, ep")
    p.add_argument("--models", default=None,
                   help="comma-separated models to run (default: every model of each setup: dense, moe, "
                        "moe-128e (fsdp2), moe-ep (ep))")
    p.add_argument("--contenders", default=None,
                   help="comma-separated contenders besides eager (default: cgbackend, and grouped-inductor "
                        "for the MoE models)")
    p.add_argument("--ep-dispatch", default="",
                   help="comma-separated local dispatches of the expert-parallel model (models/ep.py) to run "
                        "as contenders cgbackend-<dispatch> beside cgbackend on the loop model")
    p.add_argument("--size", default="bench", help="model size (cgbackend.models.SIZES; tiny for a smoke run)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank (GPT models)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length (GPT models: 128, or the size's max_seq if shorter; moe-128e at --size tiny)")
    p.add_argument("--steps", type=int, default=20, help="side-by-side steps compared with eager")
    p.add_argument("--iters", type=int, default=30, help="timed steps of each contender")
    p.add_argument("--peak-steps", type=int, default=PEAK_STEPS,
                   help="steps measured for each contender's memory alone (0: no memory phase)")
    p.add_argument("--dtype", default=None, help="bfloat16 on GPUs, float64 on the CPU by default")
    p.add_argument("--out", default="benchmarks/results/multigpu.json")
    p.add_argument("--append", default=None, metavar="RESULTS_JSON",
                   help="also store the run in the 'multigpu' section of this bench results file "
                        "(benchmarks/results/latest.json), replacing rows of the same setup, model and contender")
    p.add_argument("--markdown", default=None, help="with --append: render the results file's RESULTS.md here")
    return p


def _split(text: Optional[str]) -> Optional[list[str]]:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .render import read_results
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.append:
        read_results(Path(args.append))  # before the run: a wrong path fails now, not after it
    set_nvls_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.dtype is None:
        args.dtype = "bfloat16" if backend == "nccl" else "float64"
    if args.dtype not in TOLERANCE:
        parser.error(f"--dtype must be one of {', '.join(TOLERANCE)}")
    scenarios = plan(_split(args.setups) or [], size=args.size, batch=args.batch, seq=args.seq, steps=args.steps,
                     models=_split(args.models), contenders=_split(args.contenders),
                     ep_dispatch=_split(args.ep_dispatch) or [])
    if "MASTER_PORT" not in os.environ:  # no torchrun: one process
        from .dist_check import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = init_process(local if backend == "nccl" else rank, world, backend, int(os.environ["MASTER_PORT"]))
    if backend == "nccl" and rank != local:
        raise SystemExit("bench-dist runs on one host (RANK must equal LOCAL_RANK)")
    rows: list[dict] = []
    status = 0
    try:
        for sc, names in scenarios:
            torch._dynamo.reset()
            try:
                result = run_contenders(sc, list(names), rank, world, device, dtype=getattr(torch, args.dtype),
                                        simulate=backend == "gloo", time_steps=args.iters,
                                        peak_steps=args.peak_steps)
            except Exception as exc:  # one failed scenario must not hide the others' rows
                log.exception("bench-dist: %s failed", sc.name)
                result = {"error": f"{type(exc).__name__}: {exc}"}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, result)
            if rank == 0:
                errors = [r["error"] for r in gathered if "error" in r]
                new = (error_rows(sc, names, errors[0], world) if errors
                       else rows_for(sc, gathered, args.dtype, world))
                rows.extend(new)
                status |= 1 if errors or any(r["accuracy_ok"] is False for r in new) else 0
                for r in new:
                    print(json.dumps(r), file=sys.stderr, flush=True)
    finally:
        if rank == 0:
            _write(args, {"meta": _meta(args, world, backend, device), "rows": rows})
        torch._dynamo.reset()
        dist.destroy_process_group()
    return status


def _write(args: argparse.Namespace, results: dict) -> None:
    from .render import merge_runs, multigpu_key, read_results, render_markdown, write_json
    if args.out:
        write_json(results, Path(args.out))
    print(table(results["rows"]))
    if args.append:  # read again now: another run may have written it meanwhile
        bench = read_results(Path(args.append))
        old = bench.get("multigpu") or {"meta": {"runs": []}, "rows": []}
        bench["multigpu"] = merge_runs(old, results, key=multigpu_key)
        write_json(bench, Path(args.append))
        if args.markdown:
            Path(args.markdown).write_text(render_markdown(bench), encoding="utf-8")


def table(rows: list[dict]) -> str:
    """The run's rows as a plain-text table (stdout)."""
    head = f"{'setup':6} {'model':9} {'contender':18} {'ms':>9} {'x eager':>8} {'x grouped':>9} {'graphs':>6} " \
           f"{'peak MiB':>9} accuracy"
    lines = [head]
    for r in rows:
        acc = ("ref" if r["contender"] == "eager" and not r.get("error") else "-" if r.get("accuracy_ok") is None
               else "ok" if r["accuracy_ok"] else "FAILED")
        lines.append(f"{r['setup']:6} {r['model']:9} {r['contender']:18} {_cell(r.get('median_ms')):>9} "
                     f"{_cell(r.get('vs_eager')):>8} {_cell(r.get('vs_grouped_inductor')):>9} "
                     f"{_cell(r.get('graphs')):>6} {_cell(r.get('peak_mb')):>9} {acc}"
                     + (f"  ({r['error'][:100]})" if r.get("error") else ""))
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
