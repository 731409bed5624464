"""Decoder stacks at the shapes of real models, for the real-size benchmarks (`bench --models moe-mixtral-shape`, ...).

Each model is a stack of pre-norm decoder layers (RMSNorm, grouped-query attention with rotary
embeddings, then a SwiGLU MLP or a dropless top-k MoE) that takes hidden states ``[batch, seq,
hidden]`` and returns them: no embedding and no LM head, so the time is the layers' (a 128k-vocab
head would dominate a 2-layer stack). MoE layers are written the way Mixtral's eager code writes
them: a per-expert ``nn.ModuleList`` and a loop over ``range(E)`` with ``torch.where`` on the
one-hot mask, a gather, the expert, and ``index_add_``.

``RealModel(cfg, moe_impl="grouped")`` is the same model with each MoE layer written by hand in
the grouped-GEMM form (tokens sorted by expert on the device, offsets from a device-side count and
``cumsum``, one ``torch._grouped_mm`` per expert weight, weighted combine), with the expert
weights stacked; :func:`grouped_from` builds it from a loop model's weights, and
:func:`named_grads` / :func:`load_weights` map its gradients and weights back to the loop
model's parameter names, so the benchmark compares them one to one.

An MoE model returns ``(hidden, routing)``: ``routing`` is ``[layers, tokens, top_k]``, the
experts each token was sent to, so the benchmark can count tokens whose routing differs from a
float64 reference. ``return_routing=False`` returns the hidden states alone.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .grouped import StackedExperts
from .layers import Expert

__all__ = ["RealConfig", "SHAPES", "RealModel", "LoopMoE", "GroupedMoE", "grouped_from", "grouped_view",
           "device_copy", "streamed_forward", "named_grads", "load_weights", "grouped_mm_unsupported",
           "make_hidden_inputs"]


@dataclasses.dataclass(frozen=True)
class RealConfig:
    hidden: int
    heads: int
    kv_heads: int
    layers: int
    ffn: int
    """SwiGLU width of the dense MLP, or of each routed expert."""
    experts: int = 0
    """Routed experts (0: a dense model)."""
    top_k: int = 0
    shared: int = 0
    """Shared experts, as one SwiGLU MLP of width ``shared * ffn`` applied to every token (DeepSeek)."""
    norm_topk: bool = True
    """Renormalize the top-k router probabilities to sum to 1 (Mixtral) or not (DeepSeek-V2-Lite)."""
    max_pos: int = 4096
    head_dim: int = 0
    """Width of one attention head (0: hidden // heads); Qwen3's MoE models use 128 at hidden 2048."""

    @property
    def head_width(self) -> int:
        return self.head_dim or self.hidden // self.heads


SHAPES: dict[str, dict[str, RealConfig]] = {
    # DeepSeek-V2-Lite's MoE shape (its attention is MLA; here plain multi-head attention, 16 heads).
    "moe-dsv2lite-shape": {
        "full": RealConfig(hidden=2048, heads=16, kv_heads=16, layers=2, ffn=1408, experts=64, top_k=6, shared=2,
                           norm_topk=False),
        "tiny": RealConfig(hidden=64, heads=4, kv_heads=4, layers=2, ffn=32, experts=8, top_k=3, shared=2,
                           norm_topk=False, max_pos=256),
    },
    "moe-mixtral-shape": {
        "full": RealConfig(hidden=4096, heads=32, kv_heads=8, layers=2, ffn=14336, experts=8, top_k=2),
        "tiny": RealConfig(hidden=64, heads=4, kv_heads=2, layers=2, ffn=64, experts=4, top_k=2, max_pos=256),
    },
    # Qwen3-30B-A3B's shape: 128 routed experts top-8 (no shared expert), expert ffn 768, 32 query /
    # 4 key-value heads of width 128; 2 layers here, 48 (the real depth) in moe-128e-deep.
    "moe-128e": {
        "full": RealConfig(hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=2, ffn=768, experts=128,
                           top_k=8),
        "tiny": RealConfig(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=2, ffn=32, experts=16, top_k=4,
                           max_pos=256),
    },
    "moe-128e-deep": {
        "full": RealConfig(hidden=2048, heads=32, kv_heads=4, head_dim=128, layers=48, ffn=768, experts=128,
                           top_k=8),
        "tiny": RealConfig(hidden=64, heads=4, kv_heads=2, head_dim=32, layers=12, ffn=32, experts=16, top_k=4,
                           max_pos=256),
    },
    "dense-llama8b-shape": {
        "full": RealConfig(hidden=4096, heads=32, kv_heads=8, layers=2, ffn=14336),
        "tiny": RealConfig(hidden=64, heads=4, kv_heads=2, layers=2, ffn=128, max_pos=256),
    },
}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention (Llama's layout: q/k/v/o projections, rotary embeddings, key and value
    heads repeated to the query heads), causal SDPA."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int = 0) -> None:
        super().__init__()
        if (not head_dim and hidden % heads) or heads % kv_heads:
            raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}: need hidden % heads == 0 "
                             "(or a head_dim) and heads % kv_heads == 0")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim or hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        if rep > 1:
            k = k[:, :, None].expand(b, self.kv_heads, rep, t, hd).reshape(b, self.heads, t, hd)
            v = v[:, :, None].expand(b, self.kv_heads, rep, t, hd).reshape(b, self.heads, t, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * hd))


