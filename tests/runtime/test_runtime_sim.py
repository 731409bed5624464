"""Runtime logic on CPU with simulated graphs (option simulate_graphs): a simulated graph re-runs the
region into the same static buffers, so keys, hand-offs, copies, slots, replay order and fallbacks
are exercised exactly as with CUDA graphs. GPU tests (test_cuda_*) check the real thing."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.models import MODEL_NAMES, build_model, is_language_model, make_inputs
from cgbackend.runtime.capture import CaptureError, Capturer

SIM = dict(simulate_graphs=True, warmup=1, static_dispatch="off")
"""Simulated graphs, and the reference models' dispatch as written: these tests follow the runtime
through static regions with dynamic ones between them, bitwise against eager (static dispatch's own
runtime tests: tests/moe/test_static_dispatch.py)."""


def _loss(name, out, x):
    if is_language_model(name):
        return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())
    return out.float().pow(2).mean()


def _inference_run(name: str, n: int = 6, snapshot_after: int = 0) -> tuple[list, list, dict, dict]:
    """``name`` compiled with SIM and called on ``n`` batches: the inputs, (output, eager output,
    whether they were equal when returned) per call, the counters after ``snapshot_after`` calls
    and after all of them (plain data)."""
    model = build_model(name).eval()
    inputs = make_inputs(name, model, n=n)
    compiled = cgbackend.compile(model, **SIM)
    kept, early = [], {}
    with torch.no_grad():
        for i, x in enumerate(inputs):
            torch.manual_seed(0)
            ref = model(x)
            torch.manual_seed(0)
            out = compiled(x)
            kept.append((out, ref, torch.equal(out, ref)))
            if i + 1 == snapshot_after:
                early = copy.deepcopy(cgbackend.stats(compiled))
    return inputs, kept, early, copy.deepcopy(cgbackend.stats(compiled))


@pytest.fixture(scope="module")
def moe_inference_run() -> tuple[list, list, dict, dict]:
    """The MoE reference model's inference run, shared by the tests that check it: six batches, the
    counters after the first four and after all six."""
    torch._dynamo.reset()
    cgbackend.reset()
    try:
        return _inference_run("moe", n=6, snapshot_after=4)
    finally:
        torch._dynamo.reset()
        cgbackend.reset()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_inference_counters_and_exact_results(name, request):
    if name == "moe":
        inputs, kept, _, st = request.getfixturevalue("moe_inference_run")
    else:
        inputs, kept, _, st = _inference_run(name)
    assert all(equal for _, _, equal in kept)  # each output equal to eager's when it was returned
    assert all(torch.equal(o, r) for o, r, _ in kept), "a replay overwrote an output returned earlier"
    regions = st["static_regions"]
    assert st["graphs_captured"] == regions >= 1
    assert st["replays"] == regions * (len(inputs) - 1)
    assert st["eager_calls"] == {"warmup": regions}
    assert st["copied_by_kind"].get("param", 0) == 0
    # Every output is kept: the capturing call copies, two handout graphs hand theirs out, and
    # then both are held, so the region's own graph runs and copies.
    assert st["handout_graphs"] == 2 and st["outputs_handed"] == 2
    assert st["output_clones"] == len(inputs) - 1 - 2


def test_moe_static_outputs_handed_over_without_copies(moe_inference_run):
    _, _, st, _ = moe_inference_run  # the counters after its first four calls
    # The token ids: once per replay after the capturing call (which fills the buffer itself).
    assert st["copied_by_kind"] == {"user_input": 2}
    assert st["copies_avoided"] > 0


class _ThreeOut(nn.Module):
    """Three outputs of different dtypes and layouts (one transposed, one integer) in graph memory."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h.relu(), (h * 2).t(), h.argmax(-1)


