"""The models of the distributed scenarios, built the same way for every contender, and their engines.

A :class:`Scenario` names a setup (``ddp``, ``fsdp2``, ``ep``) and a model. Every contender builds
its own copy with :func:`build` from the same seed, so all of them start from the same weights
(the grouped form stacks the loop model's experts), and wraps it with :func:`wrap` the way a user
applies the engine. :func:`batches` gives each rank its own distinct batches; :func:`loss_of` is the
training loss of a step: the mean square of the output (the first element of a tuple) in float32.

| model    | what it is                                                                       |
|----------|----------------------------------------------------------------------------------|
| dense    | GPT decoder (cgbackend.models, ``--size``)                                        |
| moe      | GPT with Mixtral-style dropless MoE: per-expert ModuleList and a loop             |
| moe-128e | realsize.SHAPES["moe-128e"] (Qwen3-30B-A3B's layer shape) at 16 layers, hidden-state inputs, LoopMoE |
| moe-ep   | GPT whose experts are split over the ranks (models/ep.py)                         |

``form="grouped"`` (models ``moe`` and ``moe-128e``) is the same model with the experts stacked
and run with ``torch._grouped_mm`` (models/grouped.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn as nn

__all__ = ["Scenario", "SETUPS", "GROUPED_MODELS", "MOE_128E_LAYERS", "build", "wrap", "batches", "loss_of",
           "N_BATCHES"]

SETUPS = {"ddp": ("dense", "moe"), "fsdp2": ("dense", "moe", "moe-128e"), "ep": ("moe-ep",)}
"""Distributed setup -> the models it runs."""

GROUPED_MODELS = ("moe", "moe-128e")
"""Models with a grouped-GEMM form of their experts."""

MOE_128E_LAYERS = 16
MOE_128E_TOKENS = (1, 2048)
"""moe-128e's batch and sequence per rank (tokens per rank: 2048)."""

N_BATCHES = 8
"""Distinct batches per rank, rotated over the steps."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    setup: str
    """"ddp", "fsdp2" or "ep"."""
    model: str
    """"dense", "moe" (Mixtral-style dispatch, replicated experts), "moe-128e" (real layer shape) or
    "moe-ep" (experts split)."""
    steps: int = 20
    size: str = "tiny"
    batch: int = 2
    seq: int = 16
    options: tuple = ()
    """cgbackend options as (name, value) pairs."""
    local_dispatch: str = "loop"
    """moe-ep only: how the local experts run on the received rows (models/ep.py); a contender may
    name another (dist_run.ep_variant)."""
    lr: float = 0.05
    layers: Optional[int] = None
    """Override of the model's layer count (CPU tests use 1; moe-128e runs MOE_128E_LAYERS)."""

    @property
    def name(self) -> str:
        return f"{self.setup}:{self.model}" + (f":{self.local_dispatch}" if self.model == "moe-ep" else "")

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq


def _realsize_config(sc: Scenario) -> Any:
    from ..models.realsize import SHAPES
    cfg = SHAPES["moe-128e"]["tiny" if sc.size == "tiny" else "full"]
    return dataclasses.replace(cfg, layers=sc.layers or MOE_128E_LAYERS)


def n_layers(sc: Scenario) -> int:
    """The layer count the scenario's model is built with."""
    from ..models import SIZES
    if sc.layers is not None:
        return sc.layers
    return MOE_128E_LAYERS if sc.model == "moe-128e" else SIZES[sc.size]["n_layers"]


def build(sc: Scenario, rank: int, world: int, device: torch.device, dtype: torch.dtype, *, form: str = "loop",
          local_dispatch: Optional[str] = None, seed: int = 0) -> nn.Module:
    """The scenario's model from ``seed`` on ``device`` in ``dtype``: the loop form, or (``form="grouped"``)
    the same weights with the experts stacked."""
    if form not in ("loop", "grouped"):
        raise ValueError(f"form must be 'loop' or 'grouped', got {form!r}")
    if form == "grouped" and sc.model not in GROUPED_MODELS:
        raise ValueError(f"{sc.model} has no grouped form (only {', '.join(GROUPED_MODELS)})")
    if sc.model == "moe-ep":
        from ..models.ep import build_ep_model
        kw = {"tiny": dict(d_model=64, n_layers=2, n_heads=4, n_experts=4),
              "bench": dict(d_model=512, n_layers=4, n_heads=8, n_experts=8, vocab=1024, max_seq=512)}[sc.size]
        if sc.layers is not None:
            kw["n_layers"] = sc.layers
        return build_ep_model(rank, world, device=device, dtype=dtype, seed=seed,
                              local_dispatch=local_dispatch or sc.local_dispatch, **kw)
    if sc.model == "moe-128e":
        from ..models.realsize import RealModel, grouped_from
        torch.manual_seed(seed)
        with torch.device(device):  # drawn on the device: 10B parameters at 16 layers
            model = RealModel(_realsize_config(sc), return_routing=False)
        model = model.to(dtype)
        return grouped_from(model) if form == "grouped" else model
    from ..models import build_model
    from ..models.grouped import grouped_gpt
    extra = {"n_layers": sc.layers} if sc.layers is not None else {}
    model = build_model(sc.model, size=sc.size, device=device, dtype=dtype, seed=seed, **extra)
    return grouped_gpt(model) if form == "grouped" else model


def wrap(sc: Scenario, model: nn.Module, device: torch.device) -> nn.Module:
    """The distributed engine around a model, as a user would apply it."""
    if sc.setup == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if sc.setup == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    return model  # ep: the experts are split by construction; the rest is replicated


def batches(sc: Scenario, rank: int, device: torch.device, dtype: torch.dtype, n: int = N_BATCHES) -> list:
    """``n`` distinct input batches of this rank (token ids, or hidden states for moe-128e)."""
    if sc.model == "moe-128e":
        from ..models.realsize import make_hidden_inputs
        return make_hidden_inputs(_realsize_config(sc), tokens=sc.tokens_per_rank, n=n, device=device, dtype=dtype,
                                  seed=1000 + rank, max_seq=sc.seq)
    from ..models import SIZES
    vocab = SIZES[sc.size]["vocab"]
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, vocab, (sc.batch, sc.seq), generator=gen).to(device) for _ in range(n)]


def loss_of(out: Any) -> torch.Tensor:
    """A step's loss: the mean square of the output (a tuple's first element), in float32."""
    if isinstance(out, tuple):
        out = out[0]
    return out.float().pow(2).mean()
