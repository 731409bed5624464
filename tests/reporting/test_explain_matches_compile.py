"""explain reports the graphs cgbackend.compile runs: the same preparation (source rewrites, expert
layout, layer stacks, Dynamo settings), so its graph and region counts equal cgbackend.stats()
after as many calls of the compiled model with the same options and inputs."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

import cgbackend

transformers = pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "cg_zoo_explain", pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "zoo.py")
zoo = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = zoo
_spec.loader.exec_module(zoo)


def _qwen3_moe(layers: int) -> torch.nn.Module:
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, num_hidden_layers=layers,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                      max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    cfg._experts_implementation = "eager"
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _zoo(name: str) -> torch.nn.Module:
    return zoo.ZOO[name][1](layers=1).eval()


def _counts(model: torch.nn.Module, x: torch.Tensor, options: dict) -> tuple:
    with torch.no_grad():
        report = cgbackend.explain(model, (x,), options=options, count_launches=False)
    explained = (report.summary["graphs"], report.summary["static_regions"], report.summary["dynamic_regions"],
                 [(sum(r.kind == "static" for r in g.regions), sum(r.kind == "dynamic" for r in g.regions))
                  for g in report.graphs])
    compiled = cgbackend.compile(model, **options)
    with torch.no_grad():
        for _ in range(report.traced_via["calls"]):
            out = compiled(x)
        expected = model(x)
    torch.testing.assert_close(out.logits, expected.logits)
    stats = cgbackend.stats(compiled)
    run = cgbackend.report(compiled)
    counted = (stats["compiled_graphs"], stats["static_regions"], stats["dynamic_regions"],
               [(sum(r.kind == "static" for r in g.regions), sum(r.kind == "dynamic" for r in g.regions))
                for g in run.graphs])
    return explained, counted, report


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "olmoe"])
def test_explain_counts_equal_compile_for_zoo_moe(name):
    torch.manual_seed(0)
    model = _zoo(name)
    x = torch.randint(0, 512, (2, 16))
    explained, counted, _ = _counts(model, x, {"simulate_graphs": True})
    assert explained == counted


def test_explain_shows_regional_compilation_of_eight_layers():
    """Without the KV cache the eight layers read no per-layer state: a prologue, one layer graph
    serving the eight, an epilogue."""
    torch.manual_seed(0)
    model = _qwen3_moe(8)
    model.config.use_cache = False
    x = torch.randint(0, 256, (1, 16))
    explained, counted, report = _counts(model, x, {"simulate_graphs": True})
    assert explained == counted
    assert explained[0] > 1  # prologue, layer graphs and epilogue, not one whole-model graph
    assert [s["path"] for s in report.regional] == ["model.layers"] and report.regional[0]["layers"] == 8
    assert [g["layers"] for g in report.regional[0]["groups"]] == [list(range(8))]


def test_explain_shows_layers_compiled_apart_as_the_run_does():
    """With the KV cache each layer reads its own ``layer_idx``, so Dynamo specialises each layer
    and the stack is compiled with the model from the second call on: explain reports the graphs
    the run gives (three layers, the stack threshold lowered to keep the test small)."""
    torch.manual_seed(0)
    model = _qwen3_moe(3)
    x = torch.randint(0, 256, (1, 16))
    explained, counted, report = _counts(model, x, {"simulate_graphs": True, "regional_min_layers": 2})
    assert explained == counted
    stack = report.regional[0]
    # the first layer's graph, specialised on layer_idx, tells that every layer would be compiled
    # apart: the other two ran as written at the first call, none was compiled on its own
    assert stack["layers"] == 3 and [g["layers"] for g in stack["groups"]] == [[0]]
    assert stack["with_model"] and "self.self_attn.layer_idx, 3 values" in stack["why"], stack
