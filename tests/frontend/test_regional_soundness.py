"""Regional compilation never changes what a layer computes (regional_calls.py): hooks on one
layer's submodules run as in eager, registered before or after compiling; layers with Python
values of their own (``self.layer_idx``, a per-block DropPath rate) are compiled in groups of their
own instead of falling off Dynamo's recompile limit; and a call Dynamo runs without the backend is
counted, reported and warned about once (uncompiled.py). Every case is compared with eager in
float64 on simulated graphs: outputs, hook calls, gradients."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import cgbackend
from layer_helpers import Chain as _Chain, assert_same_grads

SIM = dict(simulate_graphs=True)


class _Block(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x):
        return x + self.mlp(self.lin(x))


def _model(kind: str, n: int = 6) -> nn.Module:
    torch.manual_seed(0)
    if kind == "sequential":
        model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(*(_Block() for _ in range(n))))
    else:
        model = _Chain(_Block() for _ in range(n))
    return model.double()


def _layers(model: nn.Module) -> nn.Module:
    return model[1] if isinstance(model, nn.Sequential) else model.layers


def _inputs(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(n)]


HOOKS = {
    "forward hook": lambda m, seen: m.register_forward_hook(lambda mod, i, o: seen.append(1) or o * 0.5),
    "pre-hook": lambda m, seen: m.register_forward_pre_hook(lambda mod, i: seen.append(1) or (i[0] * 0.5,)),
    "probe": lambda m, seen: m.register_forward_hook(lambda mod, i, o: seen.append(o.detach().clone())),
}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("hook", list(HOOKS))
@pytest.mark.parametrize("kind", ["loop", "sequential"])
def test_hooks_on_one_layers_submodule_run_as_in_eager(kind, hook, when):
    """Activation steering, ablation and probing hooks on ``layers[3].mlp`` (``layers[0].mlp`` for
    the probe), registered before the first call or after it."""
    model = _model(kind)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    index = 0 if hook == "probe" else 3
    mine, theirs = [], []
    xs = _inputs(5)
    if when == "after":
        with torch.no_grad():
            torch.testing.assert_close(compiled(xs[0]), ref(xs[0]))
    HOOKS[hook](_layers(model)[index].mlp, mine)
    HOOKS[hook](_layers(ref)[index].mlp, theirs)
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-12, atol=1e-12)
    assert len(mine) == len(theirs) == len(xs)
    for a, b in zip(mine, theirs):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    st = cgbackend.stats(compiled)
    assert st["uncompiled_calls"] == 0 and set(st["eager_calls"]) <= {"warmup"}, st
    (stack,) = cgbackend.report(compiled).regional
    assert sorted(i for g in stack["groups"] for i in g["layers"]) == list(range(6))
    assert any(g["layers"] == [index] for g in stack["groups"]), stack["groups"]


def test_a_removed_hook_stops_running_and_a_global_hook_runs():
    model = _model("loop")
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    xs = _inputs(6)
    handles = [m.layers[2].mlp.register_forward_hook(lambda mod, i, o: o + 1.0) for m in (model, ref)]
    scaled: list = []
    with torch.no_grad():
        for step, x in enumerate(xs):
            if step == 2:
                for h in handles:
                    h.remove()
            if step == 4:
                scaled.append(torch.nn.modules.module.register_module_forward_hook(
                    lambda mod, i, o: o * 0.75 if isinstance(mod, nn.Tanh) else None))
            try:
                torch.testing.assert_close(compiled(x), ref(x), rtol=1e-12, atol=1e-12)
            except AssertionError:
                for h in scaled:
                    h.remove()
                raise
    for h in scaled:
        h.remove()
    assert cgbackend.stats(compiled)["uncompiled_calls"] == 0


class _DepthScaled(nn.Module):
    """A residual scaled by the layer's depth: ``self.layer_idx``, a Python int of each layer."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.lin(x)) / (self.layer_idx + 1)


def test_twelve_layers_with_their_own_index_are_traced_once_with_the_model():
    """Each layer specialised on its own index: the first layer's graph, specialised on
    ``self.layer_idx``, tells at the first call that every layer would be compiled apart (12 values
    among 12 layers), so the stack is compiled with the model from the second call on and the other
    layers run as written at the first call: 2 graphs compiled, not 12 layer graphs thrown away
    and then the model's (13). None falls off Dynamo's recompile limit or runs uncompiled later."""
    torch.manual_seed(0)
    model = _Chain(_DepthScaled(i) for i in range(12)).double()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for x in _inputs(6):
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-12, atol=1e-12)
    st = cgbackend.stats(compiled)
    assert st["uncompiled_calls"] == 0 and st["compiled_graphs"] == 1 + 1, st
    assert st["graphs_captured"] == 1 and st["replays"] >= 1, st  # the whole model's graph
    assert set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]
    (stack,) = cgbackend.report(compiled).regional
    assert [g["layers"] for g in stack["groups"]] == [[0]]
    assert stack["with_model"] and "11 of its 12 layers would be compiled apart" in stack["why"], stack
    assert "self.layer_idx, 12 values" in stack["why"], stack


