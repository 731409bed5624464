"""Expert parallelism with a fixed-capacity exchange (models/ep_capacity.py) and the collectives a
graph may hold (passes/collectives.py).

In one process: the exchange's math for two ranks simulated by hand (equal to a dense MoE, output
and gradients, overflow counted), the classification of static and dynamic collectives on traced
graphs, and, on a one-rank gloo group, that every call of a region holding a collective issues it
exactly once (warm-up, capture, replay, a backward through the captured forward, a release). One
spawn of two gloo ranks runs the checks of tests/ep_helpers.py: the capacity exchange against the
dropless loop, overflow raised on every rank, training under cgbackend with the whole layer in one
static region, and ranks that capture or fall back at different calls.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol

import cgbackend
from cgbackend.by_name import find_backend
from cgbackend.config import Config
from cgbackend.models.ep_capacity import CapacityOverflow, OverflowCounter, capacity_for
from cgbackend.models.layers import Expert
from cgbackend.passes.classify import classify
from cgbackend.common.reasons import Rule
from cgbackend.runtime.capture import Capturer
from cgbackend.runtime.pool import PoolState
from ep_helpers import ROUTINGS, all_to_all_before_212, dense_reference, simulated_ranks, spawn_checks
from fx_helpers import trace

needs_dist = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


# ----------------------------------------------------------------------------- capacity and overflow

def test_capacity_is_the_worst_case_by_default_and_a_factor_of_the_balanced_load():
    assert capacity_for(12, 2, 2, None) == 24
    assert capacity_for(12, 2, 2, 1.0) == 12
    assert capacity_for(12, 2, 2, 1.25) == 15
    assert capacity_for(12, 2, 2, 5.0) == 24  # never above the worst case
    assert capacity_for(3, 1, 8, 0.01) == 1
    with pytest.raises(ValueError, match="capacity_factor"):
        capacity_for(12, 2, 2, 0.0)


def test_overflow_counter_raises_or_counts_a_fallback():
    counter = OverflowCounter("raise")
    with pytest.raises(CapacityOverflow, match="3 routed rows did not fit"):
        counter(3, 12, 24)
    assert counter.as_dict() == {"calls": 1, "fallbacks": 0, "rows": 3}
    counter = OverflowCounter("fallback")
    counter(2, 12, 24)
    counter(5, 12, 24)
    assert counter.as_dict() == {"calls": 2, "fallbacks": 2, "rows": 7}
    with pytest.raises(ValueError, match="overflow must be one of"):
        OverflowCounter("drop")


def _routing(kind: str, rank: int, tokens: int) -> torch.Tensor:
    """[tokens, 2] distinct experts of 4 (rank 0 owns 0 and 1)."""
    gen = torch.Generator().manual_seed(rank)
    if kind == "random":
        return torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    if kind == "one_expert":  # every copy to expert 0 or 1, on rank 0
        return torch.tensor([[0, 1]] * tokens)
    if kind == "other_rank":  # every copy to the other rank's experts
        return torch.tensor([[3, 2]] * tokens) if rank == 0 else torch.tensor([[1, 0]] * tokens)
    return torch.tensor([[0, 3]] * tokens)  # "split": one copy to each rank


@pytest.mark.parametrize("kind", ["random", "one_expert", "other_rank", "split"])
def test_exchange_of_two_ranks_equals_a_dense_moe_with_every_gradient(kind):
    torch.manual_seed(0)
    experts = [Expert(8, 16).double() for _ in range(4)]
    tokens = 5
    hs = [torch.randn(tokens, 8, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    weights = [torch.rand(tokens, 2, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    selected = [_routing(kind, r, tokens) for r in range(2)]
    outs, plans = simulated_ranks(hs, weights, selected, experts, capacity=capacity_for(tokens, 2, 2, None))
    assert all(int(p.overflow) == 0 for p in plans)
    refs = [dense_reference(h, w, s, experts) for h, w, s in zip(hs, weights, selected)]
    leaves = hs + weights + [p for e in experts for p in e.parameters()]
    probe = [torch.randn_like(o) for o in outs]
    got = torch.autograd.grad(sum((o * g).sum() for o, g in zip(outs, probe)), leaves)
    # an expert no token reaches: no gradient in the dense layer, a zero one through the masks
    want = torch.autograd.grad(sum((o * g).sum() for o, g in zip(refs, probe)), leaves, allow_unused=True)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=0, atol=1e-12)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("capacity", [1, 3, 6, 10])
def test_overflow_counts_every_routed_copy_past_the_capacity(capacity):
    experts = [Expert(8, 16).double() for _ in range(4)]
    tokens = 5
    selected = [_routing("random", r, tokens) for r in range(2)]
    hs = [torch.randn(tokens, 8, dtype=torch.float64) for _ in range(2)]
    weights = [torch.rand(tokens, 2, dtype=torch.float64) for _ in range(2)]
    _, plans = simulated_ranks(hs, weights, selected, experts, capacity=capacity)
    for s, plan in zip(selected, plans):
        per_rank = torch.bincount(s.reshape(-1) // 2, minlength=2)
        assert int(plan.overflow) == int((per_rank - capacity).clamp(min=0).sum())
        assert int(plan.slot_used.sum()) == int(per_rank.clamp(max=capacity).sum())


# ----------------------------------------------------------------------------- classification

@pytest.fixture
def one_rank_group():
    from cgbackend.bench.dist_check import free_port
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _collectives(group, x, counts):
    a2a = funcol.all_to_all_single_autograd(x * 2, None, None, group)  # equal splits: sizes from shapes
    fixed = funcol.all_to_all_single(x, [x.shape[0]], [x.shape[0]], group)  # constant splits
    most = funcol.all_reduce(counts, "max", group)
    splits = counts.tolist()  # read on the host: sizes that change every call
    moved = funcol.all_to_all_single(x, splits, splits, group)
    gathered = funcol.all_gather_tensor(x, 0, group)
    return a2a + fixed, most, moved, gathered


def _verdicts(group, **options) -> dict:
    gm = trace(lambda x, c: _collectives(group, x, c), torch.randn(4, 3), torch.tensor([4]))
    options.setdefault("capture_collectives", True)  # off by default (config/options.py says why)
    classification = classify(gm, Config(**options))
    out: dict = {}
    for node, verdict in classification.verdicts.items():
        name = str(node.target)
        if "_c10d_functional" in name:
            out.setdefault(name.split(".")[1], []).append(verdict)
    return out


@needs_dist
def test_collectives_with_sizes_from_shapes_are_static_and_host_read_sizes_stay_dynamic(one_rank_group):
    verdicts = _verdicts(one_rank_group)
    a2a = verdicts["all_to_all_single"]
    assert [v.static for v in a2a] == [True, True, False]
    assert "read from device data" in a2a[2].reason.detail and a2a[2].reason.rule is Rule.COLLECTIVE
    assert [v.static for v in verdicts["all_reduce"]] == [True]
    assert [v.static for v in verdicts["all_gather_into_tensor"]] == [False]
    assert "not one of the collectives cgbackend captures" in verdicts["all_gather_into_tensor"][0].reason.detail
    # a wait follows its collective
    assert [v.static for v in verdicts["wait_tensor"]] == [True, True, True, False, False]
    assert "waits for a collective that runs eagerly" in verdicts["wait_tensor"][3].reason.detail


@needs_dist
def test_collectives_stay_eager_by_default(one_rank_group):
    gm = trace(lambda x, c: _collectives(one_rank_group, x, c), torch.randn(4, 3), torch.tensor([4]))
    verdicts = classify(gm, Config()).verdicts
    found = [v for n, v in verdicts.items() if "_c10d_functional" in str(n.target)]
    assert found and not any(v.static for v in found)
    assert any("capture_collectives is off" in v.reason.detail for v in found)


@needs_dist
@pytest.mark.parametrize("options, why", [
    ({"capture_collectives": False}, "capture_collectives is off"),
    ({"dynamic_ops": ("_c10d_functional::wait_tensor",)}, "wait_tensor is marked dynamic"),
])
def test_collectives_stay_eager_when_the_options_say_so(one_rank_group, options, why):
    verdicts = _verdicts(one_rank_group, **options)
    assert not any(v.static for vs in verdicts.values() for v in vs)
    assert any(why in v.reason.detail for v in verdicts["all_to_all_single"])


@needs_dist
def test_report_shows_a_static_collective_inside_a_static_region(one_rank_group):
    def fn(x):
        y = torch.tanh(x) @ x.T
        z = funcol.all_to_all_single_autograd(y, None, None, one_rank_group)
        return torch.relu(z) + y

    report = cgbackend.explain(fn, torch.randn(4, 4), options={"capture_collectives": True})
    regions = report.regions()
    assert [r.kind for r in regions] == ["static"]
    ops = {c["op"]: c["count"] for c in regions[0].collectives}
    # torch < 2.12: the autograd op of _c10d_functional_autograd (torch 2.11 traces its wait as a
    # plain wait_tensor; torch.distributed's older source wraps it in an autograd.Function)
    assert ops in ({"_c10d_functional.all_to_all_single": 1, "_c10d_functional.wait_tensor": 1},
                   {"_c10d_functional_autograd.all_to_all_single": 1, "_c10d_functional.wait_tensor": 1},
                   {"_c10d_functional_autograd.all_to_all_single": 1, "higher_order.autograd_function_apply": 1}), ops
    assert "collectives captured in this region's graphs" in report.to_text()


# ----------------------------------------------------------------------------- torch < 2.12's exchange

def _hop_and_collective(group, capture: bool):
    x = torch.randn(4, 3, requires_grad=True)  # an input needing grad: Dynamo keeps the autograd.Function
    gm = trace(lambda x: torch.tanh(all_to_all_before_212(x * 2, None, None, group)) + 1, x)
    verdicts = classify(gm, Config(capture_collectives=capture)).verdicts
    waits = [n for n in verdicts if "autograd_function_apply" in str(n.target)]
    a2a = [n for n in verdicts if "all_to_all_single" in str(n.target)]
    assert len(waits) == 1 and len(a2a) == 1, list(verdicts)
    return verdicts[waits[0]], verdicts[a2a[0]]


@needs_dist
@pytest.mark.parametrize("capture", [False, True])
def test_a_wait_inside_an_autograd_function_follows_its_collective(one_rank_group, capture):
    """torch < 2.12's all_to_all_single_autograd waits inside an autograd.Function: that wait runs
    eagerly with its collective, or is captured with it, never in a graph without it (which would
    replay without waiting for the eager work)."""
    wait, a2a = _hop_and_collective(one_rank_group, capture)
    assert wait.static == a2a.static == capture
    if not capture:
        assert wait.reason.rule is Rule.COLLECTIVE, wait.reason


class _ReduceInside(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, name):
        return funcol.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", name))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@needs_dist
def test_a_collective_inside_an_autograd_function_stays_eager(one_rank_group):
    x = torch.randn(4, 3, requires_grad=True)
    gm = trace(lambda x: torch.tanh(_ReduceInside.apply(x * 2, one_rank_group.group_name)) + 1, x)
    verdicts = classify(gm, Config(capture_collectives=True)).verdicts
    (hop,) = [n for n in verdicts if "autograd_function_apply" in str(n.target)]
    assert not verdicts[hop].static and verdicts[hop].reason.rule is Rule.COLLECTIVE
    assert "_c10d_functional::all_reduce" in verdicts[hop].reason.detail


@needs_dist
@pytest.mark.parametrize("capture", [False, True])
def test_every_exchange_of_torch_before_212_is_waited_for_by_every_call(one_rank_group, capture):
    """Under cgbackend, each call waits for the work of each collective it issued (none is left in
    the work registry: a wait captured without its eager collective waits only at the capture, and
    the replays read the receive buffer while the collective may still write it), and training
    equals eager."""
    registry = getattr(torch._C._distributed_c10d, "_get_work_registry_size", None)
    if registry is None:
        pytest.skip("this torch does not tell the functional collectives' pending work")
    model = _Exchange(one_rank_group, all_to_all_before_212).double()
    ref = _Exchange(one_rank_group, all_to_all_before_212).double()
    ref.load_state_dict(model.state_dict())
    compiled = cgbackend.compile(model, simulate_graphs=True, capture_collectives=capture)
    before = registry()  # what earlier code in this process left (the registry is the process's)
    pending = []
    for i in range(7):
        x = torch.randn(4, 8, dtype=torch.float64)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        compiled(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        pending.append(registry() - before)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    stats = cgbackend.stats(compiled)
    assert stats["replays"] > 0 and stats["graphs_captured"] >= 2, stats
    assert pending == [0] * 7, pending


class _AroundExchange(torch.nn.Module):
    """Static runs of ops before and after torch < 2.12's exchange (an autograd.Function that Dynamo
    records as a higher-order op whose bodies are get_attr nodes)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = torch.tanh(h) * 2 + h.sigmoid() - h.cos()
        y = all_to_all_before_212(h, None, None, self.group)
        return self.b(torch.relu(y) * 3 + y.exp() - y.sin())


