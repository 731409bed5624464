"""DDP, FSDP2 and expert parallelism under cgbackend.

Two ranks are spawned with torch.multiprocessing. On CPU (gloo, simulated graphs) everything runs in
CI: one spawn runs every scenario for a few steps on one-layer models. The ``multigpu`` tests run
the same scenarios for 20 steps on two GPUs with NCCL and real CUDA graphs (skipped without two).
Each compares the loss and every gradient with the same engine without cgbackend on the same data,
checks the graph count stays constant after warm-up, and checks the processes exit soon after
``destroy_process_group``. Unit tests below need no second process.
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
    Scenario("fsdp2", "dense", steps=CPU_STEPS, layers=1),
    Scenario("ep", "moe-ep", steps=CPU_STEPS, layers=1),
]


def _by_scenario(run, name: str) -> list[dict]:
    out = []
    for rank in run.ranks:
        assert rank is not None, f"a rank wrote no result (exit codes {run.exitcodes})"
        assert rank["error"] is None, rank["error"]
        out.extend(r for r in rank["results"] if r["scenario"] == name)
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
        assert "param_moved" not in r["final_eager_calls"], (where, r["final_eager_calls"])


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
            # one forward and one backward graph per call slot (the root and the block run in
            # slots 0 and 1 while their backward is pending), not one per parameter address
            assert r["graphs"][-1] <= 4, r["graphs"]

    def test_ep_moe_exchange_is_dynamic_and_training_equals_eager(self, cpu_run):
        results = _by_scenario(cpu_run, "ep:moe-ep:loop")
        _check(results, CPU_STABLE_FROM, 1e-12)
        for r in results:
            assert r["stats"]["dynamic_regions"] >= 1 and r["stats"]["static_regions"] >= 2, r["stats"]

    def test_processes_exit_within_30s(self, cpu_run):
        assert all(code == 0 for code in cpu_run.exitcodes), cpu_run.exitcodes
        assert cpu_run.exit_s < 30, cpu_run.exit_s


# ---------------------------------------------------------------------------- two GPUs

GPU_SCENARIOS = [
    Scenario("ddp", "dense"),
    Scenario("ddp", "moe", options=(("static_dispatch", "auto"),)),
    Scenario("fsdp2", "dense"),
    Scenario("fsdp2", "moe", options=(("static_dispatch", "auto"),)),
    Scenario("ep", "moe-ep"),
    Scenario("ep", "moe-ep", local_dispatch="padded", options=(("static_dispatch", "auto"),)),
]


@pytest.fixture(scope="module")
def gpu_run():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    return spawn_run(GPU_SCENARIOS, world=2, backend="nccl", dtype="float32", timeout_s=540)


@pytest.mark.multigpu
@pytest.mark.parametrize("name", sorted({s.name for s in GPU_SCENARIOS}))
def test_two_gpus_training_equals_eager(gpu_run, name):
    # fp32 with the same kernels: equal up to cuBLAS choosing other algorithms inside a capture
    _check(_by_scenario(gpu_run, name), stable_from=10, rel_tol=1e-4)


@pytest.mark.multigpu
def test_two_gpus_processes_exit_within_30s(gpu_run):
    assert all(code == 0 for code in gpu_run.exitcodes), gpu_run.exitcodes
    assert gpu_run.exit_s < 30, gpu_run.exit_s
