"""Distributed scenarios run on every rank: the same model compiled with cgbackend and eager, under
DDP, FSDP2 (``fully_shard``) or expert parallelism, trained side by side on the same data.

Used by tests/test_distributed.py (gloo on CPU with simulated graphs, NCCL on GPUs) and by
``python -m cgbackend bench-dist``. :func:`run_scenario` returns plain data (losses, the largest
gradient difference, graph counts after each step) that the caller checks.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["Scenario", "SETUPS", "run_scenario", "init_process", "spawn_env", "wrap", "rank_main", "spawn_run",
           "SpawnResult"]

SETUPS = {"ddp": ("dense", "moe"), "fsdp2": ("dense", "moe"), "ep": ("moe-ep",)}
"""Distributed setup -> the models it runs."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    setup: str
    """"ddp", "fsdp2" or "ep"."""
    model: str
    """"dense", "moe" (Mixtral-style dispatch, replicated experts) or "moe-ep" (experts split)."""
    steps: int = 20
    size: str = "tiny"
    batch: int = 2
    seq: int = 16
    options: tuple = ()
    """cgbackend options as (name, value) pairs."""
    local_dispatch: str = "loop"
    """moe-ep only: "loop" or "padded" (models/ep.py)."""
    lr: float = 0.05
    layers: Optional[int] = None
    """Override of the model size's layer count (CPU tests use 1)."""

    @property
    def name(self) -> str:
        return f"{self.setup}:{self.model}" + (f":{self.local_dispatch}" if self.model == "moe-ep" else "")


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


def _build(sc: Scenario, rank: int, world: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from ..models import build_model
    from ..models.ep import build_ep_model
    if sc.model == "moe-ep":
        kw = {"tiny": dict(d_model=64, n_layers=2, n_heads=4, n_experts=4),
              "bench": dict(d_model=512, n_layers=4, n_heads=8, n_experts=8, vocab=1024, max_seq=512)}[sc.size]
        if sc.layers is not None:
            kw["n_layers"] = sc.layers
        return build_ep_model(rank, world, device=device, dtype=dtype, local_dispatch=sc.local_dispatch, **kw)
    extra = {"n_layers": sc.layers} if sc.layers is not None else {}
    return build_model(sc.model, size=sc.size, device=device, dtype=dtype, **extra)


def wrap(sc: Scenario, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The distributed engine around a model, as a user would apply it."""
    if sc.setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if sc.setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return model  # ep: the experts are split by construction; the rest is replicated


def _inputs(sc: Scenario, model: torch.nn.Module, rank: int, device: torch.device) -> list:
    vocab = 1024 if sc.size == "bench" else 128
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (sc.batch, sc.seq), generator=gen).to(device) for _ in range(4)]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out[name] = g.to_local() if hasattr(g, "to_local") else g
    return out


def _grad_diff(a: torch.nn.Module, b: torch.nn.Module, where: str) -> tuple[float, float]:
    """The largest difference between the two models' gradients and the largest gradient of ``b``.
    Holds no gradient past the call: a harness that kept ``.grad`` tensors between steps would
    be a user holding gradients, which the runtime must then not overwrite (it runs such calls
    eagerly, counted as replay_order_hazard)."""
    ga, gb = _grads(a), _grads(b)
    if set(ga) != set(gb):
        raise AssertionError(f"{where}: gradients of {sorted(set(ga) ^ set(gb))} exist on one side only")
    diff = scale = 0.0
    for key in ga:
        diff = max(diff, float((ga[key].double() - gb[key].double()).abs().max()))
        scale = max(scale, float(gb[key].double().abs().max()))
    return diff, scale


def run_scenario(sc: Scenario, rank: int, world: int, device: torch.device, *, dtype: torch.dtype,
                 simulate: bool, compare: bool = True, time_steps: int = 0) -> dict[str, Any]:
    """Train ``sc.steps`` steps of the compiled model and (``compare``) of an eager twin on the same
    batches; returns losses, max gradient and loss differences, graph counts per step and (with
    ``time_steps``) the median time of that many further steps of each."""
    import cgbackend

    base = _build(sc, rank, world, device, dtype)
    options = dict(sc.options)  # the defaults otherwise: nothing here scales an option with the depth
    if simulate:
        options["simulate_graphs"] = True
    twin = copy.deepcopy(base) if compare else None
    model = wrap(sc, base, device)
    compiled = cgbackend.compile(model, **options)
    runs = [("cgbackend", model, compiled)]
    if twin is not None:
        eager = wrap(sc, twin, device)
        runs.append(("eager", eager, eager))
    opts = {name: torch.optim.SGD(m.parameters(), lr=sc.lr) for name, m, _ in runs}
    batches = _inputs(sc, base, rank, device)
    losses: dict[str, list] = {name: [] for name, _, _ in runs}
    grad_diff, loss_diff, grad_scale = 0.0, 0.0, 0.0
    graphs: list[int] = []
    eager_calls: list[dict] = []

    def step(name: str, module: torch.nn.Module, fn: Callable, x: torch.Tensor) -> torch.Tensor:
        opts[name].zero_grad(set_to_none=True)
        out = fn(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    for i in range(sc.steps):
        x = batches[i % len(batches)]
        results = {}
        for name, module, fn in runs:
            results[name] = step(name, module, fn, x)
            losses[name].append(float(results[name].detach()))
        if len(runs) == 2:
            loss_diff = max(loss_diff, abs(losses["cgbackend"][-1] - losses["eager"][-1]))
            diff, scale = _grad_diff(runs[0][1], runs[1][1], f"rank {rank} step {i}")
            grad_diff, grad_scale = max(grad_diff, diff), max(grad_scale, scale)
        for name, _, _ in runs:
            opts[name].step()
        stats = cgbackend.stats(compiled)
        graphs.append(stats["graphs_captured"])
        eager_calls.append(dict(stats["eager_calls"]))
    timing: dict[str, float] = {}
    if time_steps:
        for name, module, fn in runs:
            times = []
            for i in range(time_steps):
                x = batches[i % len(batches)]
                _sync(device)
                start = time.perf_counter()
                step(name, module, fn, x)
                opts[name].step()
                _sync(device)
                times.append(time.perf_counter() - start)
            times.sort()
            timing[name] = 1000 * times[len(times) // 2]
    stats = cgbackend.stats(compiled)
    return {"rank": rank, "scenario": sc.name, "losses": losses, "grad_diff": grad_diff,
            "grad_scale": grad_scale, "loss_diff": loss_diff,
            "graphs": graphs, "eager_calls": eager_calls, "timing_ms": timing,
            "stats": {k: stats.get(k) for k in ("graphs_captured", "replays", "fwd_replays", "bwd_replays",
                                               "static_regions", "dynamic_regions", "capture_failures")},
            "final_eager_calls": dict(stats.get("eager_calls", {}))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
