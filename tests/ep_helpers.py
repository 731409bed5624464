"""Expert-parallel checks of the fixed-capacity exchange (cgbackend/models/ep_capacity.py).

``simulated_ranks`` runs the exchange of ``W`` ranks in one process (an equal-split all-to-all is
a block transpose), for the math tests. ``spawn_checks`` runs :data:`CHECKS` on two gloo ranks (one
spawn for all of them), or :data:`GPU_CHECKS` on two GPUs with NCCL: each check returns plain data
the test asserts on, or the traceback it raised, so one failing check hides no other.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from cgbackend.models.ep_capacity import combine_rows, dispatch_rows, local_expert_ids, plan_send

D_MODEL, N_EXPERTS, TOP_K = 16, 4, 2


# ----------------------------------------------------------------------------- one process

def _transpose(blocks: list[torch.Tensor], block: int) -> list[torch.Tensor]:
    """What an equal-split all-to-all gives each rank: block ``r`` of every rank's buffer."""
    world = len(blocks)
    return [torch.cat([b[r * block:(r + 1) * block] for b in blocks]) for r in range(world)]


def simulated_ranks(hs: list, weights: list, selected: list, experts: list, capacity: int) -> tuple[list, list]:
    """Each rank's layer output and send plan, the exchange done by hand: ``hs[r]`` ``[tokens, d]``,
    ``weights[r]`` / ``selected[r]`` ``[tokens, top_k]``, ``experts`` all ``E`` experts (rank ``r``
    owns ``r * E/W ..``)."""
    world, top_k = len(hs), selected[0].shape[1]
    n_local = len(experts) // world
    plans = [plan_send(s, len(experts), world, capacity) for s in selected]
    received = _transpose([dispatch_rows(h, p, top_k) for h, p in zip(hs, plans)], capacity)
    counts = _transpose([p.counts for p in plans], n_local)
    outs = []
    for r in range(world):
        ids = local_expert_ids(counts[r], world, n_local, capacity)
        out = torch.zeros_like(received[r])
        for e in range(n_local):
            out = out + torch.where((ids == e).unsqueeze(-1), experts[r * n_local + e](received[r]), 0.0)
        outs.append(out)
    back = _transpose(outs, capacity)
    return [combine_rows(b, p, w) for b, p, w in zip(back, plans, weights)], plans


def dense_reference(h: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor, experts: list) -> torch.Tensor:
    """The MoE layer without expert parallelism: each token's experts on its row, weighted."""
    rows = []
    for t in range(h.shape[0]):
        rows.append(sum(weights[t, j] * experts[int(selected[t, j])](h[t:t + 1])[0] for j in range(selected.shape[1])))
    return torch.stack(rows)


# ----------------------------------------------------------------------------- two ranks

ROUTINGS = {
    "random": None,
    "all_to_rank0": (4.0, 3.0, 0.0, 0.0),  # every routed copy of every rank to rank 0: the worst case
    "all_to_rank1": (0.0, 0.0, 3.0, 4.0),
    "alternating": (4.0, 3.0, -3.0, -4.0),  # even tokens to rank 0's experts, odd ones to rank 1's
}
"""Routing -> the gate's weights on the first input feature (the others zero), the same on every
rank; None keeps the drawn gate."""


def _route(layer: torch.nn.Module, routing: str) -> None:
    column = ROUTINGS[routing]
    if column is not None:
        with torch.no_grad():
            layer.gate.weight.zero_()
            layer.gate.weight[:, 0] = torch.tensor(column, dtype=layer.gate.weight.dtype)