@pytest.mark.parametrize("mode", ["clone", "copy", "auto", "none"])
def test_outputs_copied_out_of_graph_memory_with_one_foreach_call(mode, monkeypatch):
    """Inference outputs leave graph memory with one foreach call per dtype (one launch instead of
    one per output), each into its own storage with the layout ``clone()`` gives: ``_foreach_clone`` where
    torch has it, or one ``empty_like`` each and one ``_foreach_copy_`` (``_foreach_mul`` by True is
    the CUDA form on torch without ``_foreach_clone``: tests/runtime/test_cuda_inference.py); without the
    private APIs (``none``) each is cloned. Either way a later replay overwrites none of them."""
    from cgbackend.runtime import outputs
    if mode == "clone" and outputs._foreach_clone is None:
        pytest.skip("this torch has no _foreach_clone")
    calls = []

    def counting(name, real):
        def wrapped(*args):
            calls.append((name, len(args[0])))
            return real(*args)
        return wrapped

    monkeypatch.setattr(outputs, "OUTPUT_COPY", "copy" if mode == "none" else mode)
    if outputs._foreach_clone is not None:
        monkeypatch.setattr(outputs, "_foreach_clone", counting("clone", outputs._foreach_clone))
    monkeypatch.setattr(outputs, "foreach_copy", None if mode == "none" else counting("copy", outputs.foreach_copy))
    torch.manual_seed(0)
    model = _ThreeOut().eval()
    compiled = cgbackend.compile(model, handout_graphs=0, **SIM)  # every output copied
    kept = []
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(5, 8)
            out, ref = compiled(x), model(x)
            for o, r in zip(out, ref):
                assert torch.equal(o, r) and o.stride() == r.stride() and o.dtype == r.dtype
            assert len({o.untyped_storage().data_ptr() for o in out}) == 3
            kept.append((out, ref))
    for out, ref in kept:
        assert all(torch.equal(o, r) for o, r in zip(out, ref)), "a replay overwrote an earlier output"
    st = cgbackend.stats(compiled)
    assert st["replays"] == 3 and st["output_clones"] == 9
    expected = {"clone": "clone", "copy": "copy", "none": None,
                "auto": "clone" if outputs._foreach_clone is not None else "copy"}[mode]
    # One call per dtype (float32: two outputs, int64: one): a foreach op given several dtypes
    # would take its per-tensor path.
    assert calls == ([(expected, 2), (expected, 1)] * 3 if expected else []), calls


@pytest.mark.parametrize("mode", ["auto", "copy", "clone"])
def test_mixed_dtype_outputs_copied_with_one_foreach_call_per_dtype(mode, monkeypatch):
    """A foreach op given several dtypes takes its per-tensor path (a launch each): copy_out
    groups the outputs by device and dtype, one call per group, and returns them in order."""
    from cgbackend.runtime import outputs
    if mode == "clone" and outputs._foreach_clone is None:
        pytest.skip("this torch has no _foreach_clone")
    calls = []

    def counting(name, real):
        def wrapped(*args):
            tensors = args[-1] if name == "copy" else args[0]
            calls.append((name, tuple(t.dtype for t in tensors)))
            return real(*args)
        return wrapped

    monkeypatch.setattr(outputs, "OUTPUT_COPY", mode)
    if outputs._foreach_clone is not None:
        monkeypatch.setattr(outputs, "_foreach_clone", counting("clone", outputs._foreach_clone))
    monkeypatch.setattr(outputs, "foreach_copy", counting("copy", outputs.foreach_copy))
    sources = [torch.tensor(7), torch.randn(3, 4), torch.randn(4, 3).t(), torch.tensor(-2 ** 62),
               torch.randn(2, dtype=torch.float64), torch.randn(5)]
    copies = outputs.copy_out(sources)
    for c, src in zip(copies, sources):
        assert c.dtype == src.dtype and c.stride() == src.clone().stride() and torch.equal(c, src)
        assert c.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    form = "clone" if mode == "clone" or (mode == "auto" and outputs._foreach_clone is not None) else "copy"
    assert sorted(calls, key=str) == sorted([(form, (torch.int64,) * 2), (form, (torch.float32,) * 3),
                                             (form, (torch.float64,))], key=str)
    calls.clear()
    outputs.copy_out(sources[1:3] + sources[5:])  # one dtype: one call, no grouping
    assert calls == [(form, (torch.float32,) * 3)]


