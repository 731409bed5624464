"""Benchmark contenders: one registry of the ways of running a model (eager, the stock torch.compile
modes, cgbackend with its options, and the hand-written forms that rebuild a model from the same
weights). A contender is data (:class:`Contender`); ``register_contender`` adds one.

The contenders that rebuild a model in another form from the same weights (``Contender.convert``):
what a person gets by rewriting the model by hand.

- ``grouped-reduce-overhead``: the shape MoE models (cgbackend/models/realsize.py) with every MoE
  layer in the grouped-GEMM form (``realsize.GroupedMoE``: sort by expert, device-side offsets,
  ``torch._grouped_mm``), under ``torch.compile(mode="reduce-overhead")``.
- ``hf-grouped-mm-reduce-overhead``: a transformers MoE model with
  ``set_experts_implementation("grouped_mm")`` (its experts are stored stacked, so the weights are
  the very same tensors' copy), under reduce-overhead; decode mode.

On CPU, where reduce-overhead cannot record CUDA graphs, both run under
``torch.compile(backend="eager")`` (Dynamo traces the form; no kernels compiled), so the smoke
tests exercise the tracing, the weights and the gradient mapping.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Any, Callable, ContextManager, Optional

import torch
import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Contender:
    """One way of running a model.

    make(model) -> callable: compiles (lazily, as torch.compile does) the given module.
    stock: a PyTorch-only contender (eligible for "best stock").
    needs_cuda: skipped with error "needs CUDA" when the run is on CPU.
    mark_step: call torch.compiler.cudagraph_mark_step_begin() before every call (cudagraph trees).
    call_context: a fresh context manager entered around every call (including the first).
    backend_stats(compiled) -> dict | None: counters of a cgbackend contender.
    """

    name: str
    make: Callable[[nn.Module], Callable[..., Any]]
    stock: bool
    needs_cuda: bool = False
    mark_step: bool = False
    call_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
    backend_stats: Optional[Callable[[Any], Optional[dict]]] = None
    description: str = ""
    convert: Optional[Callable[[nn.Module, torch.device], nn.Module]] = None
    """convert(base, device): the contender's own module on ``device``, built from the seed weights
    ``base`` in another structure (used instead of a plain copy of ``base``)."""
    applies_to: Optional[Callable[[Any], Optional[str]]] = None
    """BenchModel -> None, or why this contender does not apply to that model (row skipped)."""
    unsupported: Optional[Callable[[torch.device, torch.dtype], Optional[str]]] = None
    """Feature probe: None, or why this torch/device/dtype cannot run it (row skipped with the reason)."""
    restore: Optional[Callable[[nn.Module, nn.Module], None]] = None
    """restore(model, base): copy the seed weights back into a converted module."""
    named_grads: Optional[Callable[[nn.Module], Any]] = None
    """(name, grad) pairs under the base model's parameter names, for a converted module."""
    share: Optional[Callable[[nn.Module], nn.Module]] = None
    """share(model): the contender's own module viewing the weights of ``model``, the one device copy
    every contender runs on under --share-weights (inference)."""
    modes: tuple[str, ...] = ("infer", "train", "decode")


def _eager(model: nn.Module) -> Callable[..., Any]:
    return model


def _inductor(model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model)


def _reduce_overhead(model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model, mode="reduce-overhead")


def _dynops_context() -> ContextManager[Any]:
    return torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True, capture_scalar_outputs=True)


def _cudagraphs(model: nn.Module) -> Callable[..., Any]:
    return torch.compile(model, backend="cudagraphs")


def _cgbackend(**options: Any) -> Callable[[nn.Module], Callable[..., Any]]:
    def make(model: nn.Module) -> Callable[..., Any]:
        import cgbackend
        return cgbackend.compile(model, **options)
    return make


def _cgbackend_by_name(model: nn.Module) -> Callable[..., Any]:
    import cgbackend  # noqa: F401  (registers the name where the entry point is not installed)
    return torch.compile(model, backend="cgbackend")


