"""GPU: training through forward and backward CUDA graphs matches eager (loss and every gradient)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.api import find_backend
from cgbackend.runtime.capture import clear_blas_workspaces
from cgbackend.models import MODEL_NAMES, build_model, is_language_model, make_inputs

from cuda_utils import assert_matches, lm_loss, vec_loss

pytestmark = pytest.mark.cuda


def _loss(name, out, x):
    return lm_loss(out, x) if is_language_model(name) else vec_loss(out)


def _pair(name, dtype=torch.float32, **options):
    base = build_model(name, size="tiny", device="cuda", dtype=dtype).train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    return ref, mine, cgbackend.compile(mine, **options)


def _settle():
    """Garbage collected, kernels done, cuBLAS workspaces and cached blocks dropped: what the
    allocator counts as allocated then is what is held."""
    gc.collect()
    torch.cuda.synchronize()
    clear_blas_workspaces()
    torch.cuda.empty_cache()


def _compare_grads(ref, mine, dtype, what):
    for (n, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
        assert (a.grad is None) == (b.grad is None), f"{what}: {n} grad presence differs"
        if a.grad is not None:
            assert_matches(b.grad, a.grad, dtype, f"{what}: grad of {n}")


# Dropout draws different random numbers inside graphs than eagerly; tested on its own below.
@pytest.mark.parametrize("name", [n for n in MODEL_NAMES if n != "dropout"])
def test_training_steps_match_eager(name):
    ref, mine, compiled = _pair(name, warmup=1)
    inputs = make_inputs(name, ref, n=5, device="cuda", seed=5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.05)
    for step, x in enumerate(inputs):
        set_to_none = step % 2 == 0
        opt_ref.zero_grad(set_to_none=set_to_none)
        opt_mine.zero_grad(set_to_none=set_to_none)
        loss_ref = _loss(name, ref(x), x)
        loss_ref.backward()
        loss = _loss(name, compiled(x), x)
        loss.backward()
        assert_matches(loss.detach(), loss_ref.detach(), torch.float32, f"{name} loss step {step}")
        _compare_grads(ref, mine, torch.float32, f"{name} step {step}")
        opt_ref.step()
        opt_mine.step()
    st = cgbackend.stats(compiled)
    regions = st["static_regions"]
    assert st["fwd_graphs"] >= 1 and st["bwd_graphs"] == st["fwd_graphs"]
    assert st["bwd_replays"] == st["fwd_replays"] > 0
    assert st["eager_calls"].keys() <= {"warmup"}, st["eager_calls"]
    assert st["graphs_captured"] <= 2 * regions
    assert st["copied_by_kind"].get("param", 0) == 0


@pytest.mark.parametrize("pattern", ["each", "sum", "two_then_backward"])
def test_gradient_accumulation(pattern):
    name = "moe"
    ref, mine, compiled = _pair(name, warmup=1)
    batches = make_inputs(name, ref, n=12, device="cuda", seed=7)
    for step in range(3):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            micro = batches[4 * step: 4 * step + 4]
            if pattern == "each":
                for x in micro:
                    _loss(name, fn(x), x).backward()
            elif pattern == "sum":
                sum(_loss(name, fn(x), x) for x in micro).backward()
            else:
                losses = [_loss(name, fn(x), x) for x in micro[:2]]
                for loss in losses:
                    loss.backward()
                for x in micro[2:]:
                    _loss(name, fn(x), x).backward()
        _compare_grads(ref, mine, torch.float32, f"{pattern} step {step}")
    st = cgbackend.stats(compiled)
    assert st["bwd_replays"] > 0
    if pattern == "each":
        assert st["fwd_graphs"] == st["static_regions"]  # one slot suffices
    else:
        assert st["fwd_graphs"] > st["static_regions"]  # outstanding forwards got their own graphs
    assert st["pending_forwards"] == 0


def test_autocast_bf16_training():
    name = "moe"
    ref, mine, compiled = _pair(name, warmup=1)
    inputs = make_inputs(name, ref, n=4, device="cuda", seed=11)
    for x in inputs:
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = fn(x)
            _loss(name, out, x).backward()
        _compare_grads(ref, mine, torch.bfloat16, "autocast")
    assert cgbackend.stats(compiled)["bwd_replays"] > 0


def test_eval_then_train_then_eval():
    name = "dense"
    ref, mine, compiled = _pair(name, warmup=1)
    xs = make_inputs(name, ref, n=3, device="cuda", seed=2)
    for phase in ("eval", "train", "eval", "train"):
        ref.train(phase == "train")
        mine.train(phase == "train")
        for x in xs:
            if phase == "eval":
                with torch.no_grad():
                    assert_matches(compiled(x), ref(x), torch.float32, phase)
            else:
                ref.zero_grad(set_to_none=True)
                mine.zero_grad(set_to_none=True)
                _loss(name, ref(x), x).backward()
                _loss(name, compiled(x), x).backward()
                _compare_grads(ref, mine, torch.float32, phase)
    assert cgbackend.stats(compiled)["eager_calls"].keys() <= {"warmup"}


class _DropLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)

    def forward(self, x):
        return F.dropout((x @ self.w).abs() + 0.5, p=0.3, training=self.training)


def test_dropout_training_same_mask_forward_and_backward():
    model = _DropLinear().cuda().train()
    compiled = cgbackend.compile(model, warmup=1)
    masks = []
    for step in range(4):
        x = torch.randn(32, 64, device="cuda")
        model.zero_grad(set_to_none=True)
        out = compiled(x)
        out.sum().backward()
        keep = (out != 0).float()
        masks.append(keep)
        # d(sum(dropout(|xW| + .5)))/dW = x^T @ (keep / (1 - p) * sign(xW))
        expected = x.t() @ (keep / 0.7 * torch.sign(x @ model.w.detach()))
        assert_matches(model.w.grad, expected, torch.float32, f"dropout grad step {step}")
    assert not torch.equal(masks[-1], masks[-2])
    assert cgbackend.stats(compiled)["bwd_replays"] >= 2
    # A region that draws random numbers cannot compute its forward again: no donated buffers.
    from cgbackend.runtime.inner import donating
    assert not any(donating(f) for f in _compiled_calls(compiled))


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_inductor_inner_compiler_on_gpu(name, train):
    ref, mine, compiled = _pair(name, warmup=1, inner="inductor")
    ref.train(train)
    mine.train(train)
    for step, x in enumerate(make_inputs(name, ref, n=4, device="cuda", seed=13)):
        if not train:
            with torch.no_grad():
                assert_matches(compiled(x), ref(x), torch.float32, f"inductor infer {step}")
            continue
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            _loss(name, fn(x), x).backward()
        _compare_grads(ref, mine, torch.float32, f"inductor train {step}")
    st = cgbackend.stats(compiled)
    assert st["capture_failures"] == []
    assert st["eager_calls"].keys() <= {"warmup"}, st["eager_calls"]
    assert st["replays"] > 0


def test_gradients_handed_over_and_never_overwritten_on_gpu():
    name = "dense"
    ref, mine, compiled = _pair(name, warmup=1)
    kept, expected = [], []
    for x in make_inputs(name, ref, n=5, device="cuda", seed=17):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            _loss(name, fn(x), x).backward()
        kept.append([p.grad for p in mine.parameters()])
        expected.append([p.grad.clone() for p in ref.parameters()])
    for step, (got, want) in enumerate(zip(kept, expected)):
        for g, w in zip(got, want):
            assert_matches(g, w, torch.float32, f"kept grad step {step}")
    st = cgbackend.stats(compiled)
    assert st["bwd_replays"] >= 1
    calls = st["eager_calls"]  # the graphs that could overwrite held gradients ran eagerly
    assert calls.get("replay_order_hazard", 0) + calls.get("gradient_still_held", 0) >= 1


def test_between_steps_the_graphs_hold_what_the_report_says():
    """After the capture step the saved activations are released into the pool: between steps the
    allocator counts the parameters' gradients and the static buffers (stats()["memory"]["held"]),
    not the activations; the steps still match eager (the backward reads the released blocks)."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=2)
    xs = [torch.randn(512, 1024, device="cuda") for _ in range(6)]
    # cuBLAS keeps a workspace per thread and stream (32 MiB on Hopper), made at the first product
    # of each: dropped at both ends, or the figure depends on what ran in this process before; so
    # is the garbage of earlier tests, collected first (its release would count against this one).
    gc_sync = _settle
    gc_sync()
    start = torch.cuda.memory_allocated()
    for x in xs:
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            fn(x).pow(2).mean().backward()
        _compare_grads(ref, mine, torch.float32, "step")
        ref.zero_grad(set_to_none=True)
    gc_sync()
    held = torch.cuda.memory_allocated() - start
    mem = cgbackend.stats(compiled)["memory"]
    activations = 512 * 4096 * 4  # the first linear's output at least (Inductor may recompute the GELU)
    assert mem["saved"] == 0 and mem["released"] >= activations + mem["released_inputs"]
    # The input needs no gradient: its static buffer went to the backward graph once the graph's
    # capture had read it (the first weight's gradient does), and the allocator agrees.
    assert mem["released_inputs"] == 512 * 1024 * 4 and mem["inputs"] == 0, mem
    assert abs(held - mem["held"]) <= 2**20, (held, mem)
    assert mem["held"] < sum(p.numel() * 4 for p in mine.parameters()) + activations


