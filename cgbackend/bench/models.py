"""The benchmark's model registry: each entry is data (how to build the model and its inputs, its
loss, which modes and contenders it runs by default, and per-model settings defaults).

Families:
- ``reference``: the small reference models of ``cgbackend.models`` (``--size`` and the size flags).
- ``shape``: real-size decoder stacks (``cgbackend/models/realsize.py``), ``--scale full|tiny``,
  ``--tokens`` (a sweep gives one row group per token count, same model name).
- ``decode``: transformers models from small configs, greedy decode with a StaticCache
  (``decode.py``).
- ``hf`` (``hf_models.py``): transformers models at real size on hidden states, token counts swept.
- ``zoo``: transformers MoE models from the zoo's small configs (``benchmarks/zoo.py``) with
  ``set_experts_implementation("eager")``, inference and a training step on ``--batch`` x ``--seq``
  token ids (``--scale tiny``: a smaller config for CPU checks).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .registry import SHAPE_MAX_SEQ, BenchModel, MODELS, register_model, upcast_float

__all__ = ["BenchModel", "DECODE_SHAPES", "MODELS", "SHAPE_MAX_SEQ", "build_hf", "register_model", "upcast_float"]


# ---------------------------------------------------------------------------------- reference


def _reference(name: str) -> BenchModel:
    from ..models import is_language_model

    def build(s: Any) -> nn.Module:
        from ..models import build_model
        return build_model(name, size=s.size, device="cpu", dtype=s.dtype, seed=s.seed, **s.overrides)

    def inputs(base: nn.Module, s: Any, tokens: Optional[int]) -> list:
        from ..models import make_inputs
        return make_inputs(name, base, batch=s.batch, seq=s.seq, n=s.batches, device=s.device, dtype=s.dtype,
                           seed=s.seed + 1)

    def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if is_language_model(name):
            logits = upcast_float(out[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return upcast_float(out).pow(2).mean()

    return BenchModel(name=name, family="reference", modes=("infer", "train"), build=build, inputs=inputs,
                      loss=loss, moe=name in ("moe", "moe_sort"), description=f"cgbackend.models {name!r}")


for _name in ("dense", "moe", "moe_sort", "item", "cpu_op", "dropout"):
    register_model(_reference(_name))

# ---------------------------------------------------------------------------------- real-size shapes

_MOE_SHAPE_CONTENDERS = ("eager", "cgbackend", "cgbackend-static-dispatch", "grouped-reduce-overhead")
_DENSE_SHAPE_CONTENDERS = ("eager", "reduce-overhead", "cgbackend", "cgbackend-eager-kernels")
_MOE_128E_CONTENDERS = ("eager", "cgbackend", "grouped-reduce-overhead", "step-floor")
_SHAPE_DEFAULTS = dict(batches=4, warmup=6, iters=40, acc_batches=1, time_budget=3.0, tokens=(4096,),
                       tiny_tokens=(64,))


def _shape(name: str, contenders: tuple[str, ...], description: str, modes: tuple[str, ...] = ("infer", "train"),
           defaults: Optional[dict] = None) -> BenchModel:
    from ..models import realsize

    def cfg(s: Any) -> "realsize.RealConfig":
        return realsize.SHAPES[name][s.scale]

    def build(s: Any) -> nn.Module:
        # Drawn on the run device (fast at 3B parameters), kept on CPU between contenders.
        torch.manual_seed(s.seed)
        with torch.device(s.device):
            model = realsize.RealModel(cfg(s))
        return model.to(dtype=s.dtype).to("cpu")

    def inputs(base: nn.Module, s: Any, tokens: Optional[int]) -> list:
        return realsize.make_hidden_inputs(cfg(s), tokens=tokens, n=s.batches, device=s.device, dtype=s.dtype,
                                           seed=s.seed + 1, max_seq=SHAPE_MAX_SEQ)

    moe = bool(realsize.SHAPES[name]["full"].experts)
    return BenchModel(
        name=name, family="shape", modes=modes, build=build, inputs=inputs,
        loss=lambda out, x: upcast_float(out[0] if isinstance(out, tuple) else out).pow(2).mean(),
        output=lambda out: out[0] if isinstance(out, tuple) else out,
        routing=lambda out: out[1] if isinstance(out, tuple) else None,
        contenders=contenders, defaults=dict(_SHAPE_DEFAULTS, **(defaults or {})), moe=moe, grouped=moe,
        description=description, to_device=lambda base, s: realsize.device_copy(base, s.device),
        reference_forward=lambda base, x, s: realsize.streamed_forward(base, x, s.device))


register_model(_shape("moe-dsv2lite-shape", _MOE_SHAPE_CONTENDERS,
                      "hidden 2048, 64 routed experts top-6 + 2 shared, expert ffn 1408, 16 heads, 2 layers, "
                      "per-expert ModuleList loop"))
register_model(_shape("moe-mixtral-shape", _MOE_SHAPE_CONTENDERS,
                      "hidden 4096, 8 experts top-2, expert ffn 14336, 32 heads / 8 KV heads, 2 layers, "
                      "per-expert ModuleList loop"))
register_model(_shape("moe-128e", _MOE_128E_CONTENDERS,
                      "hidden 2048, 128 routed experts top-8, expert ffn 768, 32 heads / 4 KV heads of width 128 "
                      "(Qwen3-30B-A3B's layer), 2 layers, per-expert ModuleList loop",
                      defaults=dict(tokens=(64, 512, 2048, 8192))))
register_model(_shape("moe-128e-deep", _MOE_128E_CONTENDERS,
                      "moe-128e at 48 layers (the real depth): one copy of the weights shared by every contender "
                      "(--share-weights; inference), float64 reference computed layer by layer",
                      modes=("infer",), defaults=dict(tokens=(2048,), share_weights=True, batches=3, warmup=3,
                                                      acc_batches=1, floor_steps=0)))
register_model(_shape("dense-llama8b-shape", _DENSE_SHAPE_CONTENDERS,
                      "hidden 4096, 32 heads / 8 KV heads, SwiGLU ffn 14336, 2 layers"))

# ---------------------------------------------------------------------------------- decode

DECODE_SHAPES: dict[str, dict[str, Any]] = {
    "full": dict(hidden=512, layers=4, heads=8, kv_heads=4, ffn=1536, expert_ffn=1024, experts=8, top_k=2,
                 olmoe_experts=64, olmoe_top_k=8, olmoe_ffn=256, vocab=32000, batch=8, prompt=16, new_tokens=32),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, expert_ffn=64, experts=4, top_k=2,
                 olmoe_experts=8, olmoe_top_k=4, olmoe_ffn=32, vocab=256, batch=2, prompt=4, new_tokens=6),
}


def build_hf(name: str, s: Any) -> nn.Module:
    """The transformers model behind ``name`` from a small config, random weights from ``s.seed``,
    on CPU in ``s.dtype``, in eval mode."""
    import transformers
    shape = DECODE_SHAPES[s.scale]
    common = dict(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_hidden_layers=shape["layers"],
                  num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                  max_position_embeddings=max(256, shape["prompt"] + shape["new_tokens"]))
    torch.manual_seed(s.seed)
    if name == "hf-llama":
        cfg = transformers.LlamaConfig(intermediate_size=shape["ffn"], **common)
        cfg._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(cfg)
    elif name == "hf-mixtral-eager-experts":
        cfg = transformers.MixtralConfig(intermediate_size=shape["expert_ffn"], num_local_experts=shape["experts"],
                                         num_experts_per_tok=shape["top_k"], **common)
        cfg._attn_implementation = "sdpa"
        model = transformers.MixtralForCausalLM(cfg)
        model.set_experts_implementation("eager")
    elif name in ("hf-olmoe-eager-experts", "hf-olmoe-grouped-mm"):
        cfg = transformers.OlmoeConfig(intermediate_size=shape["olmoe_ffn"], num_experts=shape["olmoe_experts"],
                                       num_experts_per_tok=shape["olmoe_top_k"], **common)
        cfg._attn_implementation = "sdpa"
        model = transformers.OlmoeForCausalLM(cfg)
        model.set_experts_implementation("eager" if name.endswith("eager-experts") else "grouped_mm")
    else:
        raise ValueError(f"no decode model {name!r}")
    return model.to(dtype=s.dtype).eval()


_DECODE_DEFAULTS = dict(batches=1, warmup=1, iters=20, acc_batches=1, time_budget=3.0)
"""Decode: up to 20 timed rounds of ``new_tokens - 1`` steps (620 at the full scale) within 3 s a
contender, in the alternating blocks: two identical contenders measured 0.6-11% apart with 2 rounds."""


def _decode(name: str, contenders: tuple[str, ...], moe: bool, description: str) -> BenchModel:
    def build(s: Any) -> nn.Module:
        return build_hf(name, s)

    return BenchModel(name=name, family="decode", modes=("decode",), build=build,
                      inputs=lambda base, s, tokens: [], loss=lambda out, x: out, contenders=contenders,
                      defaults=_DECODE_DEFAULTS, moe=moe, description=description)


register_model(_decode("hf-llama", ("eager", "reduce-overhead", "cgbackend", "cgbackend-static-dispatch"), False,
                       "transformers Llama, 4 layers, hidden 512, random weights"))
register_model(_decode("hf-mixtral-eager-experts",
                       ("eager", "reduce-overhead", "cgbackend", "cgbackend-static-dispatch",
                        "hf-grouped-mm-reduce-overhead"), True,
                       'transformers Mixtral, 4 layers, hidden 512, 8 experts top-2, '
                       'set_experts_implementation("eager")'))
register_model(_decode("hf-olmoe-eager-experts",
                       ("eager", "cgbackend", "cgbackend-small-batch", "hf-grouped-mm-reduce-overhead"), True,
                       'transformers OLMoE, 4 layers, hidden 512, 64 experts top-8 of width 256, '
                       'set_experts_implementation("eager")'))
register_model(_decode("hf-olmoe-grouped-mm", ("eager", "reduce-overhead", "cgbackend"), True,
                       'transformers OLMoE as hf-olmoe-eager-experts, set_experts_implementation("grouped_mm")'))

# ---------------------------------------------------------------------------------- zoo (infer, train)

ZOO_SHAPES: dict[str, dict[str, Any]] = {
    "full": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, experts=8, expert_ffn=128),
    "tiny": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, experts=4, expert_ffn=24),
}
_ZOO_TOP_K = 2


class LogitsAndRouting(nn.Module):
    """A transformers MoE causal LM returning ``(logits, top-k expert ids of its first MoE layer)``.
    The ids come from a forward hook on that layer's router, at ``router`` (its path in the layer;
    ``output_router_logits=True`` would collect them through transformers' output hooks, which
    break the graph under torch.compile)."""

    def __init__(self, model: nn.Module, router: str = "mlp.gate") -> None:
        super().__init__()
        self.model = model
        self.routing: Optional[torch.Tensor] = None
        model.model.layers[0].get_submodule(router).register_forward_hook(self._keep_routing)

    def _keep_routing(self, module: nn.Module, args: Any, out: Any) -> None:
        self.routing = out[2]  # (router logits, scores, expert ids)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=ids).logits
        routing, self.routing = self.routing, None
        return logits, routing


def _zoo_family(family: str) -> tuple[Any, Any, Callable[[int, int], dict], str]:
    """(config class, model class, the family's own config arguments for ``e`` experts of width
    ``ffn``, its router's path in a layer) of a zoo MoE family."""
    import transformers
    table = {
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                    lambda e, ffn: dict(num_local_experts=e), "mlp.gate"),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                      lambda e, ffn: dict(num_experts=e, moe_intermediate_size=ffn,
                                     shared_expert_intermediate_size=ffn, decoder_sparse_step=1),
                      "mlp.gate"),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
                  lambda e, ffn: dict(num_experts=e), "mlp.gate"),
        "phimoe": (transformers.PhimoeConfig, transformers.PhimoeForCausalLM,
                   lambda e, ffn: dict(num_local_experts=e), "mlp.router"),
        "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM,
                       lambda e, ffn: dict(num_local_experts=e), "block_sparse_moe.router"),
    }
    if family not in table:
        raise ValueError(f"no transformers MoE family {family!r} (known: {', '.join(table)})")
    return table[family]


