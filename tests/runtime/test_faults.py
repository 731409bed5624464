"""Fault and bad-input matrix: each case ends in a correct result or a clear error naming the cause,
never a silently wrong result. CPU cases run with simulated graphs (same runtime code paths);
GPU cases (capture out of memory, memory given back) carry the cuda marker."""

from __future__ import annotations

import copy
import gc
import threading
import traceback

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.models import build_model, make_inputs

# Real CUDA graphs on a GPU machine, simulated graphs (same runtime code) on a CPU machine.
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
SIM = dict(warmup=1) if CUDA else dict(simulate_graphs=True, warmup=1)
EXACT = dict(rtol=1e-5, atol=1e-5) if CUDA else dict(rtol=0, atol=0)


class _MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return self.b(F.gelu(self.a(x))) + x


def _check(compiled, model, xs):
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(compiled(x), model(x), **EXACT)


@pytest.mark.parametrize("change", ["shape", "dtype", "stride", "non_contiguous"])
def test_input_changes_between_calls_give_correct_results(change):
    model = _MLP().to(DEV).eval()
    compiled = cgbackend.compile(model, **SIM)
    base = [torch.randn(8, 16, device=DEV) for _ in range(3)]
    if change == "shape":
        later = [torch.randn(5, 16, device=DEV), torch.randn(9, 16, device=DEV)]
    elif change == "dtype":
        later = []
    elif change == "stride":  # same shape, transposed strides
        later = [torch.randn(16, 8, device=DEV).t(), torch.randn(16, 8, device=DEV).t()]
    else:
        later = [torch.randn(8, 32, device=DEV)[:, ::2], torch.randn(8, 32, device=DEV)[:, 1::2]]
    _check(compiled, model, base + later + base)
    if change == "dtype":
        model64 = model.double()
        _check(compiled, model64, [x.double() for x in base])
    st = cgbackend.stats(compiled)
    assert st["capture_failures"] == []
    assert st["replays"] > 0


def test_two_compiled_models_alive_at_once_stay_independent():
    m1, m2 = _MLP().to(DEV).eval(), _MLP().to(DEV).eval()
    c1, c2 = cgbackend.compile(m1, **SIM), cgbackend.compile(m2, **SIM)
    xs = [torch.randn(8, 16, device=DEV) for _ in range(5)]
    with torch.no_grad():
        for x in xs:
            torch.testing.assert_close(c1(x), m1(x), **EXACT)
            torch.testing.assert_close(c2(x), m2(x), **EXACT)
    assert cgbackend.stats(c1)["replays"] > 0 and cgbackend.stats(c2)["replays"] > 0
    assert cgbackend.find_backend(c1) is not cgbackend.find_backend(c2)


def test_two_models_sharing_the_default_backend_share_one_pool_safely():
    m1, m2 = _MLP().to(DEV).eval(), _MLP().to(DEV).eval()
    options = cgbackend.backend(**SIM)
    c1 = torch.compile(m1, backend=options)
    c2 = torch.compile(m2, backend=options)
    xs = [torch.randn(8, 16, device=DEV) for _ in range(5)]
    with torch.no_grad():
        kept = []
        for x in xs:
            kept.append((c1(x), m1(x), c2(x), m2(x)))
        for a, ra, b, rb in kept:
            torch.testing.assert_close(a, ra, **EXACT)
            torch.testing.assert_close(b, rb, **EXACT)


class _Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if (x.abs().max() > 1e3).item():  # read on the host: eager code, never inside a graph
            raise ValueError("input too large for this model")
        return F.relu(self.lin(x))


def test_exception_inside_the_model_reaches_the_caller_with_its_traceback():
    model = _Raises().to(DEV).eval()
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(4, 8, device=DEV))
        with pytest.raises(ValueError, match="input too large") as info:
            compiled(torch.full((4, 8), 1e6, device=DEV))
    frames = traceback.extract_tb(info.value.__traceback__)
    assert any(f.name == "forward" and "test_faults.py" in f.filename for f in frames)
    with torch.no_grad():  # and the model still works afterwards
        x = torch.randn(4, 8, device=DEV)
        torch.testing.assert_close(compiled(x), model(x), **EXACT)


def test_calls_from_several_threads_are_serialized_and_correct():
    model = build_model("moe", device=DEV).eval()
    compiled = cgbackend.compile(model, static_dispatch="off", **SIM)  # dynamic regions between graphs
    xs = make_inputs("moe", model, n=8, device=DEV)
    with torch.no_grad():
        compiled(xs[0]), compiled(xs[0])  # warm-up and capture on this thread
        refs = [model(x) for x in xs]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def worker(i):
        try:
            with torch.no_grad():
                for _ in range(3):
                    results[i] = compiled(xs[i])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, ref in enumerate(refs):
        torch.testing.assert_close(results[i], ref, **EXACT)