def _move(p, keep):
    """Re-allocate float32 parameter ``p`` with the same values (as FSDP2 does between forward and
    backward); ``keep`` holds the blocks taken so the new storage lands elsewhere."""
    values, old = p.detach().clone(), p.data_ptr()
    while p.data_ptr() == old:
        p.untyped_storage().resize_(0)
        keep.append(torch.empty(values.numel() * 4, dtype=torch.uint8, device="cuda"))
        p.untyped_storage().resize_(values.numel() * 4)
    with torch.no_grad():
        p.copy_(values)


def test_a_released_entry_whose_backward_cannot_replay_recomputes_its_forward():
    """After the capture step the saved activations are gone (the backward graph consumed them): a
    parameter re-allocated between forward and backward (as FSDP2 does) sends the backward to
    autograd through the forward computed again, and the gradients still equal eager's."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=2)
    keep = []
    for i in range(6):
        x = torch.randn(64, 256, device="cuda")
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            out = fn(x)
            if model is mine and i == 4:
                _move(mine[0].weight, keep)
            out.pow(2).mean().backward()
        _compare_grads(ref, mine, torch.float32, f"step {i}")
    st = cgbackend.stats(compiled)
    assert st["saved_released"] >= 1 and st["eager_calls"].get("param_moved", 0) >= 1
    assert st["bwd_recomputes"] == st["eager_calls"]["param_moved"]


class _ThreeOut(nn.Module):
    """``h`` read again in the region, ``y`` whose backward may read it (tanh), ``z`` only returned."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x):
        h = self.a(x)
        return h, torch.tanh(self.b(h)), self.b(h).relu() * 2


