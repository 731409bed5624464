"""Accuracy of benchmark contenders against a float64 reference.

The harness runs each model once in float64 (same weights and inputs, upcast) and eager once in the
run's dtype. Errors are ``max|got - ref| / max|ref|`` per tensor, grouped as ``output``, ``loss``
and ``grads`` (the worst parameter gradient). A contender passes when, in every group, its error
against the float64 reference is at most ``LIMIT`` times eager's own error in that group (eager's
error is floored at the dtype's machine epsilon, so a group where eager happens to be exact does
not demand exactness). For MoE models the fraction of (layer, token) pairs whose top-k expert set
differs from the reference's is reported (``routing_flip_frac``) and never used to judge.

Results are kept off the device between contenders (eager's in the run dtype, the reference as
float32, or float64 when the run itself is float32) and compared one tensor at a time on the
device the contender ran on, so a real-size model's gradients never sit twice on the GPU.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

__all__ = ["LIMIT", "Results", "store", "group_errors", "flip_fraction", "Judgement", "judge", "upcast_inputs"]

LIMIT = 2.0
"""A contender's error against float64 may be at most this many times eager's own (per group)."""

GROUPS = ("output", "loss", "grads")

Results = dict
"""``{"output": T?, "loss": T?, "grads": {name: T | None}?, "routing": T?}`` for one batch."""


def _storage_dtype(run_dtype: torch.dtype, t: torch.Tensor) -> torch.dtype:
    if not t.is_floating_point():
        return t.dtype
    if t.dtype == torch.float64:
        return torch.float64 if run_dtype in (torch.float32, torch.float64) else torch.float32
    return t.dtype


def store(results: Results, run_dtype: torch.dtype) -> Results:
    """A CPU copy of ``results`` to keep as a reference (see the module doc for the dtypes)."""

    def one(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return t.detach().to("cpu", _storage_dtype(run_dtype, t), copy=True)

    out: Results = {}
    for key, value in results.items():
        out[key] = {k: one(v) for k, v in value.items()} if isinstance(value, dict) else one(value)
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (absolute when b is all zeros), computed on the accelerator (when either
    side is on one) in float64 when
    either side is float64, else float32; inf for a shape mismatch or a NaN."""
    if a.shape != b.shape:
        return math.inf
    if a.numel() == 0:
        return 0.0
    dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    device = a.device if a.device.type != "cpu" else b.device
    a = a.detach().to(device, dtype)
    b = b.detach().to(device, dtype)
    diff = (a - b).abs().max().item()
    scale = b.abs().max().item()
    err = diff / scale if scale > 0 else diff
    return math.inf if math.isnan(err) else err


def group_errors(got: Results, ref: Results) -> dict[str, tuple[float, str]]:
    """group -> (worst error, the tensor behind it) over the tensors ``ref`` holds. A missing or
    extra gradient, or a shape mismatch, is an infinite error."""
    out: dict[str, tuple[float, str]] = {}

    def one(group: str, name: str, a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> None:
        if a is None and b is None:
            return
        if a is None or b is None:
            err, note = math.inf, f"{name}: gradient {'missing' if a is None else 'unexpected'}"
        elif a.shape != b.shape:
            err, note = math.inf, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        else:
            err, note = rel_err(a, b), name
        if group not in out or err > out[group][0]:
            out[group] = (err, note)

    for key in ("output", "loss"):
        if key in ref:
            one(key, key, got.get(key), ref[key])
    if "grads" in ref:
        grads = got.get("grads") or {}
        for name, b in ref["grads"].items():
            one("grads", f"grad {name}", grads.get(name), b)
    return out


def worst(errors: dict[str, tuple[float, str]]) -> tuple[float, str]:
    if not errors:
        return 0.0, ""
    return max(errors.values(), key=lambda e: e[0])


def merge(into: dict[str, tuple[float, str]], errors: dict[str, tuple[float, str]]) -> None:
    """Keep the worst per group over batches."""
    for group, value in errors.items():
        if group not in into or value[0] > into[group][0]:
            into[group] = value


def flip_fraction(routing: Optional[torch.Tensor], ref: Optional[torch.Tensor]) -> Optional[float]:
    """Fraction of (layer, token) rows of ``[..., top_k]`` expert ids whose expert set differs."""
    if routing is None or ref is None:
        return None
    if routing.shape != ref.shape:
        return 1.0
    a = routing.detach().sort(dim=-1).values
    b = ref.detach().to(a.device).sort(dim=-1).values
    rows = (a != b).any(dim=-1)
    return float(rows.float().mean().item()) if rows.numel() else 0.0


@dataclasses.dataclass
class Judgement:
    ok: bool
    ratio: float
    """max over groups of err / max(eager's err, eps)."""
    worst: str
    """The tensor behind the worst ratio."""
    errors: dict[str, Optional[float]]


def judge(errors: dict[str, tuple[float, str]], eager: dict[str, tuple[float, str]],
          dtype: torch.dtype, limit: float = LIMIT) -> Judgement:
    floor = torch.finfo(dtype).eps / 2 if dtype.is_floating_point else 0.0  # unit roundoff
    ratio, where = 0.0, ""
    for group, (err, name) in errors.items():
        base = max(eager.get(group, (0.0, ""))[0], floor)
        r = math.inf if math.isinf(err) else (err / base if base > 0 else (0.0 if err == 0 else math.inf))
        if not where or r > ratio:
            ratio, where = r, name
    return Judgement(ok=bool(ratio <= limit), ratio=ratio, worst=where,
                     errors={g: (None if math.isinf(e) else e) for g, (e, _) in errors.items()})


def upcast_inputs(x: Any, dtype: torch.dtype = torch.float64) -> Any:
    """Floating tensors (also inside tuples, lists and dicts) cast to ``dtype``; others as they are."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(upcast_inputs(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: upcast_inputs(v, dtype) for k, v in x.items()}
    return x
