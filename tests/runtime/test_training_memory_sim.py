"""Training entries free their saved activations once their backward graph exists (runtime/pool.py,
"Released memory"; runtime/backward.py), and the last region's inference outputs once captured
(runtime/loose_outputs.py): simulated graphs, against eager, on varied inputs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgbackend
from cgbackend.api import find_backend
from cgbackend.models import build_model, make_inputs
from cgbackend.runtime.inner import compiled_call, donating

SIM = dict(simulate_graphs=True, warmup=1, static_dispatch="off")


def _pair(model: nn.Module):
    ref, mine = copy.deepcopy(model), copy.deepcopy(model)
    return ref, mine, cgbackend.compile(mine, **SIM)


def _train_entries(compiled):
    return [e for g in find_backend(compiled).compiled_graphs() for r in g.runners
            for e in r.cache.entries.values() if hasattr(e, "bwd_graph")]


def _step(model, fn, x):
    model.zero_grad(set_to_none=True)
    fn(x).float().pow(2).mean().backward()


def test_saved_activations_are_freed_once_the_backward_graph_exists():
    ref, mine, compiled = _pair(build_model("dense").train())
    for i, x in enumerate(make_inputs("dense", ref, n=5, seed=11)):
        for model, fn in ((ref, ref), (mine, compiled)):
            _step(model, fn, x)
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad), i
        if i == 0:  # the warm-up call: nothing captured yet
            assert cgbackend.stats(compiled)["saved_released"] == 0
    st = cgbackend.stats(compiled)
    entries = _train_entries(compiled)
    assert entries and all(e.released and e.capture_outs is None for e in entries)
    assert st["saved_released"] == len(entries)
    assert st["saved_released_bytes"] == sum(e.saved_bytes for e in entries) > 0
    assert st["bwd_replays"] == 4 * len(entries) and st["bwd_recomputes"] == 0
    assert all(e.pool.sealed and e.pool.awaiting_backward == 0 for e in entries)


def test_a_backward_that_cannot_replay_recomputes_the_forward():
    """A parameter's storage re-allocated between forward and backward (as FSDP2 does): the
    backward graph would read the old address, so autograd runs through the forward computed again
    on the parameter's new memory; the next forward captures again, in a new pool (the released
    one takes no capture)."""
    ref, mine, compiled = _pair(build_model("dense").train())
    xs = make_inputs("dense", ref, n=5, seed=12)
    keep: list = []
    for i, x in enumerate(xs):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            out = fn(x)
            if model is mine and i == 3:
                _move_storage(next(mine.parameters()), keep)
            out.float().pow(2).mean().backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            assert torch.equal(a.grad, b.grad), i
    st = cgbackend.stats(compiled)
    assert st["eager_calls"].get("param_moved", 0) >= 1
    assert st["bwd_recomputes"] == st["eager_calls"]["param_moved"]
    pools = {id(e.pool) for e in _train_entries(compiled)}
    assert len(pools) == 2  # the graphs captured after the move are in a pool of their own


def _move_storage(p: torch.Tensor, keep_alive: list) -> None:
    """Free a parameter's bytes and gather its values again into a new allocation."""
    values, storage, old = p.detach().clone(), p.untyped_storage(), p.data_ptr()
    nbytes = storage.nbytes()
    while p.data_ptr() == old:
        storage.resize_(0)
        keep_alive.append(torch.empty(nbytes, dtype=torch.uint8))  # may take the freed place
        storage.resize_(nbytes)
    with torch.no_grad():
        p.copy_(values)


class _Dropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.nn.functional.dropout(self.a(x).relu(), 0.25, self.training))


def test_a_region_drawing_random_numbers_keeps_its_saved_activations():
    """Recomputing its forward would draw other numbers: it never releases."""
    torch.manual_seed(0)
    model = _Dropout().train()
    compiled = cgbackend.compile(model, **SIM)
    for i in range(4):
        model.zero_grad(set_to_none=True)
        compiled(torch.randn(8, 16)).pow(2).mean().backward()
    st = cgbackend.stats(compiled)
    assert st["bwd_replays"] >= 2
    assert st["saved_released"] == 0
    assert all(not e.released and e.capture_outs is not None for e in _train_entries(compiled))


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(self.a(x).relu())


def _bytes(*shapes) -> int:
    return sum(4 * torch.Size(s).numel() for s in shapes)