@pytest.mark.parametrize("inner", ["auto", "eager"])
def test_incoming_gradient_in_the_output_memory_on_gpu(inner):
    """The backward graph takes the incoming gradient of ``z`` into ``z``'s own static memory: every
    step's outputs (kept by the caller) and gradients still equal eager's, on varied inputs and
    incoming gradients, with Inductor's kernels and eager's."""
    torch.manual_seed(0)
    base = _ThreeOut().cuda().train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=1, inner=inner)
    kept, expected = [], []
    for step in range(5):
        x = torch.randn(64, 256, device="cuda")
        w = [torch.randn(64, 256, device="cuda") for _ in range(3)]
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            outs = fn(x)
            sum((o * g).sum() for o, g in zip(outs, w)).backward()
            (kept if model is mine else expected).append([o.detach() for o in outs])
        _compare_grads(ref, mine, torch.float32, f"step {step}")
    for step, (got, want) in enumerate(zip(kept, expected)):
        for g, e in zip(got, want):
            assert_matches(g, e, torch.float32, f"kept output step {step}")
    st = cgbackend.stats(compiled)
    (entry,) = [e for g in find_backend(compiled).compiled_graphs() for r in g.runners
                for e in r.cache.entries.values()]
    # z always; y where the backward does not read tanh's result (Inductor may recompute it)
    assert 2 in entry.grad_out_shared and 0 not in entry.grad_out_shared
    if inner == "eager":
        assert entry.grad_out_shared == {2}
    assert st["grad_outputs_shared"] == len(entry.grad_out_shared) and st["bwd_replays"] == 4, st
    assert st["eager_calls"].keys() <= {"warmup"}, st["eager_calls"]
    # The pool's last (and only) backward capture released those buffers: Inductor's backward took
    # each as its own argument, eager's kernels had them freed after the capture (tangents.py).
    nbytes = {i: entry.outputs[i].untyped_storage().nbytes() for i in entry.grad_out_shared}
    assert entry.released_out == nbytes and st["grad_outputs_released"] == len(nbytes), st
    assert st["grad_outputs_released_in_capture"] == (len(nbytes) if inner == "auto" else 0), st
    mem = st["memory"]
    assert mem["released_outputs"] == sum(nbytes.values()) and mem["released"] >= sum(nbytes.values()), mem
    # The caller's copies relayed their incoming gradients, dropped once copied into the backward
    # graph's buffers (4 steps with graphs, 3 copied outputs each; and y, z in the warm-up call).
    assert st["grads_relayed"] >= 14 and st["grads_relayed_freed_early"] >= 12, st


