"""Parameters a backward does not reach keep ``.grad`` None, as eagerly, on every call from the
first: warm-up calls run eagerly (None), and replays must not hand out zeros, which an
optimizer with momentum or weight decay treats differently from None."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import cgbackend


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.shared = nn.Linear(8, 8)

    def forward(self, x):
        h = self.shared(x).sin()
        return self.a(h).relu(), self.b(h).tanh()


# Which outputs each call's loss uses: a parameter unused in one call is used in the next.
PATTERNS = {
    "alternate": [(0,), (1,), (0,), (1,), (0,), (1,)],
    "first_only_then_both": [(0,), (0,), (0,), (0, 1), (0,), (0,)],
}


def _unused_grads_match_eager(pattern, device, **options):
    torch.manual_seed(0)
    ref = TwoHeads().to(device, torch.float64)
    model = copy.deepcopy(ref)
    compiled = cgbackend.compile(model, warmup=1, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for call, used in enumerate(PATTERNS[pattern]):
        x = torch.randn(4, 8, dtype=torch.float64, device=device)
        for m, o, f in ((model, opt, compiled), (ref, opt_ref, ref)):
            o.zero_grad()
            outs = f(x)
            sum(outs[i].pow(2).sum() for i in used).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), f"call {call}: {name}.grad {p.grad} vs eager {q.grad}"
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"call {call}: {name}.grad")
        opt.step()
        opt_ref.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=f"call {call}: {name} after the step")
    st = cgbackend.stats(compiled)
    assert st["fwd_replays"] >= 4 and st["bwd_replays"] >= 3, st  # graphs ran, not only warm-up


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_unused_parameter_grads_match_eager_with_sgd_momentum(pattern):
    _unused_grads_match_eager(pattern, "cpu", simulate_graphs=True)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_unused_parameter_grads_stay_none_under_inductor(pattern):
    """An Inductor-compiled region's forward is one autograd node reaching every input, so its
    outputs' reach comes from a fake run of the FX module (runtime/reach.py)."""
    _unused_grads_match_eager(pattern, "cpu", simulate_graphs=True, inner="inductor")


@pytest.mark.cuda
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_unused_parameter_grads_match_eager_with_sgd_momentum_cuda(pattern):
    _unused_grads_match_eager(pattern, "cuda")


def test_grad_of_an_output_multiplied_by_zero_is_zero_not_none():
    """Reached through an output with a zero gradient: zeros, as eagerly (not None)."""
    torch.manual_seed(0)
    ref = TwoHeads().double()
    model = copy.deepcopy(ref)
    compiled = cgbackend.compile(model, simulate_graphs=True, warmup=1)
    for call in range(4):
        x = torch.randn(4, 8, dtype=torch.float64)
        for m, f in ((model, compiled), (ref, ref)):
            m.zero_grad()
            a, b = f(x)
            (a.sum() + 0 * b.sum()).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert q.grad is not None and p.grad is not None, f"call {call}: {name}"
            torch.testing.assert_close(p.grad, q.grad)