@needs_dist
def test_a_higher_order_ops_bodies_are_read_where_it_runs_not_passed_between_regions(one_rank_group):
    """The bodies of the eager exchange once went to the region before it as outputs, and Inductor
    cannot compile a region returning modules: that region ran eager's kernels (seen on two H200s,
    torch 2.11, every rank)."""
    model = _AroundExchange(one_rank_group).double()
    ref = _AroundExchange(one_rank_group).double()
    ref.load_state_dict(model.state_dict())
    compiled = cgbackend.compile(model, simulate_graphs=True, inner="inductor", warmup=1)
    for _ in range(4):
        x = torch.randn(4, 8, dtype=torch.float64)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        out, expected = compiled(x), ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-9)
    stats = cgbackend.stats(compiled)
    assert stats["inner_fallbacks"] == {}, stats["inner_failures"]
    assert stats["static_regions"] == 2 and stats["dynamic_regions"] == 1, stats
    assert stats["replays"] > 0, stats


# ----------------------------------------------------------------------------- runtime: exactly once

class _Exchange(torch.nn.Module):
    def __init__(self, group, a2a=funcol.all_to_all_single_autograd) -> None:
        super().__init__()
        self.group, self.a2a = group, a2a
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a2a(self.a(x), None, None, self.group)))


