"""The partition report (cgbackend.explain, Report.to_json / to_text) and `python -m cgbackend explain`."""

from __future__ import annotations

import json
import os
import re
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend import ExplainError, Report, Rule
from cgbackend.models import build_model, demo_model, make_inputs

SOURCE_RE = re.compile(r"^[\w.]+\.py:\d+ in \w+$")


@pytest.fixture(scope="module")
def moe_report() -> Report:
    """The demo MoE with its dispatch as written (static_dispatch off): the report of its dynamic
    regions is what these tests read; the default rewrite is tested below and in tests/passes."""
    model, x = demo_model("moe")
    with torch.no_grad():
        return cgbackend.explain(model, x, options={"static_dispatch": "off"})


@pytest.fixture(scope="module")
def moe_json(moe_report) -> dict:
    return json.loads(moe_report.to_json())


def regions_of(d: dict) -> list[dict]:
    return [r for g in d["graphs"] for r in g["regions"]]


# ----------------------------------------------------------------------------- report of the demo MoE

def test_report_json_top_level(moe_json):
    assert moe_json["schema"] == "cgbackend.report/1"
    assert set(moe_json) >= {"schema", "config", "notes", "graph_breaks", "summary", "graphs"}
    assert moe_json["graph_breaks"] == []
    assert len(moe_json["graphs"]) == 1
    g = moe_json["graphs"][0]
    assert (g["compute_device"], g["training"], g["runtime"], g["break_reason"]) == ("cpu", False, None, None)
    assert moe_json["config"] == cgbackend.Config.from_options({"static_dispatch": "off"}).to_dict()


def test_report_summary(moe_json):
    s = moe_json["summary"]
    regions = regions_of(moe_json)
    assert 0.0 < s["static_op_fraction"] < 1.0
    assert s["ops"] == sum(r["ops"] for r in regions)
    assert s["static_ops"] == sum(r["ops"] for r in regions if r["kind"] == "static")
    assert s["static_op_fraction"] == round(s["static_ops"] / s["ops"], 4)
    assert s["static_regions"] == sum(r["kind"] == "static" for r in regions) == 3
    assert s["dynamic_regions"] == sum(r["kind"] == "dynamic" for r in regions) == 2
    assert (s["graphs"], s["graph_breaks"]) == (1, 0)
    assert s["est_launches_graphed"] < s["est_kernels_eager"]
    top = s["top_reasons"][0]
    assert (top["rule"], top["op"], top["count"]) == ("data_dependent_shape", "where", 8)
    assert SOURCE_RE.match(top["source"]) and top["source"].startswith("gpt.py:")


def test_report_regions(moe_json):
    regions = regions_of(moe_json)
    assert [(r["kind"], r["role"]) for r in regions][:4] == [
        ("static", "mixed"), ("dynamic", "moe_dispatch"), ("static", "mixed"), ("dynamic", "moe_dispatch")]
    assert [r["id"] for r in regions] == ["g0.S0", "g0.D1", "g0.S2", "g0.D3", "g0.S4"]
    for r in regions:
        assert set(r) >= {"id", "kind", "role", "roles", "ops", "est_kernels", "module_paths", "inputs", "outputs",
                          "symbols", "reasons", "nodes"}
        assert r["ops"] > 0
        assert sum(r["roles"].values()) == len(r["nodes"])
        assert all(isinstance(p, str) and p for p in r["module_paths"])
        for reason in r["reasons"]:
            assert set(reason) >= {"op", "rule", "source", "code", "module_path", "detail", "count"}
            Rule(reason["rule"])  # a known rule name
        if r["kind"] == "static":
            assert r["reasons"] == []
            assert all(n["rule"] is None for n in r["nodes"])
        else:
            assert r["reasons"]
            assert all(n["rule"] is not None for n in r["nodes"])
    assert "layers.0.attn" in regions[0]["module_paths"]
    assert "layers.0.ffn.gate" in regions[0]["module_paths"]
    assert "layers.0.ffn" in regions[1]["module_paths"]
    assert "layers.1.attn" in regions[2]["module_paths"]
    assert "lm_head" in regions[4]["module_paths"]


