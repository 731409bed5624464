"""The one-time warning that a compiled model runs with nothing captured (runtime/capture_watch.py):
it names the reason, comes once per model after warm-up, and never where graphs are captured."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn as nn

import cgbackend
from log_helpers import records_of


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


def _calls(fn, inputs):
    """Run ``fn`` on each input; the NothingCapturedWarnings of each call."""
    per_call = []
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for args in inputs:
            before = len(caught)
            fn(*args)
            per_call.append([str(w.message) for w in caught[before:]
                             if issubclass(w.category, cgbackend.NothingCapturedWarning)])
    return per_call


def test_cpu_tensors_warn_once_after_warm_up():
    compiled = torch.compile(_mlp(), backend="cgbackend")  # warmup 3: the 4th call would capture
    with records_of("cgbackend.runtime.capture_watch", logging.INFO) as records:
        per_call = _calls(compiled, [(torch.randn(2, 4),)] * 7)
    assert [len(w) for w in per_call] == [0, 0, 0, 1, 0, 0, 0]
    message = per_call[3][0]
    assert message.startswith("cgbackend: nothing was captured as a CUDA graph, every call runs eagerly: ")
    reason = "computes on cpu tensors" if torch.cuda.is_available() else "this machine has no CUDA device"
    assert reason in message
    assert [r.getMessage() for r in records] == [message]
    assert issubclass(cgbackend.NothingCapturedWarning, cgbackend.CGBackendWarning)


def test_the_warning_names_the_users_call():
    """Not capture_watch.py: the line of the user's code that made the call."""
    compiled = cgbackend.compile(_mlp(), capture=False, warmup=1)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(torch.randn(2, 4))  # the line the warning names
    (w,) = [w for w in caught if issubclass(w.category, cgbackend.NothingCapturedWarning)]
    assert w.filename == __file__
    assert "the line the warning names" in open(__file__).read().splitlines()[w.lineno - 1]


def test_capture_off_names_the_option():
    compiled = cgbackend.compile(_mlp(), capture=False, warmup=1)
    per_call = _calls(compiled, [(torch.randn(2, 4),)] * 3)
    assert [len(w) for w in per_call] == [0, 1, 0] and "the option capture=False" in per_call[1][0]


class Loops(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, n):
        for _ in range(n):  # a Python int Dynamo must know: a new graph for each n
            x = self.lin(x).relu() * 2
        return x


def test_a_value_baked_into_each_graph_warns_of_recompiles():
    compiled = torch.compile(Loops(), backend=cgbackend.backend(simulate_graphs=True))
    per_call = _calls(compiled, [(torch.randn(2, 4), n) for n in range(1, 6)])
    shown = [m for w in per_call for m in w]
    assert len(shown) == 1 and "Dynamo compiled the same function 3 times" in shown[0]
    assert "TORCH_LOGS=recompiles" in shown[0]


def test_new_signatures_every_call_warn_only_after_patience():
    compiled = cgbackend.compile(_mlp(), simulate_graphs=True, capture_sizes=(), warmup=1)
    per_call = _calls(compiled, [(torch.randn(n, 4),) for n in range(1, 20)])
    firsts = [i for i, w in enumerate(per_call) if w]
    assert len(firsts) == 1 and firsts[0] >= 8, per_call
    assert "still warming up" in per_call[firsts[0]][0] and "new input signature" in per_call[firsts[0]][0]


@pytest.mark.parametrize("sizes", [[2] * 6, [1, 2, 3, 4, 5, 6, 7, 8] * 2], ids=["one_shape", "buckets"])
def test_no_warning_where_graphs_are_captured(sizes):
    compiled = cgbackend.compile(_mlp(), simulate_graphs=True, warmup=1)
    per_call = _calls(compiled, [(torch.randn(n, 4),) for n in sizes])
    assert not any(per_call) and cgbackend.stats(compiled)["graphs_captured"] > 0


class Indexed(nn.Module):
    """A layer that reads its own index (as transformers' layers read layer_idx) and breaks the graph
    (as a MoE loop does by name): Dynamo compiles its function once per layer."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x = self.lin(x).relu() * (self.index + 1)
        torch._dynamo.graph_break()
        return self.lin(x).tanh() + self.index


class IndexedStack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Indexed(i) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_function_compiled_once_per_layer_is_not_a_value_changing_each_call():
    """Four layers compile one function four times in the first call; from the next calls on their
    graphs capture: no warning of recompiles (it said "every call runs eagerly" while graphs were
    captured: a 48-layer transformers MoE model by name on an H200)."""
    model = IndexedStack().eval()
    compiled = torch.compile(model, backend=cgbackend.backend(simulate_graphs=True, warmup=1))
    per_call = _calls(compiled, [(torch.randn(2, 4),)] * 4)
    assert not any(per_call), per_call
    assert cgbackend.stats(compiled)["graphs_captured"] > 0
    with torch.no_grad():
        x = torch.randn(2, 4)
        torch.testing.assert_close(compiled(x), model(x))


def test_stats_name_why_nothing_was_captured_only_while_nothing_was():
    """A graph on CPU tensors in a GPU run is blocked (no_cuda) while the others capture: the stats'
    nothing_captured_reason is for a run that captured nothing, so it is None once a graph was."""
    backend = cgbackend.backend()
    compiled = torch.compile(_mlp(), backend=backend)
    with torch.no_grad():
        compiled(torch.randn(2, 4))
    assert backend.stats()["nothing_captured_reason"] == "no_cuda"
    backend.shared.counters.graphs_captured += 1  # as a GPU run's other graphs would
    assert backend.stats()["nothing_captured_reason"] is None
