"""Effects and proofs read an op's arguments the way the op's schema does (passes/call_args.py):
positional or keyword, defaults included. Each case is user code that plain torch.compile runs
correctly and whose meaning hides in a position or a default: an in-place flag passed
positionally (torch's own activation modules do), ``norm(2, 0)``'s ``p`` before its ``dim``, a
softmax whose dimension is implied by the rank. Compared with eager in float64 on simulated
graphs: outputs, and the caller's tensors after the call."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.passes.call_args import call_of, implicit_softmax_dim
from fx_helpers import trace

SIM = dict(simulate_graphs=True)


class _FunctionalRelu(nn.Module):
    def forward(self, x):
        return F.relu(x, True)


ACTIVATIONS = {
    "LeakyReLU(0.1, True)": lambda: nn.LeakyReLU(0.1, True),
    "ELU(1.0, True)": lambda: nn.ELU(1.0, True),
    "ReLU6(True)": lambda: nn.ReLU6(True),
    "Hardtanh(-1, 1, True)": lambda: nn.Hardtanh(-1.0, 1.0, True),
    "SELU(True)": lambda: nn.SELU(True),
    "CELU(1.0, True)": lambda: nn.CELU(1.0, True),
    "F.relu(x, True)": _FunctionalRelu,
}


class _ActivatesCallersTensor(nn.Module):
    """Applies an in-place activation to the caller's tensor, then reads a view of it that the
    caller passed as a second argument."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = act

    def forward(self, x, alias):
        h = self.lin(x)
        self.act(x)
        return h[1:3] + alias * 2


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_in_place_activation_with_a_positional_flag_writes_the_callers_tensor(name):
    torch.manual_seed(0)
    model = _ActivatesCallersTensor(ACTIVATIONS[name]()).double()
    compiled = cgbackend.compile(model, **SIM)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randn(4, 8, generator=g, dtype=torch.float64) * 10
        mine = x.clone()
        out = compiled(mine, mine[1:3])
        ref = model(x, x[1:3])
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mine, x, rtol=1e-12, atol=1e-12)  # the caller's tensor, written in place
    st = cgbackend.stats(compiled)
    assert st["compiled_graphs"] == 1 and st["static_regions"] >= 1, st


class _NormsOverTheBatch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h / h.norm(2, 0, keepdim=True)  # p=2 over dim 0: every row of the batch


class _SoftmaxOfImpliedDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x).unsqueeze(1)  # [batch, 1, 8]: a 3-d input, so softmax runs along dim 0
        return F.softmax(h, dtype=torch.float64)


@pytest.mark.filterwarnings("ignore:Implicit dimension choice for softmax")
@pytest.mark.parametrize("cls", [_NormsOverTheBatch, _SoftmaxOfImpliedDim])
def test_a_reduction_over_the_batch_is_not_padded(cls):
    """A varying batch: a region proven row-independent would be padded to a capture size, and the
    padding rows would enter the norm or the softmax."""
    torch.manual_seed(0)
    model = cls().double()
    compiled = cgbackend.compile(model, **SIM)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for batch in [3, 5, 6, 7, 3, 5, 6, 7, 9, 3]:
            x = torch.randn(batch, 8, generator=g, dtype=torch.float64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-12, atol=1e-12)
    report = cgbackend.report(compiled)
    assert report.summary["symbolic_regions"] >= 1 and report.summary["bucketed_regions"] == 0, report.summary


def _nodes(fn, *args):
    gm = trace(fn, *args)
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and n.target is not operator.getitem]


@pytest.mark.filterwarnings("ignore:Implicit dimension choice for softmax")
@pytest.mark.parametrize("fn, wanted", [
    (lambda x: F.leaky_relu(x.clone(), 0.1, True), {"negative_slope": 0.1, "inplace": True}),
    (lambda x: F.elu(x.clone(), 1.0, True), {"alpha": 1.0, "inplace": True}),
    (lambda x: x.norm(2, 0, keepdim=True), {"p": 2, "dim": 0, "keepdim": True}),
    (lambda x: torch.norm(x, 2, 0), {"p": 2, "dim": 0, "keepdim": False}),
    (lambda x: x.sum(0), {"dim": 0, "keepdim": False}),
    (lambda x: x.topk(2), {"k": 2, "dim": -1}),
    (lambda x: F.softmax(x), {"dim": None}),
    (lambda x: x.softmax(0), {"dim": 0}),
    (lambda x: x.view(2, -1), {"size": (2, -1)}),
    (lambda x: x.permute(1, 0), {"dims": (1, 0)}),
    (lambda x: F.one_hot(x.long().abs(), 9), {"num_classes": 9}),
    (lambda x: torch.cat([x, x], 1), {"dim": 1}),
], ids=["leaky_relu", "elu", "Tensor.norm", "torch.norm", "sum", "topk", "softmax_implied", "Tensor.softmax",
        "view_varargs", "permute_varargs", "one_hot", "cat"])
def test_call_args_bind_positions_keywords_and_defaults(fn, wanted):
    node = _nodes(fn, torch.randn(4, 4))[-1]
    call = call_of(node)
    assert call is not None, node.format_node()
    assert {k: call.get(k) for k in wanted} == wanted, call.args


def test_call_args_know_what_a_schema_writes():
    nodes = _nodes(lambda x: x.clone().add_(1), torch.randn(4))
    assert call_of(nodes[-1]).written == ("input",)
    assert call_of(nodes[0]).written == ()


def test_implied_softmax_dimension_follows_torch():
    for ndim in range(5):
        x = torch.randn(*([3] * ndim)) if ndim else torch.randn(())
        with pytest.warns(UserWarning):
            implied = F.softmax(x)
        torch.testing.assert_close(implied, F.softmax(x, implicit_softmax_dim(ndim)))


@pytest.mark.parametrize("divide", [
    lambda a, ids: torch.div(a, ids, rounding_mode="floor"),
    lambda a, ids: torch.div(a, other=ids, rounding_mode="floor"),
    lambda a, ids: torch.remainder(a, other=ids),
    lambda a, ids: a // ids,
], ids=["positional", "keyword", "remainder_keyword", "operator"])
def test_padding_check_finds_the_divisor_by_name(divide):
    """passes/padvalues.py: an integer divisor computed from arange over a padded size is unsafe
    however the divisor is passed."""
    from cgbackend.passes.padvalues import unsafe_padding_use

    def fn(x):
        ids = torch.arange(1, x.shape[0] + 1).unsqueeze(1)
        return divide(torch.full((x.shape[0], 1), 7), ids) * x

    x = torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    nodes = [n for n in trace(fn, x).graph.nodes if n.op in ("call_function", "call_method")]
    aranges = [n for n in nodes if n.target is torch.arange]
    found = unsafe_padding_use(nodes, aranges)
    assert found is not None and "divides by integers" in found[1], found
