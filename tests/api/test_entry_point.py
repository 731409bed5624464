"""The ways in: torch.compile(backend="cgbackend") through the torch_dynamo_backends entry point, and
cgbackend.compile(); on CPU both must give eager's results bit for bit and say why nothing was captured."""

from __future__ import annotations

import copy
import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import cgbackend
from cgbackend.models import MODEL_NAMES, build_model, make_inputs


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


# ----------------------------------------------------------------------------- entry point

def test_entry_point_is_registered():
    eps = [ep for ep in importlib.metadata.entry_points(group="torch_dynamo_backends") if ep.name == "cgbackend"]
    assert len(eps) == 1
    assert eps[0].value == "cgbackend.by_name:dynamo_entry"
    assert eps[0].load() is sys.modules["cgbackend.by_name"].dynamo_entry


@pytest.fixture(scope="module")
def fresh_interpreter() -> tuple[subprocess.CompletedProcess, list[str]]:
    """One fresh interpreter runs both by-name checks in turn (a dense model first, through the entry
    point, then the MoE); each prints its line when it holds. One process instead of two: each spends
    most of its time importing torch."""
    proc = run_python("""
        import sys
        import torch

        assert "cgbackend" not in sys.modules
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
        compiled = torch.compile(model, backend="cgbackend")
        with torch.no_grad():
            for i in range(3):
                x = torch.randn(5, 8)
                assert torch.equal(compiled(x), model(x)), i
        assert "cgbackend" in sys.modules  # loaded through the entry point
        import cgbackend
        stats = cgbackend.stats(compiled)
        assert stats["compiled_graphs"] == 1, stats
        assert stats["nothing_captured_reason"] == "no_cuda", stats
        assert "cgbackend" in torch._dynamo.list_backends(exclude_tags=())
        print("OK dense", flush=True)

        # The MoE through plain torch.compile: Dynamo breaks the graph at the dispatch.
        from cgbackend.models import build_model, make_inputs
        model = build_model("moe", size="tiny").eval()
        compiled = torch.compile(model, backend="cgbackend")
        with torch.no_grad():
            for x in make_inputs("moe", model, n=3):
                assert torch.equal(compiled(x), model(x))
        print("OK moe", flush=True)
    """)
    return proc, proc.stdout.strip().splitlines()


def test_backend_by_name_in_a_fresh_interpreter(fresh_interpreter):
    proc, lines = fresh_interpreter
    assert "OK dense" in lines, proc.stderr[-3000:]


def _site_without_cgbackend(root: Path) -> Path:
    """A copy of site-packages (symlinks) without cgbackend's installed metadata and editable finder."""
    farm = root / "site"
    farm.mkdir()
    for folder in {Path(p) for p in site.getsitepackages()}:
        for entry in folder.iterdir():
            name = entry.name.lower()
            if "cgbackend" in name or name.endswith(".pth") or (farm / entry.name).exists():
                continue
            (farm / entry.name).symlink_to(entry)
    return farm


def test_import_registers_the_name_without_installed_metadata(tmp_path):
    """A source tree with no metadata: ``-S`` skips site-packages and its .pth files (the editable
    install), PYTHONPATH gives the copied package and the other installed packages only."""
    src = tmp_path / "src"
    shutil.copytree(Path(cgbackend.__file__).parent, src / "cgbackend",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "CGBACKEND_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(src), str(_site_without_cgbackend(tmp_path))])
    code = textwrap.dedent("""
        import importlib.metadata
        import torch

        assert not [ep for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")
                    if ep.name == "cgbackend"]
        import cgbackend
        assert cgbackend.__file__.startswith(%r), cgbackend.__file__
        compiled = torch.compile(torch.nn.Linear(4, 4), backend="cgbackend")
        other = torch.compile(torch.nn.Linear(4, 4), backend="cgbackend")
        with torch.no_grad():
            compiled(torch.randn(2, 4))
            other(torch.randn(2, 4))
        # one backend instance per torch.compile call
        assert cgbackend.find_backend(compiled) is not cgbackend.find_backend(other)
        assert cgbackend.stats(compiled)["compiled_graphs"] == 1
        print("OK")
    """ % str(src))
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "OK"


def test_register_where_dynamo_is_loaded_and_no_entry_point(monkeypatch):
    """The other order: torch._dynamo imported before cgbackend registers the name (no hook needed)."""
    import torch._dynamo.backends.registry as registry
    from cgbackend import by_name
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group=None: [])
    for table in ("_COMPILER_FNS", "_BACKENDS"):
        monkeypatch.setattr(registry, table, {k: v for k, v in getattr(registry, table).items() if k != "cgbackend"})
    by_name.register()
    assert registry.lookup_backend("cgbackend") is by_name.dynamo_entry
    by_name.register()  # again: the same function, no duplicate-name error
    registry._COMPILER_FNS["cgbackend"] = lambda gm, inputs: gm
    with pytest.raises(RuntimeError, match="another backend is registered with Dynamo as 'cgbackend'"):
        by_name.register()


