"""The command line's rough edges: one-line errors with the real cause and the fix, --dynamic for
keyword inputs, --training, --version, help text for every option of every subcommand under the
program name it was called by, and where bench writes."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap

import pytest
import torch

import cgbackend
from cgbackend.cli import build_parser, main

FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn as nn


    class Mismatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x[:, :3])


    def mismatch():
        return Mismatch(), (torch.randn(2, 4),)


    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, input_ids, mask=None):
            return self.lin(input_ids).relu() * mask


    def keywords():
        return Keywords(), {"input_ids": torch.randn(3, 4), "mask": torch.ones(3, 4)}


    def dropout():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.1), nn.Linear(8, 4)), (torch.randn(2, 4),)
''')


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_factories") / "cg_cli_factories.py"
    path.write_text(FACTORIES)
    return path


@pytest.fixture
def run_main(monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    for key in [k for k in os.environ if k.startswith("CGBACKEND_")]:
        monkeypatch.delenv(key)

    def call(*argv, prog="cgbackend"):
        code = main(list(argv), prog=prog)
        out, err = capsys.readouterr()
        return code, out, err

    return call


def one_line(code, out, err) -> str:
    assert code == 2 and out == "", (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("cgbackend: error:")
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is about a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(run_main):
    line = one_line(*run_main("explain", "--demo", "moe", "--device", "cuda"))
    assert "--device cuda" in line and "no CUDA device" in line and "drop --device" in line


def test_bad_device_is_one_line(run_main):
    line = one_line(*run_main("explain", "--demo", "moe", "--device", "gpu0"))
    assert "'gpu0'" in line


def test_tracing_failure_names_the_root_error_and_line(run_main, factories):
    line = one_line(*run_main("explain", f"{factories}:mismatch"))
    # The real cause, not "RuntimeError when making fake tensor call".
    assert "must have same reduction dim" in line and "RuntimeError" in line
    assert "cg_cli_factories.py:" in line and "in forward" in line
    assert "runs eagerly" in line  # the fix to try


def test_tracing_failure_from_the_command_line_is_one_line_even_with_torch_logs(program_runs):
    proc = program_runs["explain mismatch"]
    assert proc["returncode"] == 2 and proc["stdout"] == ""
    assert len(proc["stderr"].strip().splitlines()) == 1, proc["stderr"][-3000:]  # torch's own log lines kept out
    assert "must have same reduction dim" in proc["stderr"]


def test_dynamic_for_keyword_inputs(run_main, factories):
    code, out, err = run_main("explain", f"{factories}:keywords", "--json", "--option", "min_region_ops=1",
                              "--dynamic", "input_ids:0", "--dynamic", "mask:0")
    assert code == 0, err
    regions = [r for g in json.loads(out)["graphs"] for r in g["regions"]]
    assert any(r["symbols"] for r in regions)
    # DIM alone: the first tensor input, here the keyword input_ids; its partner must be marked too.
    line = one_line(*run_main("explain", f"{factories}:keywords", "--dynamic", "0"))
    assert "ConstraintViolationError" in line and "--dynamic NAME:DIM" in line


@pytest.mark.parametrize("spec, mentions", [
    ("nope:0", "no input named 'nope' (inputs: input_ids, mask)"),
    ("mask:5", "2 dimension(s)"),
    ("mask:x", "DIM or NAME:DIM"),
])
def test_dynamic_mistakes_are_one_line(run_main, factories, spec, mentions):
    line = one_line(*run_main("explain", f"{factories}:keywords", "--dynamic", spec))
    assert mentions in line


@pytest.mark.parametrize("flag, mode", [([], "inference"), (["--training"], "training"), (["--train"], "training")])
def test_cli_states_what_it_traced(run_main, factories, flag, mode):
    code, out, err = run_main("explain", f"{factories}:dropout", "--json", *flag)
    assert code == 0, err
    d = json.loads(out)
    assert d["traced_as"]["mode"] == mode and d["traced_as"]["why"]
    assert all(g["training"] == (mode == "training") for g in d["graphs"])
    code, text, _ = run_main("explain", f"{factories}:dropout", *flag)
    assert f"traced as {mode}:" in text


def test_version(run_main, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"cgbackend {cgbackend.__version__}"


@pytest.mark.parametrize("args, first", [(["--version"], "cgbackend "), (["--help"], "usage: python -m cgbackend"),
                                         (["explain", "--help"], "usage: python -m cgbackend explain")])
def test_version_and_help_import_no_torch_and_take_well_under_a_second(args, first):
    """``python -m cgbackend --version`` / ``--help`` print before torch is imported (the package
    loads only its version for them): the child's CPU time, which load on the machine does not
    inflate the way it does wall time, stays far below torch's import alone (2 s and more)."""
    import resource
    import subprocess
    import sys
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "cgbackend", *args],
                          capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0 and proc.stdout.startswith(first), proc.stdout[:200] + proc.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert cpu < 0.8, f"{cpu:.2f} s of CPU"