def _inputs(rank: int, routing: str) -> torch.Tensor:
    """A rank's batch; the first feature's sign picks the experts of the routings above."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 6, D_MODEL, generator=gen, dtype=torch.float64)
    if routing != "random":
        x[..., 0] = x[..., 0].abs() + 0.5
    if routing == "alternating":  # tokens per rank: half to each rank, a balanced load
        x[:, 1::2, 0] *= -1
    return x


def _layer(rank: int, world: int, dispatch: str, routing: str, **kw: Any) -> torch.nn.Module:
    from cgbackend.models.ep import EPMoE
    torch.manual_seed(0)
    layer = EPMoE(D_MODEL, 2 * D_MODEL, N_EXPERTS, TOP_K, rank, world, local_dispatch=dispatch, **kw).double()
    _route(layer, routing)
    return layer


def _run_layer(layer: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = layer(xi)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    grads = {name: p.grad for name, p in layer.named_parameters()}
    grads["input"] = xi.grad
    return y.detach(), grads


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def check_equal_to_loop(rank: int, world: int, device: torch.device) -> dict:
    """Eager: the capacity exchange (worst case, and a capacity of the balanced load that falls back
    on overflow) against the dropless loop, output and every gradient, per routing."""
    out = {}
    for routing in ROUTINGS:
        x = _inputs(rank, routing)
        y_ref, g_ref = _run_layer(_layer(rank, world, "loop", routing), x)
        for label, kw in (("worst", {}), ("factor1", {"capacity_factor": 1.0})):
            layer = _layer(rank, world, "capacity", routing, **kw)
            y, g = _run_layer(layer, x)
            missing = sorted(k for k in g_ref if (g_ref[k] is None) != (g.get(k) is None))
            out[f"{routing}:{label}"] = {
                "out": _max_diff(y, y_ref), "scale": float(y_ref.abs().max()),
                "grad": max(_max_diff(g[k], g_ref[k]) for k in g_ref if g_ref[k] is not None),
                "missing": missing, "overflows": layer.overflows.as_dict()}
    return out


def check_overflow_raises(rank: int, world: int, device: torch.device) -> dict:
    """A capacity below this routing's load with overflow="raise": every rank raises (none waits in
    an exchange the others left), and the next call with a routing that fits runs."""
    from cgbackend.models.ep_capacity import CapacityOverflow
    layer = _layer(rank, world, "capacity", "all_to_rank0", capacity_factor=1.0, overflow="raise")
    raised = None
    try:
        layer(_inputs(rank, "all_to_rank0"))
    except CapacityOverflow as exc:
        raised = str(exc)
    _route(layer, "alternating")  # a balanced load: exactly the capacity
    y = layer(_inputs(rank, "alternating"))
    return {"raised": raised, "after": bool(torch.isfinite(y).all()), "overflows": layer.overflows.as_dict()}


def check_scenario(rank: int, world: int, device: torch.device) -> dict:
    """The bench's EP scenario with the capacity exchange, under cgbackend with its collectives
    captured (capture_collectives=True; off by default)."""
    from cgbackend.bench.dist_check import Scenario, run_scenario
    sc = Scenario("ep", "moe-ep", steps=8, layers=1, local_dispatch="capacity",
                  options=(("capture_collectives", True),))
    return run_scenario(sc, rank, world, device, dtype=_dtype(device), simulate=device.type == "cpu")


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float64 if device.type == "cpu" else torch.float32


def _compiled_pair(rank: int, world: int, device: torch.device, **options: Any) -> tuple:
    """The EP model with the capacity exchange on ``device``, compiled (simulated graphs on a CPU),
    and an eager twin with the same weights."""
    import cgbackend
    from cgbackend.models.ep import build_ep_model
    factor = options.pop("capacity_factor", None)
    model = build_ep_model(rank, world, n_layers=1, dtype=_dtype(device), device=device, local_dispatch="capacity",
                           capacity_factor=factor)
    twin = copy.deepcopy(model)
    options.setdefault("capture_collectives", True)  # what these checks are about (off by default)
    compiled = cgbackend.compile(model, simulate_graphs=device.type == "cpu", **options)
    return model, compiled, twin


def _grads_diff(a: torch.nn.Module, b: torch.nn.Module) -> tuple[float, float]:
    """The largest gradient difference and the largest gradient of ``b``."""
    pairs = [(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()) if q.grad is not None]
    return max(_max_diff(g, h) for g, h in pairs), max(float(h.abs().max()) for _, h in pairs)


def check_rank_local_fallbacks(rank: int, world: int, device: torch.device) -> dict:
    """Ranks that capture at different calls (warm-up 1 on rank 0, 3 on rank 1: rank 0 replays while
    rank 1 still runs eagerly) and a rank that drops its graphs mid-run (rank 0 before step 5: it
    captures again while rank 1 replays): the collectives inside the graphs stay matched, and
    training equals eager."""
    import cgbackend
    model, compiled, twin = _compiled_pair(rank, world, device, warmup=1 if rank == 0 else 3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, twin)]
    gen = torch.Generator().manual_seed(7 + rank)
    diffs, scales, eager_calls = [], [], []
    for step in range(8):
        x = torch.randint(0, 128, (2, 16), generator=gen).to(device)
        if step == 5 and rank == 0:
            cgbackend.distributed.release(compiled)
        losses = []
        for fn, opt in zip((compiled, twin), opts):
            opt.zero_grad(set_to_none=True)
            loss = fn(x).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        grad_diff, grad_scale = _grads_diff(model, twin)
        diffs.append(max(_max_diff(losses[0], losses[1]) / float(losses[1].abs()), grad_diff / grad_scale))
        for opt in opts:
            opt.step()
        eager_calls.append(sum(cgbackend.stats(compiled)["eager_calls"].values()))
    stats = cgbackend.stats(compiled)
    return {"rel_diffs": diffs, "eager_calls": eager_calls, "graphs": stats["graphs_captured"],
            "replays": stats["replays"], "bwd_recomputes": stats["bwd_recomputes"],
            "capture_failures": stats["capture_failures"]}


def check_small_capacity_compiled(rank: int, world: int, device: torch.device) -> dict:
    """A capacity below the worst case under cgbackend: the overflow check is a host read between
    two graphs; calls that overflow run at the worst case; training equals eager."""
    import cgbackend
    model, compiled, twin = _compiled_pair(rank, world, device, capacity_factor=1.0)
    gen = torch.Generator().manual_seed(11 + rank)
    diffs = []
    for step in range(6):
        # a narrow vocabulary routes most tokens alike: some calls overflow, others do not
        x = torch.randint(0, 128 if step % 2 else 3, (2, 16), generator=gen).to(device)
        outs = []
        for m in (compiled, twin):
            y = m(x)
            y.pow(2).mean().backward()
            outs.append(y.detach())
        grad_diff, grad_scale = _grads_diff(model, twin)
        diffs.append(max(_max_diff(outs[0], outs[1]) / float(outs[1].abs().max()), grad_diff / grad_scale))
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
    stats = cgbackend.stats(compiled)
    return {"rel_diffs": diffs, "overflows": model.layers[0].ffn.overflows.as_dict(),
            "twin_overflows": twin.layers[0].ffn.overflows.as_dict(),
            "replays": stats["replays"], "capture_failures": stats["capture_failures"]}


CHECKS: dict[str, Callable[[int, int, torch.device], dict]] = {
    "equal_to_loop": check_equal_to_loop,
    "overflow_raises": check_overflow_raises,
    "scenario": check_scenario,
    "rank_local_fallbacks": check_rank_local_fallbacks,
    "small_capacity_compiled": check_small_capacity_compiled,
}


GPU_CHECKS = ("rank_local_fallbacks", "small_capacity_compiled")
"""The checks that also run on two GPUs (NCCL, real CUDA graphs); the others are eager or covered
by tests/integrations/test_distributed.py's scenarios."""


