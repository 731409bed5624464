"""Training entries free their saved activations once their backward graph exists (runtime/pool.py,
"Released memory"; runtime/backward.py): simulated graphs, bitwise against eager, on varied inputs."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import cgbackend
from cgbackend.api import find_backend
from cgbackend.models import build_model, make_inputs

SIM = dict(simulate_graphs=True, warmup=1, static_dispatch="off")


def _pair(model: nn.Module):
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    return ref, mine, cgbackend.compile(mine, **SIM)


def _train_entries(compiled):
    return [e for g in find_backend(compiled).compiled_graphs() for r in g.runners
            for e in r.entries.values() if hasattr(e, "bwd_graph")]


def _step(model, fn, x):
    model.zero_grad(set_to_none=True)
    fn(x).float().pow(2).mean().backward()


def test_saved_activations_are_freed_once_the_backward_graph_exists():
    ref, mine, compiled = _pair(build_model("dense").train())
    for i, x in enumerate(make_inputs("dense", ref, n=5, seed=11)):
        for model, fn in ((ref, ref), (mine, compiled)):
            _step(model, fn, x)
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad), i
        if i == 0:  # the warm-up call: nothing captured yet
            assert cgbackend.stats(compiled)["saved_released"] == 0
    st = cgbackend.stats(compiled)
    entries = _train_entries(compiled)
    assert entries and all(e.released and e.capture_outs is None for e in entries)
    assert st["saved_released"] == len(entries)
    assert st["saved_released_bytes"] == sum(e.saved_bytes for e in entries) > 0
    assert st["bwd_replays"] == 4 * len(entries) and st["bwd_recomputes"] == 0
    assert all(e.pool.sealed and e.pool.awaiting_backward == 0 for e in entries)


def test_a_backward_that_cannot_replay_recomputes_the_forward():
    """A parameter's storage re-allocated between forward and backward (as FSDP2 does): the
    backward graph would read the old address, so autograd runs through the forward computed again
    on the parameter's new memory; the next forward captures again, in a new pool (the released
    one takes no capture)."""
    ref, mine, compiled = _pair(build_model("dense").train())
    xs = make_inputs("dense", ref, n=5, seed=12)
    keep: list = []
    for i, x in enumerate(xs):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            out = fn(x)
            if model is mine and i == 3:
                _move_storage(next(mine.parameters()), keep)
            out.float().pow(2).mean().backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad), i
    st = cgbackend.stats(compiled)
    assert st["eager_calls"].get("param_moved", 0) >= 1
    assert st["bwd_recomputes"] == st["eager_calls"]["param_moved"]
    pools = {id(e.pool) for e in _train_entries(compiled)}
    assert len(pools) == 2  # the graphs captured after the move are in a pool of their own


def _move_storage(p: torch.Tensor, keep_alive: list) -> None:
    """Free a parameter's bytes and gather its values again into a new allocation."""
    values, storage, old = p.detach().clone(), p.untyped_storage(), p.data_ptr()
    nbytes = storage.nbytes()
    while p.data_ptr() == old:
        storage.resize_(0)
        keep_alive.append(torch.empty(nbytes, dtype=torch.uint8))  # may take the freed place
        storage.resize_(nbytes)
    with torch.no_grad():
        p.copy_(values)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.nn.functional.dropout(self.a(x).relu(), 0.25, self.training))


def test_a_region_drawing_random_numbers_keeps_its_saved_activations():
    """Recomputing its forward would draw other numbers: it never releases."""
    torch.manual_seed(0)
    model = _Dropout().train()
    compiled = cgbackend.compile(model, **SIM)
    for i in range(4):
        model.zero_grad(set_to_none=True)
        compiled(torch.randn(8, 16)).pow(2).mean().backward()
    st = cgbackend.stats(compiled)
    assert st["bwd_replays"] >= 2
    assert st["saved_released"] == 0
    assert all(not e.released and e.capture_outs is not None for e in _train_entries(compiled))
