"""Decoder-only language models: dense, and dropless MoE with two dispatch styles."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .layers import MLP, Block, Expert

__all__ = ["GPT", "MixtralStyleMoE", "SortedMoE"]


class _DroplessMoE(nn.Module):
    """Router ``gate`` and ``n_experts`` SwiGLU ``experts``; subclasses choose the dispatch."""

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.top_k = top_k
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(d_model, d_ff) for _ in range(n_experts))


class MixtralStyleMoE(_DroplessMoE):
    """Dropless top-k MoE dispatched like Hugging Face Mixtral's eager experts: one-hot expert mask,
    per-expert ``torch.where``, gather, expert MLP, ``index_add_`` weighted by the router."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = x.reshape(-1, c)
        router_logits = self.gate(h)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(h.dtype)
        final = torch.zeros((b * t, c), dtype=h.dtype, device=h.device)
        expert_mask = F.one_hot(selected, num_classes=self.n_experts).permute(2, 1, 0)
        for e in range(self.n_experts):
            idx, top_x = torch.where(expert_mask[e])
            current = h[None, top_x].reshape(-1, c)
            out = self.experts[e](current) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(h.dtype))
        return final.reshape(b, t, c)


class SortedMoE(_DroplessMoE):
    """Dropless top-k MoE dispatched by sorting: argsort tokens by expert, bincount the groups,
    split, run each expert on its group, scatter back with ``index_add_``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = x.reshape(-1, c)
        probs = F.softmax(self.gate(h), dim=-1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token_idx = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        torch._check(counts.shape[0] == self.n_experts)
        splits = counts.tolist()
        grouped = h[token_idx]
        outs = [self.experts[e](chunk) for e, chunk in enumerate(torch.split(grouped, splits))]
        y = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(h).index_add_(0, token_idx, y).reshape(b, t, c)


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, final norm, LM head.

    ``ffn`` chooses the feed-forward: "mlp" (dense), "moe" (Mixtral-style dispatch) or
    "moe_sort" (sort/bincount dispatch)."""

    def __init__(self, vocab: int = 1024, d_model: int = 512, n_layers: int = 4, n_heads: int = 8,
                 d_ff: int | None = None, max_seq: int = 1024, ffn: str = "mlp", n_experts: int = 8,
                 top_k: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        d_ff = d_ff or 4 * d_model
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_seq, d_model)
        blocks = []
        for _ in range(n_layers):
            if ffn == "mlp":
                layer = MLP(d_model, d_ff, dropout)
            elif ffn == "moe":
                layer = MixtralStyleMoE(d_model, d_ff // 2, n_experts, top_k)
            elif ffn == "moe_sort":
                layer = SortedMoE(d_model, d_ff // 2, n_experts, top_k)
            else:
                raise ValueError(f"ffn must be 'mlp', 'moe' or 'moe_sort', got {ffn!r}")
            blocks.append(Block(d_model, n_heads, layer, dropout))
        self.layers = nn.ModuleList(blocks)
        self.norm_f = nn.RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))
