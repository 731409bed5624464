"""Small models that exercise the other reasons to stay eager: .item()-driven control, CPU work,
and dropout (random numbers inside graphs)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ItemControlModel", "CPUOpModel", "DropoutModel"]


class ItemControlModel(nn.Module):
    """Refines only the rows whose score is positive, counted on the host with ``.item()``
    (rows are ordered so the positive ones come first)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.proj_in = nn.Linear(d, d)
        self.score = nn.Linear(d, 1)
        self.refine = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.proj_out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj_in(x)
        s = self.score(h).squeeze(-1)
        order = torch.argsort(s, descending=True)
        h = h[order]
        n = int((s > 0).sum().item())
        torch._check_is_size(n)
        torch._check(n <= h.shape[0])
        refined = self.refine(h[:n])
        h = torch.cat([h[:n] + refined, h[n:]], dim=0)
        return self.proj_out(F.gelu(h))


class CPUOpModel(nn.Module):
    """Computes a per-feature scale on the host (NumPy-style CPU work) and applies it on the device."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc1(x))
        stats = h.detach().float().mean(dim=0).cpu()
        scale = torch.softmax(stats * 2.0, dim=-1) * stats.numel()
        h = h * scale.to(device=h.device, dtype=h.dtype)
        return self.fc2(F.gelu(h))


class DropoutModel(nn.Module):
    """MLP with dropout inside what becomes one static region."""

    def __init__(self, d: int = 64, p: float = 0.25) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.fc1(self.norm(x))), p=self.p, training=self.training)
        return x + F.dropout(self.fc2(h), p=self.p, training=self.training)
