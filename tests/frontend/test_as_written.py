"""By name, a function with nothing to graph that Dynamo compiles again runs as written from then on
(frontend/as_written.py): a MoE loop body's activation, called once per expert with a new row count."""

from __future__ import annotations

import torch
import torch.nn as nn

import cgbackend

SIM = {"simulate_graphs": True}


class Act(nn.Module):
    """An activation module of the model's own code (as transformers' ``SiLUActivation``: Dynamo
    compiles a call of it from plain Python as a frame; torch.nn's own it would not)."""

    def forward(self, x):
        return nn.functional.silu(x)


class LoopMoE(nn.Module):
    """A dispatch loop as transformers writes it: a data-dependent ``where`` per expert (Dynamo
    breaks the graph and runs the loop as Python), the activation a module of its own."""

    def __init__(self, experts=4, width=8):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.up = nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)
        self.act = Act()

    def forward(self, x):
        choice = self.router(x).argmax(-1)
        mask = nn.functional.one_hot(choice, self.up.shape[0]).permute(1, 0)
        hit = torch.greater(mask.sum(-1), 0).nonzero()
        out = torch.zeros_like(x)
        for e in hit:  # over a tensor: Dynamo runs this loop as Python
            e = e[0]
            (rows,) = torch.where(mask[e])
            out.index_add_(0, rows, self.act(x[rows] @ self.up[e]))
        return out * 2


def _batches(n, rows=24, width=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, width, generator=g, dtype=torch.float64) for _ in range(n)]


def test_the_activation_runs_as_written_after_its_recompile_and_results_are_eager():
    torch.manual_seed(0)
    model = LoopMoE().double().eval()
    compiled = torch.compile(model, backend="cgbackend", options=SIM)
    with torch.no_grad():
        for x in _batches(5):
            assert torch.equal(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    assert st["frames_as_written"] == 1 and sum(st["frames_as_written_by"].values()) == 1, st
    note = next(n for n in cgbackend.report(compiled).notes if "run as written" in n)
    assert "Dynamo compiled it again" in note
    assert "functions run as written" in cgbackend.summary(compiled)


def test_a_function_with_a_static_region_is_never_left_to_python():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.lin(x)) * 3 + 1  # a static region at every size

    body = Body().double().eval()
    compiled = torch.compile(body, backend="cgbackend", options=SIM)
    with torch.no_grad():
        for rows in (3, 5, 7, 9):
            x = torch.randn(rows, 8, dtype=torch.float64)
            assert torch.equal(compiled(x), body(x))
    st = cgbackend.stats(compiled)
    assert st["frames_as_written"] == 0 and st["static_regions"] >= 1 and st["graph_calls"] == 4, st


def test_cgbackend_compile_leaves_every_frame_to_dynamo():
    """Not by name: cgbackend.compile rewrites the loop before tracing; nothing is left to Python."""
    torch.manual_seed(0)
    model = LoopMoE().double().eval()
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for x in _batches(3, seed=1):
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-12, atol=1e-12)
    assert cgbackend.stats(compiled)["frames_as_written"] == 0
