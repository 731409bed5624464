"""Fixed-capacity expert-parallel exchange: every shape known from the token count, so the whole
MoE layer, the all-to-all included, can be one CUDA graph.

The dropless exchange (ep.py, ``local_dispatch="loop"`` / ``"padded"``) reads its split sizes on
the host (``.tolist()``) and sends exactly the routed rows: its shapes change every call and it
stays eager between graphs. Here, as in DeepEP's low-latency mode, Megatron's
``moe_pad_expert_input_to_capacity`` and torchtitan's static-capacity expert parallelism, each rank
sends every rank a block of ``capacity`` rows whatever the routing, and the counts go along as a
device tensor:

1. counts per expert on the device (``scatter_add``: ``bincount`` sizes its output from the data);
2. the send buffer ``[W * C, d]``: block ``j`` holds, in expert order, the first ``min(n_j, C)``
   routed copies owned by rank ``j`` and zeros after them. It is a gather (slot -> routed copy),
   so its backward is an ``index_add`` into the tokens' rows;
3. ``all_to_all_single`` with equal splits (split sizes None) for the rows and for the counts
   ``[E]`` (each rank receives ``[W, E_l]``: per source rank, per local expert);
4. the receiver gives each row of block ``s`` its local expert from the received counts (row
   ``i`` is expert ``e`` where ``cum[s, e-1] <= i < cum[s, e]``; rows past the block's count get
   ``E_l``, no expert) and runs its experts masked on the fixed buffer (ep.py);
5. the results go back the same way, and the combine reads, for each routed copy, only the row of
   its own slot: padding rows are never read.

**Capacity.** The worst case is every routed copy of a rank going to one rank: ``C = tokens *
top_k`` (:func:`capacity_for` with ``capacity_factor=None``, the default). Then nothing can overflow,
no check runs, and the result equals the dropless exchange up to rounding; the cost is ``W``
times the routed rows on the wire and in the buffers, and the local experts' masked FLOPs over
``W * C`` rows. A smaller capacity (``capacity_factor``: ``C = ceil(factor * tokens * top_k / W)``,
the balanced load times the factor) may overflow: the rows past ``C`` for a destination are
counted on the device (:attr:`SendPlan.overflow`) and :func:`overflow_on_any_rank` all-reduces
that count (max over ranks) and reads it on the host: one host synchronisation per layer and call,
which splits the layer's graph in two. Every rank reads the same value, so every rank takes the
same decision (a decision taken per rank would send one rank into an exchange the others never
join): run this call again at the worst-case capacity (``overflow="fallback"``) or raise
:class:`CapacityOverflow` (``overflow="raise"``). Both are counted (:class:`OverflowCounter`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch

__all__ = ["OVERFLOW_POLICIES", "CapacityOverflow", "OverflowCounter", "SendPlan", "capacity_for", "plan_send",
           "dispatch_rows", "combine_rows", "local_expert_ids", "exchange", "overflow_on_any_rank"]

OVERFLOW_POLICIES = ("fallback", "raise")
"""What a call whose routing overflows a capacity below the worst case does (on every rank)."""


class CapacityOverflow(RuntimeError):
    """Routed rows exceeded the expert-parallel capacity on some rank (``overflow="raise"``)."""


def capacity_for(tokens: int, top_k: int, world: int, capacity_factor: Optional[float]) -> int:
    """Rows each rank sends to each rank. ``None``: the worst case ``tokens * top_k`` (nothing can
    overflow); else ``ceil(factor * tokens * top_k / world)``, at least 1, at most the worst case."""
    worst = tokens * top_k
    if capacity_factor is None:
        return worst
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor!r}")
    return max(1, min(worst, math.ceil(capacity_factor * worst / world)))


@dataclasses.dataclass
class SendPlan:
    """Where each routed copy goes in the fixed-size send buffer (all device tensors)."""

    capacity: int
    counts: torch.Tensor
    """[E] routed copies per expert (int64)."""
    order: torch.Tensor
    """[M] routed copies (token-major index ``token * top_k + j``) sorted by expert, stably."""
    slot_src: torch.Tensor
    """[W * C] for each send slot, the sorted routed copy it carries (clamped where empty)."""
    slot_used: torch.Tensor
    """[W * C] the slot carries a routed copy."""
    copy_slot: torch.Tensor
    """[M] for each routed copy (token-major), its slot (clamped where it overflowed)."""
    copy_sent: torch.Tensor
    """[M] the routed copy (token-major) fits in its destination's block."""
    overflow: torch.Tensor
    """[] routed copies of this rank that did not fit (0 when the capacity is the worst case)."""


