"""Parameter gradients a backward graph stops owning once nobody holds them (runtime/loose_grads.py),
and training graphs of every call slot in one pool: simulated graphs against eager, float64, on
varied inputs. A consumer that copies each gradient away and drops it at once (as FSDP2 does after
each layer's backward) lets the layers' gradients share memory; one that keeps ``.grad`` does not,
and a consumer that changes its habit later still gets its gradients intact."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import cgbackend

SIM = dict(simulate_graphs=True, warmup=1, static_dispatch="off")


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class Stack(nn.Module):
    def __init__(self, d: int = 16, n: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class TakeAndDrop:
    """Copies each parameter's gradient away as soon as it is accumulated and drops ``.grad``
    (FSDP2's reduce-scatter copy-in, then ``unsharded_param.grad = None``)."""

    def __init__(self, model: nn.Module) -> None:
        self.taken: dict[str, torch.Tensor] = {}
        self.active = True
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name: str):
        def take(p: torch.Tensor) -> None:
            if not self.active:
                return
            self.taken[name] = self.taken.get(name, 0) + p.grad.clone()
            p.grad = None
        return take


def _models(seed: int = 0):
    torch.manual_seed(seed)
    ref = Stack().double()
    mine = copy.deepcopy(ref)
    return ref, mine, cgbackend.compile(mine, **SIM)


def _inputs(n: int, seed: int = 3) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 16, generator=g, dtype=torch.float64) for _ in range(n)]


def test_gradients_dropped_after_each_layer_share_memory_and_equal_eager():
    ref, mine, compiled = _models()
    ref_take, my_take = TakeAndDrop(ref), TakeAndDrop(mine)
    for i, x in enumerate(_inputs(6)):
        ref_take.taken.clear(), my_take.taken.clear()
        for fn in (ref, compiled):
            fn(x).pow(2).mean().backward()
        assert set(my_take.taken) == set(ref_take.taken)
        for name, g in ref_take.taken.items():
            torch.testing.assert_close(my_take.taken[name], g, rtol=1e-12, atol=1e-12, msg=f"step {i} {name}")
    st = cgbackend.stats(compiled)
    # the first layers' backward graphs gave their blocks to the later captures: all but the last
    # two captured of the step (the activations' gradients free one capture later)
    assert st["grads_loosened"] >= 3 and st["grads_loosened_bytes"] > 0, st
    assert st["bwd_replays"] > 0 and set(st["eager_calls"]) == {"warmup"}, st["eager_calls"]


def test_gradients_kept_as_grad_stay_owned_and_equal_eager():
    ref, mine, compiled = _models(1)
    for i, x in enumerate(_inputs(5, seed=4)):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            fn(x).pow(2).mean().backward()
        for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=f"step {i} {name}")
    st = cgbackend.stats(compiled)
    assert st["grads_loosened"] == 0 and set(st["eager_calls"]) == {"warmup"}, st


def test_a_consumer_that_starts_keeping_grad_gets_intact_gradients():
    """Loosened while the consumer dropped them; then ``.grad`` is kept across a whole step and read
    after every layer's backward ran: the later graphs must not have written over it."""
    ref, mine, compiled = _models(2)
    ref_take, my_take = TakeAndDrop(ref), TakeAndDrop(mine)
    xs = _inputs(7, seed=5)
    for x in xs[:4]:
        for fn in (ref, compiled):
            fn(x).pow(2).mean().backward()
    assert cgbackend.stats(compiled)["grads_loosened"] > 0
    ref_take.active = my_take.active = False
    for i, x in enumerate(xs[4:]):
        for model, fn in ((ref, ref), (mine, compiled)):
            model.zero_grad(set_to_none=True)
            fn(x).pow(2).mean().backward()
        for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=f"step {i} {name}")


def test_loosened_gradients_kept_as_grad_on_alternate_steps_replay_every_call():
    """A model of several regions, .grad set to None on even steps and zeroed in place on odd ones:
    the first regions' gradients are loosened (nothing held them at a later capture); afterwards a
    kept ``.grad`` aliasing them is copied before a later graph replays, and no call runs eagerly
    for a gradient the runtime itself counted as held."""
    from cgbackend.models import build_model, make_inputs
    torch.manual_seed(3)
    ref = build_model("item", size="tiny").double().train()
    mine = copy.deepcopy(ref)
    compiled = cgbackend.compile(mine, **SIM)
    o_ref, o_mine = torch.optim.SGD(ref.parameters(), lr=0.05), torch.optim.SGD(mine.parameters(), lr=0.05)
    for step, x in enumerate(make_inputs("item", ref, n=6, seed=5, dtype=torch.float64)):
        for opt in (o_ref, o_mine):
            opt.zero_grad(set_to_none=step % 2 == 0)
        ref(x).pow(2).mean().backward()
        compiled(x).pow(2).mean().backward()
        for (name, a), b in zip(ref.named_parameters(), mine.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=f"step {step} {name}")
        o_ref.step(), o_mine.step()
    st = cgbackend.stats(compiled)
    assert st["grads_loosened"] >= 1 and set(st["eager_calls"]) == {"warmup"}, st
