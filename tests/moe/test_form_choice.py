"""The static-dispatch cost model against what was measured: its picks on the committed crossover
table (benchmarks/results/dispatch_crossover.json, made with the committed costs.json), and the
rule that a layer needing gradients never takes the small-batch form under "auto"."""

import json
import os
from types import SimpleNamespace

import pytest

from cgbackend.config import DispatchMode
from cgbackend.moe import form_choice as cost

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
FORMS = ("masked_dense", "grouped", "small_batch", "dynamic")


def _committed() -> dict:
    """benchmarks/results/dispatch_crossover.json: its meta and rows."""
    with open(os.path.join(ROOT, "benchmarks", "results", "dispatch_crossover.json"), encoding="utf-8") as f:
        return json.load(f)


def _crossover() -> list[dict]:
    return _committed()["rows"]


def _layer(tokens: int, experts: int, k: int, hidden: int, ffn: int) -> SimpleNamespace:
    return SimpleNamespace(experts=experts, k=k, tokens=tokens, flops_per_row=3 * 2 * hidden * ffn, stack_bytes=0)


def test_the_committed_costs_and_crossover_come_from_one_run():
    meta = _committed()["meta"]
    c = cost.constants(meta["device"])
    assert c["source"].startswith("measured")
    assert (c["device"], c["date"], c["torch"]) == (meta["device"], meta["date"], meta["torch"])


@pytest.mark.parametrize("row", _crossover(), ids=lambda r: f"E{r['experts']}k{r['k']}T{r['tokens']}")
def test_auto_picks_a_form_within_15_percent_of_the_fastest_measured(row):
    layer = _layer(row["tokens"], row["experts"], row["k"], row["hidden"], row["ffn"])
    form, why, figures = cost.choose_layer_form(layer, DispatchMode.AUTO, "cuda", 2, native=True, needs_grad=False,
                                                device_name=_committed()["meta"]["device"])
    measured = {f: row[f"{f}_ms"] for f in FORMS}
    assert form in measured, why
    assert measured[form] <= 1.15 * min(measured.values()), (form, measured, figures["estimate_us"])


def test_the_small_batch_form_wins_somewhere_and_loses_somewhere():
    rows = _crossover()
    assert {r["fastest"] for r in rows} >= {"small_batch", "grouped"}
    assert all(r["fastest"] != "small_batch" for r in rows if r["tokens"] * r["k"] > 4 * r["experts"])


@pytest.mark.parametrize("mode", [DispatchMode.AUTO, DispatchMode.SMALL_BATCH], ids=str)
def test_a_layer_that_needs_gradients_takes_the_small_batch_form_only_when_asked(mode):
    layer = _layer(1, 128, 2, 2048, 768)  # one decode token: the small-batch form's best case
    inference, _, _ = cost.choose_layer_form(layer, mode, "cuda", 2, native=True, needs_grad=False)
    training, why, figures = cost.choose_layer_form(layer, mode, "cuda", 2, native=True, needs_grad=True)
    assert inference == "small_batch"
    if mode is DispatchMode.AUTO:
        assert training == "grouped" and "small_batch" not in figures["estimate_us"], why
    else:
        assert training == "small_batch"


def test_the_docs_quote_the_committed_crossover():
    import importlib.util
    spec = importlib.util.spec_from_file_location("dispatch_costs", os.path.join(ROOT, "benchmarks", "dispatch_costs.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    doc = _committed()
    with open(os.path.join(ROOT, "docs", "static-dispatch.md"), encoding="utf-8") as f:
        assert script.table(doc) in f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:  # it links the table, not carries it
        assert "docs/static-dispatch.md" in f.read()


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_pass_tells_the_cost_model_whether_a_layer_needs_gradients(monkeypatch, grad):
    """Through the dispatch pass: a one-token MoE layer traced under no_grad takes the small-batch
    form under "auto", traced with gradients it does not (the device check is made to say CUDA,
    where "auto" weighs forms; test_forms.py checks the form's results against the loop)."""
    import torch

    from cgbackend.models.gpt import MixtralStyleMoE
    from cgbackend.moe import graph_rewrite as dispatch
    from cgbackend.moe import grouped
    from fx_helpers import trace

    real, seen = cost.choose_layer_form, []

    def on_cuda(layer, mode, device_type, itemsize, native=True, needs_grad=True, device_name=None,
                native_on_cuda=None):
        out = real(layer, mode, "cuda", itemsize, native, needs_grad, device_name=device_name)
        seen.append((needs_grad, out[0]))
        return out

    monkeypatch.setattr(grouped, "choose_layer_form", on_cuda)
    torch.manual_seed(0)
    layer = MixtralStyleMoE(16, 32, 8, 2)
    x = torch.randn(1, 1, 16)
    with torch.set_grad_enabled(grad):
        gm = trace(layer, x)
        result = dispatch.rewrite_static_dispatch(gm, DispatchMode.AUTO)
    assert seen and all(needs == grad for needs, _ in seen), seen
    forms = {r.form for r in result.rewrites}
    assert ("small_batch" in forms) is (not grad), (forms, seen)


def test_constants_are_picked_by_device_name(tmp_path, monkeypatch):
    """One set per GPU in costs.json; a GPU without its own set takes the reference device's, and
    the source says it stands in; a file in the one-device layout still reads as that device's."""
    h100 = dict(cost.measured_sets()[cost.REFERENCE_DEVICE])
    other = dict(h100, device="Other GPU", date="2099-01-01", bandwidth_gbs=1.0)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"devices": {cost.REFERENCE_DEVICE: h100, "Other GPU": other}}))
    monkeypatch.setattr(cost, "COSTS_PATH", str(path))
    cost.use_measured(None)
    try:
        assert cost.constants("Other GPU")["bandwidth_gbs"] == 1.0
        assert cost.constants("Other GPU")["source"] == "measured (Other GPU, 2099-01-01; costs.json)"
        stand_in = cost.constants("NVIDIA H200")
        assert stand_in["bandwidth_gbs"] == h100["bandwidth_gbs"]
        assert stand_in["source"].endswith("standing in for NVIDIA H200, not measured)")
        assert cost.constants(cost.REFERENCE_DEVICE)["source"].endswith("; costs.json)")
        path.write_text(json.dumps(other))  # the one-device layout
        cost.use_measured(None)
        assert set(cost.measured_sets(str(path))) == {"Other GPU"}
        assert cost.constants("Other GPU")["bandwidth_gbs"] == 1.0
    finally:
        monkeypatch.undo()
        cost.use_measured(None)
    assert cost.constants(cost.REFERENCE_DEVICE)["bandwidth_gbs"] == h100["bandwidth_gbs"]
