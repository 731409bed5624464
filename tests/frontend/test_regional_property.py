"""Property test of regional compilation (regional.py, regional_calls.py): random stacks of 2-16
layers with random Python values of their own, hooks on random submodules registered before or
between calls, and in-place activations (positional flags, on the layer's input too: the caller's
tensor for the first layer), in inference and training. Each case is compared with eager in float64
on simulated graphs: outputs, every parameter gradient (and the input's), the caller's tensor after
the call, what the hooks saw; a call Dynamo ran without the backend must be in the report."""

from __future__ import annotations

import copy
import dataclasses
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from layer_helpers import Chain, assert_same_grads

W = 4
ACTIVATIONS = [lambda: nn.LeakyReLU(0.1, True), lambda: nn.ReLU(True), lambda: nn.ELU(1.0, True),
               lambda: nn.Hardtanh(-2.0, 2.0, True), lambda: nn.Tanh()]


class _Layer(nn.Module):
    def __init__(self, act: nn.Module, scale: float, idx: int, shift: bool, act_input: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.act = act
        self.scale, self.idx, self.shift, self.act_input = scale, idx, shift, act_input

    def forward(self, x):
        if self.act_input:
            F.leaky_relu(x, 0.2, True)  # the layer's input, in place (the caller's tensor at layer 0)
        h = self.act(self.lin(x))
        if self.shift:
            h = h + 1.0
        return x + h * self.scale / (self.idx + 1)


class _Seq(nn.Module):
    def __init__(self, layers) -> None:
        super().__init__()
        self.seq = nn.Sequential(*layers)

    def forward(self, x):
        return self.seq(x) * 1.0


@dataclasses.dataclass
class Case:
    seed: int
    layers: int
    training: bool
    sequential: bool
    act: int
    scales: list
    idx: list
    shift: list
    act_input: list
    hooks: list
    """(layer, submodule path, kind, registered before the first call)"""
    input_grad: bool


def _case(rng: random.Random, seed: int) -> Case:
    n = rng.randint(2, 16)
    training = rng.random() < 0.5
    pool = [rng.choice([0.5, 1.0, 1.5, 2.0]) for _ in range(1 if rng.random() < 0.6 else 2)]
    unique_idx = rng.random() < 0.12
    if unique_idx:
        n = min(n, 6)  # a group per layer: a trace each
    input_grad = training and rng.random() < 0.7
    act_input = [rng.random() < 0.3 for _ in range(n)]
    if input_grad:
        act_input[0] = False  # eager refuses an in-place write to a leaf that requires grad
    hooks = [(rng.randrange(n), rng.choice(["", "lin", "act"]), rng.choice(["fwd", "pre", "probe"]),
              rng.random() < 0.5) for _ in range(rng.choice([0, 0, 1, 2]))]
    return Case(seed, n, training, rng.random() < 0.3, rng.randrange(len(ACTIVATIONS)),
                [rng.choice(pool) for _ in range(n)], list(range(n)) if unique_idx else [0] * n,
                [rng.random() < 0.2 for _ in range(n)], act_input, hooks, input_grad)


def _build(case: Case) -> nn.Module:
    torch.manual_seed(case.seed)
    layers = [_Layer(ACTIVATIONS[case.act](), case.scales[i], case.idx[i], case.shift[i], case.act_input[i])
              for i in range(case.layers)]
    model = (_Seq if case.sequential else Chain)(layers).double()
    return model.train(case.training)


def _hook(module: nn.Module, kind: str, seen: list) -> None:
    if kind == "fwd":
        module.register_forward_hook(lambda m, i, o: o * 0.5)
    elif kind == "pre":
        module.register_forward_pre_hook(lambda m, i: (i[0] + 0.25,))
    else:
        module.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))


def _register(model: nn.Module, case: Case, before: bool, seen: list) -> None:
    stack = model.seq if case.sequential else model.layers
    for layer, path, kind, early in case.hooks:
        if early == before:
            _hook(stack[layer].get_submodule(path) if path else stack[layer], kind, seen)


