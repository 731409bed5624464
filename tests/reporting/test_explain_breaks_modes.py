"""explain: breaks that make Dynamo skip a frame (a print() inside a loop) are listed with their full
reason and line; graph/break counts agree with torch._dynamo.explain or the report says why; it states
whether it traced inference or training and why; per-call figures count graph runs; the partition
report goes to the structured trace when that is on."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import cgbackend
import cgbackend.reporting.structured as structured

FILE = "test_explain_breaks_modes.py"


class LoopPrint(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        for i in range(3):
            x = self.lin(x).relu()
            print("cgbackend test step", i)
        return x


class TwoItems(nn.Module):
    def forward(self, x):
        x = x.sin()
        if x.sum().item() > 0:
            x = x + 1
        x = x.cos()
        if x.sum().item() > 0:
            x = x + 1
        return x.exp()


def test_break_in_a_loop_is_listed_with_full_reason_and_line(capsys):
    with torch.no_grad():
        report = cgbackend.explain(LoopPrint(), torch.randn(2, 4), trace_dynamic_ops=False)
    assert report.summary["graphs"] == 0
    assert report.summary["graph_breaks"] == 1
    brk = report.graph_breaks[0]
    assert "print" in brk["reason"] and "graph break in loop" in brk["reason"]
    assert "Skipping the frame" in brk["reason"]  # the explanation, not only the first line
    assert brk["source"].startswith(FILE + ":") and brk["source"].endswith(" in forward")
    text = report.to_text()
    assert f"graph break at {brk['source']}: " in text
    assert any("skipped the frame" in n for n in report.notes)


class BranchesOnData(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        if h.sum() > 0:
            h = h * 2
        return h.relu()


def test_a_branch_on_tensor_data_is_explained_at_the_users_line():
    """Dynamo ends the graph with only ``generic_jump TensorVariable()``: the report says what it
    means and what to do, with the user's line and code."""
    report = cgbackend.explain(BranchesOnData(), torch.randn(2, 4), training=False)
    brk = next(b for b in report.graph_breaks if b.get("code"))
    assert brk["code"] == "if h.sum() > 0:" and brk["source"].startswith(FILE + ":")
    assert brk["reason"].startswith("a Python branch on a tensor's value")
    assert "torch.where" in brk["reason"] and "torch.cond" in brk["reason"]
    text = report.to_text()
    assert f"graph break at {brk['source']}: a Python branch" in text and "`if h.sum() > 0:`" in text


def test_training_false_from_python_is_not_called_the_clis_default():
    report = cgbackend.explain(nn.Linear(4, 4), torch.randn(2, 4), training=False)
    why = report.traced_as["why"]
    assert why.startswith("training=False (CLI: without --training)") and "default" not in why


@pytest.mark.parametrize("trace_dynamic_ops", [False, True])
def test_counts_agree_with_torch_dynamo_explain(trace_dynamic_ops):
    x = torch.randn(5)
    ours = cgbackend.explain(TwoItems(), x, trace_dynamic_ops=trace_dynamic_ops)
    # The same Dynamo settings for both (a branch on a host value breaks the graph either way).
    from cgbackend.frontend.tracing import dynamic_ops_config
    import contextlib
    with dynamic_ops_config() if trace_dynamic_ops else contextlib.nullcontext():
        theirs = torch._dynamo.explain(TwoItems())(x)
    assert (ours.summary["graphs"], ours.summary["graph_breaks"]) == (theirs.graph_count, theirs.graph_break_count) == (3, 2)
    # Two breaks with one reason stay two breaks, told apart by their lines.
    sources = [b["source"] for b in ours.graph_breaks]
    assert len(set(sources)) == 2 and all(s.startswith(FILE + ":") for s in sources)


