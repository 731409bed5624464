"""Launch coverage (coverage.py), hints (hints.py), per-region timing (runtime/region_timer.py), torch logging
(logs.py) and the HTML report (html.py)."""

from __future__ import annotations

import html.parser
import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.config import Config
import cgbackend.reporting.coverage
from cgbackend.reporting.coverage import counting_supported
from cgbackend.reporting.hints import build_hints
from cgbackend.models import build_model, demo_model, make_inputs

needs_counting = pytest.mark.skipif(not counting_supported(),
                                    reason="torch without TorchDispatchMode.ignore_compile_internals")


class _Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class HitExpertsMoE(nn.Module):
    """Loops over the experts that received tokens: a loop over a data-dependent tensor, where
    Dynamo breaks the graph and runs the rest of the frame uncompiled."""

    def __init__(self, d: int = 32, f: int = 64, n_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.gate = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(_Expert(d, f) for _ in range(n_experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        w, sel = torch.topk(probs, self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        mask = F.one_hot(sel, self.n_experts).permute(2, 1, 0)
        for e in mask.sum(dim=(-1, -2)).gt(0).nonzero():  # LOOP
            idx, top = torch.where(mask[e].squeeze(0))  # WHERE
            y = self.experts[e](h[top]) * w[top, idx, None]
            out.index_add_(0, top, y.to(h.dtype))  # INDEX_ADD
        return out


class HitModel(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.moe = HitExpertsMoE(d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.inp(x))
        return self.out(h + self.moe(h))


def _line_of(marker: str) -> str:
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return f"{os.path.basename(__file__)}:{number} in forward"
    raise AssertionError(marker)


def _hit_model():
    torch.manual_seed(0)
    return HitModel().eval(), torch.randn(16, 32)


def _kinds(report) -> list[str]:
    return [h["kind"] for h in report.hints]


# ----------------------------------------------------------------------------- launch coverage

def _explain_hit_model(trace_dynamic_ops: bool = True):
    model, x = _hit_model()
    with torch.no_grad():
        return cgbackend.explain(model, x, options={"static_dispatch": "off"}, trace_dynamic_ops=trace_dynamic_ops)


@pytest.fixture(scope="module")
def hit_model_off():
    """explain of the hit-experts model, static_dispatch off: read by the coverage and HTML tests."""
    return _explain_hit_model()


@needs_counting
@pytest.mark.parametrize("trace_dynamic_ops", [True, False], ids=["cgbackend_explain", "plain_torch_compile"])
def test_hit_experts_loop_coverage_below_static_fraction(trace_dynamic_ops, request):
    """static_dispatch off (plain torch.compile's view too): the expert loop runs uncompiled, so the
    launch coverage is below the traced-op fraction and the uncompiled launches name their lines."""
    report = request.getfixturevalue("hit_model_off") if trace_dynamic_ops else _explain_hit_model(False)
    s = report.summary
    launches = s["launches"]
    assert s["graph_breaks"] >= 1
    assert launches["basis"] == "measured"
    assert s["launch_coverage"] < s["static_op_fraction"]
    outside = launches["in_dynamic_regions"] + launches["uncompiled"]
    assert s["launch_coverage"] == round(1 - outside / launches["eager_call"], 4)
    assert launches["in_graphs"] + launches["in_dynamic_regions"] + launches["uncompiled"] == launches["with_cgbackend"]
    # same ops, compiled or not, less the constants made once per compiled graph (passes/constants.py)
    assert 0 <= launches["eager_call"] - launches["with_cgbackend"] <= 2
    assert launches["uncompiled"] > 0
    sources = {src["source"]: src for src in launches["uncompiled_sources"]}
    assert _line_of("WHERE") in sources and sources[_line_of("WHERE")]["ops"].get("nonzero") == 4
    assert sources[_line_of("INDEX_ADD")]["ops"] == {"index_add_": 4}
    assert "index_add_" in sources[_line_of("INDEX_ADD")]["code"]
    assert sum(src["launches"] for src in launches["uncompiled_sources"]) == launches["uncompiled"]
    # by region: every region of every graph, adding up to the launches inside graphs
    ids = {r.id for r in report.regions()}
    assert set(launches["by_region"]) <= ids
    assert sum(launches["by_region"].values()) == launches["in_graphs"] + launches["in_dynamic_regions"]
    text = report.to_text()
    assert f"launch coverage: {s['launch_coverage']:.3f}" in text
    assert f"at {_line_of('INDEX_ADD')}" in text
    loop = [h for h in report.hints if h["kind"] == "data_dependent_loop"]
    assert len(loop) == 1 and loop[0]["option"] is None
    assert loop[0]["source"]["path"] == __file__ and loop[0]["source"]["code"].endswith("# LOOP")
    assert f"{loop[0]['source']['path']}:{loop[0]['source']['line']} in forward".endswith(_line_of("LOOP"))
    assert "range(E)" in loop[0]["message"]


@needs_counting
def test_dense_demo_is_fully_covered():
    model, x = demo_model("dense")
    with torch.no_grad():
        report = cgbackend.explain(model, x)
    s = report.summary
    assert s["launch_coverage"] == 1.0
    assert s["launches"]["uncompiled"] == 0 and s["launches"]["in_dynamic_regions"] == 0
    assert s["launches"]["in_graphs"] == s["launches"]["with_cgbackend"] > 0
    assert "static_dispatch" not in _kinds(report)
    assert "data_dependent_loop" not in _kinds(report)


@pytest.fixture(scope="module")
def moe_demo_off():
    """explain of the demo MoE (the model and batch of ``explain --demo moe``) with its dispatch as
    written (static_dispatch off), launches counted: read by the coverage and the HTML tests."""
    model, x = demo_model("moe")
    with torch.no_grad():
        return cgbackend.explain(model, x, options={"static_dispatch": "off"})


@needs_counting
def test_moe_demo_coverage_and_static_dispatch_hint(moe_demo_off):
    model, x = demo_model("moe")
    report = moe_demo_off
    s = report.summary
    launches = s["launches"]
    # Everything Dynamo traced: no uncompiled launches; the dispatch regions hold the rest.
    assert launches["uncompiled"] == 0
    # each call launches what eager does, less the constants made once per compiled graph
    assert 0 <= launches["eager_call"] - (launches["in_graphs"] + launches["in_dynamic_regions"]) <= 2
    assert 0.2 < s["launch_coverage"] < 0.8
    by_region = launches["by_region"]
    assert sum(n for rid, n in by_region.items() if ".S" in rid) == launches["in_graphs"]
    hint = next(h for h in report.hints if h["kind"] == "static_dispatch")
    assert hint["option"] == {"option": "static_dispatch", "value": "auto"}
    assert hint["source"]["path"].endswith("cgbackend/models/gpt.py") and hint["source"]["line"] > 0
    text = report.to_text()
    assert "set: --option static_dispatch=auto  or  cgbackend.compile(model, static_dispatch=\"auto\")" in text
    assert f"at: {hint['source']['path']}:{hint['source']['line']} in forward" in text
    assert hint["message"].startswith("2 dynamic region(s) hold 8 MoE dispatch loop(s)")
    assert "estimated launch coverage after 100%" in hint["message"]
    js = json.loads(report.to_json())
    assert js["summary"]["launch_coverage"] == s["launch_coverage"]
    assert [h["kind"] for h in js["hints"]] == _kinds(report)
    assert all(set(h) == {"kind", "message", "option", "source"} for h in js["hints"])
    assert js["hints"][0]["option"] == {"option": "static_dispatch", "value": "auto"}
    # Under static_dispatch="auto" (the default) the dispatch is graphed: no hint, whole call covered.
    with torch.no_grad():
        auto = cgbackend.explain(model, x)
    assert "static_dispatch" not in _kinds(auto)
    assert auto.summary["launch_coverage"] == 1.0


@pytest.mark.parametrize("pasted", ["static_dispatch=auto", 'static_dispatch="auto"', "static_dispatch='auto'",
                                    "inner=inductor", 'inner="inductor"', "strict=True", "capture_sizes=1,2",
                                    'dynamic_ops=("torch.nonzero",)'])
def test_an_option_parses_as_printed_and_as_pasted(pasted):
    """The text prints ``--option name=value``; users also paste the Python form a message shows."""
    import shlex
    from cgbackend.cli import _parse_options
    from cgbackend.reporting.hints import option_cli, option_python
    (name, value), = _parse_options([pasted]).items()
    assert cgbackend.Config.from_options({name: value}, environ={})  # a valid value
    printed = shlex.split(option_cli(name, value))
    assert printed[0] == "--option" and _parse_options([printed[1]]) == {name: value}
    assert _parse_options([option_python(name, value)]) == {name: value}


def test_hints_of_older_reports_still_read():
    from cgbackend.reporting.hints import hint_option, hints_text
    old = {"kind": "static_dispatch", "message": "m", "option": 'static_dispatch="auto"', "source": "gpt.py:3 in f"}
    assert hint_option(old) == ("static_dispatch", "auto")
    assert hints_text([old])[2:] == ['        set: --option static_dispatch=auto  or  cgbackend.compile(model, '
                                     'static_dispatch="auto")', "        at: gpt.py:3 in f"]


def test_launch_counting_off_or_unsupported(monkeypatch):
    model, x = demo_model("dense")
    with torch.no_grad():
        off = cgbackend.explain(model, x, count_launches=False)
    assert "launch_coverage" not in off.summary and "launch coverage" not in off.to_text()
    monkeypatch.setattr(cgbackend.reporting.coverage, "counting_supported", lambda: False)
    with torch.no_grad():
        old = cgbackend.explain(model, x)
    assert "launch_coverage" not in old.summary
    assert any(n.startswith("launch coverage not measured: this torch has no") for n in old.notes)
    assert old.summary["static_regions"] == off.summary["static_regions"] == 1


def test_inner_compiler_hint_follows_the_config_in_effect():
    model, x = demo_model("dense")
    with torch.no_grad():
        report = cgbackend.explain(model, x, options={"inner": "eager"})
    hint = next(h for h in report.hints if h["kind"] == "inner_compiler")
    assert hint["option"] == {"option": "inner", "value": "inductor"}
    assert 'inner="eager" in effect' in hint["message"]
    assert build_hints(report, [], Config.from_options({"inner": "inductor"})) == []


# ----------------------------------------------------------------------------- runtime figure, timing

def test_runtime_coverage_and_profile_timing():
    model = build_model("moe").eval()
    xs = make_inputs("moe", model, n=4)
    # The dispatch as written: static and dynamic regions, both timed.
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, profile=True, static_dispatch="off")
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=0)
    report = cgbackend.report(compiled)
    stats = cgbackend.stats(compiled)
    assert stats["replays"] == 3 * 3 and stats["eager_calls"] == {"warmup": 3}
    s = report.summary
    assert s["launches"]["basis"] == "runtime" and s["launches"]["upper_bound"] is False
    est = {r.id: r.est_kernels for r in report.regions()}
    static = {rid: k for rid, k in est.items() if ".S" in rid}
    dynamic = {rid: k for rid, k in est.items() if ".D" in rid}
    # the 3 calls after the warm-up call: every static region replayed, every dynamic one eager
    in_graphs = 3 * sum(static.values())
    total = 3 * (sum(static.values()) + sum(dynamic.values()))
    assert (s["launches"]["in_graphs"], s["launches"]["with_cgbackend"]) == (in_graphs, total)
    assert (s["launches"]["calls"], s["launches"]["warmup_calls"]) == (3, 1)
    assert s["launch_coverage"] == round(in_graphs / total, 4)
    timing = report.graphs[0].runtime["timing"]
    assert list(timing) == ["S0", "D1", "S2", "D3", "S4"]  # execution order
    for name in ("S0", "S2", "S4"):
        assert timing[name]["eager"]["calls"] == 1 and timing[name]["capture"]["calls"] == 1
        assert timing[name]["replay"]["calls"] == 2 and timing[name]["replay"]["total_ms"] > 0
    for name in ("D1", "D3"):
        assert set(timing[name]) == {"eager"} and timing[name]["eager"]["calls"] == 4
    text = report.to_text()
    assert "time per region (profile=True" in text and "launch coverage: " in text
    assert "static_dispatch" in _kinds(report)
    page = report.to_html()
    assert "ms measured (profile=True)" in page
    assert "replay 2 x " in page and "capture 1 x " in page  # the split, on hover


def test_profile_off_has_no_timing():
    model, x = demo_model("dense")
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1)
    with torch.no_grad():
        compiled(x)
    report = cgbackend.report(compiled)
    assert "timing" not in report.graphs[0].runtime
    assert "time per region" not in report.to_text()


# ----------------------------------------------------------------------------- torch logging

_LOG_SCRIPT = """
import torch, cgbackend
from cgbackend.models import demo_model
model, x = demo_model("dense")
compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1)
with torch.no_grad():
    for _ in range(2):
        compiled(x)
"""


@pytest.mark.skipif("TORCH_LOGS" in os.environ, reason="the quiet half needs torch's default logging")
def test_torch_logs_env_shows_debug_lines(capfd):
    """TORCH_LOGS="+cgbackend" in a fresh interpreter shows the DEBUG and INFO lines; with torch's
    default logging (here, in this process: set_logs() with nothing named) nothing is printed."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TORCH_LOGS="+cgbackend", PYTHONPATH=root)
    run = subprocess.Popen([sys.executable, "-c", _LOG_SCRIPT], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=root)
    torch._logging.set_logs()  # the default state, whatever an earlier test of this worker set
    try:
        capfd.readouterr()
        exec(_LOG_SCRIPT, {})
        quiet = capfd.readouterr()
    finally:
        _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-2000:]
    assert "cgbackend: captured g0.S0 (inference, slot 0)" in err  # DEBUG, one per capture
    assert re.search(r"cgbackend: graph 0: \d+ ops, 1 static region \(", err)  # INFO at compile
    assert "cgbackend: graph 0: 1 static region, 1 graph captured in" in err  # INFO after capture
    assert "cgbackend:" not in quiet.err + quiet.out


@pytest.mark.skipif("TORCH_LOGS" in os.environ, reason="TORCH_LOGS takes precedence over set_logs")
def test_set_logs_reaches_cgbackend():
    logger = logging.getLogger("cgbackend")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep(level=logging.DEBUG)
    logger.addHandler(keep)
    try:
        torch._logging.set_logs(cgbackend=logging.DEBUG)
        assert logger.getEffectiveLevel() == logging.DEBUG
        model, x = demo_model("dense")
        compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1)
        with torch.no_grad():
            compiled(x)
            compiled(x)
        messages = [r.getMessage() for r in records]
        assert any(m.startswith("cgbackend: captured g0.S0") for m in messages)
        assert any(r.levelno == logging.INFO and "captured in" in r.getMessage() for r in records)
        torch._logging.set_logs(cgbackend=logging.WARNING, dynamo=logging.WARNING)
        assert logger.getEffectiveLevel() == logging.WARNING
    finally:
        torch._logging.set_logs()
        logger.removeHandler(keep)
    assert logger.level == logging.NOTSET


# ----------------------------------------------------------------------------- HTML

class _Page(html.parser.HTMLParser):
    """Collects the elements of a page and checks that tags nest properly."""

    VOID = {"meta", "br", "img", "link", "input", "hr"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.elements: list[tuple[str, dict]] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()

    def find(self, tag: str, **attrs) -> list[dict]:
        return [a for t, a in self.elements if t == tag and all(
            (attrs[k] in (a.get(k) or "").split()) if k == "class" else a.get(k) == attrs[k] for k in attrs)]


def _parse(page: str) -> _Page:
    parser = _Page()
    parser.feed(page)
    parser.close()
    assert parser.errors == [] and parser.stack == []
    return parser


def _self_contained(parser: _Page, page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    for tag, attrs in parser.elements:
        assert tag not in ("script", "link", "img", "iframe"), tag
        assert "src" not in attrs and "href" not in attrs, (tag, attrs)
    assert "url(" not in page and "@import" not in page


@needs_counting
def test_html_report_structure(tmp_path, moe_demo_off):
    from cgbackend.cli import main
    out = tmp_path / "report.html"
    assert main(["explain", "--demo", "moe", "--html", str(out), "--option", "static_dispatch=off"]) == 0
    page = out.read_text()
    parser = _parse(page)
    _self_contained(parser, page)
    report = moe_demo_off  # the same model, batch and options, explained through the API
    assert parser.find("section", id="summary") and parser.find("section", id="hints")
    assert parser.find("section", id="timeline") and parser.find("table", id="regions")
    boxes = [a for a in parser.find("div", **{"class": "region"}) if "data-id" in a]
    assert [(b["data-id"], b["data-kind"]) for b in boxes] == [(r.id, r.kind) for r in report.regions()]
    by_region = report.summary["launches"]["by_region"]
    for box in boxes:
        assert box["class"].split()[:2] == ["region", box["data-kind"]]
        assert float(box["data-weight"]) == by_region[box["data-id"]]
        assert box["title"].startswith(f"{box['data-id']}: {box['data-kind']}, role ")
    dyn = next(b for b in boxes if b["data-kind"] == "dynamic")
    assert "where [data_dependent_shape] at gpt.py:" in dyn["title"]
    assert "modules: layers.0.ffn" in dyn["title"]
    hints = parser.find("li", **{"class": "hint"})
    assert [h["data-kind"] for h in hints] == _kinds(report)
    assert f"{report.summary['launch_coverage']:.3f}" in page


@needs_counting
def test_html_shows_uncompiled_code(hit_model_off):
    report = hit_model_off
    page = report.to_html()
    parser = _parse(page)
    _self_contained(parser, page)
    rows = [r for r in parser.find("div", **{"class": "uncompiled"}) if "data-source" in r]
    sources = report.summary["launches"]["uncompiled_sources"]
    # uncompiled code where it ran: each stretch between the regions it ran between, every line named
    sequence = report.summary["launches"]["sequence"]
    steps = [b.get("data-id") or "uncompiled" for b in parser.find("div", **{"class": "region"})
             if "data-id" in b or "data-source" in b]
    expected = [e["id"] if e["kind"] == "region" else "uncompiled" for e in sequence]
    assert steps == [x for i, x in enumerate(expected) if x != "uncompiled" or i == 0 or expected[i - 1] != x]
    assert rows and all(r["title"].startswith("uncompiled code") for r in rows)
    for s in sources:
        assert any(s["source"] in r["title"] for r in rows), s["source"]
    assert parser.find("li", **{"class": "hint"}, **{"data-kind": "data_dependent_loop"})


# ----------------------------------------------------------------------------- GPU

@pytest.mark.cuda
def test_cuda_profile_timing_and_coverage():
    """CUDA events time replays and eager calls; explain on CUDA tensors measures coverage."""
    model = build_model("moe", size="tiny", device="cuda").eval()
    xs = make_inputs("moe", model, n=5, device="cuda")
    with torch.no_grad():
        explained = cgbackend.explain(model, xs[0], options={"static_dispatch": "off"})  # first: resets Dynamo
        compiled = cgbackend.compile(model, warmup=1, profile=True, static_dispatch="off")
        for x in xs:
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)  # Inductor's kernels
    report = cgbackend.report(compiled)
    timing = report.graphs[0].runtime["timing"]
    assert cgbackend.stats(compiled)["graphs_captured"] == 3
    for name in ("S0", "S2", "S4"):
        assert timing[name]["replay"]["calls"] == 3 and timing[name]["replay"]["total_ms"] > 0
        assert timing[name]["capture"]["calls"] == 1
    assert timing["D1"]["eager"]["calls"] == 5
    s = explained.summary
    assert s["launches"]["uncompiled"] == 0 and 0.2 < s["launch_coverage"] < 0.9
    assert 0.0 < report.summary["launch_coverage"] < 1.0
    assert "static_dispatch" in [h["kind"] for h in explained.hints]