def test_backend_by_name_moe_in_a_fresh_interpreter(fresh_interpreter):
    """The MoE through plain torch.compile: Dynamo breaks the graph at the dispatch; results still equal eager."""
    proc, lines = fresh_interpreter
    assert proc.returncode == 0 and lines[-1] == "OK moe", proc.stderr[-3000:]


@pytest.mark.parametrize("backend", ["by_name", "instance"])
def test_stats_of_a_compiled_function(backend):
    """find_backend / stats take "a compiled model or function"."""
    instance = cgbackend.backend() if backend == "instance" else "cgbackend"
    f = torch.compile(lambda x: x.sin() * 2, backend=instance)
    x = torch.randn(4)
    assert torch.equal(f(x), x.sin() * 2)
    if backend == "instance":
        assert cgbackend.find_backend(f) is instance
    assert cgbackend.stats(f)["compiled_graphs"] == 1


def test_separate_instances_keep_separate_counters():
    a, b = cgbackend.backend(), cgbackend.backend()
    torch.compile(lambda x: x.sin() * 2, backend=a)(torch.randn(3))
    assert a.stats()["compiled_graphs"] == 1
    assert b.stats()["compiled_graphs"] == 0


# ----------------------------------------------------------------------------- eager runtime on CPU

def _compile(model, how: str):
    if how == "by_name":
        return torch.compile(model, backend="cgbackend")
    return cgbackend.compile(model)


@pytest.fixture(scope="module")
def moe_compiled_run() -> dict:
    """One ``cgbackend.compile`` of the tiny MoE with default options, as plain data for the tests
    that check it: ``explain`` of its first batch (before any call), three batches of the default
    shape (outputs beside eager's, then the counters), then new input shapes (outputs beside eager's,
    then the counters again)."""
    torch._dynamo.reset()
    cgbackend.reset()
    model = build_model("moe", size="tiny").eval()
    compiled = cgbackend.compile(model)
    batches = make_inputs("moe", model, n=3)
    run: dict = {"batches": batches}
    with torch.no_grad():
        run["explained"] = dict(cgbackend.explain(model, batches[0], options={}).summary)
        run["pairs"] = [(compiled(x), model(x)) for x in batches]
        run["stats"] = copy.deepcopy(cgbackend.stats(compiled))
        run["shape_pairs"] = []
        for batch, seq in ((2, 16), (3, 8), (1, 5)):
            (x,) = make_inputs("moe", model, batch=batch, seq=seq, n=1)
            run["shape_pairs"].append((compiled(x), model(x)))
        run["shape_stats"] = copy.deepcopy(cgbackend.stats(compiled))
    del compiled
    torch._dynamo.reset()
    cgbackend.reset()
    return run


