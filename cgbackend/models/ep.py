"""Expert-parallel dropless MoE: experts split over the ranks, tokens exchanged with all-to-all.

Each rank routes its own tokens (router replicated), sends every routed copy to the rank owning
its expert with ``all_to_all_single`` whose split sizes are read on the host (``.tolist()``),
runs its local experts on what it received, and sends the results back the same way. The
exchange is data-dependent: it is a dynamic region between static ones (router before, combine
after). ``local_dispatch="loop"`` runs the local experts as a per-expert ``torch.where`` loop on the
received rows (dynamic); ``"padded"`` first places the received rows into a buffer of fixed
capacity (every routed copy of every rank could come here) and runs each local expert masked on
all of it, so the local experts see fixed shapes and are graphed.

``"capacity"`` makes the exchange itself static (ep_capacity.py): every rank sends every rank a
block of ``capacity`` rows with the counts as a device tensor, the local experts run masked on the
fixed buffer, and the results come back the same way; no host read, so the whole layer, the
all-to-alls included, is one static region. ``capacity_factor=None`` (the default) is the worst
case, where nothing can overflow; a smaller capacity checks for overflow on every rank at once and
falls back to the worst case for that call, or raises (``overflow``).

``build_ep_model(rank, world_size, ...)`` builds the same weights on every rank (the full model's
experts ``rank * E/W .. (rank+1) * E/W - 1`` are local); :func:`eager_reference_grads` in the tests
compare against the same computation without cgbackend.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ep_capacity import (OverflowCounter, capacity_for, combine_rows, dispatch_rows, exchange, local_expert_ids,
                          overflow_on_any_rank, plan_send)
from .gpt import GPT
from .layers import Expert

__all__ = ["EPMoE", "build_ep_model", "LOCAL_DISPATCH"]

LOCAL_DISPATCH = ("loop", "padded", "capacity")


class EPMoE(nn.Module):
    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, rank: int, world_size: int,
                 group: Any = None, local_dispatch: str = "loop", capacity_factor: Optional[float] = None,
                 overflow: str = "fallback") -> None:
        super().__init__()
        if n_experts % world_size:
            raise ValueError(f"n_experts ({n_experts}) must be a multiple of the world size ({world_size})")
        if local_dispatch not in LOCAL_DISPATCH:
            raise ValueError(f"local_dispatch must be one of {', '.join(LOCAL_DISPATCH)}, got {local_dispatch!r}")
        self.n_experts, self.top_k = n_experts, top_k
        self.rank, self.world_size = rank, world_size
        self.n_local = n_experts // world_size
        self.group = group
        self.local_dispatch = local_dispatch
        self.capacity_factor = capacity_factor
        """``"capacity"`` only: rows per destination rank as a multiple of the balanced load; None: the
        worst case (tokens * top_k), which cannot overflow."""
        capacity_for(1, top_k, world_size, capacity_factor)  # rejects a bad factor now
        self.overflows = OverflowCounter(overflow)
        """``"capacity"`` only: calls that overflowed a capacity below the worst case (ep_capacity.py)."""
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(self.n_local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        ws, n_local = self.world_size, self.n_local
        group = self.group if self.group is not None else torch.distributed.group.WORLD
        h = x.reshape(-1, c)
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        if self.local_dispatch == "capacity":
            return self._capacity_exchange(h, weights, selected, group).reshape(b, t, c)
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)  # routed copies grouped by expert, so by rank
        token_idx = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)[: self.n_experts]
        # Counts of every (source rank, local expert) this rank receives: a fixed-size exchange.
        recv_counts = exchange(counts, group, differentiable=False)
        send_splits = counts.view(ws, n_local).sum(1).tolist()
        recv_matrix = recv_counts.view(ws, n_local)
        recv_splits = recv_matrix.sum(1).tolist()
        sent = h[token_idx]
        received = exchange(sent, group, out_splits=recv_splits, in_splits=send_splits)
        n_recv = sum(recv_splits)
        local_ids = torch.repeat_interleave(
            torch.arange(n_local, device=h.device).repeat(ws), recv_matrix.reshape(-1), output_size=n_recv)
        if self.local_dispatch == "padded":
            out = self._padded_experts(received, local_ids, n_recv, b * t * self.top_k * ws)
        else:
            out = torch.zeros_like(received)
            for e in range(n_local):
                (rows,) = torch.where(local_ids == e)
                out = out.index_add(0, rows, self.experts[e](received[rows]))
        back = exchange(out, group, out_splits=send_splits, in_splits=recv_splits)
        y = back * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(h).index_add(0, token_idx, y).reshape(b, t, c)

    def _padded_experts(self, received: torch.Tensor, local_ids: torch.Tensor, n_recv: int,
                        capacity: int) -> torch.Tensor:
        """Local experts on a fixed-capacity buffer: shapes no longer depend on the routing."""
        pad = capacity - n_recv
        rows = F.pad(received, (0, 0, 0, pad))
        ids = F.pad(local_ids, (0, pad), value=-1)
        return self._masked_experts(rows, ids)[:n_recv]

    def _masked_experts(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each local expert on every row, kept where the row is its own (``ids``; any other value:
        no expert, a zero row)."""
        out = torch.zeros_like(rows)
        for e in range(self.n_local):
            mask = (ids == e).unsqueeze(-1)
            out = out + torch.where(mask, self.experts[e](rows), 0.0)
        return out

    @torch._dynamo.disable
    def _overflowed(self, overflow: torch.Tensor, group: Any, capacity: int, worst: int) -> bool:
        """Did some rank's routing overflow the capacity? The largest overflow over the ranks, read
        on the host (the same answer on every rank); counted, and raised under ``overflow="raise"``.
        Run outside Dynamo's graphs: a graph break before and after (the rest of the layer is
        compiled once per answer), nothing guarded on the counts."""
        rows = int(overflow_on_any_rank(overflow, group).item())
        if rows:
            self.overflows(rows, capacity, worst)
        return rows > 0

    def _capacity_exchange(self, h: torch.Tensor, weights: torch.Tensor, selected: torch.Tensor,
                           group: Any) -> torch.Tensor:
        """The exchange with fixed shapes (ep_capacity.py): nothing is read on the host unless the
        capacity is below the worst case, where every rank reads the largest overflow."""
        ws, n_local = self.world_size, self.n_local
        tokens, top_k = selected.shape
        worst = tokens * top_k
        capacity = capacity_for(tokens, top_k, ws, self.capacity_factor)
        plan = plan_send(selected, self.n_experts, ws, capacity)
        if capacity < worst and self._overflowed(plan.overflow, group, capacity, worst):
            plan = plan_send(selected, self.n_experts, ws, worst)  # this call at the worst case
        recv_counts = exchange(plan.counts, group, differentiable=False)
        received = exchange(dispatch_rows(h, plan, top_k), group)
        ids = local_expert_ids(recv_counts, ws, n_local, plan.capacity)
        back = exchange(self._masked_experts(received, ids), group)
        return combine_rows(back, plan, weights)


