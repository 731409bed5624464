"""Helpers shared by the tests of regional compilation and of training steps: a stack's owner that
runs its layers one after the other, and the gradient comparison with eager."""

from __future__ import annotations

import torch
import torch.nn as nn


class Chain(nn.Module):
    """Its forward runs the stack one layer after the other (``x = layer(x)``): the loop regional
    compilation recognises (regional.chained_loop reads this source)."""

    def __init__(self, layers) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def assert_same_grads(model: nn.Module, ref: nn.Module, tol: float = 1e-12, what: object = "") -> None:
    """Every parameter gradient of ``model`` equals ``ref``'s (None where it is None); both cleared."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), (what, name)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol, msg=f"{what}: {name}")
        p.grad = q.grad = None
