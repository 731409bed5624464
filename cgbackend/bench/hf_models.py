"""transformers models at real size in the bench registry (family ``hf``): a stack of transformers'
own decoder layers on hidden states (no embedding, no LM head, so the time is the layers'), token
counts swept as the shape models' are (``--tokens``; counts above 4096 are sequences of 4096).

``hf-qwen3-moe-128e``: transformers' ``Qwen3MoeModel`` shaped like Qwen3-30B-A3B's layers (hidden
2048, attention 32 query / 4 key-value heads of width 128, 128 experts top-8 of width 768, dense
width 6144), 2 layers, ``set_experts_implementation("eager")``: the model ``moe-128e`` writes by
hand, in transformers' code. Its contenders: eager, cgbackend (default options) and
``hf-grouped-mm-reduce-overhead`` (the same weights with transformers' grouped_mm experts under
reduce-overhead).

``hf-qwen3-moe-48l``: transformers' whole ``Qwen3MoeForCausalLM`` at that layer shape and 48 layers
(family ``zoo``: token ids in, logits out), the by-name contender beside ``cgbackend``."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from .registry import SHAPE_MAX_SEQ, BenchModel, register_model, upcast_float

__all__ = ["HiddenStatesMoE", "QWEN3_MOE_SHAPES", "build_qwen3_moe"]

QWEN3_MOE_SHAPES: dict[str, dict[str, Any]] = {
    "full": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 num_hidden_layers=2),
    "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2),
}


class HiddenStatesMoE(nn.Module):
    """A transformers MoE decoder stack (its ``*Model``, without the LM head) on hidden states:
    returns ``(last hidden states, top-k expert ids of the first MoE layer)``, the ids from a forward
    hook on that layer's router (``router``: its path in the layer)."""

    def __init__(self, model: nn.Module, router: str) -> None:
        super().__init__()
        self.model = model
        self.routing: Optional[torch.Tensor] = None
        model.layers[0].get_submodule(router).register_forward_hook(self._keep_routing)

    def _keep_routing(self, module: nn.Module, args: Any, out: Any) -> None:
        self.routing = out[2]  # (router logits, scores, expert ids)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(inputs_embeds=hidden, use_cache=False).last_hidden_state
        routing, self.routing = self.routing, None
        return out, routing


def build_qwen3_moe(scale: str, seed: int, dtype: torch.dtype, device: Any = "cpu",
                    experts: str = "eager") -> HiddenStatesMoE:
    """transformers' Qwen3-MoE stack at ``scale`` (QWEN3_MOE_SHAPES), random weights from ``seed``
    (drawn on ``device``, returned on CPU in ``dtype``), experts implementation ``experts``."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, max_position_embeddings=SHAPE_MAX_SEQ,
                                      decoder_sparse_step=1, mlp_only_layers=[], **QWEN3_MOE_SHAPES[scale])
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3MoeModel(cfg)
    model.set_experts_implementation(experts)
    return HiddenStatesMoE(model.to(dtype=dtype).to("cpu").eval(), "mlp.gate")


def _hidden_inputs(base: nn.Module, s: Any, tokens: Optional[int]) -> list:
    tokens = tokens or 64
    seq = min(tokens, SHAPE_MAX_SEQ)
    if tokens % seq:
        raise ValueError(f"tokens={tokens} must be at most {SHAPE_MAX_SEQ} or a multiple of it")
    hidden = base.model.config.hidden_size
    gen = torch.Generator(device=s.device).manual_seed(s.seed + 1)
    return [torch.randn(tokens // seq, seq, hidden, generator=gen, device=s.device).to(s.dtype)
            for _ in range(s.batches)]


register_model(BenchModel(
    name="hf-qwen3-moe-128e", family="hf", modes=("infer",),
    build=lambda s: build_qwen3_moe(s.scale, s.seed, s.dtype, device=s.device),
    inputs=_hidden_inputs,
    loss=lambda out, x: upcast_float(out[0]).pow(2).mean(),
    output=lambda out: out[0], routing=lambda out: out[1],
    contenders=("eager", "cgbackend", "hf-grouped-mm-reduce-overhead"), moe=True,
    defaults=dict(batches=4, warmup=6, iters=40, acc_batches=1, time_budget=3.0, tokens=(64, 512, 2048, 8192),
                  tiny_tokens=(64,)),
    description="transformers Qwen3MoeModel (no LM head) on hidden states: hidden 2048, 128 experts top-8 of "
                "width 768, 32 heads / 4 KV heads of width 128, 2 layers (Qwen3-30B-A3B's layer), "
                'set_experts_implementation("eager")'))


# ---------------------------------------------------------------------------------- Qwen3-MoE at depth

QWEN3_MOE_48L: dict[str, dict[str, Any]] = {
    "full": {**QWEN3_MOE_SHAPES["full"], "vocab_size": 151936, "num_hidden_layers": 48, "tokens": 2048},
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                 num_hidden_layers=2, tokens=32),
}
"""Qwen3-30B-A3B's whole model (``full``: hf-qwen3-moe-128e's layer shape at 48 layers, about 30B
parameters, 61 GB in bfloat16) and a CPU check's."""


def _qwen3_moe_48l() -> BenchModel:
    def build(s: Any) -> nn.Module:
        import transformers
        shape = dict(QWEN3_MOE_48L[s.scale])
        shape.pop("tokens")
        cfg = transformers.Qwen3MoeConfig(max_position_embeddings=4096, **shape)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(s.seed)
        # Drawn on the run device in the run dtype: the full model is one device copy (shared by every
        # contender, --share-weights), never a float32 or host one.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(s.dtype)
        try:
            with torch.device(s.device):
                model = transformers.Qwen3MoeForCausalLM(cfg)
        finally:
            torch.set_default_dtype(previous)
        model.set_experts_implementation("eager")
        return model.eval()

    def inputs(base: nn.Module, s: Any, tokens: Optional[int]) -> list:
        gen = torch.Generator().manual_seed(s.seed + 1)
        n = tokens or QWEN3_MOE_48L[s.scale]["tokens"]
        return [torch.randint(0, base.config.vocab_size, (1, n), generator=gen).to(s.device)
                for _ in range(s.batches)]

    return BenchModel(
        name="hf-qwen3-moe-48l", family="zoo", modes=("infer",), build=build, inputs=inputs,
        loss=lambda out, x: upcast_float(out.logits).pow(2).mean(), output=lambda out: out.logits,
        contenders=("eager", "cgbackend", "cgbackend-by-name", "hf-grouped-mm-reduce-overhead"), moe=True,
        # The float64 copy (240 GB) fits nowhere: judged against eager (--tol).
        defaults=dict(batches=3, warmup=3, iters=20, acc_batches=1, time_budget=3.0, share_weights=True,
                      reference="eager", floor_steps=0),
        description="transformers Qwen3-MoE at Qwen3-30B-A3B's shape: hidden 2048, 128 experts top-8 of width "
                    "768, 32 heads / 4 KV heads of width 128, 48 layers, set_experts_implementation(\"eager\"), "
                    "2048 tokens, inference, random weights drawn on the device, one copy shared by every "
                    "contender",
        to_device=lambda base, s: base.to(s.device))


register_model(_qwen3_moe_48l())
