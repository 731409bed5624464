"""bench and serve-bench on a machine without CUDA: one line that says so and what to run instead,
quickly, unless the run asks for the CPU; long runs say which case of how many they are at."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from cgbackend.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("command, other", [("bench", "--smoke runs a short CPU check"),
                                            ("serve-bench", "--device cpu times on the CPU")])
def test_refuses_without_cuda_in_one_line(command, other, no_cuda, capsys):
    start = time.perf_counter()
    assert main([command, "--models", "moe"]) == 2
    assert time.perf_counter() - start < 1.0  # nothing built or imported before the check
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"cgbackend {command}: no CUDA device (torch ") and other in err
    assert "--device cpu" in err


def _wall(args: list[str], env: dict) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    return time.perf_counter() - start, proc


@pytest.mark.skipif(torch.cuda.is_available(), reason="refuses only where there is no CUDA device")
@pytest.mark.parametrize("command", ["bench", "serve-bench"])
def test_a_fresh_process_refuses_having_imported_torch_alone(command):
    """``python -m cgbackend bench`` refuses before cgbackend imports torch's compiler stack: under
    5 s, and where a busy machine makes importing torch itself slow, at most 2.5 s beyond that."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGBACKEND_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    wall, proc = _wall(["-X", "importtime", "-m", "cgbackend", command], env)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(lines) == 1 and "no CUDA device" in lines[0], proc.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and not {"torch._dynamo", "cgbackend.api", "cgbackend.bench"} & imported
    if wall >= 5.0:  # torch's import alone is timed only when needed: a fresh interpreter costs 2 s of CPU
        torch_alone, _ = _wall(["-c", "import torch"], env)
        assert wall < torch_alone + 2.5, (wall, torch_alone)


def test_a_long_run_says_which_case_of_how_many(tmp_path, capsys):
    assert main(["bench", "--smoke", "--models", "dense", "--modes", "infer,train", "--contenders", "eager",
                 "--warmup", "1", "--iters", "1", "--out", str(tmp_path / "b.json")]) == 0
    err = capsys.readouterr().err
    assert "[bench] case 1 of 2: dense/infer, contenders eager;" in err
    assert "[bench] case 2 of 2: dense/train, contenders eager;" in err
