"""A Python float that changes every call (mixup's lambda) is read by the graph as a device value
(passes/scalars.py), so its regions replay one graph for every value instead of warming up again
at each new value; compared with eager in float64 (outputs and every gradient), simulated graphs."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.passes.scalars import device_scalars
from layer_helpers import assert_same_grads


class _Mixup(nn.Module):
    """A training step's forward on a mixup batch: ``lam * x + (1 - lam) * x2``, lambda a new float
    each step (Beta-distributed)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x, x2, lam):
        h = lam * x + (1 - lam) * x2
        return self.b(torch.relu(self.a(h))) * lam ** 0.5


def test_a_float_that_changes_every_step_replays():
    torch.manual_seed(0)
    model = _Mixup().double()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, simulate_graphs=True)
    rng = random.Random(0)
    g = torch.Generator().manual_seed(1)
    steps = 20
    for _ in range(steps):
        lam = rng.betavariate(0.4, 0.4)
        x, x2 = (torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(2))
        out, expected = compiled(x, x2, lam), ref(x, x2, lam)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert_same_grads(model, ref)
    st = cgbackend.stats(compiled)
    # Dynamo compiles twice (the first value as a constant, then the float as an input); the
    # second graph's regions warm up once and replay every later step, forward and backward.
    assert st["compiled_graphs"] == 2, st
    assert set(st["eager_calls"]) == {"warmup"} and st["eager_calls"]["warmup"] <= 2 * 3, st["eager_calls"]
    assert st["fwd_replays"] >= steps - 6 and st["bwd_replays"] >= steps - 6, st
    assert st["uncompiled_calls"] == 0


def _lam_graph(fn, *args):
    """Dynamo's graph of ``fn`` once the float argument (last) has changed: the float is an input."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fn, backend=record)
    compiled(*args[:-1], 0.25)
    compiled(*args[:-1], 0.75)
    return graphs[-1]


@pytest.mark.parametrize("fn, proven", [
    (lambda x, lam: lam * x + (1 - lam) * x.exp(), True),
    (lambda x, lam: x.mul(lam ** 0.5).add(2.0 / lam), True),
    (lambda x, lam: x + torch.full((8,), lam), False),             # a factory's fill value
    (lambda x, lam: x.long() * lam, False),                         # an integer operand: promotes to float64
    (lambda x, lam: torch.add(x, x, alpha=lam), False),             # a keyword argument
    (lambda x, lam: x.sum() * lam, False),                          # a 0-d operand: float64 would win
], ids=["mix", "methods", "fill_value", "int_tensor", "alpha", "zero_dim"])
def test_which_float_uses_read_a_device_value(fn, proven):
    x = torch.randn(4, 8)
    gm = _lam_graph(fn, x, 0.5)
    if not any(n.op == "call_method" and n.target == "item" for n in gm.graph.nodes):
        pytest.skip("this torch does not hand a changed float to the graph as a 0-d tensor read by .item()")
    found = device_scalars(gm)
    assert bool(found.inputs) == proven, gm.code
    if proven:
        assert not any(n.op == "call_method" and n.target == "item" for n in gm.graph.nodes)
        (position,) = found.inputs
        args = [torch.tensor(0.4, dtype=torch.float64) if i == position else x
                for i in range(len([n for n in gm.graph.nodes if n.op == "placeholder"]))]
        torch.testing.assert_close(gm(*args)[0], fn(x, 0.4))

