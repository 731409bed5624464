"""Distributed scenarios run on every rank: the same model compiled with cgbackend and eager, under
DDP, FSDP2 (``fully_shard``) or expert parallelism, trained side by side on the same data.

Used by tests/integrations/test_distributed.py (gloo on CPU with simulated graphs, NCCL on GPUs) and
by ``python -m cgbackend bench-dist``. :func:`run_scenario` returns plain data (losses, the largest
gradient difference, graph counts after each step) that the caller checks; the run itself is
dist_run's (the scenarios and models: dist_models). :func:`spawn_run` runs scenarios on spawned
ranks.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from .dist_models import SETUPS, Scenario, wrap
from .dist_run import run_contenders

__all__ = ["Scenario", "SETUPS", "run_scenario", "init_process", "spawn_env", "wrap", "rank_main", "spawn_run",
           "SpawnResult", "free_port"]


def spawn_env(backend: str) -> None:
    """Environment for a spawned rank: NVLink multicast off on GPUs (cgbackend.distributed)."""
    from ..distributed import set_nvls_env
    if backend == "nccl":
        set_nvls_env()


def init_process(rank: int, world_size: int, backend: str, port: int) -> torch.device:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    spawn_env(backend)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, device_id=device)
        return device
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return torch.device("cpu")


def run_scenario(sc: Scenario, rank: int, world: int, device: torch.device, *, dtype: torch.dtype,
                 simulate: bool, time_steps: int = 0) -> dict[str, Any]:
    """Train ``sc.steps`` steps of the model compiled with cgbackend and of an eager twin on the
    same batches; returns losses, the largest gradient and loss differences, graph counts per step
    and (with ``time_steps``) the median time of that many further steps of each (timed in
    alternating blocks). A failure of either raises."""
    result = run_contenders(sc, ["eager", "cgbackend"], rank, world, device, dtype=dtype, simulate=simulate,
                            time_steps=time_steps)
    per = result["contenders"]
    for name, rec in per.items():
        if rec.get("error"):
            raise RuntimeError(f"{sc.name} {name}: {rec['error']}")
    cg = per["cgbackend"]
    timing = {name: sorted(rec["times_ms"])[len(rec["times_ms"]) // 2] for name, rec in per.items()
              if rec.get("times_ms")}
    return {"rank": rank, "scenario": sc.name, "losses": {name: rec["losses"] for name, rec in per.items()},
            "grad_diff": cg["grad_diff"], "grad_scale": cg["grad_scale"], "loss_diff": cg["loss_diff"],
            "graphs": cg["graphs"], "eager_calls": cg["eager_calls"], "timing_ms": timing,
            "stats": cg["stats"], "final_eager_calls": cg["final_eager_calls"]}


def rank_main(rank: int, world: int, backend: str, port: int, scenarios: list, out_dir: str,
              dtype_name: str, time_steps: int = 0) -> None:
    """One rank of a spawned run (tests, benchmark): every scenario in turn, one JSON file per
    rank in ``out_dir``; ``finished`` is the time after destroy_process_group, so the parent can
    tell how long the interpreter took to exit."""
    import json

    import traceback

    device = init_process(rank, world, backend, port)
    dtype = getattr(torch, dtype_name)
    results, error = [], None
    try:
        for sc in scenarios:
            torch._dynamo.reset()
            try:
                results.append(run_scenario(sc, rank, world, device, dtype=dtype, simulate=backend == "gloo",
                                            time_steps=time_steps))
            except Exception:  # this scenario's failure, for the parent; the next scenarios still run
                results.append({"rank": rank, "scenario": sc.name, "error": traceback.format_exc()})
                if backend == "nccl":
                    raise  # a failed NCCL job may leave the communicator unusable: stop this rank
    except Exception:  # written for the parent, then raised so the rank fails
        error = traceback.format_exc()
        raise
    finally:
        torch._dynamo.reset()  # the compiled graphs and their backends go first (README: exit)
        dist.destroy_process_group()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"results": results, "error": error, "finished": time.time()}, f)


@dataclasses.dataclass
class SpawnResult:
    ranks: list
    """Per rank: {"results": [run_scenario dicts], "error", "finished"}."""
    exit_s: float
    """Seconds from the last rank's destroy_process_group to the last process's exit."""
    exitcodes: list


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_run(scenarios: list, *, world: int = 2, backend: str = "gloo", dtype: str = "float64",
              time_steps: int = 0, timeout_s: float = 600.0) -> SpawnResult:
    """Run ``scenarios`` on ``world`` spawned ranks (torch.multiprocessing) and collect their results.
    Ranks still alive ``timeout_s`` after the start are killed and reported with exit code None."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    spawn_env(backend)  # inherited by the children
    with tempfile.TemporaryDirectory(prefix="cgbackend-dist-") as out_dir:
        ctx = mp.start_processes(rank_main, args=(world, backend, free_port(), scenarios, out_dir, dtype,
                                                  time_steps),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if all(not p.is_alive() for p in ctx.processes):
                break
            time.sleep(0.2)
        exited = time.time()
        codes = []
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
                codes.append(None)
            else:
                codes.append(p.exitcode)
        ranks = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.json")
            ranks.append(json.load(open(path)) if os.path.exists(path) else None)
    finished = [r["finished"] for r in ranks if r is not None]
    exit_s = exited - max(finished) if finished else float("inf")
    return SpawnResult(ranks=ranks, exit_s=exit_s, exitcodes=codes)
