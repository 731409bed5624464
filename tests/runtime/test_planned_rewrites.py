"""The runtime consumes the pass pipeline's decisions: a training graph's dynamic regions are built
with the row-gather rewrites passes/gather.py planned for them (the same ones rewriting each
region's own module finds), and results and gradients equal eager's."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import cgbackend
from cgbackend.passes.gather import rewrite_gathers
from cgbackend.runtime.split import build_region_module


_REWRITTEN = ("_take_rows", "_take_pairs")


class _Loop(nn.Module):
    """A per-expert loop: ``x[idx]`` gathers the rows each expert takes (a dynamic region)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        top = self.router(x).topk(2, dim=-1).indices
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx, _ = torch.where(top == e)
            out = out.index_add(0, idx, expert(x[idx]))
        return out.relu()


def test_dynamic_regions_are_built_with_the_planned_gather_rewrites():
    torch.manual_seed(0)
    model = _Loop()
    mine = copy.deepcopy(model)
    compiled = cgbackend.compile(mine, simulate_graphs=True, static_dispatch="off", warmup=1)
    for step in range(4):
        x = torch.randn(16, 8) + 0.1 * step
        for m in (model, mine):
            m.zero_grad(set_to_none=True)
        ref = model(x)
        out = compiled(x)
        torch.testing.assert_close(out, ref)
        ref.pow(2).sum().backward()
        out.pow(2).sum().backward()
        for a, b in zip(model.parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad)
    (graph,) = cgbackend.find_backend(compiled).compiled_graphs()
    analysis = graph.analysis
    assert graph.runtime_summary()["gather_rewrites"], graph.runtime_summary()
    for step in graph.steps:
        if step.runner is not None:
            continue
        region = step.region
        plain = build_region_module(analysis.gm, region, analysis.schedule.order.get(region.index))
        planned = analysis.gathers.count(region.index)
        assert rewrite_gathers(plain) == planned
        built = [n for n in step.module.graph.nodes if getattr(n.target, "__name__", "") in _REWRITTEN]
        assert len(built) == planned


def test_inference_graphs_plan_no_gather_rewrite():
    torch.manual_seed(0)
    model = _Loop().eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, static_dispatch="off", warmup=1)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(16, 8)
            torch.testing.assert_close(compiled(x), model(x))
    (graph,) = cgbackend.find_backend(compiled).compiled_graphs()
    assert graph.analysis.gathers.regions == {} and graph.runtime_summary()["gather_rewrites"] == {}