def _python_ptrs_equal(tensors, ptrs, indices):
    assert all(type(a) is list for a in (tensors, ptrs, indices))  # as strict as the C++ binding
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


@pytest.mark.parametrize("check", ["python", "cached"])
def test_parameter_replaced_recaptures_and_load_state_dict_does_not(check, monkeypatch):
    """"cached": the key reuses the parameters' part while one comparison says no address changed
    (PyTorch's C++ comparison on CUDA builds; a Python stand-in here, counted)."""
    from cgbackend.runtime import params
    calls = []
    if check == "cached":
        monkeypatch.setattr(params, "ptrs_equal", lambda *a: calls.append(1) or _python_ptrs_equal(*a))
    else:
        monkeypatch.setattr(params, "ptrs_equal", None)
    model = build_model("dense").eval()
    x = make_inputs("dense", model, n=1)[0]
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        compiled(x), compiled(x)
        assert cgbackend.stats(compiled)["graphs_captured"] == 1
        # Kept: a new weight allocated at a freed one's address would be that graph's key again
        # (a valid replay, not the new capture this test counts).
        replaced = [model.lm_head.weight.data]
        model.lm_head.weight.data = torch.randn_like(model.lm_head.weight)
        assert torch.equal(compiled(x), model(x))
        assert cgbackend.stats(compiled)["graphs_captured"] == 2
        model.load_state_dict({k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()})
        assert torch.equal(compiled(x), model(x))
        assert cgbackend.stats(compiled)["graphs_captured"] == 2
        replaced.append(model.lm_head.weight.data)
        model.lm_head.weight.data = torch.randn_like(model.lm_head.weight)  # a second move, cached or not
        assert torch.equal(compiled(x), model(x))
        assert cgbackend.stats(compiled)["graphs_captured"] == 3
    assert (len(calls) >= 4) == (check == "cached"), calls


def test_graph_limit_falls_back_with_reason():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    # dynamic=True: one Dynamo graph for every batch size, so one region sees several signatures.
    # No bucketing and no eviction: every new size is its own signature.
    compiled = cgbackend.compile(model, dynamic=True, max_graphs_per_region=1, graph_cache="keep",
                                 capture_sizes=(), **SIM)
    with torch.no_grad():
        for n in (4, 4, 5, 5, 5, 6, 6):
            x = torch.randn(n, 8)
            assert torch.equal(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == 1
    # Each new size warms up once; its later calls would need a second graph.
    assert st["eager_calls"] == {"warmup": 3, "graph_limit": 3}


def _failing_capture(monkeypatch, region_suffix="S0"):
    real = Capturer.capture

    def capture(self, fn, pool, restore=(), hooks=None, **kwargs):
        raise CaptureError("RuntimeError: injected failure")
    monkeypatch.setattr(Capturer, "capture", capture)
    return real


def test_capture_failure_falls_back_and_is_reported(monkeypatch):
    _failing_capture(monkeypatch)
    model = build_model("dense").eval()
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for x in make_inputs("dense", model, n=4):
            assert torch.equal(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    assert [f["error"] for f in st["capture_failures"]] == ["RuntimeError: injected failure"]
    assert st["eager_calls"]["capture_failed"] == 3
    report = cgbackend.report(compiled)
    runtime = report.graphs[0].runtime["regions"]
    assert any(r["disabled"] == "capture_failed" and "injected" in r["disabled_detail"] for r in runtime.values())


def test_capture_failure_strict_raises(monkeypatch):
    _failing_capture(monkeypatch)
    model = build_model("dense").eval()
    compiled = cgbackend.compile(model, strict=True, **SIM)
    x = make_inputs("dense", model, n=1)[0]
    with torch.no_grad():
        compiled(x)
        with pytest.raises(RuntimeError, match="injected failure"):
            compiled(x)


class _MutatesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, state):
        state.mul_(0.5).add_(self.lin(x))
        return torch.tanh(state) * 2


def test_region_writing_a_caller_tensor_writes_it_back():
    model = _MutatesInput().eval()
    compiled = cgbackend.compile(model, **SIM)
    ref_state, my_state = torch.randn(4, 8), None
    my_state = ref_state.clone()
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 8)
            assert torch.equal(compiled(x, my_state), model(x, ref_state))
            assert torch.equal(my_state, ref_state)
    assert cgbackend.stats(compiled)["copy_backs"] >= 1


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_training_matches_eager_bitwise(name):
    base = build_model(name).train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, **SIM)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.1)
    for step, x in enumerate(make_inputs(name, base, n=5, seed=3)):
        for model, fn, opt in ((ref, ref, opt_ref), (mine, compiled, opt_mine)):
            opt.zero_grad(set_to_none=step % 2 == 0)
            torch.manual_seed(step)
            loss = _loss(name, fn(x), x)
            loss.backward()
            opt.step()
            if model is ref:
                ref_loss = loss.detach()
        assert torch.equal(loss.detach(), ref_loss)
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a, b)
    st = cgbackend.stats(compiled)
    assert st["fwd_graphs"] == st["bwd_graphs"] == st["static_regions"]
    assert st["fwd_replays"] == st["bwd_replays"] == 4 * st["static_regions"]
    assert st["eager_calls"] == {"warmup": st["static_regions"]}