def _cgbackend_stats(compiled: Any) -> Optional[dict]:
    """cgbackend's counters, and ``dispatch_forms``: how many dispatch units static dispatch
    rewrote into each form, how many it declined (the report says why), and the first rewrite's
    reason (the cost model's estimate where it chose)."""
    import cgbackend
    stats = dict(cgbackend.stats(compiled))
    forms: dict[str, int] = {}
    declined, why = 0, None
    for graph in cgbackend.report(compiled).graphs:
        for rewrite in graph.dispatch.get("rewrites", ()):
            forms[rewrite["form"]] = forms.get(rewrite["form"], 0) + 1
            why = why or rewrite.get("why")
        declined += len(graph.dispatch.get("skipped", ()))
    stats["dispatch_forms"] = {"forms": forms, "declined": declined, "why": why}
    return stats


CONTENDERS: dict[str, Contender] = {}


"""name -> Contender, in the default run order (eager first: everything is compared to it)."""


STOCK_CONTENDERS = ("eager", "inductor", "reduce-overhead", "reduce-overhead-dynops", "cudagraphs")


GROUPED_CONTENDERS = ("grouped-reduce-overhead", "hf-grouped-mm-reduce-overhead")
"""The hand-written grouped-GEMM forms (this module) that ``ratio_to_grouped`` divides by."""

YARDSTICKS = ("step-floor",)
"""Rows that measure a bound, not a way of running the model: not judged for accuracy (they do not
compute it), never best and never a win; other rows get ``ratio_to_step_floor`` against them."""


def register_contender(contender: Contender) -> Contender:
    """Add (or replace) a contender."""
    CONTENDERS[contender.name] = contender
    return contender


for _c in (
    Contender("eager", _eager, stock=True, description="the module as is"),
    Contender("inductor", _inductor, stock=True, description="torch.compile(model)"),
    Contender("reduce-overhead", _reduce_overhead, stock=True, needs_cuda=True, mark_step=True,
              description='torch.compile(model, mode="reduce-overhead")'),
    Contender("reduce-overhead-dynops", _reduce_overhead, stock=True, needs_cuda=True, mark_step=True,
              call_context=_dynops_context,
              description='reduce-overhead with capture_dynamic_output_shape_ops and '
                          'capture_scalar_outputs patched on around every call'),
    Contender("cudagraphs", _cudagraphs, stock=True, needs_cuda=True, mark_step=True,
              description='torch.compile(model, backend="cudagraphs")'),
    Contender("cgbackend", _cgbackend(), stock=False, backend_stats=_cgbackend_stats,
              description="cgbackend.compile(model) (default options: Inductor's kernels in the graphs on CUDA)"),
    Contender("cgbackend-eager-kernels", _cgbackend(inner="eager"), stock=False,
              backend_stats=_cgbackend_stats, description='cgbackend.compile(model, inner="eager") (the bitwise mode)'),
    Contender("cgbackend-inductor", _cgbackend(inner="inductor"), stock=False,
              backend_stats=_cgbackend_stats, description='cgbackend.compile(model, inner="inductor")'),
    Contender("cgbackend-static-dispatch", _cgbackend(static_dispatch="auto"), stock=False,
              backend_stats=_cgbackend_stats,
              description='cgbackend.compile(model, static_dispatch="auto") (MoE dispatch rewritten '
                          'into a static form, cgbackend/moe/)'),
    Contender("cgbackend-static-dispatch-eager-kernels", _cgbackend(static_dispatch="auto", inner="eager"),
              stock=False, backend_stats=_cgbackend_stats,
              description='cgbackend.compile(model, static_dispatch="auto", inner="eager")'),
    Contender("cgbackend-static-dispatch-inductor", _cgbackend(static_dispatch="auto", inner="inductor"),
              stock=False, backend_stats=_cgbackend_stats,
              description='cgbackend.compile(model, static_dispatch="auto", inner="inductor")'),
    Contender("cgbackend-by-name", _cgbackend_by_name, stock=False, backend_stats=_cgbackend_stats,
              description='torch.compile(model, backend="cgbackend") (Dynamo\'s default settings: graph breaks '
                          'at data-dependent ops, no source rewrites, no layer stacks)'),
    Contender("cgbackend-small-batch", _cgbackend(static_dispatch="small_batch"), stock=False,
              backend_stats=_cgbackend_stats,
              description='cgbackend.compile(model, static_dispatch="small_batch") (the MoE layers in the '
                          'small-batch form: per-row expert products, for decode)'),
):
    register_contender(_c)


del _c


# --------------------------------------------- contenders that rebuild the model from the same weights