def _all_options(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from ((f"{name} {a}", h) for a, h in _all_options(sub))
        elif action.option_strings or action.dest not in ("help",):
            yield "/".join(action.option_strings) or action.dest, action.help


@pytest.mark.parametrize("make", ["cli", "bench", "serving"])
def test_every_option_has_help(make):
    if make == "cli":
        parser = build_parser()
    elif make == "bench":
        from cgbackend.bench.settings import build_parser as bench_parser
        parser = bench_parser()
    else:
        from cgbackend.bench.serving import build_parser as serving_parser
        parser = serving_parser()
    missing = [name for name, text in _all_options(parser) if not text]
    assert not missing


_HELP_ARGS = [["serve-bench", "--help"], ["bench", "--help"], ["explain", "--help"]]


@pytest.fixture(scope="module")
def program_runs(factories):
    """``python -m cgbackend ARGS`` (tests/program_runs.py: one interpreter) for the tracing failure
    first, in the interpreter's fresh state, then for each of _HELP_ARGS; keyed by ARGS (the
    failure by "explain mismatch")."""
    from program_runs import run_programs
    runs = run_programs([["explain", f"{factories}:mismatch"], *_HELP_ARGS])
    keys = ["explain mismatch"] + [" ".join(args) for args in _HELP_ARGS]
    return {key: vars(run) for key, run in zip(keys, runs)}


@pytest.mark.parametrize("args, prog", [
    (["-m", "cgbackend", "serve-bench", "--help"], "usage: python -m cgbackend serve-bench"),
    (["-m", "cgbackend", "bench", "--help"], "usage: python -m cgbackend bench"),
    (["-m", "cgbackend", "explain", "--help"], "usage: python -m cgbackend explain"),
])
def test_help_uses_the_program_name(args, prog, program_runs):
    proc = program_runs[" ".join(args[2:])]
    assert proc["returncode"] == 0, proc["stderr"][-2000:]
    assert proc["stdout"].startswith(prog), proc["stdout"][:200]
    if "serve-bench" in " ".join(args):
        assert "batch sizes are drawn uniformly" in proc["stdout"]  # the options have help text


@pytest.mark.parametrize("argv, prog", [(["serve-bench", "--help"], "usage: cgbackend serve-bench"),
                                        (["--help"], "usage: cgbackend ")])
def test_console_script_help_uses_the_program_name(argv, prog, capsys):
    """What the console script runs: cgbackend.cli.main (in this process)."""
    from cgbackend.cli import main
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr().out
    assert code in (0, None) and out.startswith(prog), out[:200]
    if "serve-bench" in argv:
        assert "batch sizes are drawn uniformly" in out


def test_bench_default_output_is_a_new_folder_never_a_tracked_file(tmp_path, monkeypatch):
    from cgbackend.bench import settings as bench
    monkeypatch.chdir(tmp_path)
    args = bench.build_parser().parse_args(["--device", "cpu", "--models", "dense", "--modes", "infer"])
    first = bench.resolve_settings(args)
    assert first.out.parent.parent == tmp_path / "cgbackend-results" and first.out.name == "results.json"
    assert "benchmarks" not in first.out.parts and first.markdown is None  # CPU: no markdown unless asked
    first.out.parent.mkdir(parents=True)
    second = bench.resolve_settings(args)
    assert second.out.parent != first.out.parent  # an existing folder is never reused
    given = bench.resolve_settings(bench.build_parser().parse_args(["--device", "cpu", "--out", "x/r.json"]))
    assert given.out == bench.Path("x/r.json")


def test_bench_names_where_it_writes_on_stdout(tmp_path, capsys):
    from cgbackend import bench
    out = tmp_path / "b.json"
    assert bench.main(["--smoke", "--models", "dense", "--modes", "infer", "--contenders", "eager",
                       "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"results will be written to {out}" in printed and f"results: {out}" in printed
    assert out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is about a machine without CUDA")
def test_device_cuda_for_a_factory_without_cuda_is_one_line(run_main, factories):
    line = one_line(*run_main("explain", f"{factories}:mismatch", "--device", "cuda"))
    assert "--device cuda" in line and "no CUDA device" in line
