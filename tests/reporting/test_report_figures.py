"""The report's figures agree with each other and say what they are (reporting/figures.py): the launch
coverage is a share of the counts printed beside it, estimated and measured launches are labelled
as such in the text and on the HTML page alike, the graph memory line says how many graphs it adds
up, and a region's role is what most of its ops do."""

from __future__ import annotations

import html
import re

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.models import demo_model


@pytest.fixture(scope="module")
def demo():
    """The MoE demo, as ``python -m cgbackend explain --demo moe`` reports it: its graphs run static
    dispatch's masked dense form, which dispatches more ops than the eager loop."""
    model, x = demo_model("moe")
    with torch.no_grad():
        return cgbackend.explain(model, x, training=False)


def _coverage_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith("launch coverage:"))


def test_launch_coverage_is_the_share_of_the_counts_beside_it(demo):
    info = demo.summary["launches"]
    assert info["in_graphs"] + info["in_dynamic_regions"] + info["uncompiled"] == info["with_cgbackend"]
    assert info["eager_call"] != info["with_cgbackend"]  # another form runs in the graphs
    assert demo.summary["launch_coverage"] == round(info["in_graphs"] / info["with_cgbackend"], 4)
    line = _coverage_line(demo.to_text())
    for part, whole in re.findall(r"(\d+) of the (\d+) launch", line):
        assert int(part) <= int(whole), line
    assert f"{info['in_graphs']} of the {info['with_cgbackend']} launches of a call through cgbackend" in line
    assert f"an eager call makes {info['eager_call']} launches" in line


def test_the_page_and_the_text_give_the_same_figures_with_their_basis(demo):
    from cgbackend.reporting.figures import summary_figures
    text, page = demo.to_text(), html.unescape(demo.to_html())
    figures = summary_figures(demo.summary)
    assert [label for label, _ in figures] == ["kernel launches per call (estimated from the traced ops)",
                                              "launch coverage", "graph memory (estimated before capture)"]
    for label, figure in figures:
        assert f"  {label}: {figure}" in text
        assert f'<tr><td>{label}</td><td class="long">{figure}</td></tr>' in page
    assert "measured, one launch per dispatched op" in _coverage_line(text)
    for part, whole in re.findall(r"(\d+) of (?:the )?(\d+) launch", page):
        assert int(part) <= int(whole)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return self.lin(x).relu() * 2


class Stack(nn.Module):
    """Six identical layers, each behind a graph break: one Dynamo graph that runs six times per call."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.compiler.disable(lambda v: v)(x)
            x = layer(x)
        return x


def test_graph_memory_says_how_many_graphs_it_adds_up():
    with torch.no_grad():
        report = cgbackend.explain(Stack(), torch.randn(32, 64), training=False)
    s = report.summary
    runs = {g.index: g.runs_per_call for g in report.graphs}
    sizes = [(runs[int(r.id[1:].split(".")[0])], max(m["bytes"] for m in r.memory)) for r in report.regions()]
    assert sum(n for n, _ in sizes) == s["est_graphs"] >= 6 > len(sizes)
    one = max(b for _, b in sizes)
    assert s["est_graph_bytes"] == sum(n * b for n, b in sizes) and s["est_graph_bytes_largest"] == one
    line = next(line for line in report.to_text().splitlines() if "graph memory (estimated before capture)" in line)
    assert f"for {s['est_graphs']} graphs" in line and f"the largest {one / 2**20:.1f} MiB" in line


def test_a_regions_role_is_what_most_of_its_ops_do(demo):
    """The demo's one region runs the whole model: no role has most of its ops."""
    (region,) = demo.regions()
    assert region.role == "mixed"
    assert 2 * max(region.roles.values()) <= sum(region.roles.values())
    assert region.roles["moe_dispatch"] > region.roles["attention"]  # the masked dense form's own ops
    assert re.search(r"roles \(ops, share\): moe_dispatch \d+ \(\d+%\)", demo.to_text())


@pytest.mark.parametrize("n, noun, expected", [
    (1, "graph launch", "1 graph launch"), (2, "graph launch", "2 graph launches"), (1, "step", "1 step"),
    (0, "launch", "0 launches"), (3, "static region", "3 static regions"),
])
def test_counts_agree_in_number(n, noun, expected):
    from cgbackend.common.wording import count
    assert count(n, noun) == expected


def test_one_of_each_reads_in_the_singular(demo):
    text = demo.to_text()
    assert "1 graph launch +" in text and "1 graph launches" not in text
    assert "1 step of one call" in html.unescape(demo.to_html())