@pytest.mark.parametrize("index, layer", [(1, 0), (3, 1)])
def test_dispatch_region_reasons_name_where(moe_json, index, layer):
    region = regions_of(moe_json)[index]
    first = region["reasons"][0]  # root causes first
    assert (first["op"], first["rule"], first["count"]) == ("where", "data_dependent_shape", 4)
    assert SOURCE_RE.match(first["source"]) and first["source"].startswith("gpt.py:")
    assert first["source"].endswith(" in forward")
    assert "torch.where" in first["code"]
    assert first["module_path"] == f"layers.{layer}.ffn"
    roots = [r for r in region["reasons"] if Rule(r["rule"]).is_root_cause]
    assert [(r["op"], r["rule"]) for r in roots] == [("where", "data_dependent_shape")]
    # Everything else follows from it.
    assert {r["rule"] for r in region["reasons"][1:]} == {"depends_on_data_dependent_shape"}
    assert sum(r["count"] for r in region["reasons"]) == region["ops"]


def test_report_objects_match_json(moe_report, moe_json):
    assert moe_report.to_dict() == moe_json
    assert [r.id for r in moe_report.regions()] == [r["id"] for r in regions_of(moe_json)]
    assert moe_report.summary["dynamic_regions"] == 2


def test_report_text(moe_report):
    text = moe_report.to_text()
    assert "static_op_fraction" in text
    assert str(moe_report) == text
    assert f"{moe_report.summary['static_op_fraction']:.3f}" in text
    for rid in ("S0", "D1", "S2", "D3", "S4"):
        assert re.search(rf"^\s+{rid}\s+(static|dynamic)\s", text, re.M), rid


def test_explain_leaves_dynamo_settings_alone(moe_report):
    assert torch._dynamo.config.capture_dynamic_output_shape_ops is False
    assert torch._dynamo.config.capture_scalar_outputs is False


def test_explain_dense_is_fully_static():
    model, x = demo_model("dense")
    with torch.no_grad():
        report = cgbackend.explain(model, x)
    s = report.summary
    assert (s["static_op_fraction"], s["static_regions"], s["dynamic_regions"]) == (1.0, 1, 0)
    assert s["top_reasons"] == []


def test_explain_options_reach_the_passes():
    model = build_model("dense", size="tiny").eval()
    (x,) = make_inputs("dense", model, n=1)
    with torch.no_grad():
        report = cgbackend.explain(model, x, options={"dynamic_modules": ("layers.1*",)})
    assert report.config["dynamic_modules"] == ["layers.1*"]
    kinds = [(r.kind, r.role) for r in report.regions()]
    assert [k for k, _ in kinds] == ["static", "dynamic", "static"]
    dyn = report.regions()[1]
    assert all(p.startswith("layers.1") for p in dyn.module_paths)
    assert {r["rule"] for r in dyn.reasons} == {"user_marked"}


# ----------------------------------------------------------------------------- graph breaks

class ItemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x).relu()
        n = h.sum().item()
        return self.lin(h * n).sigmoid()


class PrintModel(nn.Module):
    def forward(self, x):
        h = x.sin().cos()
        print("cgbackend test print")
        return h.exp().tanh()


def test_item_without_dynamic_ops_is_a_graph_break():
    with torch.no_grad():
        report = cgbackend.explain(ItemModel(), torch.randn(3, 4), trace_dynamic_ops=False)
    assert report.summary["graph_breaks"] >= 1
    brk = report.graph_breaks[0]
    assert brk["reason"]
    assert "item" in brk["reason"].lower()
    assert brk["source"].startswith("test_report_cli.py:") and brk["source"].endswith(" in forward")
    assert report.summary["graphs"] == 2
    assert report.graphs[0].break_reason == brk
    json.loads(report.to_json())


def test_item_with_dynamic_ops_stays_in_one_graph():
    with torch.no_grad():
        report = cgbackend.explain(ItemModel(), torch.randn(3, 4))
    assert report.summary["graph_breaks"] == 0 and report.summary["graphs"] == 1
    reasons = [r for reg in report.regions() for r in reg.reasons]
    assert ("Tensor.item", "host_sync") in {(r["op"], r["rule"]) for r in reasons}
    item = next(r for r in reasons if r["op"] == "Tensor.item")
    assert item["source"].startswith("test_report_cli.py:")


@pytest.mark.parametrize("trace_dynamic_ops", [False, True])
def test_print_is_a_graph_break(capsys, trace_dynamic_ops):
    report = cgbackend.explain(PrintModel(), torch.randn(3), trace_dynamic_ops=trace_dynamic_ops)
    assert report.summary["graph_breaks"] == 1
    brk = report.graph_breaks[0]
    assert brk["reason"]
    assert brk["source"].startswith("test_report_cli.py:") and brk["source"].endswith(" in forward")
    assert report.summary["graphs"] == 2


