"""``python -m cgbackend bench-dist``: training steps under DDP, FSDP2 and expert parallelism.

Run with torchrun, one process per GPU::

    torchrun --nproc-per-node 2 -m cgbackend bench-dist [--size bench] [--steps 20] [--iters 30]

Every rank trains the chosen setups (cgbackend.dist_check.Scenario) with cgbackend and with the
same engine eagerly, side by side on the same batches for ``--steps`` steps (loss and every
gradient compared: ``accuracy_ok``), then times ``--iters`` more steps of each. Rank 0 writes
``benchmarks/results/multigpu.json``: ``{"meta": {...}, "rows": [...]}``, one row per setup,
model, mode and contender, the slowest rank's median step time. Without torchrun's environment it
runs one process on the CPU (gloo, simulated graphs): a smoke run of the code, not a benchmark.
NVLink multicast stays off (cgbackend.distributed.NVLS_ENV).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from .dist_check import Scenario, init_process, run_scenario
from ..distributed import NVLS_ENV, set_nvls_env

__all__ = ["main", "plan", "rows_for", "TOLERANCE"]

log = logging.getLogger(__name__)

TOLERANCE = {"bfloat16": (2e-2, 5e-2), "float16": (2e-2, 5e-2), "float32": (1e-4, 1e-3), "float64": (1e-9, 1e-9)}
"""dtype -> (relative loss difference, gradient difference relative to the largest gradient)."""

STATIC = (("static_dispatch", "auto"),)


def plan(setups: Sequence[str], *, size: str, batch: int, seq: int, steps: int) -> list[tuple[str, Scenario]]:
    """(contender, scenario) pairs: cgbackend for every setup and model, and the static-dispatch
    contender for the MoE models (EP: local experts on a fixed-capacity buffer)."""
    out = []
    common = dict(size=size, batch=batch, seq=seq, steps=steps)
    for setup in setups:
        if setup in ("ddp", "fsdp2"):
            out.append(("cgbackend", Scenario(setup, "dense", **common)))
            out.append(("cgbackend", Scenario(setup, "moe", **common)))
            out.append(("cgbackend-static-dispatch", Scenario(setup, "moe", options=STATIC, **common)))
        elif setup == "ep":
            out.append(("cgbackend", Scenario("ep", "moe-ep", **common)))
            out.append(("cgbackend-static-dispatch",
                        Scenario("ep", "moe-ep", local_dispatch="padded", options=STATIC, **common)))
        else:
            raise ValueError(f"unknown setup {setup!r}; choose from ddp, fsdp2, ep")
    return out


def _accuracy(result: dict, dtype: str) -> tuple[bool, float, float]:
    loss_tol, grad_tol = TOLERANCE[dtype]
    scale = max(abs(v) for v in result["losses"]["eager"]) or 1.0
    loss_rel = result["loss_diff"] / scale
    grad_rel = result["grad_diff"] / max(result["grad_scale"], 1e-30)
    return loss_rel <= loss_tol and grad_rel <= grad_tol, loss_rel, grad_rel


def rows_for(contender: str, sc: Scenario, per_rank: list[dict], dtype: str, world: int,
             with_eager: bool) -> list[dict]:
    """Rows of one scenario from every rank's run_scenario result (pure)."""
    checks = [_accuracy(r, dtype) for r in per_rank]
    ok = all(c[0] for c in checks)
    graphs = [r["graphs"] for r in per_rank]
    warm = len(graphs[0]) // 2
    constant = all(len(set(g[warm:])) == 1 for g in graphs)
    base = {"setup": sc.setup, "model": sc.model, "mode": "train", "world_size": world}
    rows = []
    if with_eager:
        rows.append({**base, "contender": "eager",
                     "median_ms": round(max(r["timing_ms"]["eager"] for r in per_rank), 4),
                     "accuracy_ok": True, "graphs": 0})
    rows.append({**base, "contender": contender,
                 "median_ms": round(max(r["timing_ms"]["cgbackend"] for r in per_rank), 4),
                 "eager_ms_same_run": round(max(r["timing_ms"]["eager"] for r in per_rank), 4),
                 "accuracy_ok": ok,
                 "loss_rel_err": max(c[1] for c in checks), "grad_rel_err": max(c[2] for c in checks),
                 "graphs": max(g[-1] for g in graphs),
                 "graphs_per_step": graphs[0],
                 "graphs_constant_after_warmup": constant,
                 "options": dict(sc.options),
                 "local_dispatch": sc.local_dispatch if sc.model == "moe-ep" else None,
                 "eager_calls": per_rank[0]["final_eager_calls"],
                 "static_regions": per_rank[0]["stats"]["static_regions"],
                 "dynamic_regions": per_rank[0]["stats"]["dynamic_regions"]})
    return rows