def test_memory_held_between_calls_is_reported_by_kind_and_adds_up():
    """A one-region float32 training model, [8, 16] inputs: what stats() and the report say each
    part holds, from the shapes; the saved activation (the relu's output) goes to ``released``."""
    torch.manual_seed(0)
    model = _Two().train()
    compiled = cgbackend.compile(model, **SIM)
    seen = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        out = compiled(torch.randn(8, 16))
        if i == 1:  # captured, its backward not yet: the saved activation is held
            seen.append(cgbackend.stats(compiled)["memory"])
        out.pow(2).mean().backward()
    before, after = seen[0], cgbackend.stats(compiled)["memory"]
    params = _bytes((32, 16), (32,), (16, 32), (16,))
    assert before["inputs"] == _bytes((8, 16)) and before["outputs"] == _bytes((8, 16))
    assert before["saved"] == _bytes((8, 32)) and before["grads"] == 0 and before["released"] == 0
    assert after["inputs"] == before["inputs"] and after["outputs"] == before["outputs"]
    assert after["saved"] == 0 and after["released"] == _bytes((8, 32)) and after["released_outputs"] == 0
    # The parameters' gradients; the incoming gradient lies in the output's memory (only the caller
    # reads the output, and it got a copy), so it adds nothing.
    assert after["grads"] == params and cgbackend.stats(compiled)["grad_outputs_shared"] == 1
    for mem in (before, after):
        assert mem["held"] == sum(mem[k] for k in ("inputs", "outputs", "saved", "grads"))
        assert mem["reserved"] == 0 and mem["by_size"] == {}  # simulated graphs reserve nothing
    regions = cgbackend.report(compiled).graphs[0].runtime["regions"]
    assert sum(r["memory"]["held"] for r in regions.values()) == after["held"]
    assert "MiB of saved activations released" in cgbackend.report(compiled).to_text()


class _TwoOut(nn.Module):
    """Three outputs: ``h`` the caller reads and the region uses again (for ``y``), ``y`` saved for
    its own backward (tanh's gradient reads its result) and ``z`` only the caller reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        y = torch.tanh(self.b(h))
        z = self.b(h).relu() * 2
        return h, y, z


def _shared_outputs(compiled) -> list:
    """Per training entry, the outputs whose memory the backward graph's incoming gradient uses."""
    out = []
    for e in _train_entries(compiled):
        pos = [k for k, i in enumerate(e.diff_out)
               if e.static_grad_outs[k].untyped_storage().data_ptr() == e.outputs[i].untyped_storage().data_ptr()]
        assert sorted(e.diff_out[k] for k in pos) == sorted(e.grad_out_shared)
        out.append(sorted(e.grad_out_shared))
    return out


def test_incoming_gradient_takes_the_memory_of_an_output_only_the_caller_reads():
    """Of three outputs, only the one that nothing in the graph reads again and that its backward
    does not need lends its memory to the incoming gradient; outputs and gradients equal eager's on
    varied inputs and incoming gradients, with the outputs of every step kept by the caller."""
    torch.manual_seed(0)
    ref = _TwoOut().train()
    mine = copy.deepcopy(ref)
    compiled = cgbackend.compile(mine, **SIM)
    kept, expected = [], []
    for i in range(5):
        x = torch.randn(8, 16)
        w = [torch.randn(8, 16) for _ in range(3)]
        results = []
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            outs = fn(x)
            sum((o * g).sum() for o, g in zip(outs, w)).backward()
            results.append(([o.detach() for o in outs], [p.grad for p in model.parameters()]))
        kept.append(results[1][0])
        expected.append(results[0][0])
        (ref_outs, ref_grads), (outs, grads) = results
        assert all(torch.equal(a, b) for a, b in zip(ref_outs + ref_grads, outs + grads)), i
        # Gradients held into the next forward would keep it from replaying (the replay-order rule)
        del results, grads, ref_grads
    for i, (got, want) in enumerate(zip(kept, expected)):  # each step's outputs, as the caller kept them
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
    assert _shared_outputs(compiled) == [[2]]
    st = cgbackend.stats(compiled)
    assert st["grad_outputs_shared"] == 1 and st["bwd_replays"] == 4 and st["bwd_recomputes"] == 0
    assert st["eager_calls"] == {"warmup": 1}


def _bucketed_dense(seed: int):
    """The dense reference model in inference with capture sizes 2, 4, 8 (simulated graphs), and
    ``make(n)``: token ids of ``n`` rows, dimension 0 dynamic, drawn from ``seed``."""
    model = build_model("dense").eval()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1, capture_sizes=(2, 4, 8))
    gen = torch.Generator().manual_seed(seed)

    def make(n):
        x = torch.randint(0, model.tok_emb.num_embeddings, (n, 16), generator=gen)
        torch._dynamo.mark_dynamic(x, 0)
        return (x,)

    return model, compiled, make