def plan_send(selected: torch.Tensor, n_experts: int, world: int, capacity: int) -> SendPlan:
    """The send plan of one call: ``selected`` is the router's ``[tokens, top_k]`` expert ids."""
    device = selected.device
    flat = selected.reshape(-1)
    m = flat.numel()
    n_local = n_experts // world
    counts = torch.zeros(n_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    order = torch.argsort(flat, stable=True)
    per_rank = counts.view(world, n_local).sum(1)
    start = torch.cumsum(per_rank, 0) - per_rank  # first sorted copy of each destination
    # Send side: slot j * C + i carries sorted copy start[j] + i while i < per_rank[j].
    i = torch.arange(capacity, device=device)
    slot_used = (i.unsqueeze(0) < per_rank.unsqueeze(1)).reshape(-1)
    slot_src = (start.unsqueeze(1) + i.unsqueeze(0)).reshape(-1).clamp(max=m - 1)
    # Combine side: the routed copy q (token-major) to rank dst, at sorted position p, sits in
    # slot dst * C + (p - start[dst]).
    positions = torch.arange(m, device=device)
    sorted_at = torch.empty_like(order).scatter_(0, order, positions)  # q -> p
    dst = torch.div(flat, n_local, rounding_mode="floor")
    within = sorted_at - start.index_select(0, dst)
    copy_sent = within < capacity
    copy_slot = dst * capacity + within.clamp(max=capacity - 1)
    overflow = (~copy_sent).sum()
    return SendPlan(capacity, counts, order, slot_src, slot_used, copy_slot, copy_sent, overflow)


def dispatch_rows(h: torch.Tensor, plan: SendPlan, top_k: int) -> torch.Tensor:
    """The send buffer ``[W * C, d]``: each used slot holds its routed copy's token row, the others
    zeros."""
    tokens = plan.order.index_select(0, plan.slot_src) // top_k
    rows = h.index_select(0, tokens)
    return torch.where(plan.slot_used.unsqueeze(-1), rows, torch.zeros((), dtype=h.dtype, device=h.device))


def combine_rows(back: torch.Tensor, plan: SendPlan, weights: torch.Tensor) -> torch.Tensor:
    """``[tokens, d]``: each token's routed copies read from their slots of the returned buffer
    (``back``), weighted by the router (``weights``: ``[tokens, top_k]``) and summed over the
    token's ``top_k`` copies in order (no atomics). A copy that did not fit reads nothing (the
    overflow check runs before this on every rank)."""
    rows = back.index_select(0, plan.copy_slot)
    w = weights.reshape(-1, 1).to(back.dtype)
    rows = torch.where(plan.copy_sent.unsqueeze(-1), rows * w, torch.zeros((), dtype=back.dtype, device=back.device))
    return rows.view(*weights.shape, back.shape[-1]).sum(1)


def local_expert_ids(recv_counts: torch.Tensor, world: int, n_local: int, capacity: int) -> torch.Tensor:
    """``[W * C]`` the local expert of each received row, ``n_local`` for rows past the count.
    ``recv_counts``: ``[W * E_l]``, per source rank the routed copies of each local expert, in the
    order the source sent them (by expert)."""
    cum = recv_counts.view(world, n_local).cumsum(1)
    i = torch.arange(capacity, device=recv_counts.device)
    return (i.view(1, capacity, 1) >= cum.unsqueeze(1)).sum(-1).reshape(-1)


def exchange(x: torch.Tensor, group: Any, differentiable: bool = True, out_splits: Optional[list] = None,
             in_splits: Optional[list] = None) -> torch.Tensor:
    """``all_to_all_single`` (the functional one, with gradients when ``differentiable``). Without
    split sizes the blocks are equal: block ``j`` of ``x`` goes to rank ``j``, sizes fixed by ``x``'s
    shape, so it may be captured in a graph (passes/collectives.py)."""
    from torch.distributed import _functional_collectives as funcol
    if differentiable:
        return funcol.all_to_all_single_autograd(x, out_splits, in_splits, group)
    return funcol.all_to_all_single(x, out_splits, in_splits, group)


def overflow_on_any_rank(overflow: torch.Tensor, group: Any) -> torch.Tensor:
    """The largest overflow over the ranks (an all-reduce of one number, on the device)."""
    from torch.distributed import _functional_collectives as funcol
    return funcol.all_reduce(overflow, "max", group)


class OverflowCounter:
    """Calls that overflowed the capacity and what they did, counted on the host.

    Called only on overflow, after the one host read every rank makes; kept out of Dynamo's
    tracing (``torch._dynamo.disable`` at the call site), so counting guards nothing and
    recompiles nothing."""

    def __init__(self, policy: str) -> None:
        if policy not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {policy!r}")
        self.policy = policy
        self.calls = 0
        """Calls whose routing overflowed the capacity on some rank."""
        self.fallbacks = 0
        """Of those, calls run again at the worst-case capacity (``overflow="fallback"``)."""
        self.rows = 0
        """The largest overflow over the ranks, summed over those calls."""

    def __call__(self, rows: int, capacity: int, worst: int) -> None:
        self.calls += 1
        self.rows += rows
        if self.policy == "raise":
            raise CapacityOverflow(
                f"expert-parallel capacity {capacity} rows per destination rank is too small for this "
                f"routing: {rows} routed rows did not fit on some rank (worst case {worst}); raise "
                "capacity_factor, leave it None for the worst case, or use overflow='fallback'")
        self.fallbacks += 1

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "fallbacks": self.fallbacks, "rows": self.rows}