@pytest.mark.parametrize("how", ["by_name", "cgbackend_compile"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reference_models_equal_eager_on_cpu(name, how, request):
    # cgbackend.compile rewrites the MoE dispatch into static code by default (masked dense on the
    # CPU): each expert multiplies every token's row, so the sums round as a larger product does,
    # within float32 rounding of the loop; everything else runs eager's own ops, bitwise.
    rewritten = how == "cgbackend_compile" and name in ("moe", "moe_sort")
    if (name, how) == ("moe", "cgbackend_compile"):  # the run the MoE tests below check too
        run = request.getfixturevalue("moe_compiled_run")
        batches, pairs, stats = run["batches"], run["pairs"], run["stats"]
    else:
        model = build_model(name, size="tiny").eval()
        compiled = _compile(model, how)
        batches = make_inputs(name, model, n=3)
        with torch.no_grad():
            pairs = [(compiled(x), model(x)) for x in batches]
        stats = cgbackend.stats(compiled)
    assert not all(torch.equal(batches[0], b) for b in batches[1:])
    for got, expected in pairs:
        assert got.shape == expected.shape and got.dtype == expected.dtype
        if rewritten:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, expected)
    assert stats["nothing_captured_reason"] == "no_cuda"
    assert stats["compiled_graphs"] >= 1
    assert stats["graphs_captured"] == 0 and stats["replays"] == 0
    assert set(stats["eager_calls"]) == {"no_cuda"}
    assert stats["eager_calls"]["no_cuda"] >= len(batches) * stats["static_regions"] // stats["compiled_graphs"]
    # The dynamic-op path traces each model into one graph.
    if how == "cgbackend_compile":
        assert stats["compiled_graphs"] == 1


@pytest.mark.parametrize("options, regions", [({}, (1, 1, 0)), ({"static_dispatch": "off"}, (1, 3, 2))],
                         ids=["default", "dispatch_as_written"])
def test_cgbackend_compile_splits_moe_like_explain(options, regions, request):
    if not options:  # default options: the shared run
        run = request.getfixturevalue("moe_compiled_run")
        summary, stats = run["explained"], run["stats"]
    else:
        model = build_model("moe", size="tiny").eval()
        compiled = cgbackend.compile(model, **options)
        with torch.no_grad():
            x = make_inputs("moe", model, n=1)[0]
            summary = cgbackend.explain(model, x, options=options).summary
            for x in make_inputs("moe", model, n=3):
                compiled(x)
        stats = cgbackend.stats(compiled)
    assert (stats["compiled_graphs"], stats["static_regions"], stats["dynamic_regions"]) == regions
    assert (summary["static_regions"], summary["dynamic_regions"]) == regions[1:]
    assert stats["eager_calls"] == {"no_cuda": 3 * regions[1]}


def test_cgbackend_compile_leaves_dynamo_settings_alone():
    model = build_model("item", size="tiny").eval()
    compiled = cgbackend.compile(model)
    with torch.no_grad():
        compiled(make_inputs("item", model, n=1)[0])
    assert torch._dynamo.config.capture_dynamic_output_shape_ops is False
    assert torch._dynamo.config.capture_scalar_outputs is False


def test_new_input_shapes_equal_eager(moe_compiled_run):
    """The shared MoE compile called at (batch, seq) (2, 16), (3, 8), (1, 5) after its first batches."""
    run = moe_compiled_run
    assert [tuple(ref.shape[:2]) for _, ref in run["shape_pairs"]] == [(2, 16), (3, 8), (1, 5)]
    for got, ref in run["shape_pairs"]:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # masked dense rounding
    assert run["shape_stats"]["compiled_graphs"] > run["stats"]["compiled_graphs"]  # the new shapes traced again
    assert set(run["shape_stats"]["eager_calls"]) == {"no_cuda"}


@pytest.mark.parametrize("how", ["by_name", "cgbackend_compile"])
def test_dropout_training_is_bitwise_equal_with_the_same_seed(how):
    model = build_model("dropout", size="tiny").train()
    reference = build_model("dropout", size="tiny").train()
    reference.load_state_dict(model.state_dict())
    compiled = _compile(model, how)
    for i, x in enumerate(make_inputs("dropout", model, n=3)):
        torch.manual_seed(100 + i)
        got = compiled(x)
        torch.manual_seed(100 + i)
        expected = reference(x)
        assert torch.equal(got, expected)
        got.square().sum().backward()
        expected.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name
    # Dropout really drew different masks from call to call.
    torch.manual_seed(1)
    a = compiled(x)
    torch.manual_seed(2)
    b = compiled(x)
    assert not torch.equal(a, b)
    assert set(cgbackend.stats(compiled)["eager_calls"]) == {"no_cuda"}


def test_compile_leaves_the_users_module_alone_and_backends_stay_apart():
    """cgbackend.compile keeps its backend on the wrapper: the user's module gets no attribute, and
    a later torch.compile of the same module reports its own backend, not the earlier one."""
    import torch

    import cgbackend
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4))
    first = cgbackend.compile(model, simulate_graphs=True, warmup=0)
    with torch.no_grad():
        first(torch.randn(2, 4))
    assert "_cgbackend" not in vars(model) and "forward" not in vars(model)
    second_backend = cgbackend.backend(simulate_graphs=True, warmup=0)
    second = torch.compile(model, backend=second_backend)
    assert cgbackend.find_backend(second) is second_backend
    assert cgbackend.find_backend(first) is not second_backend