def test_memory_per_captured_size_adds_up_to_the_total():
    model, compiled, make = _bucketed_dense(seed=5)

    cgbackend.warm_up(compiled, make, sizes=[2, 4, 8])
    mem = cgbackend.stats(compiled)["memory"]
    by_size = mem["by_size"]
    assert sorted(by_size) == [2, 4, 8]
    assert by_size[2]["held"] < by_size[4]["held"] < by_size[8]["held"]  # buffers sized by the capture size
    for key in ("inputs", "outputs", "held"):
        assert sum(part[key] for part in by_size.values()) <= mem[key]
    regions = cgbackend.report(compiled).graphs[0].runtime["regions"]
    assert sum(r["memory"]["held"] for r in regions.values()) == mem["held"]
    for size, part in by_size.items():
        assert sum(r["memory_by_size"].get(size, {}).get("held", 0) for r in regions.values()) == part["held"]


def test_the_last_regions_inference_outputs_are_released_and_every_result_stays_eagers():
    """Bucketed inference of the dense model (one static region): once a size is captured, the
    runtime holds its outputs no more (``released``; runtime/loose_outputs.py) and a later capture
    may use that memory (simulated graphs: every other replay scribbles them). Every call's result,
    kept by the caller across calls of other sizes, equals eager's."""
    model, compiled, make = _bucketed_dense(seed=11)

    done = cgbackend.warm_up(compiled, make, sizes=[2, 8, 4])
    assert [r["size"] for r in done.sizes] == [8, 4, 2]  # largest first
    mem = cgbackend.stats(compiled)["memory"]
    logits = {n: 4 * n * 16 * model.tok_emb.num_embeddings for n in (2, 4, 8)}  # float32 [n, 16, vocab]
    assert mem["outputs"] == 0 and mem["released"] == sum(logits.values()), mem
    assert {n: (part["outputs"], part["released"]) for n, part in mem["by_size"].items()} == {
        n: (0, b) for n, b in logits.items()}
    assert mem["held"] == mem["inputs"] > 0 and mem["released_outputs"] == mem["released"]
    assert "MiB of outputs released" in cgbackend.report(compiled).to_text()
    assert "saved activations" not in cgbackend.summary(compiled)
    (entries,) = [r.cache.entries for g in find_backend(compiled).compiled_graphs() for r in g.runners]
    eight = next(e for e in entries.values() if e.size == 8)
    kept = []
    with torch.no_grad():
        for n in (3, 8, 6, 4, 7, 5, 2):
            (x,) = make(n)
            out, ref = compiled(x), model(x)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            kept.append((out, ref))
        assert torch.isnan(eight.outputs[0]).all()  # the last call (size 2) scribbled size 8's outputs
    for out, ref in kept:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    st = cgbackend.stats(compiled)
    assert st["graphs_captured"] == 3 and st["replays"] >= 7 and not st["eager_calls"].get("replay_order_hazard")


def test_regions_around_a_dynamic_one_release_after_every_backward_graph_exists():
    """The reference MoE with its dispatch as written: static regions on both sides of dynamic
    ones; every training entry of the pool releases once the pool's last backward graph exists."""
    ref, mine, compiled = _pair(build_model("moe").train())
    for i, x in enumerate(make_inputs("moe", ref, n=5, seed=13)):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(fn(x).flatten(0, 1), x.flatten()).backward()
        for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
            assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad)), (i, name)
    st = cgbackend.stats(compiled)
    entries = _train_entries(compiled)
    assert st["dynamic_regions"] >= 1 and len(entries) >= 2
    assert st["saved_released"] == len(entries) and all(e.released for e in entries)


def test_two_forwards_before_their_backward_share_the_pool_and_release():
    """Gradient accumulation that keeps two losses: the second forward uses call slot 1, its own
    graphs in the pool new captures go to, not one of the slot's own (the replay-order rule keeps
    graphs of one pool apart); the pools release the saved activations once their entries have
    their backward graphs, every call past warm-up replays, and the gradients equal eager's."""
    ref, mine, compiled = _pair(build_model("dense").train())
    xs = make_inputs("dense", ref, n=8, seed=14)
    for i in range(0, 8, 2):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            losses = [fn(x).float().pow(2).mean() for x in xs[i:i + 2]]
            (losses[0] + losses[1]).backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    entries = _train_entries(compiled)
    assert {e.slot for e in entries} == {0, 1} and {e.pool.slot for e in entries} == {0}
    stats = cgbackend.stats(compiled)
    assert all(e.released for e in entries) and stats["bwd_replays"] > 0
    assert set(stats["eager_calls"]) == {"warmup"}, stats["eager_calls"]


