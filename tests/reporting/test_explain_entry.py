"""explain as a torch.compile user meets it: which entry point's partition it shows (by name or
cgbackend.compile) and how the other differs; inputs as a tuple; a failed trace in one line that
names the user's line, not torch's frames."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.reporting.explain import ExplainError
from cgbackend.models import demo_model
from cgbackend.reporting.schema import validate_report

FILE = "test_explain_entry.py"


def _line(marker: str) -> int:
    for number, text in enumerate(inspect.getsource(inspect.getmodule(_line)).splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(marker)


def test_by_name_report_of_the_moe_demo_shows_its_graph_breaks():
    model, x = demo_model("moe")
    with torch.no_grad():
        report = cgbackend.explain(model, x, by_name=True, compare=True, count_launches=False)
    lines = report.to_text().splitlines()
    assert lines[1].startswith('  shows: torch.compile(model, backend="cgbackend") (by name: ')
    assert "4 graphs, 3 graph breaks; cgbackend.compile(model) gives 1 graph, 0 graph breaks" in lines[1]
    assert "graphs: 4   graph breaks: 3" in lines[2]
    breaks = [line for line in lines if line.startswith("  graph break at gpt.py:")]
    assert len(breaks) == 3 and "nonzero" in breaks[0]
    assert report.traced_via["other"] == {"entry": "compile", "graphs": 1, "graph_breaks": 0}
    assert validate_report(report) == []


def test_cli_by_name_and_compare_reach_explain(monkeypatch, capsys):
    import sys
    from cgbackend.cli import main
    explain_module = sys.modules["cgbackend.reporting.explain"]  # the package's explain is the function
    seen = []
    real = explain_module.explain

    def spy(*args, **kwargs):
        seen.append({k: kwargs[k] for k in ("by_name", "compare")})
        return real(*args, **{**kwargs, "count_launches": False, "compare": False})

    monkeypatch.setattr(explain_module, "explain", spy)
    assert main(["explain", "--demo", "dense", "--by-name", "--no-compare"]) == 0
    assert main(["explain", "--demo", "dense"]) == 0
    assert seen == [{"by_name": True, "compare": False}, {"by_name": False, "compare": True}]
    assert 'shows: torch.compile(model, backend="cgbackend")' in capsys.readouterr().out


@pytest.fixture(scope="module")
def moe_report():
    model, x = demo_model("moe")
    with torch.no_grad():
        # the dispatch as written (dynamic regions): what the text says of their ops
        return cgbackend.explain(model, x, count_launches=False, options={"static_dispatch": "off"})


def test_the_report_says_how_the_other_entry_point_differs(moe_report):
    report = moe_report
    assert report.traced_via == {"entry": "compile", "calls": 2, "trace_dynamic_ops": True, "other": None,
                                 "other_may_differ": True}
    first = report.to_text().splitlines()[1]
    assert first.startswith("  shows: cgbackend.compile(model) (data-dependent ops traced into the graph): "
                            "1 graph, 0 graph breaks; ")
    assert "may differ" in first and "--by-name (Python: by_name=True)" in first and "compare=True" in first
    assert validate_report(report) == []
    dense, y = demo_model("dense")
    with torch.no_grad():
        same = cgbackend.explain(dense, y, count_launches=False)
    assert "gives the same partition (no data-dependent op, no graph break)" in same.to_text().splitlines()[1]


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale):
        return self.lin(x) * scale


@pytest.mark.parametrize("model, inputs", [
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),)),
    (nn.Sequential(nn.Linear(4, 4), nn.ReLU()), [torch.randn(2, 4)]),
    (TwoInputs(), (torch.randn(2, 4), torch.randn(2, 4))),
], ids=["one_in_a_tuple", "one_in_a_list", "two"])
def test_inputs_as_a_tuple_of_positional_inputs(model, inputs):
    """``cgbackend.explain(model, inputs)`` as the README writes it."""
    with torch.no_grad():
        report = cgbackend.explain(model, inputs, count_launches=False)
        unpacked = cgbackend.explain(model, *inputs, count_launches=False)
    assert report.summary == unpacked.summary and report.summary["graphs"] == 1


class Mismatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(4, 8))

    def forward(self, x):
        h = self.lin(x).sin()
        return h @ x  # MISMATCH


class AfterABreak(nn.Module):
    def forward(self, x):
        print("cgbackend test: a graph break")
        return x.view(3, 7)  # VIEW


@pytest.mark.parametrize("model, marker", [(Mismatch(), "MISMATCH"), (AfterABreak(), "VIEW")])
def test_a_failed_trace_is_one_line_naming_the_users_line(model, marker, capfd):
    with pytest.raises(ExplainError) as info:
        cgbackend.explain(model, torch.randn(2, 4))
    message = str(info.value)
    assert len(message.splitlines()) == 1
    assert f"at {FILE}:{_line(marker)} in forward (`" in message, message
    assert f"# {marker}`)" in message
    assert "external_utils" not in message and "torch_dynamo_resume" not in message
    # torch's own frames stay out of the traceback and the terminal, and are kept on the error
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value.torch_error, Exception)
    assert "failed while attempting to run meta" not in capfd.readouterr().err


# ----------------------------------------------------------------------------- reasons in the text

class TwoSyncs(nn.Module):
    def forward(self, x):
        v = x.sum().item()  # SYNC
        y = x * v
        w = y.sum().item()
        return x + w


def test_each_rule_is_explained_where_it_first_appears():
    from cgbackend.common.reasons import Rule
    text = cgbackend.explain(TwoSyncs(), torch.randn(4), count_launches=False).to_text()
    lines = text.splitlines()
    for rule in ("small_region", "host_sync", "depends_on_data_dependent_shape"):
        explained = [i for i, line in enumerate(lines) if line.strip() == f"({rule}: {Rule(rule).description})"]
        named = [i for i, line in enumerate(lines) if f"[{rule}]" in line or "ops that follow" in line
                 and rule.startswith("depends")]
        assert len(explained) == 1 and explained[0] == named[0] + 1 + ("`" in lines[named[0] + 1]), (rule, text)
    assert "small_region: a static run of ops too small to be worth a graph" in text


def test_ops_that_follow_list_the_costly_ones_first(moe_report):
    line = next(line.strip() for line in moe_report.to_text().splitlines() if "ops that follow from those" in line)
    costly, _, free = line.partition("; no kernel: ")
    assert costly.startswith("+ 76 ops that follow from those, ~") and ": linear x12 (~12)" in costly
    assert "getitem" not in free and "aten._assert_scalar x8" in free and "linear" not in free
    d1 = next(r for r in moe_report.regions() if r.id == "g0.D1")
    assert sum(x["est_kernels"] for x in d1.reasons) <= d1.est_kernels


def test_inputs_eager_rejects_are_an_error_not_a_report():
    """Dynamo traces a NumPy array as a tensor; the model itself rejects it: explain says so."""
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with pytest.raises(ExplainError, match=r"raised when called eagerly on these inputs.*TypeError.*numpy"):
        cgbackend.explain(mlp, torch.randn(2, 4).numpy())
