"""The inference fast path (runtime/fast.py) with simulated graphs: a call whose key
is that of the entry replayed last replays it after a check field by field; anything else (shapes,
numbers, moved parameters, inference mode, the replay-order rule) takes the full path. Results are
compared with eager on varied inputs, and outputs returned earlier must survive later replays."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cgbackend

SIM = dict(simulate_graphs=True, warmup=1)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x).relu()
        return self.b(h), h.sum(-1)


def _check(compiled, model, xs, kept):
    for x in xs:
        out, ref = compiled(x), model(x)
        for o, r in zip(out, ref):
            assert torch.equal(o, r)
        kept.append((out, ref))


def test_steady_inference_calls_take_the_fast_path():
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    kept: list = []
    with torch.no_grad():
        _check(compiled, model, [torch.randn(4, 8) for _ in range(6)], kept)
    for out, ref in kept:
        assert all(torch.equal(o, r) for o, r in zip(out, ref)), "a replay overwrote an earlier output"
    st = cgbackend.stats(compiled)
    # Call 1 warms up, call 2 captures (and replays: the entry is remembered), calls 3-6 take the
    # fast path: 3 and 4 through the two handout graphs (their outputs are kept: 5 and 6 copy).
    assert st["graphs_captured"] == 1 and st["replays"] == 5 and st["fast_replays"] == 4, st
    assert st["handout_graphs"] == 2 and st["handout_replays"] == 2 and st["outputs_handed"] == 2 * 2
    assert st["copied_by_kind"] == {"user_input": 4} and st["output_clones"] == 2 * 3


def test_changed_shape_takes_the_full_path():
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, dynamic=True, capture_sizes=(), **SIM)  # a graph per size
    kept: list = []
    with torch.no_grad():
        _check(compiled, model, [torch.randn(n, 8) for n in (3, 3, 3, 5, 5, 5, 3, 5, 3, 3)], kept)
    for out, ref in kept:
        assert all(torch.equal(o, r) for o, r in zip(out, ref))
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == 2 and st["eager_calls"] == {"warmup": 2}, st
    # Calls after a size change replay through the full path (calls 7, 8, 9); a repeat of the size
    # before takes the fast one (calls 3, 6, 10).
    assert st["replays"] == 8 and st["fast_replays"] == 3, st


def test_changed_number_takes_the_full_path():
    def f(x, n):
        return (x * n).relu() + n

    compiled = cgbackend.compile(f, dynamic=True, capture_sizes=(), **SIM)
    with torch.no_grad():
        for n in (2, 2, 2, 3, 3, 2, 2, 7):
            x = torch.randn(4, 6)
            assert torch.equal(compiled(x, n), f(x, n)), n
    st = cgbackend.stats(compiled)
    # n is a number input of the region (part of its key): a graph for 2 and one for 3, 7 warms up.
    assert st["graphs_captured"] == 2 and st["replays"] == 5 and st["fast_replays"] == 2, st


def test_moved_parameter_and_inference_mode_take_the_full_path():
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    kept: list = []
    with torch.no_grad():
        _check(compiled, model, [torch.randn(4, 8) for _ in range(4)], kept)
        fast = cgbackend.stats(compiled)["fast_replays"]
        model.b.weight.data = torch.randn_like(model.b.weight)  # new address: a new graph
        _check(compiled, model, [torch.randn(4, 8) for _ in range(3)], kept)
        st = cgbackend.stats(compiled)
        # The call after the move misses (an address), captures and is remembered; two fast ones.
        assert st["graphs_captured"] == 2 and st["fast_replays"] == fast + 2, st
    with torch.inference_mode():
        _check(compiled, model, [torch.randn(4, 8) for _ in range(3)], kept)
    with torch.no_grad():
        _check(compiled, model, [torch.randn(4, 8) for _ in range(2)], kept)
    for out, ref in kept:
        assert all(torch.equal(o, r) for o, r in zip(out, ref))
    st = cgbackend.stats(compiled)
    assert st["eager_calls"].get("warmup", 0) >= 1 and set(st["eager_calls"]) <= {"warmup"}, st


def test_grad_mode_inference_call_copies_inputs_with_copy(monkeypatch):
    """Grad mode on and a graph without grad-requiring inputs: inputs are copied with ``copy_``
    (as before), with grad off with one ``_foreach_copy_``."""
    from cgbackend.runtime import entries
    calls = []
    real = entries.foreach_copy
    monkeypatch.setattr(entries, "foreach_copy", lambda d, s: calls.append(len(d)) or real(d, s))
    torch.manual_seed(0)
    model = _Net().eval().requires_grad_(False)
    compiled = cgbackend.compile(model, **SIM)
    kept: list = []
    _check(compiled, model, [torch.randn(4, 8) for _ in range(4)], kept)
    assert calls == []
    with torch.no_grad():
        _check(compiled, model, [torch.randn(4, 8) for _ in range(3)], kept)
    assert calls and set(calls) == {1}
    assert cgbackend.stats(compiled)["fast_replays"] >= 2


def test_replay_order_rule_holds_on_the_fast_path():
    """Two regions (a graph break between them): the first's graph replays only while no newer
    graph holds live outputs; the fast path checks the rule like the full path."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x).relu()
            torch._dynamo.graph_break()
            return self.b(h).tanh()

    model = Two().eval()
    compiled = cgbackend.compile(model, **SIM)
    kept: list = []
    with torch.no_grad():
        _check(compiled, model, [torch.randn(3, 8) for _ in range(6)], kept)
    for out, ref in kept:
        assert torch.equal(out, ref)
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == 2 and st["fast_replays"] >= 4, st