@pytest.mark.parametrize("pattern", ["sum", "two_then_backward"])
def test_outstanding_forwards_use_separate_slots(pattern):
    base = build_model("moe").train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, **SIM)
    batches = make_inputs("moe", base, n=9, seed=4)
    for step in range(3):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad()
            losses = [_loss("moe", fn(x), x) for x in batches[3 * step: 3 * step + 3]]
            if pattern == "sum":
                sum(losses).backward()
            else:
                for loss in losses:
                    loss.backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad)
    st = cgbackend.stats(compiled)
    assert st["fwd_graphs"] == 3 * st["static_regions"]  # three forwards in flight: three slots
    assert st["pending_forwards"] == 0
    assert st["eager_calls"] == {"warmup": st["static_regions"]}


def test_pending_forward_limit_runs_eagerly():
    base = build_model("dense").train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, max_pending_forwards=1, **SIM)
    batches = make_inputs("dense", base, n=6, seed=4)
    for step in range(3):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad()
            sum(_loss("dense", fn(x), x) for x in batches[2 * step: 2 * step + 2]).backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad)
    st = cgbackend.stats(compiled)
    # Step 0 starts with the warm-up call; steps 1 and 2 each have one forward beyond the limit.
    assert st["eager_calls"]["pending_forwards_limit"] == 2
    assert st["fwd_graphs"] == 1


def test_backward_after_slot_reuse_raises():
    model = build_model("dense").train()
    compiled = cgbackend.compile(model, **SIM)
    x, y = make_inputs("dense", model, n=2)
    compiled(x).sum().backward()  # warm-up
    out = compiled(x)
    loss = out.float().pow(2).mean()
    loss.backward(retain_graph=True)
    compiled(y).sum().backward()  # reuses the slot of the retained graph
    with pytest.raises(RuntimeError, match="memory was reused"):
        loss.backward()