def _issued(group, fn) -> int:
    """Collectives ``fn`` issues on ``group`` (the process group's sequence number)."""
    before = group._get_sequence_number_for_group()
    fn()
    return group._get_sequence_number_for_group() - before


@needs_dist
def test_each_call_issues_its_collectives_once_on_every_path(one_rank_group):
    group = one_rank_group
    if not hasattr(group, "_get_sequence_number_for_group"):
        pytest.skip("this torch has no collective sequence numbers")
    model = _Exchange(group).double()
    compiled = cgbackend.compile(model, simulate_graphs=True, capture_collectives=True)
    ref = _Exchange(group).double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, dtype=torch.float64)
    held = []

    def step(i: int):
        def run():
            if i == 8:
                held.clear()
            out = compiled(x)
            if i == 6:  # gradients still held: the next forward must not overwrite them (eager)
                held.extend(torch.autograd.grad(out.sum(), list(model.parameters())))
            elif i == 8:  # retain_graph: the backward runs through the captured forward, not again
                out.sum().backward(retain_graph=True)
            else:
                out.sum().backward()
        return run

    issued = []
    for i in range(11):
        if i == 9:
            cgbackend.distributed.release(compiled)  # warm-up and capture again
        model.zero_grad(set_to_none=True)
        issued.append(_issued(group, step(i)))
    stats = cgbackend.stats(compiled)
    assert issued == [2] * 11, issued  # one all-to-all forward, one backward, whatever ran them
    assert stats["graphs_captured"] >= 2 and stats["replays"] > 0, stats
    assert stats["bwd_recomputes"] == 0  # a recomputed forward would issue its all-to-all again
    assert stats["eager_calls"]["replay_order_hazard"] >= 1, stats["eager_calls"]  # an eager fallback ran
    runner = find_backend(compiled).compiled_graphs()[0].runners[0]
    assert runner.spec.collectives and not runner.spec.recomputable
    model.zero_grad(set_to_none=True)
    ref(x).sum().backward()
    compiled(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


def test_a_simulated_capture_that_issues_collectives_is_the_first_replay():
    runs = []
    x = torch.ones(3)
    graph, out = Capturer(simulate=True).capture(lambda: runs.append(1) or x * 2, PoolState("cpu", 0),
                                                  restore=[x], once=True)
    assert len(runs) == 1
    graph.replay()  # the replay right after the capture: already computed
    assert len(runs) == 1
    graph.replay()
    assert len(runs) == 2
    graph, _ = Capturer(simulate=True).capture(lambda: runs.append(1) or x * 2, PoolState("cpu", 0),
                                               restore=[x], once=True)
    x.add_(1)  # what it read changed since the capture: the first replay runs
    graph.replay()
    assert len(runs) == 4


# ----------------------------------------------------------------------------- two ranks

@pytest.fixture(scope="module")
def two_ranks():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    ranks, codes, exit_s = spawn_checks(world=2, timeout_s=300)
    assert all(r is not None for r in ranks), f"a rank wrote no result (exit codes {codes})"
    return ranks, codes, exit_s


def _results(two_ranks, name: str) -> list[dict]:
    ranks = two_ranks[0]
    out = [r["results"][name] for r in ranks]
    for r in out:
        assert "error" not in r, r["error"]
    return out


def test_capacity_exchange_equals_the_dropless_loop_for_every_routing(two_ranks):
    for rank, result in enumerate(_results(two_ranks, "equal_to_loop")):
        result.pop("seconds", None)
        assert set(result) == {f"{r}:{c}" for r in ROUTINGS for c in ("worst", "factor1")}
        for case, r in result.items():
            assert not r["missing"], (rank, case, r)
            assert r["out"] <= 1e-12 * max(r["scale"], 1) and r["grad"] <= 1e-12, (rank, case, r)
        # the worst case never checks; a capacity of the balanced load overflows where one rank
        # takes everything, and fits a balanced routing exactly
        assert all(r["overflows"]["calls"] == 0 for c, r in result.items() if c.endswith(":worst"))
        assert result["all_to_rank0:factor1"]["overflows"]["fallbacks"] == 1
        assert result["all_to_rank1:factor1"]["overflows"]["fallbacks"] == 1
        assert result["alternating:factor1"]["overflows"]["calls"] == 0


def test_overflow_raises_on_every_rank_and_the_next_call_runs(two_ranks):
    for r in _results(two_ranks, "overflow_raises"):
        assert r["raised"] and "did not fit" in r["raised"], r
        assert r["after"] and r["overflows"] == {"calls": 1, "fallbacks": 0, "rows": 12}, r


def test_training_captures_the_whole_layer_exchange_included(two_ranks):
    for r in _results(two_ranks, "scenario"):
        where = f"rank {r['rank']}"
        assert r["loss_diff"] <= 1e-12 * max(abs(v) for v in r["losses"]["eager"]), where
        assert r["grad_diff"] <= 1e-12 * r["grad_scale"], where
        assert r["stats"]["static_regions"] == 1 and r["stats"]["dynamic_regions"] == 0, r["stats"]
        assert r["final_eager_calls"] == {"warmup": 3}, r["final_eager_calls"]
        assert len(set(r["graphs"][4:])) == 1 and r["graphs"][-1] == 2, r["graphs"]  # forward + backward
        assert r["stats"]["replays"] == 2 * 5 and not r["stats"]["capture_failures"], r["stats"]


def _check_rank_local_fallbacks(results: list[dict], rel_tol: float) -> None:
    for rank, r in enumerate(results):
        assert max(r["rel_diffs"]) <= rel_tol, (rank, r["rel_diffs"])
        assert r["bwd_recomputes"] == 0 and r["replays"] > 0 and not r["capture_failures"], r
    # rank 0 captured after one warm-up call (replaying while rank 1 still ran eagerly) and again
    # after its release at step 5 (capturing while rank 1 replayed); rank 1 after three
    assert results[0]["eager_calls"] == [1] * 8 and results[0]["graphs"] == 4, results[0]
    assert results[1]["eager_calls"] == [1, 2, 3, 3, 3, 3, 3, 3] and results[1]["graphs"] == 2, results[1]


def _check_small_capacity(results: list[dict], rel_tol: float) -> None:
    for r in results:
        assert max(r["rel_diffs"]) <= rel_tol, r["rel_diffs"]
        assert r["overflows"] == r["twin_overflows"] and r["overflows"]["fallbacks"] >= 1, r
        assert r["replays"] > 0 and not r["capture_failures"], r


def test_the_capacity_model_with_torch_before_212s_exchange_trains_as_eager(two_ranks):
    for r in _results(two_ranks, "before_212"):
        where = f"rank {r['rank']}"
        assert r["loss_diff"] <= 1e-12 * max(abs(v) for v in r["losses"]["eager"]), where
        assert r["grad_diff"] <= 1e-12 * r["grad_scale"], where
        assert r["final_eager_calls"] == {"warmup": 3 * r["stats"]["static_regions"]}, r["final_eager_calls"]
        assert r["stats"]["replays"] > 0 and not r["stats"]["capture_failures"], r["stats"]
        # every collective's work waited for by the call that issued it
        assert r["pending_work"] in (None, 0), r["pending_work"]


def test_ranks_that_capture_and_fall_back_at_different_calls_stay_matched(two_ranks):
    _check_rank_local_fallbacks(_results(two_ranks, "rank_local_fallbacks"), 1e-12)


def test_a_small_capacity_under_cgbackend_falls_back_at_overflow_and_equals_eager(two_ranks):
    _check_small_capacity(_results(two_ranks, "small_capacity_compiled"), 1e-12)


def test_ranks_exit_cleanly_within_30s(two_ranks):
    _, codes, exit_s = two_ranks
    assert codes == [0, 0], codes
    assert exit_s < 30, exit_s


# ----------------------------------------------------------------------------- two GPUs

@pytest.mark.multigpu
def test_two_gpus_nccl_collectives_in_graphs_with_rank_local_fallbacks_and_overflow_checks():
    """The checks above that run graphs, on two GPUs: NCCL work captured in CUDA graphs while the
    other rank runs the same collective eagerly or captures it, and the overflow check's host read
    between two graphs. fp32 with Inductor's kernels: equal to eager up to their rounding."""
    from ep_helpers import GPU_CHECKS
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    run = spawn_checks(world=2, backend="nccl", names=GPU_CHECKS, timeout_s=300)
    _check_rank_local_fallbacks(_results(run, "rank_local_fallbacks"), 1e-4)
    _check_small_capacity(_results(run, "small_capacity_compiled"), 1e-4)
    _, codes, exit_s = run
    assert codes == [0, 0] and exit_s < 30, (codes, exit_s)