def test_eval_model_with_grad_on_reports_training_and_why():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 4)
    report = cgbackend.explain(model, x)  # grad mode on (the default), parameters require grad
    assert report.traced_as["mode"] == "training" and report.graphs[0].training
    assert "grad mode was on" in report.traced_as["why"] and "training=False" in report.traced_as["why"]
    assert "traced as training:" in report.to_text()
    inference = cgbackend.explain(model, x, training=False)
    assert inference.traced_as["mode"] == "inference" and not inference.graphs[0].training
    assert "training=False" in inference.traced_as["why"]
    with torch.no_grad():
        forced = cgbackend.explain(model, x, training=True)
    assert forced.traced_as["mode"] == "training" and forced.graphs[0].training
    assert json.loads(forced.to_json())["traced_as"]["mode"] == "training"


def test_per_call_figures_count_graph_runs():
    """A block's code compiled once runs once per layer: the per-call launches count each run."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.a(x).relu()).tanh() + x

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = torch.compiler.disable(lambda v: v)(x)  # a break between layers
                x = block(x)
            return x

    with torch.no_grad():
        report = cgbackend.explain(Stack(), torch.randn(2, 8))
    s = report.summary
    assert s["graph_runs_per_call"] > s["graphs"]
    assert s["graph_runs_per_call"] == sum(g.runs_per_call for g in report.graphs)
    assert s["graph_launches_per_call"] == sum(g.runs_per_call * sum(r.kind == "static" for r in g.regions)
                                               for g in report.graphs)
    assert s["graph_launches_per_call"] > s["static_regions"]


def test_report_is_a_structured_trace_artifact_when_tracing_is_on(monkeypatch):
    emitted = []
    monkeypatch.setattr(structured, "structured_tracing_on", lambda: True)
    def record(kind, metadata_fn=None, payload_fn=None, **kwargs):  # torch calls it too
        meta = metadata_fn() if metadata_fn is not None else {}
        if str(meta.get("name", "")).startswith("cgbackend"):
            emitted.append((kind, meta, payload_fn()))

    monkeypatch.setattr(torch._logging, "trace_structured", record)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        compiled = torch.compile(model, backend=cgbackend.backend())
        compiled(torch.randn(2, 4))
        cgbackend.explain(model, torch.randn(2, 4))
    names = [meta["name"] for kind, meta, _ in emitted]
    assert names == ["cgbackend_partition_report", "cgbackend_partition_report", "cgbackend_explain_report"]
    assert all(kind == "artifact" and meta["encoding"] == "json" for kind, meta, _ in emitted)
    assert json.loads(emitted[-1][2])["schema"] == "cgbackend.report/1"


def test_no_artifact_when_structured_tracing_is_off(monkeypatch):
    emitted = []
    def record(kind, metadata_fn=None, payload_fn=None, **kwargs):
        if metadata_fn is not None and str(metadata_fn().get("name", "")).startswith("cgbackend"):
            emitted.append(kind)

    monkeypatch.setattr(torch._logging, "trace_structured", record)
    # Tracing off as in a fresh process: PyTorch's own trace handler, without a directory. (Handlers
    # other code attached, pytest's log capture among them, would count as on, as torch counts them.)
    from torch._logging._internal import LazyTraceHandler, trace_log
    monkeypatch.setattr(trace_log, "handlers", [LazyTraceHandler(None)])
    assert not structured.structured_tracing_on()
    with torch.no_grad():
        cgbackend.explain(nn.Linear(4, 4), torch.randn(2, 4))
    assert emitted == []


def test_torch_trace_directory_receives_the_report(tmp_path):
    """With TORCH_TRACE set, the report lands in the trace file (PyTorch's default trace handler has
    no directory otherwise, and then structured_tracing_on() is False: the test above)."""
    import os
    import subprocess
    import sys
    code = ("import torch, torch.nn as nn, cgbackend\n"
            "from cgbackend.reporting import structured\n"
            "assert structured.structured_tracing_on()\n"
            "with torch.no_grad():\n"
            "    cgbackend.explain(nn.Linear(4, 4), torch.randn(2, 4))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TORCH_TRACE=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    env.pop("TORCH_LOGS", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    logs = "".join(p.read_text() for p in tmp_path.iterdir())
    assert "cgbackend_explain_report" in logs
