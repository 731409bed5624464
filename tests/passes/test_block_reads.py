"""Expert parameters read from their block in no-grad calls (cgbackend/passes/dispatch/blockreads.py):
the graph gets one input per block instead of one per expert parameter, results equal eager's on
varied batches, the user's modules are untouched outside calls, parameters updated in place are read
as they are, and a parameter replaced or moved after compilation is read as it is now."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.backend import CGBackend
from cgbackend.models.realsize import RealConfig, RealModel, make_hidden_inputs

SIM = dict(simulate_graphs=True, inner="eager")


def _model(layers: int = 2, experts: int = 8) -> RealModel:
    cfg = RealConfig(hidden=32, heads=4, kv_heads=2, head_dim=8, layers=layers, ffn=16, experts=experts, top_k=2,
                     max_pos=64)
    torch.manual_seed(0)
    return RealModel(cfg).double().eval()


def _inputs(model: RealModel, n: int = 4, seed: int = 1) -> list:
    return make_hidden_inputs(model.cfg, tokens=16, n=n, device="cpu", dtype=torch.float64, seed=seed)


@pytest.fixture
def graph_inputs(monkeypatch):
    """The number of inputs of every graph Dynamo hands to cgbackend."""
    seen: list[int] = []
    real = CGBackend.__call__

    def spy(self, gm, example_inputs):
        seen.append(len(example_inputs))
        return real(self, gm, example_inputs)

    monkeypatch.setattr(CGBackend, "__call__", spy)
    return seen


def _experts_params(model: RealModel) -> int:
    return sum(1 for n, _ in model.named_parameters() if ".experts." in n)


@pytest.mark.parametrize("form", ["grouped", "auto"])
def test_no_grad_calls_pass_one_input_per_block_and_match_eager(graph_inputs, form):
    model = _model()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = cgbackend.compile(model, static_dispatch=form, **SIM)
    lists = [model.layers[i].mlp.experts for i in range(2)]
    with torch.no_grad():
        for x in _inputs(model, 5):
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-9, atol=1e-9)
    # 3 blocks per layer in place of 3 x 8 expert parameters
    assert len(graph_inputs) == 1, graph_inputs
    others = sum(1 for n, _ in model.named_parameters() if ".experts." not in n)
    assert graph_inputs[0] <= others + 2 * 3 + 4, (graph_inputs, others)
    reads = compiled._cgbackend.block_reads
    assert reads.calls == 5 and all(e.standin is not None for e in reads.lists)
    st = cgbackend.stats(compiled)
    assert st["static_regions"] == 1 and st["dynamic_regions"] == 0 and set(st["eager_calls"]) == {"warmup"}, st
    # Outside calls the user's modules are their own.
    assert [model.layers[i].mlp.experts for i in range(2)] == lists
    assert not any(type(m).__module__.endswith("blockreads") for m in model.modules())
    assert any("from their blocks (3 graph inputs instead of 24)" in n for n in cgbackend.report(compiled).notes)


def test_gradients_on_read_each_parameter_and_match_eager(graph_inputs):
    model = _model().train()
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = cgbackend.compile(model, static_dispatch="grouped", **SIM)
    for x in _inputs(model, 4, seed=3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        compiled(x)[0].pow(2).mean().backward()
        ref(x)[0].pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-9, msg=name)
    assert compiled._cgbackend.block_reads.calls == 0
    assert graph_inputs and min(graph_inputs) >= _experts_params(model), graph_inputs


def test_parameters_updated_in_place_are_read_as_they_are_now():
    """An optimizer's step (in place, same storage) between evaluation calls: the blocks are that
    storage, so the next no-grad call reads the new values."""
    model = _model()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch="grouped", **SIM)
    xs = _inputs(model, 3, seed=5)
    with torch.no_grad():
        for step, x in enumerate(xs):
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-9, atol=1e-9, msg=f"step {step}")
            for m in (model, ref):
                for name, p in m.named_parameters():
                    if ".experts." in name:
                        p.mul_(1.5).add_(0.01)
    assert compiled._cgbackend.block_reads.calls == 3


@pytest.mark.parametrize("change", ["replace_parameter", "assign_data"])
def test_a_parameter_changed_after_compilation_is_read_as_it_is(change):
    model = _model()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch="grouped", **SIM)
    xs = _inputs(model, 4, seed=7)
    with torch.no_grad():
        for x in xs[:2]:
            compiled(x)
        new = torch.randn_like(model.layers[0].mlp.experts[2].w1.weight)
        for m in (model, ref):
            lin = m.layers[0].mlp.experts[2].w1
            if change == "replace_parameter":
                lin.weight = nn.Parameter(new.clone())
            else:
                lin.weight.data = new.clone()
        for x in xs:
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-9, atol=1e-9)
    reads = compiled._cgbackend.block_reads
    moved = [e for e in reads.lists if e.path == "layers.0.mlp.experts"][0]
    assert moved.standin is None and "not laid out as one block" in moved.reason
    assert any("layers.0.mlp.experts: expert parameters passed one by one" in n
               for n in cgbackend.report(compiled).notes)


def test_regional_layers_still_share_one_compiled_graph(graph_inputs):
    model = _model(layers=6, experts=4)
    ref = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = cgbackend.compile(model, static_dispatch="grouped", **SIM)
    with torch.no_grad():
        for x in _inputs(model, 4, seed=9):
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-9, atol=1e-9)
    st = cgbackend.stats(compiled)
    assert cgbackend.report(compiled).regional and st["compiled_graphs"] == 1, st
    assert compiled._cgbackend.block_reads.calls == 4