@pytest.mark.cuda
def test_input_moving_between_devices_between_calls():
    model = _MLP().cuda().eval()
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for x in [torch.randn(8, 16, device="cuda") for _ in range(3)]:
            torch.testing.assert_close(compiled(x), model(x), **EXACT)
        cpu_model = _MLP().eval()
        cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        model.cpu()  # the same module now computes on the CPU: Dynamo recompiles, nothing is captured
        x = torch.randn(8, 16)
        torch.testing.assert_close(compiled(x), cpu_model(x), **EXACT)
    st = cgbackend.stats(compiled)
    assert st["compiled_graphs"] == 2
    assert st["eager_calls"].get("no_cuda", 0) >= 1


def test_bad_options_fail_fast_with_the_valid_list():
    with pytest.raises(cgbackend.ConfigError, match="valid options: .*warmup"):
        cgbackend.compile(_MLP(), wramup=3)


def test_failed_capture_leaves_no_graph_memory_behind(monkeypatch):
    """A capture that fails (out of memory, injected here) after its static input buffers were
    made: the eager call that follows, and every later one, is what eager alone would allocate.
    The attempt's buffers stop counting as graph memory, so an eager output that the allocator
    places where one of them lay is handed over as is, never copied (a copy needs memory that an
    out-of-memory error just said is not there)."""
    from cgbackend.runtime.capture import CaptureError, Capturer
    seen = []

    def failing(self, fn, pool, restore=(), **kwargs):
        seen.extend(t.untyped_storage().data_ptr() for t in restore if t.numel())
        raise CaptureError("OutOfMemoryError: CUDA out of memory (injected)")

    monkeypatch.setattr(Capturer, "capture", failing)
    model = _MLP().to(DEV).eval()
    compiled = cgbackend.compile(model, **SIM)
    xs = [torch.randn(8, 16, device=DEV) for _ in range(4)]
    _check(compiled, model, xs)
    shared = cgbackend.find_backend(compiled).shared
    assert seen, "the capture was attempted with static input buffers"
    assert not set(seen) & shared.persistent_storages
    st = cgbackend.stats(compiled)
    assert len(st["capture_failures"]) == 1 and "out of memory" in st["capture_failures"][0]["error"]
    assert st["eager_calls"].get("capture_failed", 0) == len(xs) - 1
    assert st["graphs_captured"] == 0 and shared.counters.output_clones == 0


# ------------------------------------------------------------------------------------ GPU


_OOM_SCRIPT = r"""
import json, torch, torch.nn as nn, torch.nn.functional as F, cgbackend, cgbackend.runtime.capture

class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        return self.b(F.gelu(self.a(x))) + x

model = MLP(2048).cuda().eval()
xs = [torch.randn(4096, 2048, device="cuda") for _ in range(3)]
compiled = cgbackend.compile(model, warmup=1)
total = torch.cuda.get_device_properties(0).total_memory
def fresh():  # no cuBLAS workspace kept: an eager call and a capture each make their own
    torch.cuda.synchronize()
    cgbackend.runtime.capture.clear_blas_workspaces()
    torch.cuda.empty_cache()

with torch.no_grad():
    fresh()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    compiled(xs[0])  # warm-up (eager): what an eager call needs, its cuBLAS workspace included
    torch.cuda.synchronize()
    eager_need = torch.cuda.max_memory_allocated() - base
    refs = [model(x).cpu() for x in xs[1:]]  # references before memory gets tight
    fresh()
    # Room for an eager call and 8 MiB. Whether a capture fits next to that depends on what
    # Inductor fuses on this GPU (on an H200 the fused region's capture fit), so the capture also
    # asks for more than the limit leaves: a real out-of-memory error inside a CUDA capture.
    limit = torch.cuda.memory_allocated() + eager_need + 8 * 2**20
    capture = cgbackend.runtime.capture.Capturer.capture
    def hungry_capture(self, fn, *args, **kwargs):
        def run():
            torch.empty(2 * limit, dtype=torch.uint8, device="cuda")
            return fn()
        return capture(self, run, *args, **kwargs)
    cgbackend.runtime.capture.Capturer.capture = hungry_capture
    torch.cuda.set_per_process_memory_fraction(limit / total)
    try:
        outs = [compiled(x).cpu() for x in xs[1:]]
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    ok = [torch.allclose(o, r, rtol=1e-5, atol=1e-5) for o, r in zip(outs, refs)]
st = cgbackend.stats(compiled)
clones = cgbackend.find_backend(compiled).shared.counters.output_clones
print(json.dumps({"ok": ok, "failures": st["capture_failures"], "eager": dict(st["eager_calls"]),
                  "clones": clones}))
"""


