"""Benchmark contenders that run a model rebuilt in another form from the same weights: what a
person gets by rewriting the model by hand (``bench.Contender.convert``).

- ``grouped-reduce-overhead``: the shape MoE models (cgbackend/models/realsize.py) with every MoE
  layer in the grouped-GEMM form (``realsize.GroupedMoE``: sort by expert, device-side offsets,
  ``torch._grouped_mm``), under ``torch.compile(mode="reduce-overhead")``.
- ``hf-grouped-mm-reduce-overhead``: a transformers MoE model with
  ``set_experts_implementation("grouped_mm")`` (its experts are stored stacked, so the weights are
  the very same tensors' copy), under reduce-overhead; decode mode.

On CPU, where reduce-overhead cannot record CUDA graphs, both run under
``torch.compile(backend="eager")`` (Dynamo traces the form; no kernels compiled), so the smoke
tests exercise the tracing, the weights and the gradient mapping.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import copy

import torch
import torch.nn as nn

from .bench import Contender, register_contender

__all__: list[str] = []


def _reduce_overhead_on_cuda(model: nn.Module) -> Callable[..., Any]:
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model, backend="eager")


def _grouped_convert(base: nn.Module, device: torch.device) -> nn.Module:
    from .models.realsize import grouped_from
    return grouped_from(base, device)


def _grouped_restore(model: nn.Module, base: nn.Module) -> None:
    from .models.realsize import load_weights
    load_weights(model, base)


def _grouped_grads(model: nn.Module) -> Any:
    from .models.realsize import named_grads
    return named_grads(model)


def _grouped_unsupported(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    from .models.realsize import grouped_mm_unsupported
    return grouped_mm_unsupported(device, dtype)


def _needs_grouped_form(spec: Any) -> Optional[str]:
    if getattr(spec, "grouped", False):
        return None
    return f"{spec.name} has no hand-written grouped-GEMM form (only the shape MoE models do)"


def _hf_grouped_convert(base: nn.Module, device: torch.device) -> nn.Module:
    model = copy.deepcopy(base).to(device)
    model.set_experts_implementation("grouped_mm")
    return model


def _needs_hf_moe(spec: Any) -> Optional[str]:
    if spec.family == "decode" and spec.moe:
        return None
    return f"{spec.name} is not a transformers MoE model"


register_contender(Contender(
    "grouped-reduce-overhead", _reduce_overhead_on_cuda, stock=False, mark_step=True,
    convert=_grouped_convert, applies_to=_needs_grouped_form, unsupported=_grouped_unsupported,
    restore=_grouped_restore, named_grads=_grouped_grads, modes=("infer", "train"),
    description='the MoE layers rewritten by hand in the grouped-GEMM form (torch._grouped_mm, device-side '
                'offsets; cgbackend/models/realsize.py GroupedMoE), same weights, under '
                'torch.compile(mode="reduce-overhead") (CPU: backend="eager")'))

register_contender(Contender(
    "hf-grouped-mm-reduce-overhead", _reduce_overhead_on_cuda, stock=False, mark_step=True,
    convert=_hf_grouped_convert, applies_to=_needs_hf_moe, unsupported=_grouped_unsupported, modes=("decode",),
    description='transformers experts with set_experts_implementation("grouped_mm"), same weights, under '
                'torch.compile(mode="reduce-overhead") (CPU: backend="eager")'))
