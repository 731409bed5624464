"""Handout graphs (option handout_graphs, runtime/handout.py) with simulated graphs: outputs go to
the caller without a copy when nobody holds the earlier ones, and nothing the caller holds (the
output, a view of it, its storage) is ever overwritten."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import cgbackend

SIM = dict(simulate_graphs=True, warmup=1)
KEYS = ("graphs_captured", "handout_graphs", "handout_replays", "outputs_handed", "output_clones", "replays")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h), h.sum(-1)


def _counts(compiled) -> dict:
    st = cgbackend.stats(compiled)
    return {k: st[k] for k in KEYS}


def _inputs(n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 8, generator=g) for _ in range(n)]


def test_outputs_nobody_keeps_are_handed_out_without_a_copy():
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    xs = _inputs(8)
    with torch.no_grad():
        for x in xs:
            out, ref = compiled(x), model(x)
            assert all(torch.equal(o, r) for o, r in zip(out, ref))
            del out  # nothing of this call's outputs is alive at the next call
    # Call 1 warms up, call 2 captures (its outputs copied), calls 3-8 replay one handout graph.
    assert _counts(compiled) == {"graphs_captured": 1, "handout_graphs": 1, "handout_replays": 6,
                                 "outputs_handed": 2 * 6, "output_clones": 2, "replays": 7}
    regions = cgbackend.report(compiled).graphs[0].runtime["regions"]
    assert [r["handout_graphs"] for r in regions.values()] == [1]
    assert "1 graph(s) + 1 handout graph(s) (outputs to the caller without a copy)" in cgbackend.report(compiled).to_text()


def test_outputs_kept_by_a_loop_variable_alternate_between_two_handout_graphs():
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    previous = None
    with torch.no_grad():
        for x in _inputs(10):
            out = compiled(x)  # the previous call's `out` is alive during this call
            ref = model(x)
            assert all(torch.equal(o, r) for o, r in zip(out, ref))
            if previous is not None:
                assert all(torch.equal(o, r) for o, r in zip(*previous)), "a replay overwrote the previous output"
                assert all(o.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
                           for o, p in zip(out, previous[0]))
            previous = (out, ref)
    counts = _counts(compiled)
    assert counts["handout_graphs"] == 2 and counts["handout_replays"] == 8
    assert counts["output_clones"] == 2  # the capturing call only


@pytest.mark.parametrize("hold", ["view", "storage", "element_view_of_second_output"])
def test_what_the_caller_holds_of_a_handed_output_is_never_overwritten(hold):
    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    xs = _inputs(12, seed=1)
    with torch.no_grad():
        for x in xs[:3]:
            compiled(x)
        out = compiled(xs[3])
        assert cgbackend.stats(compiled)["outputs_handed"] >= 2
        expected = [o.clone() for o in out]
        if hold == "view":
            held = out[0][1:, 2:]
            want = expected[0][1:, 2:]
        elif hold == "storage":
            held = out[0].untyped_storage()
            want = expected[0]
        else:
            held = out[1][2]
            want = expected[1][2]
        del out
        for x in xs[4:]:
            compiled(x)
            compiled(x)
        if hold == "storage":
            view = torch.empty(0).set_(held, 0, want.shape, want.stride())
            assert torch.equal(view, want)
        else:
            assert torch.equal(held, want)
    counts = _counts(compiled)
    assert counts["handout_graphs"] == 2 and counts["output_clones"] == 2  # the capture only


def test_an_output_fed_back_as_the_next_input_matches_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).eval()
    compiled = cgbackend.compile(model, **SIM)
    h = r = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(8):
            h, r = compiled(h), model(r)
            assert torch.equal(h, r)
            h.mul_(0.5)  # the caller writes the handed output in place: eager does the same to its own
            r.mul_(0.5)
    assert _counts(compiled)["handout_replays"] >= 5


def test_no_handout_graphs_when_off_in_training_or_for_a_region_writing_its_input():
    torch.manual_seed(0)
    model = _Net().eval()
    off = cgbackend.compile(model, handout_graphs=0, **SIM)
    with torch.no_grad():
        for x in _inputs(5):
            off(x)
    assert _counts(off)["handout_graphs"] == 0 and _counts(off)["output_clones"] == 2 * 4

    torch._dynamo.reset()
    train = cgbackend.compile(_Net().train(), **SIM)
    for x in _inputs(5):
        out, s = train(x)
        (out.sum() + s.sum()).backward()
    assert _counts(train)["handout_graphs"] == 0

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            x.mul_(2)  # the region copies x back after each replay
            return self.lin(x).relu()

    torch._dynamo.reset()
    writes = cgbackend.compile(Writes().eval(), **SIM)
    with torch.no_grad():
        for x in _inputs(5):
            writes(x)
    assert _counts(writes)["handout_graphs"] == 0


def test_only_the_last_static_region_of_a_graph_hands_out():
    """A region whose outputs another static region reads keeps copying them (a graph was captured
    at their address); across a graph break, the first graph's last region hands its output to the
    second graph, which copies it into its static buffer like any input."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x).relu()
            torch._dynamo.graph_break()
            return self.b(h).tanh() * 2, h

    torch.manual_seed(0)
    model = Broken().eval()
    compiled = cgbackend.compile(model, **SIM)
    kept = []
    with torch.no_grad():
        for x in _inputs(8):
            out, ref = compiled(x), model(x)
            assert all(torch.equal(o, r) for o, r in zip(out, ref))
            kept.append((out, ref))
            del out
    for out, ref in kept[-3:]:
        assert all(torch.equal(o, r) for o, r in zip(out, ref))
    counts = _counts(compiled)
    assert cgbackend.stats(compiled)["compiled_graphs"] == 2
    assert counts["handout_graphs"] == 4  # two per graph: every output is kept
    assert counts["graphs_captured"] == 2


def test_a_handout_capture_that_fails_is_counted_and_the_region_copies(monkeypatch):
    from cgbackend.runtime import caller_graphs
    from cgbackend.runtime.capture import CaptureError

    torch.manual_seed(0)
    model = _Net().eval()
    compiled = cgbackend.compile(model, **SIM)
    real = caller_graphs.CallerGraphs._capture
    xs = _inputs(6)
    with torch.no_grad():
        compiled(xs[0])
        compiled(xs[1])

        def failing(self, entry):
            monkeypatch.setattr(self.shared.capturer, "capture",
                                lambda *a, **k: (_ for _ in ()).throw(CaptureError("no memory")))
            return real(self, entry)

        monkeypatch.setattr(caller_graphs.CallerGraphs, "_capture", failing)
        for x in xs[2:]:
            out, ref = compiled(x), model(x)
            assert all(torch.equal(o, r) for o, r in zip(out, ref))
    st = cgbackend.stats(compiled)
    assert st["handout_graphs"] == 0 and len(st["handout_failures"]) == 1
    assert st["handout_failures"][0]["error"] == "no memory"
    assert st["output_clones"] == 2 * 5