@pytest.mark.cuda
def test_out_of_memory_during_capture_falls_back_with_the_reason():
    """In a fresh process, so the memory in use is known (nothing left by other tests)."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _OOM_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] == [True, True]
    assert len(result["failures"]) == 1, result
    assert "out of memory" in result["failures"][0]["error"].lower()
    assert result["eager"].get("capture_failed", 0) >= 1
    assert result["clones"] == 0  # eager outputs handed over as they are, with no memory beyond eager's


@pytest.mark.cuda
def test_deleting_the_compiled_model_gives_the_pool_memory_back():
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    model = build_model("dense", size="small", device="cuda").eval()
    x = make_inputs("dense", model, n=1, device="cuda")[0]
    compiled = cgbackend.compile(model, warmup=1)
    with torch.no_grad():
        for _ in range(3):
            compiled(x)
    assert cgbackend.stats(compiled)["graphs_captured"] == 1
    held = torch.cuda.memory_reserved()
    del compiled, model, x
    torch._dynamo.reset()  # Dynamo's code cache holds compiled graphs of every model until reset
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert after - before < 0.1 * (held - before) + 2**20, (before, held, after)


class _Cycle:
    """Garbage that only the cyclic collector frees (as TE's make_graphed_callables leaves)."""

    def __init__(self, held):
        self.held, self.me = held, self


@pytest.mark.cuda
def test_automatic_gc_inside_a_capture_cannot_invalidate_it(monkeypatch):
    """An automatic collection inside a capture that destroys an unrelated, cyclically held CUDA
    graph invalidates the capture (destroying a graph is not permitted while a stream captures).
    The test makes such garbage right after each capture begins and makes an automatic collection
    due at once: cgbackend pauses automatic collection while capturing, so every region captures."""
    old = []
    for _ in range(8):  # one stray graph per capture
        g = torch.cuda.CUDAGraph()
        buf = torch.zeros(4, device="cuda")
        with torch.cuda.graph(g):
            buf.add_(1)
        old.append(g)
    del g
    begin = torch.cuda.CUDAGraph.capture_begin
    thresholds = gc.get_threshold()

    def capture_begin(self, *args, **kwargs):
        begin(self, *args, **kwargs)
        if old:
            _Cycle(old.pop())
            gc.set_threshold(1)
            try:
                _ = [[i] for i in range(64)]  # allocations that trigger a due collection
            finally:
                gc.set_threshold(*thresholds)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    model = build_model("moe", size="tiny", device="cuda").train()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, warmup=1)
    for x in make_inputs("moe", model, n=3, device="cuda"):
        out = compiled(x)
        expected = ref(x)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
        F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
        F.cross_entropy(expected.flatten(0, 1), x.flatten()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    st = cgbackend.stats(compiled)
    assert st["capture_failures"] == [], st["capture_failures"]
    assert st["fwd_graphs"] == st["bwd_graphs"] == st["static_regions"] > 0
    assert len(old) < 8, "no capture ran the injected collection"


class _NoProduct(nn.Module):
    def forward(self, x):
        return F.gelu(x * 2.0 + 1.0).softmax(-1)


@pytest.mark.cuda
def test_capture_in_a_thread_that_never_ran_a_matrix_product():
    """A thread without a cuBLAS handle yet (nothing it ran used cuBLAS, as with a model made of TE
    modules only) must not get one made inside a capture: that invalidates the capture."""
    result = {}

    def work():
        try:
            model = _NoProduct()
            compiled = cgbackend.compile(model, warmup=1)
            xs = [torch.randn(64, 32, device="cuda") for _ in range(3)]
            with torch.no_grad():
                result["ok"] = all(torch.allclose(compiled(x), model(x), **EXACT) for x in xs)
            result["stats"] = cgbackend.stats(compiled)
        except BaseException as exc:  # reported by the assertions below
            result["error"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in result, result.get("error")
    st = result["stats"]
    assert result["ok"]
    assert st["capture_failures"] == [], st["capture_failures"]
    assert st["graphs_captured"] == st["static_regions"] == 1