def _compare(case: Case, calls: int = 2) -> None:
    model = _build(case)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, inner="eager", regional_min_layers=2)
    mine_seen: list = []
    ref_seen: list = []
    _register(model, case, True, mine_seen)
    _register(ref, case, True, ref_seen)
    g = torch.Generator().manual_seed(case.seed)
    for call in range(calls):
        if call == 1:
            _register(model, case, False, mine_seen)
            _register(ref, case, False, ref_seen)
        x = torch.randn(3, W, generator=g, dtype=torch.float64)
        xm, xr = x.clone().requires_grad_(case.input_grad), x.clone().requires_grad_(case.input_grad)
        with torch.set_grad_enabled(case.training):
            out_m, out_r = compiled(xm), ref(xr)
        torch.testing.assert_close(out_m, out_r, rtol=1e-10, atol=1e-10, msg=f"{case}: output of call {call}")
        torch.testing.assert_close(xm.detach(), xr.detach(), rtol=0, atol=0, msg=f"{case}: the caller's tensor")
        if case.training:
            out_m.pow(2).sum().backward()
            out_r.pow(2).sum().backward()
            if case.input_grad:
                torch.testing.assert_close(xm.grad, xr.grad, rtol=1e-10, atol=1e-10, msg=f"{case}: input grad")
            assert_same_grads(model, ref, 1e-10, case)
    assert len(mine_seen) == len(ref_seen), case
    for a, b in zip(mine_seen, ref_seen):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{case}: a probe")
    st = cgbackend.stats(compiled)
    notes = " ".join(cgbackend.report(compiled).notes)
    for where in st["uncompiled_by"]:
        assert f"of {where} ran without cgbackend" in notes, (case, notes)
    assert set(st["eager_calls"]) <= {"warmup"}, (case, st["eager_calls"])


@pytest.fixture(autouse=True)
def _no_guard_latency_probe(monkeypatch):
    """Dynamo measures each new guard set's latency after a cache flush (about 70 ms a compile on a
    2-core machine, more than the trace of these layers); the measure feeds only its compile
    metrics. The hundreds of compiles here skip it (feature-tested)."""
    guards = torch._dynamo.guards
    if hasattr(guards, "profile_guard_manager"):
        monkeypatch.setattr(guards, "profile_guard_manager", lambda *args: 0.0)


def _cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    return [_case(rng, seed * 100_000 + i) for i in range(count)]


def _run(cases: list[Case]) -> None:
    for case in cases:
        torch._dynamo.reset()
        _compare(case)


def _kinds(case: Case) -> set[str]:
    """What a case exercises, for the check that a short run still exercises everything."""
    kinds = {"train" if case.training else "infer", "sequential" if case.sequential else "chain",
             f"act{case.act}"}
    kinds |= {"per-layer idx"} if len(set(case.idx)) > 1 else set()
    kinds |= {"in-place on input"} if any(case.act_input) else set()
    kinds |= {"input grad"} if case.input_grad else set()
    kinds |= {"scales differ"} if len(set(case.scales)) > 1 else set()
    kinds |= {f"hook {kind} {'before' if before else 'between'}" for _, _, kind, before in case.hooks}
    return kinds


DEFAULT_CASES = 16
DEFAULT_SEED = 1
"""The default run's cases: 16 from seed 1 hold every feature the generator has (the test checks
it; 40 from seed 0 were needed for that, in 2.5x the time); 1000 more run under the slow marker."""


def test_random_layer_stacks_match_eager():
    cases = _cases(DEFAULT_CASES, seed=DEFAULT_SEED)
    seen = set().union(*map(_kinds, cases))
    every = ({"train", "infer", "sequential", "chain", "per-layer idx", "in-place on input", "input grad",
              "scales differ"} | {f"act{i}" for i in range(len(ACTIVATIONS))}
             | {f"hook {k} {w}" for k in ("fwd", "pre", "probe") for w in ("before", "between")})
    assert every <= seen, every - seen  # the short run still tries every feature the generator has
    _run(cases)


@pytest.mark.slow
def test_random_layer_stacks_match_eager_many():
    _run(_cases(1000, seed=2))