def test_inductor_code_notes_that_its_backward_ran_outside_a_capture():
    """The backward graph of the pool's last entry is captured without a backward run first only
    if a warm-up call's backward already ran Inductor's backward (AOT autograd compiles it then)."""
    torch.manual_seed(0)
    model = _Two().train()
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=2, inner="inductor", static_dispatch="off")
    x = torch.randn(8, 16)
    compiled(x)  # forward only: no backward seen yet
    fns = [r.code.fn for g in find_backend(compiled).compiled_graphs() for r in g.runners]
    assert fns and all(f.needs_backward_prewarm and not f.backward_seen for f in fns)
    compiled(x).pow(2).mean().backward()
    assert all(f.backward_seen for f in fns)


def test_simulated_graphs_compile_without_donated_buffers():
    """A simulated capture runs the backward that its first replay runs again: AOT autograd's
    donated buffers (a backward writing into saved tensors it has read) would corrupt the second
    run, so regions are compiled without them there (on a GPU: test_cuda_training.py)."""
    seen = []
    real = cgbackend.runtime.inner.inductor_compile

    def recording(module, donate=False):
        seen.append(donate)
        return real(module, donate=donate)

    torch.manual_seed(0)
    base = _Two().train()
    ref, mine = copy.deepcopy(base), copy.deepcopy(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cgbackend.runtime.inner, "inductor_compile", recording)
        compiled = cgbackend.compile(mine, simulate_graphs=True, warmup=1, inner="inductor",
                                     static_dispatch="off")
        for i in range(3):
            x = torch.randn(8, 16)
            for model, fn in ((ref, ref), (mine, compiled)):
                model.zero_grad(set_to_none=True)
                fn(x).pow(2).mean().backward()
            for a, b in zip(ref.parameters(), mine.parameters()):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6)
    fns = [compiled_call(r.code.fn) for g in find_backend(compiled).compiled_graphs() for r in g.runners]
    assert fns and seen == [False] * len(fns)
    assert not any(donating(f) for f in fns) and cgbackend.stats(compiled)["bwd_replays"] >= 1


def test_backwards_that_keep_the_graph_compute_the_forward_again():
    """retain_graph=True, then a second backward through the same forward, every step. Once the
    entry's backward graph reuses the saved activations' memory (released), a backward graph
    replay would leave them overwritten for the next backward: the backward that keeps the graph,
    and the one after it, run autograd through the forward computed again (counted), and the
    two add up to eager's gradients. A lone backward still replays the graph."""
    ref, mine, compiled = _pair(build_model("dense").train())
    xs = make_inputs("dense", ref, n=6, seed=19)
    for i, x in enumerate(xs):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            loss = fn(x).float().pow(2).mean()
            if i == 5:
                loss.backward()
                continue
            loss.backward(retain_graph=True)
            (2 * loss).backward()
        for a, b in zip(ref.parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    st = cgbackend.stats(compiled)
    assert all(e.released for e in _train_entries(compiled))
    # Step 1 captures (its first backward replays the new graph, which then releases); steps 2-4
    # compute the forward again for both backwards; step 5's lone backward replays.
    assert st["eager_calls"]["retained_graph_backward"] == 1 + 2 * 3, st["eager_calls"]
    assert st["bwd_replays"] == 2 and st["bwd_recomputes"] == 7, st


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("norm", [False, True])
def test_no_call_input_outlives_its_call(train, norm):
    """Dynamo hands the backend the first call's real tensors as examples: a compiled graph that kept
    them would hold that batch for as long as it lives. Every input here is free once its call (and
    backward) is over, the graph still alive; the outputs still equal eager's."""
    import gc
    import weakref

    torch.manual_seed(0)
    layers = [nn.Linear(64, 128)] + ([nn.BatchNorm1d(128)] if norm else []) + [nn.GELU(), nn.Linear(128, 64)]
    ref, mine, compiled = _pair(nn.Sequential(*layers).train(train))
    alive = []
    for step in range(5):
        x = torch.randn(32, 64) * (1 + step)
        alive.append(weakref.ref(x))
        with torch.set_grad_enabled(train):
            out, want = compiled(x), ref(x)
            torch.testing.assert_close(out, want)
            if train:
                out.pow(2).mean().backward()
        del x, out, want
    gc.collect()
    assert [i for i, r in enumerate(alive) if r() is not None] == []
    assert cgbackend.stats(compiled)["replays"] >= 3