class _WithCounts(nn.Module):
    """An output without a gradient that only the caller reads (a count per row)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)

    def forward(self, x):
        return self.a(x).relu(), (x > 0).sum(-1)


def test_an_output_without_gradient_goes_to_the_last_backward_graph():
    """The memory of an output without a gradient that only the caller reads is the pool's last
    backward graph's once captured: the caller's copies of it stay right, step after step."""
    torch.manual_seed(0)
    base = _WithCounts().cuda().train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=1)
    kept, expected = [], []
    for step in range(5):
        x = torch.randn(1024, 256, device="cuda")
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            y, counts = fn(x)
            y.pow(2).mean().backward()
            (kept if model is mine else expected).append(counts)
        _compare_grads(ref, mine, torch.float32, f"step {step}")
    for step, (got, want) in enumerate(zip(kept, expected)):
        assert torch.equal(got, want), f"kept counts of step {step}"
    (entry,) = [e for g in find_backend(compiled).compiled_graphs() for r in g.runners
                for e in r.cache.entries.values()]
    nbytes = entry.outputs[1].untyped_storage().nbytes()
    assert entry.nondiff_loose == {1} and entry.released_out.get(1) == nbytes, entry.released_out
    st = cgbackend.stats(compiled)
    assert st["memory"]["released_outputs"] == sum(entry.released_out.values()), st["memory"]
    assert st["bwd_replays"] == 4 and st["eager_calls"].keys() <= {"warmup"}, st


class _Head(nn.Module):
    """A wide output (its incoming gradient 32 MiB) whose backward reads that gradient first, then
    allocates as much again for the layers below."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(4096, 4096) for _ in range(3))

    def forward(self, x):
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


