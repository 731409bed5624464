"""The tiny reference MoE trained in bf16 with Inductor in the static regions: gradients are right
wherever the routing is eager's, and a batch whose gradients are far off is one where Inductor's
rounding flipped a token's top-k choice.

This was recorded as a defect ("wrong gradients of layer 0's experts under Inductor", a strict xfail).
It is a routing flip: with 32 tokens one flipped choice moves an expert's gradient by
tens of percent, 30-50x eager-bf16's own error against float64, while the same step without the
flip matches. Flips are counted and reported (the bench's routing_flip_frac, the zoo's flips), not
corrected: eager-bf16 flips other tokens of its own.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import cgbackend
from cgbackend.bench.accuracy import LIMIT  # at most 2x eager-bf16's own error against float64
from cgbackend.models import build_model, make_inputs


class _Routing:
    """The top-k expert sets every MoE layer chose in the latest call (forward hooks on the gates)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.sets: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(model.layers):
            layer.ffn.gate.register_forward_hook(self._hook(i, layer.ffn.top_k))

    def _hook(self, i: int, k: int):
        def hook(module, args, out):
            probs = F.softmax(out, dim=1, dtype=torch.float)
            self.sets[i] = torch.topk(probs, k, dim=-1)[1].sort(-1)[0].detach()
        return hook

    def take(self) -> dict[int, torch.Tensor]:
        return {i: t.cpu().clone() for i, t in self.sets.items()}


def _step(model, fn, x, probe):
    model.zero_grad(set_to_none=True)
    out = fn(x)
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32
    F.cross_entropy(out[:, :-1].to(wide).flatten(0, 1), x[:, 1:].flatten()).backward()
    grads = {n: p.grad.detach().double().cpu() for n, p in model.named_parameters()}
    return grads, probe.take()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_moe_bf16_training_gradients_match_where_routing_matches(device):
    torch.manual_seed(0)
    base = build_model("moe", size="tiny", dtype=torch.float32)
    xs = [x.to(device) for x in make_inputs("moe", base, batch=2, seq=16, n=4)]
    ref64 = copy.deepcopy(base).to(device, torch.float64).train()
    eager = copy.deepcopy(base).to(device, torch.bfloat16).train()
    mine = copy.deepcopy(base).to(device, torch.bfloat16).train()
    probes = [_Routing(m) for m in (ref64, eager, mine)]
    # CPU: simulated graphs with Inductor forced (the default on CPU is eager's kernels) and the
    # dispatch as written, whose static regions around it are what Inductor compiles; CUDA: defaults
    # (the whole MoE layer static, in the grouped or masked-dense form).
    options = dict(simulate_graphs=True, inner="inductor", static_dispatch="off") if device == "cpu" else {}
    compiled = cgbackend.compile(mine, warmup=2, **options)
    floor = torch.finfo(torch.bfloat16).eps / 2
    same_routing, flipped = 0, []
    for step in range(8):
        x = xs[step % len(xs)]
        g64, r64 = _step(ref64, ref64, x, probes[0])
        ge, re = _step(eager, eager, x, probes[1])
        gc, rc = _step(mine, compiled, x, probes[2])
        assert set(gc) == set(ge) and all((gc[n] is None) == (ge[n] is None) for n in ge)
        ratio = max(_rel(gc[n], g64[n]) / max(_rel(ge[n], g64[n]), floor) for n in g64 if g64[n] is not None)
        tokens_differ = {i: int((rc[i] != re[i]).any(-1).sum()) for i in re}
        if not any(tokens_differ.values()):
            same_routing += 1
            assert ratio <= LIMIT, f"step {step}: routing equal to eager's, gradients {ratio:.1f}x eager's error"
        else:
            # Rounding flips a token or two, never a layer's routing wholesale.
            assert max(tokens_differ.values()) <= 2, (step, tokens_differ)
            flipped.append((step, tokens_differ, round(ratio, 1)))
    assert same_routing >= 4, flipped  # the check above ran on most steps
    stats = cgbackend.stats(compiled)
    assert stats["graphs_captured"] >= 2 and stats["replays"] > 0
    assert stats["inner_compiled"] >= 1 and not stats["inner_fallbacks"]
