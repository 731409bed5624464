"""The bench's model registry itself: what one entry is (:class:`BenchModel`) and the table of
entries; the entries are registered by ``models.py`` and ``hf_models.py``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import torch
import torch.nn as nn

__all__ = ["BenchModel", "MODELS", "SHAPE_MAX_SEQ", "register_model", "upcast_float"]

SHAPE_MAX_SEQ = 4096
"""A token count above this is split into sequences of this length (batch = tokens / 4096)."""


def upcast_float(t: torch.Tensor) -> torch.Tensor:
    """float32 for 16-bit floats; float64 stays float64 (the reference's loss is computed in it)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """One benchmark model.

    build(settings) -> module on CPU in settings.dtype, weights from settings.seed.
    inputs(base, settings, tokens) -> list of input batches on settings.device (distinct routing).
    loss(out, x) -> scalar, computed outside the compiled model in float32 (float64 for the reference).
    output(out) -> the tensor compared for accuracy; routing(out) -> [..., top_k] expert ids or None.
    contenders: the default contender list (None: every registered contender); modes: those it runs.
    defaults: settings this model uses unless given on the command line (warmup, iters, batches,
    acc_batches, time_budget, tokens). moe: it has MoE layers (routing flips are counted).
    grouped: the grouped-GEMM contender can rebuild it (cgbackend.models.realsize.grouped_from).
    """

    name: str
    family: str
    modes: tuple[str, ...]
    build: Callable[[Any], nn.Module]
    inputs: Callable[[nn.Module, Any, Optional[int]], list]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    output: Callable[[Any], torch.Tensor] = lambda out: out
    routing: Callable[[Any], Optional[torch.Tensor]] = lambda out: None
    contenders: Optional[tuple[str, ...]] = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    moe: bool = False
    grouped: bool = False
    description: str = ""
    to_device: Optional[Callable[[nn.Module, Any], nn.Module]] = None
    """to_device(base, settings) -> the model on settings.device without a second host copy (used for
    the one copy contenders share under --share-weights); None: a deep copy."""
    reference_forward: Optional[Callable[[nn.Module, torch.Tensor, Any], Any]] = None
    """reference_forward(base, x, settings) -> the float64 output of an inference call computed
    layer by layer (a model whose float64 copy does not fit the device); None: a float64 copy."""


MODELS: dict[str, BenchModel] = {}


def register_model(spec: BenchModel) -> BenchModel:
    MODELS[spec.name] = spec
    return spec