def _backward_capture_peak(keep_buffer: bool) -> tuple[int, dict]:
    """The allocator's peak inside the backward capture (warm-up 1: the second step's second
    capture), with the released gradient buffer given to the compiled backward, or
    (``keep_buffer``) kept by the capture until it is over. Inside it, not over the whole backward:
    the incoming gradient, copied into that buffer first, goes before the capture starts."""
    from cgbackend.runtime import tangents
    from cgbackend.runtime.capture import Capturer
    torch.manual_seed(0)
    model = _Head().cuda().train()
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, warmup=1)
    xs = [torch.randn(2048, 4096, device="cuda") for _ in range(3)]
    give, capture, peaks = tangents.OwnerTransfer.give, Capturer.capture, []

    def measured(self, *args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            return capture(self, *args, **kwargs)
        finally:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - before)
    Capturer.capture = measured
    if keep_buffer:
        tangents.OwnerTransfer.give = lambda self, args: None
    try:
        for step, x in enumerate(xs):
            for m, fn in ((ref, ref), (model, compiled)):
                m.zero_grad(set_to_none=True)
                fn(x).float().pow(2).mean().backward()
            _compare_grads(ref, model, torch.float32, f"step {step}")
    finally:
        tangents.OwnerTransfer.give, Capturer.capture = give, capture
    assert len(peaks) == 2, peaks  # the forward's capture, then the backward's
    return peaks[1], cgbackend.stats(compiled)


def test_the_backward_capture_frees_the_incoming_gradient_at_its_last_read():
    """The backward capture peaks one gradient buffer lower when the compiled backward owns it
    (freed after its last read, its block reused by the layers below) than when the capture holds
    it to the end; both give eager's gradients, and both release it between steps."""
    given, st_given = _backward_capture_peak(keep_buffer=False)
    kept, st_kept = _backward_capture_peak(keep_buffer=True)
    block = 2048 * 4096 * 4
    assert st_given["grad_outputs_released_in_capture"] == 1 and st_kept["grad_outputs_released_in_capture"] == 0
    for st in (st_given, st_kept):
        assert st["grad_outputs_released"] == 1 and st["memory"]["released_outputs"] == block, st["memory"]
        assert st["bwd_replays"] == 2 and st["eager_calls"].keys() <= {"warmup"}, st
    assert kept - given >= block // 2, (kept, given)


def _mlp(width=2048):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, width), nn.GELU(), nn.Linear(width, width), nn.SiLU(),
                         nn.Linear(width, 512)).cuda().train()


def _eager_grads(base, xs):
    ref = copy.deepcopy(base)
    expected = []
    for x in xs:
        ref.zero_grad(set_to_none=True)
        ref(x).pow(2).mean().backward()
        expected.append([p.grad.clone() for p in ref.parameters()])
    return expected


def _steps(compiled, mine, xs, expected, what):
    for step, (x, want) in enumerate(zip(xs, expected)):
        mine.zero_grad(set_to_none=True)
        compiled(x).pow(2).mean().backward()
        for (name, p), w in zip(mine.named_parameters(), want):
            assert_matches(p.grad, w, torch.float32, f"{what} step {step}: grad of {name}")


def _compiled_calls(compiled):
    from cgbackend.runtime.inner import compiled_call
    return [compiled_call(r.code.fn) for g in find_backend(compiled).compiled_graphs() for r in g.runners]


def test_a_training_warmup_forward_leaves_no_blas_workspace_for_its_backward():
    """A training warm-up forward drops the cuBLAS workspaces its products made: its backward
    (autograd's thread, a workspace of its own) does not peak next to the forward's. Probe: what
    clearing the workspaces frees right after the forward (an eager forward leaves one)."""
    model = _mlp()
    compiled = cgbackend.compile(model, warmup=2)
    x = torch.randn(256, 512, device="cuda")

    def workspace_after(fn):
        torch.cuda.synchronize()
        clear_blas_workspaces()
        out = fn(x)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        clear_blas_workspaces()
        freed = before - torch.cuda.memory_allocated()
        out.pow(2).mean().backward()
        return freed

    assert workspace_after(model) > 0  # the probe sees an eager forward's workspace
    model.zero_grad(set_to_none=True)
    for _ in range(2):
        assert workspace_after(compiled) == 0
        model.zero_grad(set_to_none=True)
    assert cgbackend.stats(compiled)["eager_calls"]["warmup"] == 2


