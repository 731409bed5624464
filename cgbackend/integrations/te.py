"""Transformer Engine modules as opaque calls inside cgbackend's graphs (see opaque.py).

Imported only when ``transformer_engine`` is (``opaque.families``). Supported, with their default
outputs (one tensor): ``te.Linear``, ``te.LayerNormLinear``, ``te.LayerNormMLP``, ``te.LayerNorm``,
``te.RMSNorm``, ``te.TransformerLayer``. Other TE modules, and these with tensor parallelism,
sequence parallelism, user-buffer overlap, fused weight-gradient accumulation or extra outputs
(``return_bias``, ``return_layernorm_output``), keep their own forward: Dynamo breaks the graph
there and they run eagerly, listed with the reason in the report.

A static region holding TE calls is captured and replayed like any other; its hooks do for FP8 what
Transformer Engine's own ``make_graphed_callables`` does around its graphs:

* key: FP8 on/off, calibration, the recipe and the amax group, and each module's ``training``
  flag. None of them is an input of the graph, all of them change the kernels TE records.
* capture: TE's own "graph capturing" flag is set (as make_graphed_callables sets it), so a TE
  backward records no amax reduction into the graph (the hooks run it after the replay) and TE's
  attention takes its capture-safe paths. The weight-update flag tensor TE keeps for its own
  graphs is hidden, so each call keeps its ``is_first_microbatch`` (a constant of the graph:
  Dynamo compiles one graph per value). The "first FP8 module" flag is restored after the
  capture: the replay that follows consumes it.
* forward replay (FP8 on): each module's FP8 metadata joins TE's global amax buffers (once; the
  amax reduction at ``te.autocast`` exit then updates their scales as in eager), and the region
  takes the "first FP8 module" flag if still set: its backward then runs the backward amax
  reduction and scale update, as the first module's backward does in eager TE.
* RNG: TE's tracked CUDA RNG states (``te.distributed``) are registered with each graph.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ContextManager, Iterator, Optional

import torch

from .opaque import Family, RegionHooks, fake_requires_grad, register_family

__all__ = ["TEFamily"]

log = logging.getLogger(__name__)

import transformer_engine.pytorch as te  # noqa: E402  (imported only when TE already is)

try:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager
except ImportError:  # older TE
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # type: ignore[no-redef]

try:
    from transformer_engine.pytorch import graph as _te_graph
except ImportError:  # pragma: no cover
    _te_graph = None  # type: ignore[assignment]

try:
    from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
except ImportError:  # pragma: no cover
    TransformerEngineBaseModule = ()  # type: ignore[assignment,misc]

_SAME_SHAPE = tuple(c for c in (getattr(te, n, None) for n in
                                ("LayerNormMLP", "LayerNorm", "RMSNorm", "TransformerLayer")) if c)
_LINEAR = tuple(c for c in (getattr(te, n, None) for n in ("Linear", "LayerNormLinear")) if c)
_KERNELS = {"Linear": 4, "LayerNormLinear": 6, "LayerNormMLP": 12, "LayerNorm": 1, "RMSNorm": 1,
            "TransformerLayer": 40}
_ROLES = {"LayerNormMLP": "mlp", "LayerNorm": "norm", "RMSNorm": "norm", "TransformerLayer": "attention"}


def _is_te(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("transformer_engine.")


def _state() -> Any:
    return getattr(FP8GlobalStateManager, "quantization_state", None)


def _recipe_key(recipe: Any, group: Any) -> str:
    key_fn = getattr(FP8GlobalStateManager, "get_unique_autocast_key", None)
    if key_fn is not None:
        try:
            return str(key_fn(recipe, group))
        except Exception:  # signature differs across TE versions
            pass
    return f"{type(recipe).__name__}:{recipe!r}:{id(group) if group is not None else None}"


class TEFamily(Family):
    name = "te"
    package = "transformer_engine"
    falsy_kwargs = ("fp8_output", "fp8_grad", "checkpoint_core_attention", "inference_params")

    def kind(self, module: torch.nn.Module) -> Optional[str]:
        return f"te.{type(module).__name__}" if _is_te(module) else None

    def unsupported(self, module: torch.nn.Module) -> Optional[str]:
        if not isinstance(module, _SAME_SHAPE + _LINEAR):
            return "no output-shape rule for this TE module in cgbackend"
        for flag in ("return_bias", "return_layernorm_output", "return_layernorm_output_gathered"):
            if getattr(module, flag, False):
                return f"{flag}=True: calls with several outputs are not supported"
        if getattr(module, "tp_size", 1) > 1 or getattr(module, "sequence_parallel", False):
            return "tensor or sequence parallelism (collectives inside a graph) is not supported"
        if any(getattr(module, n, False) for n in dir(module) if n.startswith("ub_overlap")):
            return "user-buffer communication overlap is not supported"
        if getattr(module, "fuse_wgrad_accumulation", False):
            return "fuse_wgrad_accumulation writes main_grad outside autograd; not supported"
        if any(isinstance(getattr(m, "weight", None), _quantized_types()) for m in module.modules()):
            return "FP8 (quantized) parameters are not supported"
        return None

    def fake(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        inp = args[0] if args else kwargs.get("inp", kwargs.get("hidden_states"))
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"cgbackend: {type(module).__name__} called without a tensor input")
        dtype = inp.dtype
        if torch.is_autocast_enabled():
            dtype = torch.get_autocast_gpu_dtype() if hasattr(torch, "get_autocast_gpu_dtype") \
                else torch.get_autocast_dtype("cuda")
        if isinstance(module, _LINEAR):
            shape = (*inp.shape[:-1], module.out_features)
        else:
            shape = tuple(inp.shape)
        out = inp.new_empty(shape, dtype=dtype)
        return fake_requires_grad(out, args, list(module.parameters()))

    def kernels(self, module: torch.nn.Module) -> int:
        return _KERNELS.get(type(module).__name__, 8)

    def role(self, module: torch.nn.Module) -> Optional[str]:
        return _ROLES.get(type(module).__name__)

    def hooks(self, modules: list[torch.nn.Module]) -> Optional[RegionHooks]:
        return TEHooks(modules)


def _quantized_types() -> tuple:
    try:
        from transformer_engine.pytorch.quantized_tensor import QuantizedTensor
        return (QuantizedTensor,)
    except ImportError:  # pragma: no cover
        return ()


class TEHooks(RegionHooks):
    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.outer = modules
        base = TransformerEngineBaseModule
        self.base = [m for o in modules for m in o.modules() if base and isinstance(m, base)]

    def key(self) -> tuple:
        enabled = FP8GlobalStateManager.is_fp8_enabled()
        calibrating = FP8GlobalStateManager.is_fp8_calibration()
        recipe = _recipe_key(FP8GlobalStateManager.get_fp8_recipe(), FP8GlobalStateManager.get_fp8_group()) \
            if enabled or calibrating else None
        return (enabled, calibrating, recipe, tuple(m.training for m in self.outer))

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        state = _state()
        first = getattr(state, "is_first_fp8_module", None)
        skip = getattr(state, "skip_fp8_weight_update_tensor", None)
        if skip is not None:
            state.skip_fp8_weight_update_tensor = None
        # Without FP8, TE fuses bias/GELU/dropout steps with torch.compile'd helpers, which guard on
        # the call and recompile inside the capture (which cannot work). They run unfused in the
        # graph then: results within bf16 rounding of eager TE, not bitwise (measured ~0.4%).
        # With FP8 on, TE's own kernels run and the graphs are bitwise equal to eager TE.
        unfused = not FP8GlobalStateManager.is_fp8_enabled() and hasattr(torch.compiler, "set_stance")
        stance = torch.compiler.set_stance("force_eager") if unfused else contextlib.nullcontext()
        try:
            with _te_capture_flag(), stance:
                yield
        finally:
            if skip is not None:
                state.skip_fp8_weight_update_tensor = skip
            if first is not None:
                state.is_first_fp8_module = first

    def generators(self) -> list:
        try:
            from transformer_engine.pytorch.distributed import get_all_rng_states, graph_safe_rng_available
        except ImportError:  # pragma: no cover
            return []
        if not graph_safe_rng_available():
            return []
        return list(get_all_rng_states().values())

    def before_forward(self) -> Any:
        if not FP8GlobalStateManager.is_fp8_enabled():
            return False
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        group = FP8GlobalStateManager.get_fp8_group()
        fp8_attention = getattr(recipe, "fp8_mha", False) or getattr(recipe, "fp8_dpa", False)
        dpa = getattr(te, "DotProductAttention", ())
        for m in self.base:
            meta = getattr(m, "fp8_meta", None)
            if meta is None or (isinstance(m, dpa) and not fp8_attention):
                continue
            meta["fp8_group"] = group
            meta["recipe"] = recipe
            FP8GlobalStateManager.add_fp8_tensors_to_global_buffer(meta)
        return FP8GlobalStateManager.is_first_fp8_module()

    def after_backward(self, token: Any) -> None:
        if token:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)

    def quiet_backward(self) -> ContextManager[None]:
        # An eager backward through a captured forward's autograd graph: TE's first-module backward
        # would run the reduction itself; after_backward does it once.
        return _te_capture_flag()


@contextlib.contextmanager
def _te_capture_flag() -> Iterator[None]:
    """TE's own "make_graphed_callables is capturing" flag, set for the duration (left alone if
    already set, or if this TE has none)."""
    was = _te_graph.is_graph_capturing() if _te_graph is not None else True
    if not was:
        _te_graph.set_capture_start()
    try:
        yield
    finally:
        if not was:
            _te_graph.set_capture_end()


register_family(TEFamily())
