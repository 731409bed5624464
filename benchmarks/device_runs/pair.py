"""The pair the device diagnostics compare: one real-size MoE model under cgbackend static dispatch
(default options) and the same weights as the hand-written grouped layer under reduce-overhead,
with three bf16 input batches. Imported by diag2.py and diag3.py (run from the repository root)."""
import sys

import torch

sys.path.insert(0, ".")  # the repository root, for cgbackend
import cgbackend  # noqa: E402
from cgbackend.models.realsize import SHAPES, RealModel, grouped_from, make_hidden_inputs  # noqa: E402


def contenders(name: str, tokens: int = 4096):
    """(inputs, cgbackend-compiled model, reduce-overhead-compiled grouped model)."""
    cfg = SHAPES[name]["full"]
    torch.manual_seed(0)
    m = RealModel(cfg).cuda().to(torch.bfloat16).eval()
    xs = make_hidden_inputs(cfg, tokens=tokens, n=3, device="cuda", dtype=torch.bfloat16, seed=1)
    g = grouped_from(m).cuda()
    return xs, cgbackend.compile(m, static_dispatch="auto"), torch.compile(g, mode="reduce-overhead")