def test_donated_buffers_lower_the_peak_and_keep_eagers_gradients():
    """Inductor's backward writes into saved activations it has read (AOT autograd's donated
    buffers, as under torch.compile), in the warm-up steps and in the backward graph: every step's
    gradients equal eager's, on varied inputs, and the peak is below the same training compiled
    without donation."""
    from cgbackend.runtime.inner import donating

    base = _mlp()
    xs = [torch.randn(2048, 512, device="cuda") for _ in range(6)]
    expected = _eager_grads(base, xs)
    gc_sync = _settle
    peaks = {}
    for donate in (False, True):
        mine = copy.deepcopy(base)
        with torch._functorch.config.patch(donated_buffer=donate):
            compiled = cgbackend.compile(mine, warmup=2)
            gc_sync()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            _steps(compiled, mine, xs, expected, f"donate={donate}")
            torch.cuda.synchronize()
            peaks[donate] = torch.cuda.max_memory_allocated() - start
        fns = _compiled_calls(compiled)
        assert fns and all(donating(f) is donate for f in fns), donate
        st = cgbackend.stats(compiled)
        assert st["bwd_replays"] >= 3 and st["capture_failures"] == []
        assert st["eager_calls"].keys() <= {"warmup"}, st["eager_calls"]
        del compiled, mine
    assert peaks[True] < peaks[False], peaks


def test_code_compiled_before_with_donated_buffers_compiles_its_backward_on_a_recomputed_forward():
    """The same region compiled a second time in the process comes from AOT autograd's cache with
    a backward that donates whatever kind of backward runs first. With no warm-up backward, the
    first backward of that code runs before the backward graph is captured; on the captured
    forward's saved tensors it would overwrite what the graph's first replay reads. It runs on the
    forward computed again, and every step still equals eager."""
    base = _mlp(1536)
    xs = [torch.randn(1024, 512, device="cuda") for _ in range(5)]
    expected = _eager_grads(base, xs)
    first = copy.deepcopy(base)
    _steps(cgbackend.compile(first, warmup=1), first, xs, expected, "first instance")
    mine = copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=1)
    out = compiled(xs[0])  # the warm-up call, whose backward never runs
    del out
    # Step 0 captures; its backward is the first of Inductor's backward code outside a capture.
    _steps(compiled, mine, xs, expected, "second instance")
    st = cgbackend.stats(compiled)
    assert st["bwd_graphs"] >= 1 and st["bwd_replays"] >= 4 and st["bwd_recomputes"] == 0, st


@pytest.mark.parametrize("first", ["plain", "retain_graph"])
def test_two_backwards_through_one_forward_on_gpu(first):
    """``loss.backward(retain_graph=True)`` then a second backward through the same forward, every
    step but the last. The region's backward graph would write over what it reads (saved
    activations it consumed, the static input it was given, donated buffers), so those backwards
    run on the forward computed again, and both add up to eager's gradients; the last step's lone
    backward replays the graph. ``first``: whether the first backward ever run (warm-up) keeps
    its graph (then AOT autograd compiles a backward that does not donate; its cache is off here,
    or code cached by another test would donate and refuse that backward, as under
    torch.compile)."""
    base = _mlp(1024 if first == "plain" else 768)
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    caches = torch._inductor.config.patch(force_disable_caches=first == "retain_graph")
    with caches:
        compiled = cgbackend.compile(mine, warmup=1)
        for step in range(7):
            x = torch.randn(1024, 512, device="cuda")
            for model, fn in ((ref, ref), (mine, compiled)):
                model.zero_grad(set_to_none=True)
                loss = fn(x).pow(2).mean()
                if step == 6 or (step == 0 and first == "plain"):
                    loss.backward()
                    continue
                loss.backward(retain_graph=True)
                (3 * loss).backward()
            _compare_grads(ref, mine, torch.float32, f"{first} step {step}")
    st = cgbackend.stats(compiled)
    # Steps 1-5: two backwards each on the forward computed again (no backward graph yet: the
    # capture waits for a lone backward); step 6 captures it and replays.
    assert st["eager_calls"].get("retained_graph_backward", 0) == 10, st["eager_calls"]
    assert st["bwd_graphs"] == 1 and st["bwd_replays"] == 1 and st["capture_failures"] == [], st


