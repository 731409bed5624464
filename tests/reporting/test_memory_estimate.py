"""The graph memory estimate before capture (reporting/memory_estimate.py) and its hint: figures
checked against the bytes of the traced values, by hand."""

import pytest
import torch
from torch import nn

import cgbackend
from cgbackend.reporting.hints import MEMORY_HINT_BYTES
from cgbackend.reporting.schema import validate_report

F32 = 4


class _MLP(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        y = torch.relu(self.up(x))
        half = y.view(-1, y.shape[-1] // 2, 2).sum(-1)  # a view of y (no bytes), then half y's size
        return (self.down(y) + half[:, :x.shape[-1]]).view(-1)


def _explain(model, x, **kw):
    with torch.no_grad():
        return cgbackend.explain(model, x, count_launches=False, **kw)


def test_one_graph_at_the_traced_sizes():
    """Peak of the values live at once (views add nothing; a value dies after its last reader;
    the output stays) plus the static copy of the user's input; parameters are read in place."""
    n, d, h = 32, 64, 256
    report = _explain(_MLP(d, h), torch.randn(n, d))
    (region,) = report.regions()
    (graph,) = region.memory
    # up: [n,h]; relu: [n,h] (up dies after it): the peak. The view adds nothing while relu and
    # the half-size sum are live; down and the sum's slice add [n,d] values; the output is a view.
    act = n * h * F32
    assert graph["peak_bytes"] == 2 * act, graph
    assert graph["output_bytes"] == n * d * F32
    assert graph["copied_input_bytes"] == n * d * F32
    assert graph["bytes"] == 2 * act + n * d * F32 and graph["size"] is None and graph["traced"]
    assert report.summary["est_graph_bytes"] == graph["bytes"]
    assert "graph memory (estimate): 0.1 MiB at the traced sizes" in report.to_text()
    validate_report(report.to_dict())


class _EarlyOutput(nn.Module):
    def __init__(self, d=64, h=256):
        super().__init__()
        self.up = nn.Linear(d, h)

    def forward(self, x):
        early = x * 2  # an output nothing in the region reads: live to the end all the same
        return early, torch.relu(self.up(x)).sum(-1)


def test_an_output_stays_live_to_the_end_of_the_graph():
    n, d, h = 32, 64, 256
    (region,) = _explain(_EarlyOutput(d, h), torch.randn(n, d)).regions()
    (graph,) = region.memory
    assert graph["peak_bytes"] == n * d * F32 + 2 * n * h * F32, graph
    assert graph["output_bytes"] == n * d * F32 + n * F32


def test_one_graph_per_capture_size_of_a_bucketed_region():
    """A padded token count: each capture size's graph at that size, the traced one marked (the
    capture size 20 rounds up to), the summary at the largest."""
    d, h = 64, 256
    x = torch.randn(20, d)
    torch._dynamo.mark_dynamic(x, 0)
    sizes = (8, 16, 32, 64)
    report = _explain(_MLP(d, h), x, options={"capture_sizes": sizes})
    (region,) = report.regions()
    assert any(b["padded"] for b in region.buckets.values()), region.buckets
    assert [m["size"] for m in region.memory] == list(sizes)
    for m in region.memory:
        s = m["size"]
        assert m["bytes"] == 2 * s * h * F32 + s * d * F32, m
        assert m["output_bytes"] == s * d * F32 and m["unknown_values"] == 0
    assert [m["traced"] for m in region.memory] == [False, False, True, False]
    assert report.summary["est_graph_bytes"] == region.memory[-1]["bytes"]
    assert "by capture size 8: " in report.to_text()
    validate_report(report.to_dict())


def test_training_regions_are_estimated_at_their_traced_sizes():
    """Training captures exact sizes: one graph (the forward's values), said to leave out the
    saved activations and the backward."""
    x = torch.randn(20, 64)
    torch._dynamo.mark_dynamic(x, 0)
    report = cgbackend.explain(_MLP(), x, training=True, count_launches=False, options={"capture_sizes": (8, 32)})
    (region,) = report.regions()
    assert len(region.memory) == 1 and region.memory[0]["size"] is None
    assert region.memory[0]["bytes"] == 2 * 20 * 256 * F32 + 20 * 64 * F32
    assert "saved activations and the backward come on top" in report.to_text()


@pytest.mark.parametrize("max_capture_size", [0, 32, 8192])
def test_the_hint_names_max_capture_size_where_the_largest_graph_dominates(max_capture_size):
    """Above the hint's bound and twice the traced size's graph: max_capture_size at the traced
    size's capture size; none where max_capture_size already bounds the pool there."""
    d, h = 64, 4096
    x = torch.randn(20, d)
    torch._dynamo.mark_dynamic(x, 0)
    options = {"capture_sizes": (32, 1024, 8192)}
    if max_capture_size:
        options["max_capture_size"] = max_capture_size
    report = _explain(_MLP(d, h), x, options=options)
    (region,) = report.regions()
    largest = region.memory[-1]["bytes"]
    hints = [hint for hint in report.hints if hint["kind"] == "graph_memory"]
    if max_capture_size == 32:
        assert [m["size"] for m in region.memory] == [32] and not hints
        return
    assert largest >= MEMORY_HINT_BYTES
    (hint,) = hints
    assert hint["option"] == {"option": "max_capture_size", "value": 32}, hint
    assert "capture size 8192" in hint["message"] and "fewer capture_sizes" in hint["message"]
    validate_report(report.to_dict())


def test_no_hint_for_small_graphs():
    x = torch.randn(20, 64)
    torch._dynamo.mark_dynamic(x, 0)
    report = _explain(_MLP(), x)
    assert report.regions()[0].memory[-1]["bytes"] < MEMORY_HINT_BYTES
    assert not [hint for hint in report.hints if hint["kind"] == "graph_memory"]


def test_the_estimate_agrees_with_what_the_runtime_holds_per_size():
    """A compiled model's report: per capture size, the estimate's input copies and outputs equal
    the bytes the runtime's memory accounting holds for them (runtime/memory.py; simulated graphs):
    the estimate decides which inputs are copied as the runtime does."""
    model = _MLP()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, capture_sizes=(8, 16, 32))
    with torch.no_grad():
        for n in (5, 5, 12, 12, 20, 20, 30, 7):
            x = torch.randn(n, 64)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x))
    held = cgbackend.stats(compiled)["memory"]["by_size"]
    (region,) = cgbackend.report(compiled).regions()
    assert sorted(held) == [m["size"] for m in region.memory] == [8, 16, 32], (held, region.memory)
    for m in region.memory:
        size = held[m["size"]]
        assert m["copied_input_bytes"] == size["inputs"] > 0, (m, size)
        assert m["output_bytes"] == size["outputs"] + size["released_outputs"] > 0, (m, size)
