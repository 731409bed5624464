"""The report's committed JSON Schema (cgbackend/reporting/report.schema.json) describes the JSON cgbackend
really prints: the demo's report from the CLI, a compiled model's report with runtime counters, and
a report with graph breaks. The small checker (cgbackend/reporting/schema.py) must reject what the
schema forbids, or these tests could not fail."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.models import build_model, make_inputs
from cgbackend.reporting.schema import check, load_schema, validate_report


@pytest.fixture(scope="module")
def demo_json() -> dict:
    from cgbackend.cli import main
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["explain", "--demo", "moe", "--json", "--option", "static_dispatch=off"]) == 0
    return json.loads(out.getvalue())


def test_schema_names_the_report_schema():
    schema = load_schema()
    from cgbackend.reporting.report import SCHEMA
    assert schema["$id"] == schema["properties"]["schema"]["const"] == SCHEMA


def test_demo_report_printed_by_the_cli_validates(demo_json):
    assert demo_json["summary"]["static_regions"] == 3  # the demo really ran
    assert validate_report(demo_json) == []


def test_compiled_model_report_with_runtime_validates():
    model = build_model("moe", size="tiny").eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1)
    with torch.no_grad():
        for x in make_inputs("moe", model, n=3):
            compiled(x)
    report = cgbackend.report(compiled)
    assert report.graphs[0].runtime is not None
    assert validate_report(report) == []


def test_report_with_graph_breaks_and_training_validates():
    class Item(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x).relu()
            if h.sum().item() > 0:
                h = h * 2
            return self.lin(h).tanh()

    report = cgbackend.explain(Item(), torch.randn(3, 4), trace_dynamic_ops=False, training=True)
    assert report.summary["graph_breaks"] >= 1 and report.traced_as["mode"] == "training"
    assert validate_report(report) == []


@pytest.mark.parametrize("mutate, problem", [
    (lambda d: d["summary"].__setitem__("undocumented_key", 1), "undocumented_key"),
    (lambda d: d["graphs"][0]["regions"][0].__setitem__("kind", "sometimes"), "sometimes"),
    (lambda d: d["graphs"][0].__setitem__("ops", "many"), "expected integer"),
    (lambda d: d["summary"].__setitem__("static_op_fraction", 1.5), "maximum"),
    (lambda d: d.pop("graphs"), "graphs"),
    (lambda d: d["graphs"][0].__setitem__("break_reason", {"reason": "x"}), "oneOf"),
    (lambda d: d["graphs"][0]["regions"][1]["reasons"][0].__setitem__("count", 0), "minimum"),
])
def test_checker_rejects_what_the_schema_forbids(demo_json, mutate, problem):
    bad = copy.deepcopy(demo_json)
    mutate(bad)
    errors = validate_report(bad)
    assert errors and any(problem in e for e in errors), errors


def test_checker_refuses_keywords_it_does_not_implement():
    schema = {"type": "object", "patternProperties": {"x": {}}}
    assert "patternProperties" in check({}, schema, schema)[0]
