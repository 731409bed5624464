"""DDP, FSDP2 and expert parallelism under cgbackend, with default options.

Two ranks are spawned with torch.multiprocessing. On CPU (gloo, simulated graphs) everything runs in
CI: one spawn runs every scenario for a few steps on small models (a scenario that fails is
recorded and the next ones still run). The ``multigpu`` tests run the scenarios for 20 steps on two
GPUs with NCCL and real CUDA graphs (skipped without two), each scenario in a spawned job of its
own, so one failure hides no other. Each compares the loss and every gradient with the same engine
without cgbackend on the same data, checks the graph count stays constant after warm-up, that no
region ran eagerly but in warm-up, and that the processes exit soon after
``destroy_process_group``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cgbackend
from cgbackend.bench.dist_check import Scenario, spawn_run

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401
    _HAVE_FSDP2 = dist.is_available()
except ImportError:
    _HAVE_FSDP2 = False
fsdp_available = pytest.mark.skipif(not _HAVE_FSDP2, reason="torch without FSDP2 or torch.distributed")

CPU_STEPS, CPU_STABLE_FROM = 8, 5
"""CPU scenarios: steps, and the step after which the graph count must not change (warm-up 3,
capture at the 4th call, and one call of margin)."""

CPU_SCENARIOS = [
    Scenario("ddp", "dense", steps=CPU_STEPS, layers=1),
    # deeper than max_pending_forwards (4): each fully_shard'ed layer's forward waits for its
    # backward, and the bound scales with the layers sharing the graph (runtime/sharing.py)
    Scenario("fsdp2", "dense", steps=CPU_STEPS, layers=6),
    # static dispatch (the default) on FSDP2's DTensor expert parameters
    Scenario("fsdp2", "moe", steps=CPU_STEPS, layers=1),
    Scenario("ep", "moe-ep", steps=CPU_STEPS, layers=1),
]


def _by_scenario(run, name: str) -> list[dict]:
    out = []
    for rank in run.ranks:
        assert rank is not None, f"a rank wrote no result (exit codes {run.exitcodes})"
        mine = [r for r in rank["results"] if r["scenario"] == name]
        for r in mine:
            assert r.get("error") is None, r["error"]
        assert mine or rank["error"] is None, rank["error"]
        out.extend(mine)
    assert len(out) == len(run.ranks), f"{name}: {len(out)} results"
    return out


def _check(results: list[dict], stable_from: int, rel_tol: float) -> None:
    for r in results:
        where = f"{r['scenario']} rank {r['rank']}"
        assert len(r["losses"]["eager"]) == len(r["graphs"]), where
        assert r["loss_diff"] <= rel_tol * max(abs(v) for v in r["losses"]["eager"]), (where, r["loss_diff"])
        assert r["grad_diff"] <= rel_tol * max(r["grad_scale"], 1e-30), (where, r["grad_diff"], r["grad_scale"])
        graphs = r["graphs"]
        assert graphs[-1] > 0, f"{where}: nothing captured ({r['final_eager_calls']})"
        assert len(set(graphs[stable_from:])) == 1, f"{where}: graph count changed after warm-up: {graphs}"
        assert r["stats"]["replays"] > 0, where
        assert not r["stats"]["capture_failures"], (where, r["stats"]["capture_failures"])
        # every region call past warm-up replayed a graph: no eager call for another reason
        assert set(r["final_eager_calls"]) <= {"warmup"}, (where, r["final_eager_calls"])


@pytest.fixture(scope="module")
def cpu_run():
    return spawn_run(CPU_SCENARIOS, world=2, backend="gloo", dtype="float64", timeout_s=300)


@fsdp_available
class TestGlooSimulated:
    def test_ddp_dense_equals_eager_ddp(self, cpu_run):
        _check(_by_scenario(cpu_run, "ddp:dense"), CPU_STABLE_FROM, 1e-12)

    def test_fsdp2_dense_equals_eager_fsdp2_with_constant_graphs(self, cpu_run):
        results = _by_scenario(cpu_run, "fsdp2:dense")
        _check(results, CPU_STABLE_FROM, 1e-12)
        for r in results:
            # a forward and a backward graph per layer (each waits for its backward in a call slot
            # of its own) and for the root's pieces around the layers, not one per step or address
            assert r["graphs"][-1] <= 3 * (6 + 2), r["graphs"]

    def test_fsdp2_moe_static_dispatch_on_sharded_experts_equals_eager(self, cpu_run):
        results = _by_scenario(cpu_run, "fsdp2:moe")
        _check(results, CPU_STABLE_FROM, 1e-12)

    def test_ep_moe_exchange_is_dynamic_and_training_equals_eager(self, cpu_run):
        results = _by_scenario(cpu_run, "ep:moe-ep:loop")
        _check(results, CPU_STABLE_FROM, 1e-12)
        for r in results:
            assert r["stats"]["dynamic_regions"] >= 1 and r["stats"]["static_regions"] >= 2, r["stats"]

    def test_processes_exit_within_30s(self, cpu_run):
        assert all(code == 0 for code in cpu_run.exitcodes), cpu_run.exitcodes
        assert cpu_run.exit_s < 30, cpu_run.exit_s


# ---------------------------------------------------------------------------- two GPUs

GPU_SCENARIOS = {sc.name: sc for sc in [
    Scenario("ddp", "dense"),
    Scenario("ddp", "moe"),
    Scenario("fsdp2", "dense", layers=6),
    Scenario("fsdp2", "moe"),
    Scenario("ep", "moe-ep"),
    Scenario("ep", "moe-ep", local_dispatch="padded"),
    Scenario("ep", "moe-ep", local_dispatch="capacity"),
]}
"""Default options throughout (static dispatch is on by default); FSDP2's dense model is deeper
than max_pending_forwards."""


@pytest.fixture(scope="module")
def gpu_runs():
    """Each scenario in a spawned job of its own, run when a test first asks for it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    runs: dict = {}

    def run(name: str):
        if name not in runs:
            runs[name] = spawn_run([GPU_SCENARIOS[name]], world=2, backend="nccl", dtype="float32",
                                   timeout_s=300)
        return runs[name]
    return run


CAPACITY_ON_GPUS = pytest.mark.xfail(
    strict=True, reason="seen on two H200s (fp32, default options, collectives eager): the capacity exchange "
    "under cgbackend gives a loss 1e-2 (relative) off the same model run eagerly, where gloo with simulated "
    "graphs (CPU, float64) matches to 1e-12; not found yet")
"""A known defect, measured: the scenario stays in the run so that a fix shows (strict)."""


@pytest.mark.multigpu
@pytest.mark.parametrize("name", [pytest.param(n, marks=CAPACITY_ON_GPUS) if n.endswith(":capacity") else n
                                  for n in sorted(GPU_SCENARIOS)])
def test_two_gpus_training_equals_eager_and_exits_within_30s(gpu_runs, name):
    run = gpu_runs(name)
    # fp32 with the same kernels: equal up to cuBLAS choosing other algorithms inside a capture
    _check(_by_scenario(run, name), stable_from=10, rel_tol=1e-4)
    assert all(code == 0 for code in run.exitcodes), run.exitcodes
    assert run.exit_s < 30, run.exit_s