@pytest.mark.parametrize("hazard", [True])
def test_fast_path_refuses_a_replay_the_rule_forbids(hazard):
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(4, 8))
    backend = cgbackend.find_backend(compiled)
    graph = backend._graphs[0]()
    runner = graph.runners[0]
    assert len(runner.fast.remembered) == 1
    entry = next(iter(runner.fast.remembered.values())).entry
    pool = entry.pool
    pool.acquire(entry.index + 1)  # a newer graph's outputs are live
    try:
        st = cgbackend.stats(compiled)
        with torch.no_grad():
            x = torch.randn(4, 8)
            out = compiled(x)
        assert all(torch.equal(o, r) for o, r in zip(out, model(x)))
        after = cgbackend.stats(compiled)
        assert after["fast_replays"] == st["fast_replays"]
        assert after["graphs_recaptured"] + sum(after["eager_calls"].values()) > \
            st["graphs_recaptured"] + sum(st["eager_calls"].values())
    finally:
        pool.release(entry.index + 1)


class _Cache(nn.Module):
    """A static KV cache in miniature: each call writes its rows into a buffer at the given
    positions (in place) and reads the whole buffer back."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(16, 8))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, self.proj(x))
        return (x @ self.cache.t()).softmax(-1) @ self.cache


def test_region_writing_a_buffer_in_place_takes_the_fast_path():
    """A region that writes only inputs it reads in place (a decode step's static cache) replays
    through the fast path; the writes land in the buffer as eagerly; a copied input that lies in the
    written buffer takes the full path, which runs that call eagerly (aliased inputs)."""
    torch.manual_seed(0)
    model = _Cache().eval()
    ref = _Cache().eval()
    ref.load_state_dict(model.state_dict())
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for step in range(8):
            x = torch.randn(2, 8)
            pos = torch.tensor([2 * step, 2 * step + 1])
            torch.testing.assert_close(compiled(x, pos), ref(x, pos), rtol=0, atol=0)
            assert torch.equal(model.cache, ref.cache), step
        st = cgbackend.stats(compiled)
        # Call 1 warms up, call 2 captures; calls 3-8 take the fast path.
        assert st["graphs_captured"] == 1 and st["replays"] == 7 and st["fast_replays"] == 6, st
        # Rows of the cache itself as the input: they would be copied before the graph writes the
        # cache, so this call runs eagerly, on the caller's tensors, as eager does.
        x_model, x_ref = model.cache[:2], ref.cache[:2]
        pos = torch.tensor([4, 5])
        torch.testing.assert_close(compiled(x_model, pos), ref(x_ref, pos), rtol=0, atol=0)
        assert torch.equal(model.cache, ref.cache)
    st = cgbackend.stats(compiled)
    assert st["fast_replays"] == 6 and st["eager_calls"].get("aliased_inputs") == 1, st
