"""Hugging Face models (small configs, random weights) under cgbackend on CPU with simulated graphs:
every region is captured and replayed by the same runtime code as on a GPU, results equal eager.
The GPU run of the same zoo (benchmarks/zoo.py) produced benchmarks/ZOO.md."""

from __future__ import annotations

import argparse
import importlib.util
import pathlib

import pytest

pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "cg_zoo", pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "zoo.py")
zoo = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(zoo)

MOE = {"mixtral", "qwen2_moe", "olmoe"}


@pytest.mark.parametrize("mode", ["infer", "train"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "mixtral", "qwen2_moe", "olmoe"])
def test_hugging_face_model_matches_eager(name, mode):
    args = argparse.Namespace(device="cpu", simulate=True, batches=3, warmup=1, time=False, iters=0, tol=1e-5)
    row = zoo.run_one(name, mode, args)
    assert row["error"] is None, row["error"]
    assert row["match"], row
    assert row["eager_after_warmup"] == {}, row["eager_after_warmup"]
    static, dynamic = (int(v) for v in row["regions"].split("/"))
    assert row["graphs"] == static * (2 if mode == "train" else 1)
    if name in MOE:
        assert dynamic >= 1 and 0 < row["static_op_fraction"] < 1  # the expert dispatch stays eager
    else:
        assert dynamic == 0 and row["static_op_fraction"] == 1.0