def test_explain_of_a_failing_model_raises_explain_error():
    class Bad(nn.Module):
        def forward(self, x):
            raise ValueError("no good")

    with pytest.raises(ExplainError) as info:
        cgbackend.explain(Bad(), torch.randn(2))
    assert "ValueError" in str(info.value) and "no good" in str(info.value)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- report of a compiled model

def test_report_of_compiled_model_has_runtime():
    model = build_model("moe", size="tiny").eval()
    for options, kinds in (({"static_dispatch": "off"}, ["static", "dynamic", "static", "dynamic", "static"]),
                           ({}, ["static"])):
        compiled = cgbackend.compile(model, **options)
        with torch.no_grad():
            for x in make_inputs("moe", model, n=2):
                compiled(x)
        report = cgbackend.report(compiled)
        assert len(report.graphs) == 1
        runtime = report.graphs[0].runtime
        assert runtime is not None and runtime["blocked"] == "no_cuda"
        assert [r.kind for r in report.regions()] == kinds
        json.loads(report.to_json())


# ----------------------------------------------------------------------------- CLI

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn as nn


    def good():
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), (torch.randn(2, 4),)


    def good_kwargs():
        return nn.Linear(4, 4), ((), {"input": torch.randn(2, 4)})


    def raises():
        raise RuntimeError("boom in factory")


    def raises_multiline():
        raise RuntimeError("first line\\nsecond line\\nthird line")


    def wrong_shape():
        return nn.Linear(4, 4)


    def wrong_tuple():
        return nn.Linear(4, 4), torch.randn(2, 4), 3


    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("broken forward")


    def broken_model():
        return Broken(), (torch.randn(2, 4),)


    class BrokenMultiline(nn.Module):
        def forward(self, x):
            raise ValueError("forward failed\\nwith details")


    def broken_multiline():
        return BrokenMultiline(), (torch.randn(2, 4),)


    NOT_CALLABLE = 3