def test_inference_graph_older_than_pending_training_forward_is_captured_again():
    """Eval graphs captured first share the pool with training graphs captured later: replaying an
    eval graph while a training forward waits for its backward could clobber saved activations, so
    it is captured again after them (then the pending backward still gets its gradients right)."""
    model = build_model("dense")
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, **SIM)
    x, y = make_inputs("dense", model, n=2)
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            compiled(y)
    model.train()
    ref.train()
    compiled(x).sum().backward()
    compiled(x).sum().backward()  # training graphs captured (newer than the eval graph)
    out = compiled(x)  # pending forward
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert torch.equal(compiled(y), ref(y))
    st = cgbackend.stats(compiled)
    assert st["graphs_recaptured"] == 1 and "replay_order_hazard" not in st["eager_calls"]
    model.train()
    ref.train()
    model.zero_grad()
    out.float().pow(2).mean().backward()
    ref(x).float().pow(2).mean().backward()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_inductor_inner_compiler(train):
    base = build_model("dense").train(train)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, inner="inductor", **SIM)
    for x in make_inputs("dense", base, n=4, seed=8):
        if not train:
            with torch.no_grad():
                torch.testing.assert_close(compiled(x), ref(x), rtol=1e-5, atol=1e-5)
            continue
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad()
            _loss("dense", fn(x), x).backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)
    st = cgbackend.stats(compiled)
    assert st["replays"] == 3 * (2 if train else 1)
    assert st["eager_calls"] == {"warmup": 1}


def test_inductor_inner_needs_warmup():
    with pytest.raises(cgbackend.ConfigError, match="warmup >= 1"):
        cgbackend.backend(inner="inductor", warmup=0)


def _train_pair(name="dense"):
    base = build_model(name).train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    return ref, mine, cgbackend.compile(mine, **SIM)


def test_parameter_gradients_are_handed_over_without_copies():
    ref, mine, compiled = _train_pair()
    for x in make_inputs("dense", ref, n=5, seed=6):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            _loss("dense", fn(x), x).backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad)
    st = cgbackend.stats(compiled)
    assert st["bwd_replays"] == 4  # every call after the warm-up one
    assert "grad_reclaimed" not in st["copied_by_kind"]
    assert st["eager_calls"] == {"warmup": 1}


def test_accumulating_into_an_aliased_grad_takes_a_copy_first():
    ref, mine, compiled = _train_pair()
    xs = make_inputs("dense", ref, n=6, seed=6)
    for model, fn in ((ref, ref), (mine, compiled)):
        for i, x in enumerate(xs):
            # Calls 0 (warm-up) and 1 (capture) start from .grad = None, so after call 1 .grad is
            # the graph's own gradient buffer; calls 2..5 accumulate into it.
            if i < 2:
                model.zero_grad(set_to_none=True)
            _loss("dense", fn(x), x).backward()
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    assert cgbackend.stats(compiled)["copied_by_kind"]["grad_reclaimed"] > 0


def test_gradients_kept_by_the_user_are_never_overwritten():
    ref, mine, compiled = _train_pair()
    xs = make_inputs("dense", ref, n=5, seed=6)
    kept, expected = [], []
    for x in xs:
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            _loss("dense", fn(x), x).backward()
        kept.append([p.grad for p in mine.parameters()])  # no clone: the user keeps the tensors
        expected.append([p.grad.clone() for p in ref.parameters()])
    for got, want in zip(kept, expected):
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    # Held gradients make the graphs that could overwrite them run eagerly: the next forward
    # (captured before the backward graph, counted as replay_order_hazard) or the backward itself.
    calls = cgbackend.stats(compiled)["eager_calls"]
    assert calls.get("replay_order_hazard", 0) + calls.get("gradient_still_held", 0) >= 1


