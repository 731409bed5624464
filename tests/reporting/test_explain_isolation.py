"""explain leaves models compiled before it alone (no Dynamo reset) and takes any positional inputs."""

from __future__ import annotations

import torch

import cgbackend
from cgbackend.models import demo_model


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _ListNet(_Net):
    def forward(self, xs: list) -> torch.Tensor:  # type: ignore[override]
        return self.b(torch.relu(self.a(xs[0]))) + xs[1]


class _DictNet(_Net):
    def forward(self, inputs: dict, scale: float = 1.0) -> torch.Tensor:  # type: ignore[override]
        return self.a(inputs["x"]) * scale + inputs["y"]


def test_explain_of_another_model_leaves_compiled_model_alone():
    torch.manual_seed(0)
    first = _Net()
    compiled = cgbackend.compile(first, simulate_graphs=True, warmup=1)
    x = torch.randn(4, 8)
    for _ in range(3):
        compiled(x)
    before = cgbackend.stats(compiled)
    graphs_before = cgbackend.find_backend(compiled).compiled_graphs()
    assert before["compiled_graphs"] == 1 and before["replays"] >= 1
    other = _Net()  # the same class: the same code objects as the compiled model's
    report = cgbackend.explain(other, (x,), options={"simulate_graphs": True})
    assert report.summary["graphs"] == 1
    assert cgbackend.stats(compiled) == before  # counters untouched
    for _ in range(2):
        torch.testing.assert_close(compiled(x), first(x))
    after = cgbackend.stats(compiled)
    assert after["compiled_graphs"] == 1 and after["graphs_captured"] == before["graphs_captured"]
    assert after["replays"] == before["replays"] + 2 and after["eager_calls"] == before["eager_calls"]
    assert cgbackend.find_backend(compiled).compiled_graphs() == graphs_before


def test_by_name_explain_leaves_no_skipped_frames_behind():
    """By name, Dynamo gives up the demo MoE's forward (a graph break in its loop) and marks its code
    to be skipped by every later compile; explain undoes that mark, so a later compile is whole."""
    model, x = demo_model("moe")
    with torch.no_grad():
        by_name = cgbackend.explain(model, x, by_name=True, count_launches=False)
        assert by_name.summary["graph_breaks"] > 0
        later = cgbackend.explain(model, x, count_launches=False)
        first = cgbackend.explain(demo_model("moe")[0], x, count_launches=False)
    assert later.summary["graphs"] == first.summary["graphs"] == 1


def test_explain_takes_lists_and_dicts_inside_the_inputs_tuple():
    torch.manual_seed(0)
    xs = [torch.randn(4, 8), torch.randn(4, 8)]
    report = cgbackend.explain(_ListNet(), (xs,), count_launches=False)
    assert report.summary["graphs"] == 1 and report.summary["static_regions"] == 1
    report = cgbackend.explain(_DictNet(), ({"x": xs[0], "y": xs[1]}, 2.0), count_launches=False)
    assert report.summary["graphs"] == 1 and report.summary["static_regions"] == 1
    # a lone list of tensors stays the positional inputs of a model that takes them one by one
    report = cgbackend.explain(_Net(), [xs[0]], count_launches=False)
    assert report.summary["graphs"] == 1