def _meta(args: argparse.Namespace, world: int, backend: str, device: torch.device) -> dict[str, Any]:
    return {
        "command": "torchrun --nproc-per-node %d -m cgbackend bench-dist %s" % (world, " ".join(args.argv)),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "world_size": world, "backend": backend, "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": args.dtype, "size": args.size, "batch_per_rank": args.batch, "seq": args.seq,
        "compare_steps": args.steps, "timed_steps": args.iters,
        "env": {k: os.environ.get(k) for k in NVLS_ENV},
        "setups": {
            "ddp": "DistributedDataParallel(model), then cgbackend.compile; gradients all-reduced by DDP",
            "fsdp2": "fully_shard on each block and on the root, then cgbackend.compile",
            "ep": "experts split over the ranks; tokens exchanged with all_to_all_single, splits read "
                  "with .tolist(); router, attention and norms replicated (not all-reduced)",
        },
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cgbackend bench-dist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", default="ddp,fsdp2,ep", help="comma-separated: ddp, fsdp2, ep")
    parser.add_argument("--size", default="bench", help="model size (cgbackend.models.SIZES; tiny for a smoke run)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="side-by-side steps compared with eager")
    parser.add_argument("--iters", type=int, default=30, help="timed steps of each contender")
    parser.add_argument("--dtype", default=None, help="bfloat16 on GPUs, float64 on the CPU by default")
    parser.add_argument("--out", default="benchmarks/results/multigpu.json")
    args = parser.parse_args(argv)
    args.argv = argv
    set_nvls_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if args.dtype is None:
        args.dtype = "bfloat16" if backend == "nccl" else "float64"
    if args.dtype not in TOLERANCE:
        parser.error(f"--dtype must be one of {', '.join(TOLERANCE)}")
    if "MASTER_PORT" not in os.environ:  # no torchrun: one process
        from .dist_check import free_port
        os.environ["MASTER_PORT"] = str(free_port())
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = init_process(local if backend == "nccl" else rank, world, backend, int(os.environ["MASTER_PORT"]))
    if backend == "nccl" and rank != local:
        raise SystemExit("bench-dist runs on one host (RANK must equal LOCAL_RANK)")
    dtype = getattr(torch, args.dtype)
    rows: list[dict] = []
    status = 0
    try:
        seen_eager: set = set()
        for contender, sc in plan(args.setups.split(","), size=args.size, batch=args.batch, seq=args.seq,
                                  steps=args.steps):
            torch._dynamo.reset()
            try:
                result = run_scenario(sc, rank, world, device, dtype=dtype, simulate=backend == "gloo",
                                      time_steps=args.iters)
            except Exception as exc:  # one failed scenario must not hide the others' rows
                log.exception("bench-dist: %s %s failed", sc.name, contender)
                result = {"error": f"{type(exc).__name__}: {exc}"}
            gathered: list = [None] * world
            dist.all_gather_object(gathered, result)
            if rank == 0:
                errors = [r["error"] for r in gathered if "error" in r]
                if errors:
                    status = 1
                    rows.append({"setup": sc.setup, "model": sc.model, "mode": "train", "contender": contender,
                                 "median_ms": None, "accuracy_ok": False, "graphs": None,
                                 "world_size": world, "error": errors[0]})
                else:
                    key = (sc.setup, sc.model)
                    new = rows_for(contender, sc, gathered, args.dtype, world, key not in seen_eager)
                    seen_eager.add(key)
                    rows.extend(new)
                    status |= 0 if all(r["accuracy_ok"] for r in new) else 1
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"meta": _meta(args, world, backend, device), "rows": rows}, f, indent=1)
            _print_table(rows)
        torch._dynamo.reset()
        dist.destroy_process_group()
    return status


def _print_table(rows: list[dict]) -> None:
    eager = {(r["setup"], r["model"]): r["median_ms"] for r in rows if r["contender"] == "eager"}
    print(f"{'setup':6} {'model':7} {'contender':26} {'ms':>9} {'x eager':>8} {'graphs':>6} accuracy")
    for r in rows:
        base = eager.get((r["setup"], r["model"]))
        ratio = f"{r['median_ms'] / base:.2f}" if base and r.get("median_ms") else "-"
        print(f"{r['setup']:6} {r['model']:7} {r['contender']:26} {r.get('median_ms') or '-':>9} {ratio:>8} "
              f"{str(r.get('graphs')):>6} {'ok' if r['accuracy_ok'] else 'FAILED'}")
