"""Helpers shared by the GPU tests."""

from __future__ import annotations

import torch

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output") -> bool:
    """Close within the dtype's tolerance; returns whether it was bitwise equal."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {out.shape}/{out.dtype} vs {ref.shape}/{ref.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    if torch.equal(out, ref):
        return True
    tol = TOL[dtype]
    # Relative to the scale of the reference, so large logits do not hide small relative errors.
    scale = ref.float().abs().max().clamp_min(1e-6)
    err = ((out.float() - ref.float()).abs().max() / scale).item()
    assert err <= tol["rtol"] * 5, f"{what}: max error {err:.3e} of the reference's scale (dtype {dtype})"
    return False


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def vec_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()