def rank_checks(rank: int, world: int, port: int, out_dir: str, backend: str, names: tuple) -> None:
    """One spawned rank: the checks ``names`` in turn (a failure is recorded and the next still
    runs), then the graphs go before the process group."""
    from cgbackend.bench.dist_check import init_process
    device = init_process(rank, world, backend, port)
    results: dict[str, Any] = {}
    try:
        for name in names:
            torch._dynamo.reset()
            start = time.perf_counter()
            try:
                results[name] = CHECKS[name](rank, world, device)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                if backend == "nccl":
                    break  # a failed NCCL job may leave the communicator unusable
            results[name]["seconds"] = time.perf_counter() - start
    finally:
        torch._dynamo.reset()
        dist.barrier()
        dist.destroy_process_group()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"results": results, "finished": time.time()}, f)


def spawn_checks(world: int = 2, backend: str = "gloo", names: tuple = tuple(CHECKS),
                 timeout_s: float = 300.0) -> tuple[list, list, float]:
    """Run :func:`rank_checks` on ``world`` spawned ranks: (per rank ``{"results", "finished"}``
    or None, exit codes, seconds from the last rank's destroy_process_group to the processes'
    exit). A rank that fails raises here with its traceback; ranks still running after
    ``timeout_s`` (a hang) are killed and raise TimeoutError."""
    import torch.multiprocessing as mp
    from cgbackend.bench.dist_check import free_port, spawn_env
    spawn_env(backend)  # inherited by the children
    with tempfile.TemporaryDirectory(prefix="cgbackend-ep-") as out_dir:
        ctx = mp.start_processes(rank_checks, args=(world, free_port(), out_dir, backend, names), nprocs=world,
                                 join=False, start_method="spawn")
        deadline = time.time() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.time() > deadline:
                    raise TimeoutError(f"the ranks still ran after {timeout_s} s: a collective out of step?")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        exited = time.time()
        paths = [os.path.join(out_dir, f"rank{r}.json") for r in range(world)]
        ranks = [json.load(open(path)) if os.path.exists(path) else None for path in paths]
    finished = [r["finished"] for r in ranks if r is not None]
    return ranks, [p.exitcode for p in ctx.processes], (exited - max(finished)) if finished else float("inf")