def build_ep_model(rank: int, world_size: int, *, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
                   n_experts: int = 4, top_k: int = 2, vocab: int = 128, max_seq: int = 64,
                   device: Any = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                   local_dispatch: str = "loop", capacity_factor: Optional[float] = None,
                   overflow: str = "fallback") -> GPT:
    """A GPT whose feed-forward layers are EPMoE; identical weights for the shared parts on every
    rank, and each rank's local experts equal to that slice of one full set drawn from ``seed``."""
    torch.manual_seed(seed)
    model = GPT(vocab=vocab, d_model=d_model, n_layers=n_layers, n_heads=n_heads, max_seq=max_seq,
                ffn="mlp", n_experts=n_experts, top_k=top_k)
    d_ff = 2 * d_model
    n_local = n_experts // world_size
    for block in model.layers:
        moe = EPMoE(d_model, d_ff, n_experts, top_k, rank, world_size, local_dispatch=local_dispatch,
                    capacity_factor=capacity_factor, overflow=overflow)
        full = [Expert(d_model, d_ff) for _ in range(n_experts)]  # same draw on every rank
        for j in range(n_local):
            moe.experts[j].load_state_dict(full[rank * n_local + j].state_dict())
        block.ffn = moe
    return model.to(device=device, dtype=dtype)
