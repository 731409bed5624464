"""The dry run (option dryrun: each graph's partition report once, the model run as compiled) and
cgbackend.summary (the counters as a short table)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import cgbackend
from log_helpers import records_of
from cgbackend.models import build_model, make_inputs
from cgbackend.reporting.schema import validate_report


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()


@pytest.mark.parametrize("how", ["by_name", "cgbackend_compile"])
def test_dry_run_shows_the_report_once_and_runs_the_model(how):
    model = _mlp()
    compiled = (torch.compile(model, backend="cgbackend", options={"dryrun": True}) if how == "by_name"
                else cgbackend.compile(model, dryrun=True))
    with records_of("cgbackend.dryrun") as shown, torch.no_grad():
        for _ in range(3):
            x = torch.randn(5, 8)
            assert torch.equal(compiled(x), model(x))
    assert len(shown) == 1 and shown[0].levelno == logging.WARNING
    text = shown[0].getMessage()
    assert text.startswith("cgbackend dry run: graph 0, at its first call (the model runs as compiled)\n"
                           "cgbackend partition report\n")
    assert "S0      static" in text
    assert cgbackend.stats(compiled)["graph_calls"] == 3


def test_dry_run_to_a_file_writes_the_json_report(tmp_path):
    path = tmp_path / "partition.json"
    compiled = cgbackend.compile(_mlp(), dryrun=str(path))
    with records_of("cgbackend.dryrun") as records, torch.no_grad():
        compiled(torch.randn(5, 8))
        compiled(torch.randn(5, 8))
    data = json.loads(path.read_text())
    assert validate_report(data) == [] and data["summary"]["static_regions"] == 1
    assert [r.getMessage() for r in records] == [
        f"cgbackend dry run: graph 0's partition report written to {path} (1 graph(s) so far); "
        "the model runs as compiled"]


@pytest.mark.parametrize("text, value", [("dryrun=true", True), ("dryrun=0", False), ("dryrun=out.json", "out.json"),
                                         ('dryrun="out.json"', "out.json")])
def test_dry_run_from_the_command_line(text, value):
    from cgbackend.cli import _parse_options
    assert _parse_options([text]) == {"dryrun": value}


def test_dry_run_rejects_other_values():
    with pytest.raises(cgbackend.ConfigError, match="takes True, False or a file path"):
        cgbackend.Config(dryrun=1)


def test_summary_is_a_short_table_per_region():
    model = build_model("moe", size="tiny").eval()
    # the dispatch as written: static and dynamic regions in turn
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, static_dispatch="off")
    assert cgbackend.summary(compiled).startswith("cgbackend summary: nothing compiled yet")
    with torch.no_grad():
        for x in make_inputs("moe", model, n=3):
            compiled(x)
    lines = cgbackend.summary(compiled).splitlines()
    assert lines[1].split() == ["region", "kind", "role", "graphs", "replays", "eager", "calls", "(by",
                                "reason)", "pool", "MiB"]
    rows = {line.split()[0]: line.split() for line in lines[3:8]}
    assert list(rows) == ["g0.S0", "g0.D1", "g0.S2", "g0.D3", "g0.S4"]  # execution order, report ids
    assert rows["g0.S0"][3:7] == ["1", "2", "warmup", "1"]
    assert rows["g0.D1"][1] == "dynamic" and "every call (3)" in " ".join(rows["g0.D1"])
    assert "  captured 3 graph(s) in " in "\n".join(lines) and "replays 6" in "\n".join(lines)
    assert any(line.startswith("  warmup: eager warm-up call before capture") for line in lines)
    assert len(lines) < 20