def _route(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    weights, selected = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, selected


def _router(moe: nn.Module, cfg: RealConfig) -> None:
    """The router of either MoE form: expert count, top-k, renormalization and the gate."""
    moe.n_experts, moe.top_k, moe.norm_topk = cfg.experts, cfg.top_k, cfg.norm_topk
    moe.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
    moe.shared_experts = Expert(cfg.hidden, cfg.shared * cfg.ffn) if cfg.shared else None


def _routing(moe: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens as rows ``[b * t, c]``, their top-k weights (in the tokens' dtype) and experts."""
    h = x.reshape(-1, x.shape[-1])
    weights, selected = _route(moe.gate(h), moe.top_k, moe.norm_topk)
    return h, weights.to(h.dtype), selected


class LoopMoE(nn.Module):
    """Dropless top-k MoE in Mixtral's eager style: a per-expert ModuleList and a loop over every
    expert (``torch.where`` on the one-hot mask, gather, expert, ``index_add_``), plus optional
    shared experts."""

    def __init__(self, cfg: RealConfig) -> None:
        super().__init__()
        _router(self, cfg)
        self.experts = nn.ModuleList(Expert(cfg.hidden, cfg.ffn) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        h, weights, selected = _routing(self, x)
        final = torch.zeros_like(h)
        expert_mask = F.one_hot(selected, num_classes=self.n_experts).permute(2, 1, 0)
        for e in range(self.n_experts):
            idx, top_x = torch.where(expert_mask[e])
            current = h[None, top_x].reshape(-1, c)
            out = self.experts[e](current) * weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(h.dtype))
        if self.shared_experts is not None:
            final = final + self.shared_experts(h)
        return final.reshape(b, t, c), selected


class GroupedMoE(StackedExperts):
    """The same layer in the grouped-GEMM form, written by hand: expert weights stacked
    (``w1``, ``w3``: ``[E, ffn, hidden]``; ``w2``: ``[E, hidden, ffn]``), token copies sorted by
    expert on the device, group ends from a device-side count and ``cumsum`` (no host sync), one
    ``torch._grouped_mm`` per weight, the weighted copies put back in token order and summed over
    the top-k (grouped.grouped_experts). Needs the expert sizes to be multiples of 8 (16-byte
    strides in bf16)."""

    def __init__(self, cfg: RealConfig) -> None:
        super().__init__(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k)
        _router(self, cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        h, weights, selected = _routing(self, x)
        final = self.run_experts(h, weights, selected)
        if self.shared_experts is not None:
            final = final + self.shared_experts(h)
        return final.reshape(b, t, c), selected


class Block(nn.Module):
    def __init__(self, cfg: RealConfig, moe_impl: str) -> None:
        super().__init__()
        self.input_norm = nn.RMSNorm(cfg.hidden)
        self.attn = Attention(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_width)
        self.post_attn_norm = nn.RMSNorm(cfg.hidden)
        if not cfg.experts:
            self.mlp: nn.Module = Expert(cfg.hidden, cfg.ffn)
        elif moe_impl == "loop":
            self.mlp = LoopMoE(cfg)
        elif moe_impl == "grouped":
            self.mlp = GroupedMoE(cfg)
        else:
            raise ValueError(f"moe_impl must be 'loop' or 'grouped', got {moe_impl!r}")

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        x = x + self.attn(self.input_norm(x), cos, sin)
        out = self.mlp(self.post_attn_norm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out, None


class RealModel(nn.Module):
    """``cfg.layers`` decoder layers on hidden states ``[batch, seq, hidden]``; see the module doc."""

    def __init__(self, cfg: RealConfig, *, moe_impl: str = "loop", return_routing: bool = True) -> None:
        super().__init__()
        self.cfg, self.moe_impl, self.return_routing = cfg, moe_impl, return_routing
        self.layers = nn.ModuleList(Block(cfg, moe_impl) for _ in range(cfg.layers))
        hd = cfg.head_width
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(cfg.max_pos, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor):
        t = x.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        routing = []
        for layer in self.layers:
            x, selected = layer(x, cos, sin)
            if selected is not None:
                routing.append(selected)
        if routing and self.return_routing:
            return x, torch.stack(routing)
        return x


def _moe_pairs(model: nn.Module, base: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    base_modules = dict(base.named_modules())
    for name, module in model.named_modules():
        if isinstance(module, GroupedMoE):
            yield name, module, base_modules[name]


def load_weights(model: nn.Module, base: nn.Module) -> None:
    """Copy ``base``'s weights into ``model`` in place: the same structure, or ``model`` grouped and
    ``base`` the loop model it was made from (expert weights stacked)."""
    grouped = {name for name, _, _ in _moe_pairs(model, base)}
    with torch.no_grad():
        base_params = dict(base.named_parameters())
        for name, p in model.named_parameters():
            owner = name.rpartition(".")[0]
            if owner in grouped and name.rpartition(".")[2] in ("w1", "w2", "w3"):
                continue
            p.copy_(base_params[name])
        for (_, mb), (_, bb) in zip(model.named_buffers(), base.named_buffers()):
            mb.copy_(bb)
    for _, module, loop in _moe_pairs(model, base):
        module.load_experts(loop.experts)


def grouped_from(base: RealModel, device: torch.device | str | None = None) -> RealModel:
    """A grouped-GEMM copy of the loop model ``base`` (same weights, experts stacked), built
    without copying each expert first; on ``device`` (default: base's)."""
    ref = next(base.parameters())
    device = ref.device if device is None else torch.device(device)
    with torch.device("meta"):
        model = RealModel(base.cfg, moe_impl="grouped", return_routing=base.return_routing).to(ref.dtype)
    model = model.to_empty(device=device)
    load_weights(model, base)
    model.train(base.training)
    return model


def device_copy(base: RealModel, device: torch.device | str) -> RealModel:
    """``base`` on ``device`` without a second copy on the host: built on the meta device, then
    each parameter and buffer copied over (a 48-layer MoE is 60 GB in bf16)."""
    ref = next(base.parameters())
    with torch.device("meta"):
        model = RealModel(base.cfg, moe_impl=base.moe_impl, return_routing=base.return_routing).to(ref.dtype)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for (_, p), (_, b) in zip(model.named_parameters(), base.named_parameters()):
            p.copy_(b)
        for (_, p), (_, b) in zip(model.named_buffers(), base.named_buffers()):
            p.copy_(b)
    model.train(base.training)
    return model


def grouped_view(loop: RealModel) -> RealModel:
    """The grouped-GEMM form of the loop model ``loop`` on the same memory, for inference: its
    experts' weights laid out as one block per weight (cgbackend's own relayout, in place: the same
    Parameter objects and values), the grouped layers' stacked weights views of those blocks, and
    every other parameter and buffer the loop model's own object. Contenders that only run
    inference can then share one copy of a model too large for three."""
    from ..moe.expert_layout import consecutive, stack_expert_params
    stack_expert_params(loop)
    with torch.device("meta"):
        model = RealModel(loop.cfg, moe_impl="grouped", return_routing=loop.return_routing)
    loop_modules = dict(loop.named_modules())
    for name, module in model.named_modules():
        source = loop_modules[name]
        if isinstance(module, GroupedMoE):
            for w in ("w1", "w2", "w3"):
                ws = [getattr(e, w).weight.detach() for e in source.experts]
                if not consecutive(ws):
                    raise RuntimeError(f"{name}: the experts' {w} weights are not one block")
                w0 = ws[0]
                block = w0.as_strided((len(ws),) + tuple(w0.shape), (w0.numel(),) + tuple(w0.stride()),
                                      w0.storage_offset())
                module._parameters[w] = nn.Parameter(block, requires_grad=False)
        for key in list(module._parameters):
            if not (isinstance(module, GroupedMoE) and key in ("w1", "w2", "w3")):
                module._parameters[key] = source._parameters[key]
        for key in list(module._buffers):
            module._buffers[key] = source._buffers[key]
    model.train(False)
    return model


def streamed_forward(base: RealModel, x: torch.Tensor, device: torch.device | str,
                     dtype: torch.dtype = torch.float64) -> Any:
    """``base(x)`` computed one layer at a time, each layer copied to ``device`` in ``dtype`` and
    dropped after: the float64 reference of a model whose float64 copy does not fit (inference).
    Returns what ``base`` returns: the hidden states and, for MoE models, the routing."""
    t = x.shape[1]
    cos = base.rope_cos[:t].to(device, dtype)
    sin = base.rope_sin[:t].to(device, dtype)
    h = x.to(device, dtype)
    routing = []
    with torch.no_grad():
        for layer in base.layers:
            on_device = copy.deepcopy(layer).to(device=device, dtype=dtype)
            h, selected = on_device(h, cos, sin)
            if selected is not None:
                routing.append(selected)
            del on_device
    if routing and base.return_routing:
        return h, torch.stack(routing)
    return h


def named_grads(model: nn.Module) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """(name, gradient) of every parameter under the loop model's names: a grouped layer's stacked
    gradients are split per expert (``...experts.<e>.w1.weight``)."""
    stacked = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedMoE):
            stacked[name] = module
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        if owner in stacked and leaf in ("w1", "w2", "w3"):
            continue
        yield name, p.grad
    for owner, module in stacked.items():
        for w in ("w1", "w2", "w3"):
            grad = getattr(module, w).grad
            for e in range(module.n_experts):
                yield f"{owner}.experts.{e}.{w}.weight", None if grad is None else grad[e]


def grouped_mm_unsupported(device: torch.device | str, dtype: torch.dtype) -> Optional[str]:
    """None when ``torch._grouped_mm`` runs forward and backward on ``device`` in ``dtype`` (a tiny
    probe with an empty group); else why not, in words."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        a = torch.randn(6, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([2, 2, 6], device=device, dtype=torch.int32)
        y = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
        y.backward(torch.ones_like(y))
    except Exception as exc:  # the probe's failure is the answer
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"torch._grouped_mm fails on {torch.device(device).type} in {dtype}: {type(exc).__name__}: {first}"
    try:  # what torch.compile traces with: the meta kernel (bf16 only in torch 2.11-2.13)
        torch._grouped_mm(a.detach().to("meta"), w.detach().to("meta").transpose(-2, -1), offs=offs.to("meta"))
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"torch._grouped_mm cannot be traced by torch.compile in {dtype}: {type(exc).__name__}: {first}"
    return None


def make_hidden_inputs(cfg: RealConfig, *, tokens: int, n: int, device: torch.device | str,
                       dtype: torch.dtype, seed: int, max_seq: int = 4096) -> list[torch.Tensor]:
    """``n`` distinct batches of ``tokens`` hidden states, ``[tokens // seq, seq, hidden]`` with
    ``seq = min(tokens, max_seq)``; each batch routes differently."""
    seq = min(tokens, max_seq)
    if tokens % seq:
        raise ValueError(f"tokens={tokens} must be at most {max_seq} or a multiple of it")
    if seq > cfg.max_pos:
        raise ValueError(f"sequence length {seq} exceeds the model's max_pos {cfg.max_pos}")
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(tokens // seq, seq, cfg.hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)
            for _ in range(n)]
