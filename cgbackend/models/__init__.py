"""Reference models used by the tests, the demo report and the benchmarks.

``build_model(name, size=...)`` and ``make_inputs(name, model, ...)`` give a model and a list of
distinct input batches (so MoE routing changes from call to call).

| name     | what it exercises                                                   |
|----------|---------------------------------------------------------------------|
| dense    | GPT decoder, all static                                             |
| moe      | GPT with Mixtral-style dropless MoE (one-hot mask, where, index_add_) |
| moe_sort | GPT with sort/argsort + bincount dispatch                           |
| item     | ``.item()``-driven row count                                        |
| cpu_op   | host-side computation between device ops                            |
| dropout  | dropout inside a static region                                      |
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .gpt import GPT, MixtralStyleMoE, SortedMoE
from .misc import CPUOpModel, DropoutModel, ItemControlModel

__all__ = ["MODEL_NAMES", "SIZES", "GPT", "MixtralStyleMoE", "SortedMoE", "CPUOpModel", "DropoutModel",
           "ItemControlModel", "build_model", "make_inputs", "demo_model", "is_language_model"]

MODEL_NAMES = ("dense", "moe", "moe_sort", "item", "cpu_op", "dropout")

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab=128, d_model=64, n_layers=2, n_heads=4, n_experts=4, top_k=2, max_seq=64),
    "small": dict(vocab=512, d_model=256, n_layers=2, n_heads=4, n_experts=8, top_k=2, max_seq=256),
    "bench": dict(vocab=1024, d_model=512, n_layers=4, n_heads=8, n_experts=8, top_k=2, max_seq=512),
}

_FFN = {"dense": "mlp", "moe": "moe", "moe_sort": "moe_sort"}


def is_language_model(name: str) -> bool:
    return name in _FFN


def build_model(name: str, *, size: str = "tiny", device: Any = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0, **overrides: Any) -> nn.Module:
    """A reference model with weights drawn from ``seed``. ``overrides`` change SIZES entries."""
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown reference model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    params = {**SIZES[size], **overrides}
    torch.manual_seed(seed)
    if is_language_model(name):
        model: nn.Module = GPT(vocab=params["vocab"], d_model=params["d_model"], n_layers=params["n_layers"],
                               n_heads=params["n_heads"], max_seq=params["max_seq"], ffn=_FFN[name],
                               n_experts=params["n_experts"], top_k=params["top_k"],
                               dropout=params.get("dropout", 0.0))
    elif name == "item":
        model = ItemControlModel(params["d_model"])
    elif name == "cpu_op":
        model = CPUOpModel(params["d_model"])
    else:
        model = DropoutModel(params["d_model"], p=params.get("p", 0.25))
    return model.to(device=device, dtype=dtype)


def make_inputs(name: str, model: nn.Module, *, batch: int = 2, seq: int = 16, n: int = 4,
                device: Any = "cpu", dtype: torch.dtype = torch.float32, seed: int = 1) -> list[torch.Tensor]:
    """``n`` distinct input batches for ``model`` (token ids for language models, else
    ``[batch * seq, d_model]`` activations)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        if is_language_model(name):
            vocab = model.tok_emb.num_embeddings
            out.append(torch.randint(0, vocab, (batch, seq), generator=gen).to(device))
        else:
            d = next(model.parameters()).shape[-1]
            out.append(torch.randn(batch * seq, d, generator=gen).to(device=device, dtype=dtype))
    return out


def demo_model(kind: str, device: Any = "cpu") -> tuple[nn.Module, torch.Tensor]:
    """The model and one input batch behind ``python -m cgbackend explain --demo moe|dense``."""
    name = {"moe": "moe", "dense": "dense"}[kind]
    model = build_model(name, size="tiny", device=device).eval()
    return model, make_inputs(name, model, batch=2, seq=16, n=1, device=device)[0]
