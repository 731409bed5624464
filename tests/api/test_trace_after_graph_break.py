"""A graph break (a print, a logging call) before a data-dependent ``.tolist()``: Dynamo fails to
trace the frame after the break with cgbackend.compile's data-dependent settings, after a graph of
the call has already run (so the call cannot be run again from the start). The frame runs as it
is (tracing.CompileScope), every call returns eager's result and prints once, and the next calls
trace as plain torch.compile does; the failed frame is counted and reported."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import cgbackend

log = logging.getLogger("cgbackend.tests.user_model")


class _PrintsThenLists(nn.Module):
    def __init__(self, say) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.say = say

    def forward(self, x, ids):
        h = self.a(x)
        self.say("step")
        rows = (ids > 0).nonzero().flatten().tolist()
        return h[rows].sum(0) * 2 if rows else h.sum(0)


@pytest.mark.parametrize("say", ["print", "logging"])
def test_data_dependent_tolist_after_a_graph_break_does_not_crash(say, capsys):
    said = []

    def printing(text):
        print(text)

    def logging_(text):
        log.debug(text)
        said.append(text)

    torch.manual_seed(0)
    model = _PrintsThenLists(printing if say == "print" else logging_).double()
    compiled = cgbackend.compile(model, simulate_graphs=True)
    g = torch.Generator().manual_seed(1)
    calls = 4
    for _ in range(calls):
        x = torch.randn(6, 8, generator=g, dtype=torch.float64)
        ids = torch.randint(-2, 3, (6,), generator=g)
        torch.testing.assert_close(compiled(x, ids), model(x, ids), rtol=1e-12, atol=1e-12)
    if say == "print":
        assert capsys.readouterr().out.count("step") == 2 * calls  # once per call of each: nothing ran twice
    else:
        assert len(said) == 2 * calls
    st = cgbackend.stats(compiled)
    assert st["trace_fallbacks"] == 1, st
    assert st["uncompiled_by"] == {"frame": 1}, st["uncompiled_by"]
    notes = " ".join(cgbackend.report(compiled).notes)
    assert "GuardOnDataDependentSymNode" in notes and "skips it from then on" in notes, notes