ZOO_FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "phimoe", "granitemoe")


def build_hf_moe(family: str, scale: str, seed: int, dtype: torch.dtype, experts: str = "eager") -> nn.Module:
    """The zoo's transformers MoE model ``family`` (ZOO_FAMILIES) at ``scale``, random weights from
    ``seed``, on CPU in ``dtype``, experts implementation ``experts``."""
    shape = dict(ZOO_SHAPES[scale])
    e, ffn = shape.pop("experts"), shape.pop("expert_ffn")
    config_cls, model_cls, own, router = _zoo_family(family)
    torch.manual_seed(seed)
    cfg = config_cls(num_experts_per_tok=_ZOO_TOP_K, **own(e, ffn), **shape)
    cfg._attn_implementation = "sdpa"
    model = model_cls(cfg)
    model.set_experts_implementation(experts)
    return LogitsAndRouting(model.to(dtype=dtype).eval(), router)


def _zoo_moe(family: str) -> BenchModel:
    def inputs(base: nn.Module, s: Any, tokens: Optional[int]) -> list:
        gen = torch.Generator().manual_seed(s.seed + 1)
        vocab = base.model.config.vocab_size
        return [torch.randint(0, vocab, (s.batch, s.seq), generator=gen).to(s.device) for _ in range(s.batches)]

    def loss(out: Any, x: torch.Tensor) -> torch.Tensor:
        logits = upcast_float(out[0][:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))

    return BenchModel(
        name=f"zoo-{family.replace('_', '-')}-eager-experts", family="zoo", modes=("infer", "train"),
        build=lambda s: build_hf_moe(family, s.scale, s.seed, s.dtype), inputs=inputs, loss=loss,
        output=lambda out: out[0], routing=lambda out: out[1],
        contenders=("eager", "cgbackend", "hf-grouped-mm-reduce-overhead"), moe=True,
        defaults=dict(batches=8, warmup=6, iters=40, acc_batches=2, time_budget=3.0),
        description=f'transformers {family} (the zoo\'s config: hidden 128, 8 experts top-2, 2 layers), '
                    'set_experts_implementation("eager")')


for _name in ZOO_FAMILIES:
    register_model(_zoo_moe(_name))
del _name

from . import hf_models  # noqa: E402,F401  (registers the transformers models at real size)