def test_autograd_grad_results_survive_later_backwards():
    ref, mine, compiled = _train_pair()
    xs = make_inputs("dense", ref, n=5, seed=6)
    results = []
    for x in xs:
        results.append((torch.autograd.grad(_loss("dense", compiled(x), x), list(mine.parameters())),
                        torch.autograd.grad(_loss("dense", ref(x), x), list(ref.parameters()))))
    for got, want in results:
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_out_of_memory_while_preparing_a_capture_falls_back(monkeypatch):
    """The static input buffers are allocated before the capture: running out of memory there is a
    capture failure like any other (the GPU version of this test squeezes real memory)."""
    from cgbackend.runtime import recorder as region_module

    def no_memory(value, layout):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 MiB")
    monkeypatch.setattr(region_module, "input_buffer", no_memory)
    model = build_model("dense").eval()
    compiled = cgbackend.compile(model, **SIM)
    with torch.no_grad():
        for x in make_inputs("dense", model, n=3):
            assert torch.equal(compiled(x), model(x))
    st = cgbackend.stats(compiled)
    assert [f["error"].split(":")[0] for f in st["capture_failures"]] == ["OutOfMemoryError"]
    assert st["eager_calls"]["capture_failed"] == 2


def _real_tensors() -> int:
    import gc
    from torch._subclasses.fake_tensor import FakeTensor
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and not isinstance(o, FakeTensor))


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_training_backend_leaves_no_tensors_behind(name):
    """Dropped and reset, a training backend frees every tensor it made: static buffers, outputs
    and the autograd graph its captures recorded. Saved-tensor hooks that handed autograd the
    tensor itself made a node that saves its own output hold it in a cycle through C++, which
    Python's collector cannot break (on the GPU: 28 MiB per backend on the MoE reference model)."""
    model = build_model(name).train()
    xs = make_inputs(name, model, n=4, seed=3)
    before = _real_tensors()
    compiled = cgbackend.compile(model, **SIM)
    for x in xs:
        _loss(name, compiled(x), x).backward()
    st = cgbackend.stats(compiled)
    assert st["bwd_replays"] == 3 * st["static_regions"] > 0
    model.zero_grad(set_to_none=True)
    del compiled
    torch._dynamo.reset()
    cgbackend.reset()
    assert _real_tensors() == before


def test_double_backward_fails_with_a_clear_error():
    """A graphed backward has no autograd history: create_graph=True through it must say so, not
    fail later with autograd's generic 'does not require grad'."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    compiled = cgbackend.compile(model, **SIM)
    x = torch.randn(4, 8, requires_grad=True)
    (g,) = torch.autograd.grad(compiled(x).sum(), x, create_graph=True)  # warm-up: eager, fine
    torch.autograd.grad(g.pow(2).sum(), x)
    x2 = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True .* not supported"):
        torch.autograd.grad(compiled(x2).sum(), x2, create_graph=True)
    (g2,) = torch.autograd.grad(compiled(x2).sum(), x2)  # a plain backward still replays
    (want,) = torch.autograd.grad(model(x2).sum(), x2)
    assert torch.equal(g2, want)
    assert cgbackend.stats(compiled)["bwd_replays"] >= 1


def test_a_graph_with_nothing_to_capture_runs_as_one_eager_call(monkeypatch):
    """A graph whose every region is dynamic (here one activation: too small a region to capture,
    as a MoE loop body's activation is when Dynamo compiles it as a frame of its own, once per
    expert) runs its graph in one call, not region by region; its calls are still counted, and
    outputs and gradients are eager's."""
    from cgbackend.runtime.executor import CompiledGraph
    walked = []
    original = CompiledGraph._call
    monkeypatch.setattr(CompiledGraph, "_call", lambda self, args: walked.append(self.index) or original(self, args))
    act = nn.SiLU()
    compiled = cgbackend.compile(act, **SIM)
    g = torch.Generator().manual_seed(7)
    for rows in (5, 9, 5, 12):
        x = torch.randn(rows, 8, generator=g, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out = compiled(x)
        ref = act(x_ref)
        assert torch.equal(out, ref)
        out.sum().backward()
        ref.sum().backward()
        assert torch.equal(x.grad, x_ref.grad)
    st = cgbackend.stats(compiled)
    assert st["static_regions"] == 0 and st["dynamic_regions"] >= 1, st
    assert st["graph_calls"] == 4 and not walked, (st, walked)