def _bn_mlp():
    """Batch norm in training mode writes its running statistics (inputs of the region) in place:
    the region cannot compute its forward again, so its saved activations are loosened."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 2048), nn.BatchNorm1d(2048), nn.GELU(), nn.Linear(2048, 512)).cuda().train()


def _runners(compiled):
    return [r for g in find_backend(compiled).compiled_graphs() for r in g.runners if r.cache.entries]


def _compare_bn(ref, mine, what):
    _compare_grads(ref, mine, torch.float32, what)
    for name in ("running_mean", "running_var"):
        assert_matches(getattr(mine[1], name), getattr(ref[1], name), torch.float32, f"{what}: {name}")


@pytest.mark.parametrize("inner", ["inductor", "eager"])
def test_a_region_that_cannot_recompute_gives_its_saved_activations_to_the_backward_graph(inner):
    """Between steps, such a region held its saved activations for good; now the blocks are its
    backward graph's (released, counted), the allocator agrees, and every step still equals eager:
    the backward graph reads them at their addresses."""
    base = _bn_mlp()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=2, inner=inner)
    xs = [torch.randn(1024, 512, device="cuda") * (1 + step) for step in range(6)]
    gc_sync = _settle
    gc_sync()
    start = torch.cuda.memory_allocated()
    for step, x in enumerate(xs):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            fn(x).pow(2).mean().backward()
        _compare_bn(ref, mine, f"{inner} step {step}")
        ref.zero_grad(set_to_none=True)
    gc_sync()
    held = torch.cuda.memory_allocated() - start
    (runner,) = _runners(compiled)
    assert not runner.spec.recomputable
    st = cgbackend.stats(compiled)
    mem = st["memory"]
    assert st["saved_released"] == 1 and st["bwd_replays"] >= 3 and st["bwd_recomputes"] == 0, st
    assert set(st["eager_calls"]) <= {"warmup"}, st["eager_calls"]
    assert mem["saved"] == 0 and mem["released"] >= 1024 * 2048 * 4, mem
    assert abs(held - mem["held"]) <= 2**20, (held, mem)


def test_the_backwards_a_loosened_entry_cannot_replay_run_on_its_captured_forward():
    """A keep-graph backward and the one after it, and a backward after a parameter moved, run
    autograd through the captured forward on the saved tensors this forward replay wrote (the
    region cannot compute its forward again): all equal eager's. A second backward after a lone one
    raises, as eagerly."""
    base = _bn_mlp()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    compiled = cgbackend.compile(mine, warmup=1)
    keep = []
    for step in range(8):
        x = torch.randn(256, 512, device="cuda") + 0.1 * step
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            out = fn(x)
            if model is mine and step == 6:
                _move(mine[0].weight, keep)
            loss = out.pow(2).mean()
            if step in (4, 5):
                loss.backward(retain_graph=True)
                (2 * loss).backward()
            else:
                loss.backward()
        _compare_bn(ref, mine, f"step {step}")
    st = cgbackend.stats(compiled)
    # The forward after the move captures a second entry (the parameter's new address): both release.
    assert st["saved_released"] == 2 and st["bwd_recomputes"] == 0, st
    assert st["eager_calls"].get("retained_graph_backward", 0) == 4, st["eager_calls"]
    assert st["eager_calls"].get("param_moved", 0) == 1, st["eager_calls"]
    x = torch.randn(256, 512, device="cuda")
    for fn in (ref, compiled):
        out = fn(x)
        out.sum().backward()  # SumBackward saves nothing: the second backward reaches the region
        with pytest.raises(RuntimeError, match="second time"):
            out.sum().backward()