''')


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    folder = tmp_path_factory.mktemp("factories")
    path = folder / "cg_factories.py"
    path.write_text(FACTORIES)
    return path


def cli_here(*args, cwd=None):
    """``python -m cgbackend ARGS`` run in this process (no interpreter start-up, no torch import):
    the same ``main``; ``cwd`` is also put first on ``sys.path``, as ``python -m`` does."""
    import contextlib
    import io
    import types

    from cgbackend.cli import main
    out, err = io.StringIO(), io.StringIO()
    old_cwd, old_path = os.getcwd(), list(sys.path)
    try:
        if cwd is not None:
            os.chdir(cwd)
            sys.path.insert(0, str(cwd))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args), prog="python -m cgbackend")
            except SystemExit as exc:
                code = exc.code
    finally:
        os.chdir(old_cwd)
        sys.path[:] = old_path
    return types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=err.getvalue())


def assert_one_line_error(proc):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("cgbackend: error:")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    return lines[0]


def test_cli_demo_moe_json():
    proc = cli_here("explain", "--demo", "moe", "--json", "--option", "static_dispatch=off")
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["schema"] == "cgbackend.report/1"
    assert (d["summary"]["static_regions"], d["summary"]["dynamic_regions"]) == (3, 2)
    assert 0 < d["summary"]["static_op_fraction"] < 1
    dispatch = [r for r in regions_of(d) if r["kind"] == "dynamic"]
    assert all(r["role"] == "moe_dispatch" and r["reasons"][0]["op"] == "where" for r in dispatch)
    # By default the dispatch is rewritten into static code: one static region, nothing dynamic.
    proc = cli_here("explain", "--demo", "moe", "--json")  # (run as a program: test_cli_errors_are_one_line)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert (d["summary"]["static_regions"], d["summary"]["dynamic_regions"]) == (1, 0)
    assert d["summary"]["static_op_fraction"] == 1.0
    assert {r["pattern"] for g in d["graphs"] for r in g["dispatch"]["rewrites"]} == {"where_loop"}


def test_cli_demo_dense_text():
    proc = cli_here("explain", "--demo", "dense")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "static_op_fraction" in proc.stdout
    assert "static_op_fraction: 1.000" in proc.stdout


@pytest.mark.parametrize("spec", ["PATH:good", "MODULE:good"])
def test_cli_factory(factories, spec):
    target = spec.replace("PATH", str(factories)).replace("MODULE", "cg_factories")
    proc = cli_here("explain", target, "--json", cwd=factories.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["summary"]["graphs"] == 1
    assert d["summary"]["ops"] == 3


_PROGRAM_ERRORS = {
    # forward_raises first: the one that traces, in the interpreter's fresh state
    "forward_raises": (["explain", "FACTORIES:broken_model"], "ValueError"),
    "module_not_found": (["explain", "nosuch:thing"], "nosuch"),
    "factory_raises": (["explain", "FACTORIES:raises"], "RuntimeError"),
    "factory_wrong_shape": (["explain", "FACTORIES:wrong_shape"], "(model, example_inputs)"),
}


@pytest.fixture(scope="module")
def program_errors(factories):
    """The commands of _PROGRAM_ERRORS run as programs (tests/program_runs.py: one interpreter)."""
    from program_runs import run_programs
    runs = run_programs([[a.replace("FACTORIES", str(factories)) for a in args]
                         for args, _ in _PROGRAM_ERRORS.values()])
    return dict(zip(_PROGRAM_ERRORS, runs))


@pytest.mark.parametrize("case", list(_PROGRAM_ERRORS))
def test_cli_errors_are_one_line(program_errors, case):
    line = assert_one_line_error(program_errors[case])
    assert _PROGRAM_ERRORS[case][1] in line


# The same contract, checked in-process (faster) for the other ways a command can go wrong.

@pytest.fixture
def main_in_process(monkeypatch, capsys):
    from cgbackend.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))  # factories add their folder to sys.path
    for key in [k for k in os.environ if k.startswith("CGBACKEND_")]:
        monkeypatch.delenv(key)

    def call(*argv):
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return call


def test_cli_in_process_success(main_in_process, factories):
    code, out, err = main_in_process("explain", f"{factories}:good_kwargs", "--json", "--option", "min_region_ops=1",
                                     "--option", "dynamic_ops=torch.nn.functional.relu,Tensor.relu")
    assert code == 0, err
    d = json.loads(out)
    assert d["config"]["min_region_ops"] == 1
    assert d["config"]["dynamic_ops"] == ["torch.nn.functional.relu", "Tensor.relu"]


@pytest.mark.parametrize("args, mentions", [
    pytest.param(["explain", "nosuch_module_xyz"], "MODULE:FACTORY", id="no_colon"),
    pytest.param(["explain", "nosuch_module_xyz:make"], "nosuch_module_xyz", id="module_not_found"),
    pytest.param(["explain", "/no/such/dir/file.py:make"], "file.py", id="file_not_found"),
    pytest.param(["explain"], "--demo", id="no_target"),
    pytest.param(["explain", "--demo", "moe", "FACTORIES:good"], "--demo", id="demo_and_target"),
    pytest.param(["explain", "FACTORIES:nosuch"], "nosuch", id="no_such_factory"),
    pytest.param(["explain", "FACTORIES:NOT_CALLABLE"], "NOT_CALLABLE", id="factory_not_callable"),
    pytest.param(["explain", "FACTORIES:raises_multiline"], "RuntimeError", id="factory_raises_multiline"),
    pytest.param(["explain", "FACTORIES:wrong_tuple"], "(model, example_inputs)", id="factory_wrong_tuple"),
    pytest.param(["explain", "FACTORIES:broken_multiline"], "ValueError", id="forward_raises_multiline"),
    pytest.param(["explain", "--demo", "dense", "--option", "bogus=1"], "bogus", id="option_unknown"),
    pytest.param(["explain", "--demo", "dense", "--option", "warmup"], "KEY=VALUE", id="option_without_value"),
    pytest.param(["explain", "--demo", "dense", "--option", "warmup=abc"], "warmup", id="option_warmup_abc"),
    pytest.param(["explain", "--demo", "dense", "--option", "warmup=-1"], "warmup", id="option_warmup_negative"),
    pytest.param(["explain", "--demo", "dense", "--option", "inner=x"], "inner", id="option_inner_x"),
    pytest.param(["explain", "--demo", "dense", "--option", "capture=maybe"], "capture", id="option_capture_maybe"),
])
def test_cli_in_process_errors_are_one_line(main_in_process, factories, args, mentions):
    args = [a.replace("FACTORIES", str(factories)) for a in args]
    code, out, err = main_in_process(*args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cgbackend: error:")
    assert mentions in lines[0]


def test_cli_bad_environment_is_one_line_error(main_in_process, monkeypatch):
    monkeypatch.setenv("CGBACKEND_WARMUP", "abc")
    code, out, err = main_in_process("explain", "--demo", "dense")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cgbackend: error:")
    assert "CGBACKEND_WARMUP" in lines[0]


def test_explain_leaves_module_state_and_rng_as_they_were():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(8, 4)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    cgbackend.explain(model, x)
    assert torch.equal(torch.rand(3), expected_next)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