def test_a_stack_compiled_with_the_model_goes_back_layer_by_layer_for_a_hook():
    """Dynamo does not guard empty hook dicts: a hook registered on a layer of a stack compiled
    with the model sends the stack back to layer-by-layer compilation, where each call checks it."""
    torch.manual_seed(0)
    model = _Chain(_DepthScaled(i) for i in range(8)).double()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, regional_min_layers=6, **SIM)
    xs = _inputs(6)
    with torch.no_grad():
        for step, x in enumerate(xs):
            if step == 3:
                for m in (model, ref):
                    m.layers[5].lin.register_forward_hook(lambda mod, i, o: o * -1.0)
            torch.testing.assert_close(compiled(x), ref(x), rtol=1e-12, atol=1e-12)
    (stack,) = cgbackend.report(compiled).regional
    assert not stack["with_model"] and "a hook was registered" in stack["why"], stack
    assert cgbackend.stats(compiled)["uncompiled_calls"] == 0


class _DropPath(nn.Module):
    """timm's stochastic depth: each sample's residual branch dropped with probability
    ``drop_prob`` in training, the kept ones scaled by 1 / (1 - drop_prob)."""

    def __init__(self, drop_prob: float) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class _ViTBlock(nn.Module):
    def __init__(self, drop_prob: float, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        self.drop_path = _DropPath(drop_prob)

    def forward(self, x):
        return x + self.drop_path(self.mlp(self.norm(x)))


class _ViT(nn.Module):
    def __init__(self, depth: int = 12, rate: float = 0.2) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_ViTBlock(rate * i / (depth - 1)) for i in range(depth)))

    def forward(self, x):
        return self.blocks(x)


def test_vit_with_stochastic_depth_trains_with_every_block_compiled():
    torch.manual_seed(0)
    model = _ViT().double().train()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    for step, x in enumerate(_inputs(4)):
        x = x.view(4, 1, 8).expand(4, 3, 8).contiguous()
        torch.manual_seed(100 + step)
        out = compiled(x)
        torch.manual_seed(100 + step)
        expected = ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert_same_grads(model, ref, what=f"step {step}")
    st = cgbackend.stats(compiled)
    assert st["uncompiled_calls"] == 0, st["uncompiled_by"]
    (stack,) = cgbackend.report(compiled).regional
    assert len(stack["groups"]) == 12 and "drop_prob" in stack["groups"][1]["why"], stack["groups"]
    assert not stack["with_model"], stack  # an nn.Sequential: its layers stay compiled one by one


class _Mode(nn.Module):
    """Branches on a string attribute the caller changes every call: Dynamo specialises on it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.mode = "m0"

    def forward(self, x):
        return self.lin(x) * (2.0 if self.mode.endswith("1") else 1.0)


def test_calls_past_dynamos_recompile_limit_are_counted_reported_and_warned_once():
    torch.manual_seed(0)
    model = _Mode().double()
    compiled = cgbackend.compile(model, **SIM)
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for i, x in enumerate(_inputs(12)):
            model.mode = f"m{i}"
            torch.testing.assert_close(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    limit = torch._dynamo.config.recompile_limit
    assert st["compiled_graphs"] == limit and st["uncompiled_calls"] == 12 - limit, st
    assert st["uncompiled_by"] == {"model": 12 - limit}
    uncompiled = [w for w in seen if issubclass(w.category, cgbackend.UncompiledCallsWarning)]
    assert len(uncompiled) == 1 and issubclass(uncompiled[0].category, cgbackend.NothingCapturedWarning)
    assert uncompiled[0].filename == __file__, uncompiled[0].filename  # the user's call, not cgbackend's frame
    notes = cgbackend.report(compiled).notes
    assert any(f"{12 - limit} calls of model ran without cgbackend" in n for n in notes), notes
    assert any("recompile limit" in n for n in notes), notes
    assert f"calls Dynamo ran without cgbackend {12 - limit} (model {12 - limit})" in cgbackend.summary(compiled)


def test_by_name_the_recompile_limit_is_reported():
    torch.manual_seed(0)
    model = _Mode().double()
    compiled = torch.compile(model, backend="cgbackend")
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        for i, x in enumerate(_inputs(10)):
            model.mode = f"m{i}"
            torch.testing.assert_close(compiled(x), model(x))
    assert len([w for w in seen if issubclass(w.category, cgbackend.UncompiledCallsWarning)]) == 1
    assert any("recompile limit" in n for n in cgbackend.report(compiled).notes)