def _reduce_overhead_on_cuda(model: nn.Module) -> Callable[..., Any]:
    param = next(model.parameters(), None)
    if param is not None and param.device.type == "cuda":
        return torch.compile(model, mode="reduce-overhead")
    return torch.compile(model, backend="eager")


def _grouped_convert(base: nn.Module, device: torch.device) -> nn.Module:
    from ..models.realsize import grouped_from
    return grouped_from(base, device)


def _grouped_restore(model: nn.Module, base: nn.Module) -> None:
    from ..models.realsize import load_weights
    load_weights(model, base)


def _grouped_grads(model: nn.Module) -> Any:
    from ..models.realsize import named_grads
    return named_grads(model)


def _grouped_unsupported(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    from ..models.realsize import grouped_mm_unsupported
    return grouped_mm_unsupported(device, dtype)


def _grouped_share(model: nn.Module) -> nn.Module:
    from ..models.realsize import grouped_view
    return grouped_view(model)


def _needs_grouped_form(spec: Any) -> Optional[str]:
    if getattr(spec, "grouped", False):
        return None
    return f"{spec.name} has no hand-written grouped-GEMM form (only the shape MoE models do)"


def _hf_grouped_convert(base: nn.Module, device: torch.device) -> nn.Module:
    model = copy.deepcopy(base).to(device)
    # the transformers model itself, or the one a bench wrapper holds (its parameter names are kept)
    hf = next(m for m in model.modules() if hasattr(m, "set_experts_implementation"))
    hf.set_experts_implementation("grouped_mm")
    return model


def _needs_hf_moe(spec: Any) -> Optional[str]:
    if spec.family in ("decode", "zoo", "hf") and spec.moe:
        return None
    return f"{spec.name} is not a transformers MoE model"


register_contender(Contender(
    "grouped-reduce-overhead", _reduce_overhead_on_cuda, stock=False, mark_step=True,
    convert=_grouped_convert, applies_to=_needs_grouped_form, unsupported=_grouped_unsupported,
    restore=_grouped_restore, named_grads=_grouped_grads, share=_grouped_share, modes=("infer", "train"),
    description='the MoE layers rewritten by hand in the grouped-GEMM form (torch._grouped_mm, device-side '
                'offsets; cgbackend/models/realsize.py GroupedMoE), same weights, under '
                'torch.compile(mode="reduce-overhead") (CPU: backend="eager")'))

register_contender(Contender(
    "hf-grouped-mm-reduce-overhead", _reduce_overhead_on_cuda, stock=False, mark_step=True,
    convert=_hf_grouped_convert, applies_to=_needs_hf_moe, unsupported=_grouped_unsupported,
    modes=("decode", "infer", "train"),
    description='transformers experts with set_experts_implementation("grouped_mm"), same weights, under '
                'torch.compile(mode="reduce-overhead") (CPU: backend="eager")'))


# --------------------------------------------- yardsticks


class _StepFloor(torch.autograd.Function):
    """Forward: a copy of the input (no model compute). Backward: the prepared gradient of every
    parameter, each a fresh alias, as a graphed backward hands its static gradients out (so
    AccumulateGrad keeps them without a copy)."""

    @staticmethod
    def forward(ctx: Any, grads: tuple, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.grads = grads
        return x.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return (None, None) + tuple(g.detach() for g in ctx.grads)


def _step_floor(model: nn.Module) -> Callable[..., Any]:
    params = tuple(p for p in model.parameters() if p.requires_grad)
    grads = tuple(torch.zeros_like(p) for p in params)  # zeros: SGD leaves the weights as they are

    def step(x: torch.Tensor) -> torch.Tensor:
        return _StepFloor.apply(grads, x, *params)
    return step


def _hidden_in_hidden_out(spec: Any) -> Optional[str]:
    if spec.family == "shape":
        return None
    return f"{spec.name} does not map hidden states to hidden states (the step floor's output is its input)"


register_contender(Contender(
    "step-floor", _step_floor, stock=False, applies_to=_hidden_in_hidden_out, modes=("train",),
    description="a yardstick, not a way of running the model: the training step's work per parameter "
                "with no model compute (zero_grad; one autograd Function over every parameter whose "
                "backward hands out ready gradients, fresh aliases as a graphed backward's; "
                "AccumulateGrad for each; the same SGD step). No implementation that keeps the "
                "model's parameters and the user's optimizer can take a step faster than this"))
