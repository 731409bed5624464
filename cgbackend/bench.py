"""Side-by-side benchmark: cgbackend against eager and the stock torch.compile modes.

``python -m cgbackend bench [FLAGS]`` (or ``python benchmarks/run.py [FLAGS]``) runs, in one
process, every chosen contender on every chosen reference model (``cgbackend.models``) in
inference and training, and writes JSON where ``--out`` says (default: a new folder under
``./cgbackend-results/``, named on stdout) plus a table on stdout.
``benchmarks/README.md`` documents the flags, what is measured and the JSON schema.

For each model x mode x contender the harness

1. takes a fresh deep copy of one seeded model (same weights for everybody), resets Dynamo
   (``--timing sequential``; alternating timing keeps the earlier contenders compiled), and compiles it (``CONTENDERS[name].make``);
2. runs ``--warmup`` calls (the first ones compile and, for CUDA-graph contenders, capture),
   timing each; ``compile_s`` is what they took beyond ``--warmup`` steady-state calls;
3. checks accuracy on ``--acc-batches`` batches (infer: the output; train: the loss and every
   parameter gradient of one step from the seed weights) against eager and against a float64 run
   of the same weights and inputs (``bench_accuracy``: at most 2x eager's own error);
4. times ``--iters`` calls (fewer under ``--time-budget``), each on its own (CUDA events on CUDA,
   perf_counter on CPU), and reports median / p10 / p90. By default (``--timing alternate``) the
   case's contenders are kept after step 3 and timed in 5 alternating blocks, so that a drift of
   the machine's pace shows in all of them alike (``run_contenders``).

Models come from the registry in ``bench_models`` (reference models, real-size shapes with a
``--tokens`` sweep, transformers decode models run by ``bench_decode``); contenders that rebuild a
model in another form are in ``bench_contenders``. Any exception inside one contender marks that
row ``error`` and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
import torch.nn as nn

from .runtime.capture import clear_blas_workspaces

__all__ = ["CONTENDERS", "STOCK_CONTENDERS", "Contender", "register_contender", "main", "run",
           "render_markdown", "render_table", "lm_loss"]

SCHEMA_VERSION = 1

# --------------------------------------------------------------------------------------- contenders


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


def _cgbackend_stats(compiled: Any) -> Optional[dict]:
    import cgbackend
    return cgbackend.stats(compiled)


CONTENDERS: dict[str, Contender] = {}
"""name -> Contender, in the default run order (eager first: everything is compared to it)."""

STOCK_CONTENDERS = ("eager", "inductor", "reduce-overhead", "reduce-overhead-dynops", "cudagraphs")
GROUPED_CONTENDERS = ("grouped-reduce-overhead", "hf-grouped-mm-reduce-overhead")
"""The hand-written grouped-GEMM forms (bench_contenders) that ``ratio_to_grouped`` divides by."""


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
                          'into a static form, passes/dispatch/)'),
    Contender("cgbackend-static-dispatch-eager-kernels", _cgbackend(static_dispatch="auto", inner="eager"),
              stock=False, backend_stats=_cgbackend_stats,
              description='cgbackend.compile(model, static_dispatch="auto", inner="eager")'),
    Contender("cgbackend-static-dispatch-inductor", _cgbackend(static_dispatch="auto", inner="inductor"),
              stock=False, backend_stats=_cgbackend_stats,
              description='cgbackend.compile(model, static_dispatch="auto", inner="inductor")'),
):
    register_contender(_c)
del _c

from . import bench_contenders  # noqa: E402  (registers the contenders that rebuild a model: grouped forms)

# ------------------------------------------------------------------------------------- settings

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}
SIZE_FLAGS = {"d_model": "d_model", "layers": "n_layers", "heads": "n_heads", "experts": "n_experts",
              "top_k": "top_k", "vocab": "vocab"}

SMOKE_DEFAULTS = dict(size="tiny", batch=2, seq=16, batches=4, warmup=2, iters=3, acc_batches=2,
                      contenders="eager,cgbackend,cgbackend-static-dispatch", device="cpu", floor_steps=2,
                      threads=1)
RUN_DEFAULTS = dict(models="dense,moe", modes="infer,train", size="bench", batch=4, seq=128, batches=64,
                    warmup=10, iters=50, acc_batches=4, contenders=None, device=None, floor_steps=10,
                    threads=None)


def default_json_path() -> Path:
    """A new folder under ./cgbackend-results/ per run (named on stdout): never a tracked file.
    The repository's benchmarks/results/latest.json and RESULTS.md are written only when named with
    --out / --markdown."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path.cwd() / "cgbackend-results" / f"bench-{stamp}"
    n = 1
    while folder.exists():
        n += 1
        folder = Path.cwd() / "cgbackend-results" / f"bench-{stamp}-{n}"
    return folder / "results.json"


def default_markdown_path(out: Path) -> Path:
    return out.parent / "RESULTS.md"


class UsageError(Exception):
    pass


@dataclasses.dataclass
class Settings:
    models: list[str]
    modes: list[str]
    contenders: list[str]
    size: str
    overrides: dict[str, int]
    batch: int
    seq: int
    batches: int
    warmup: int
    iters: int
    acc_batches: int
    floor_steps: int
    device: torch.device
    dtype: torch.dtype
    tol: float
    seed: int
    lr: float
    out: Path
    markdown: Optional[Path]
    smoke: bool
    verbose: bool
    threads: Optional[int] = None
    scale: str = "full"
    tokens: Optional[tuple[int, ...]] = None
    reference: str = "fp64"
    time_budget: Optional[float] = None
    timing: str = "alternate"
    """alternate: contenders timed in alternating blocks; sequential: each timed alone (run_contenders)."""
    explicit: frozenset = frozenset()
    """Settings given on the command line: a model's own defaults (bench_models) never override them."""

    def to_meta(self) -> dict[str, Any]:
        return {
            "models": self.models, "modes": self.modes, "contenders": self.contenders, "size": self.size,
            "size_overrides": self.overrides, "batch": self.batch, "seq": self.seq, "batches": self.batches,
            "warmup": self.warmup, "iters": self.iters, "acc_batches": self.acc_batches,
            "floor_steps": self.floor_steps, "device": str(self.device), "dtype": _dtype_name(self.dtype),
            "tolerance": self.tol, "seed": self.seed, "lr": self.lr, "smoke": self.smoke,
            "threads": self.threads if self.threads is not None else torch.get_num_threads(),
            "scale": self.scale, "tokens": list(self.tokens) if self.tokens else None,
            "reference": self.reference, "time_budget_s": self.time_budget, "timing": self.timing,
        }

    def for_model(self, spec: Any) -> "Settings":
        """These settings with the model's own defaults (``BenchModel.defaults``) where the command
        line did not set them."""
        defaults = dict(spec.defaults)
        if self.scale == "tiny" and "tiny_tokens" in defaults:
            defaults["tokens"] = defaults["tiny_tokens"]
        changes = {k: v for k, v in defaults.items() if k not in self.explicit and hasattr(self, k)}
        if "tokens" in changes:
            changes["tokens"] = tuple(changes["tokens"])
        if "acc_batches" in changes or "batches" in changes:
            batches = changes.get("batches", self.batches)
            changes["acc_batches"] = min(changes.get("acc_batches", self.acc_batches), batches)
        return dataclasses.replace(self, **changes)


def _dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype))


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser(prog: str = "python -m cgbackend bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Side-by-side benchmark of cgbackend against eager and stock torch.compile modes "
                    "(see benchmarks/README.md).")
    p.add_argument("--models", help="comma-separated models (default dense,moe; see --list-models)")
    p.add_argument("--list-models", action="store_true", help="print the models and exit")
    p.add_argument("--modes", help="comma-separated: infer, train, decode (default infer,train; a model "
                                   "runs the modes it supports)")
    p.add_argument("--contenders", help="comma-separated subset (default all: %s)" % ",".join(CONTENDERS))
    p.add_argument("--list-contenders", action="store_true", help="print the contenders and exit")
    p.add_argument("--size", help="base size from cgbackend.models.SIZES (default bench; smoke: tiny)")
    p.add_argument("--scale", choices=("full", "tiny"),
                   help="real-size (shape) and decode models: full (default) or tiny (smoke: tiny)")
    p.add_argument("--tokens", help="shape models: comma-separated token counts, one row group each "
                                    "(default 4096; above 4096, sequences of 4096)")
    p.add_argument("--reference", choices=("fp64", "eager"),
                   help="accuracy rule: fp64 (default: error against a float64 run at most 2x eager's own) "
                        "or eager (error against eager at most --tol)")
    p.add_argument("--time-budget", type=float,
                   help="seconds of timed calls per row: --iters is lowered to fit, never below 5 "
                        "(default: none for the reference models, 3 s for shape and decode models)")
    p.add_argument("--timing", choices=("alternate", "sequential"),
                   help="alternate (default): a case's contenders are compiled, warmed up and judged one "
                        "after the other and kept, then timed in 5 alternating blocks; sequential: each is "
                        "timed alone right after its warm-up and dropped (less memory held; decode rows "
                        "are always sequential)")
    p.add_argument("--d-model", type=int, help="override d_model")
    p.add_argument("--layers", type=int, help="override n_layers")
    p.add_argument("--heads", type=int, help="override n_heads")
    p.add_argument("--experts", type=int, help="override n_experts")
    p.add_argument("--top-k", type=int, help="override top_k")
    p.add_argument("--vocab", type=int, help="override vocab")
    p.add_argument("--batch", type=int, help="batch size (default 4)")
    p.add_argument("--seq", type=int, help="sequence length (default 128)")
    p.add_argument("--batches", type=int, help="distinct input batches, cycled (default 64)")
    p.add_argument("--warmup", type=int, help="untimed calls before accuracy and timing (default 10)")
    p.add_argument("--iters", type=int, help="timed calls (default 50)")
    p.add_argument("--acc-batches", type=int, help="batches compared against eager (default 4)")
    p.add_argument("--floor-steps", type=int, help="profiled eager steps for floor_ms (default 10)")
    p.add_argument("--dtype", choices=tuple(DTYPES), help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", help="cuda (default when available) or cpu")
    p.add_argument("--tol", type=float, help="accuracy tolerance on max|diff|/max|ref| "
                                             "(default 3e-2 bf16, 1e-2 fp16, 1e-4 fp32)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the run, restored after "
                                                "(default: unchanged; --smoke: 1)")
    p.add_argument("--seed", type=int, default=0, help="model weights seed (inputs use seed+1)")
    p.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate in train mode")
    p.add_argument("--out", help="JSON output path (default: results.json in a new folder "
                                 "./cgbackend-results/bench-DATE-TIME/, named on stdout; --smoke: a "
                                 "file in the temp directory)")
    p.add_argument("--markdown", help="also render RESULTS.md here (default: beside the JSON on CUDA; "
                                      "on CPU only when given)")
    p.add_argument("--no-markdown", action="store_true", help="do not render markdown")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: tiny sizes, eager and the cgbackend contenders with the eager "
                        "inner compiler, few iterations")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks and cgbackend INFO logs")
    return p


def resolve_settings(args: argparse.Namespace) -> Settings:
    from .models import SIZES

    defaults = dict(RUN_DEFAULTS)
    if args.smoke:
        defaults.update(SMOKE_DEFAULTS)

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults.get(name) if value is None else value

    from .bench_models import MODELS
    models = _csv(pick("models"))
    for m in models:
        if m not in MODELS:
            raise UsageError(f"unknown model {m!r}; choose from {', '.join(MODELS)}")
    modes = _csv(pick("modes"))
    for m in modes:
        if m not in ("infer", "train", "decode"):
            raise UsageError(f"unknown mode {m!r}; choose from infer, train, decode")
    contenders = _csv(pick("contenders")) if pick("contenders") else list(CONTENDERS)
    for c in contenders:
        if c not in CONTENDERS:
            raise UsageError(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")
    if not (models and modes and contenders):
        raise UsageError("--models, --modes and --contenders must each name at least one entry")
    size = pick("size")
    if size not in SIZES:
        raise UsageError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")

    device_text = pick("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device_text)
    except RuntimeError as exc:
        raise UsageError(f"bad --device {device_text!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for but torch.cuda.is_available() is False")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise UsageError(f"--device must be cuda or cpu, got {device_text!r}")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)

    overrides = {key: getattr(args, flag) for flag, key in SIZE_FLAGS.items() if getattr(args, flag) is not None}
    ints = {name: pick(name) for name in ("batch", "seq", "batches", "warmup", "iters", "acc_batches",
                                          "floor_steps")}
    for name, value in ints.items():
        minimum = 0 if name in ("warmup", "acc_batches", "floor_steps") else 1
        if value < minimum:
            raise UsageError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")
    max_seq = overrides.get("max_seq", SIZES[size]["max_seq"])
    if ints["seq"] > max_seq:
        overrides["max_seq"] = ints["seq"]

    tokens = None
    if args.tokens:
        try:
            tokens = tuple(int(t) for t in _csv(args.tokens))
        except ValueError:
            raise UsageError(f"--tokens takes comma-separated integers, got {args.tokens!r}") from None
        if not tokens or any(t < 1 for t in tokens):
            raise UsageError(f"--tokens must name positive counts, got {args.tokens!r}")
    if args.time_budget is not None and args.time_budget <= 0:
        raise UsageError(f"--time-budget must be > 0, got {args.time_budget}")
    explicit = frozenset(name for name in ("batches", "warmup", "iters", "acc_batches", "time_budget", "tokens",
                                           "contenders")
                         if getattr(args, name) is not None or (args.smoke and name in SMOKE_DEFAULTS))
    threads = pick("threads")
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if args.out:
        out = Path(args.out)
    elif args.smoke:
        out = Path(tempfile.gettempdir()) / "cgbackend-bench-smoke.json"
    else:
        out = default_json_path()
    if args.no_markdown:
        markdown = None
    elif args.markdown:
        markdown = Path(args.markdown)
    else:
        markdown = default_markdown_path(out) if device.type == "cuda" and not args.smoke else None
    return Settings(models=models, modes=modes, contenders=contenders, size=size, overrides=overrides,
                    batch=ints["batch"], seq=ints["seq"], batches=ints["batches"], warmup=ints["warmup"],
                    iters=ints["iters"], acc_batches=min(ints["acc_batches"], ints["batches"]),
                    floor_steps=ints["floor_steps"], device=device, dtype=dtype,
                    tol=args.tol if args.tol is not None else TOLERANCE[dtype], seed=args.seed, lr=args.lr,
                    out=out, markdown=markdown, smoke=args.smoke, verbose=args.verbose, threads=threads,
                    scale=args.scale or ("tiny" if args.smoke else "full"), tokens=tokens,
                    reference=args.reference or "fp64", time_budget=args.time_budget,
                    timing=args.timing or "alternate", explicit=explicit)


# ------------------------------------------------------------------------------------- helpers


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    # Dynamo appends long hints; the first few lines carry the cause.
    text = " | ".join(lines[:6])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def lm_loss(model_name: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The training loss, computed in float32 (float64 for the reference) outside the compiled model:
    next-token cross entropy for the language models (logits[:, :-1] vs tokens[:, 1:]), mean square
    of the output otherwise (``BenchModel.loss``)."""
    from .bench_models import MODELS
    return MODELS[model_name].loss(out, x)


def _graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def _by_first_line(counts: dict[Any, int]) -> tuple[int, dict[str, int]]:
    """Counts per graph-break reason, summed per first line: (total, per line)."""
    reasons: dict[str, int] = {}
    for reason, n in counts.items():
        key = (str(reason).strip().splitlines() or [""])[0][:200]
        reasons[key] = reasons.get(key, 0) + n
    return sum(reasons.values()), reasons


def _counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters
    return int(counters[group][key])


def _cudagraph_tree_counts(device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """(CUDA graphs recorded, re-records) held by Inductor's cudagraph-tree manager for this device;
    reduce-overhead and backend="cudagraphs" both record through it. (0, 0) when no manager exists;
    (None, None) when it cannot be inspected. Must be read before torch._dynamo.reset()."""
    if device.type != "cuda":
        return 0, 0
    try:
        from torch._inductor import cudagraph_trees
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        if manager is None:
            return 0, 0
        count = 0
        stack = list(manager.get_roots())
        while stack:
            node = stack.pop()
            count += 1
            for children in node.children.values():
                stack.extend(children)
        rerecords = sum(sum(per_fn.values()) for per_fn in manager.num_rerecord.values())
        return count, int(rerecords)
    except Exception:
        return None, None


def _cleanup(device: torch.device) -> None:
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    try:
        import cgbackend
        cgbackend.reset()
    except Exception:
        pass
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            # cuBLAS workspaces (32 MiB per stream on Hopper) outlive the contender that made them:
            # dropped, each contender's peak includes the workspaces it needs, whatever ran before.
            clear_blas_workspaces()
            torch.cuda.empty_cache()
        except Exception:
            pass


def _sanitize(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_sanitize(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _sanitize(value.item())
    return str(value)


# ------------------------------------------------------------------------------------- one case


@dataclasses.dataclass
class Case:
    """One model x mode (x token count): the seed weights (on CPU), the inputs and the references
    (eager in the run dtype; float64 with ``--reference fp64``, see bench_accuracy)."""

    model_name: str
    mode: str
    base: nn.Module
    inputs: list[torch.Tensor]
    acc_indices: list[int]
    ref: list[dict[str, Any]]
    floor_ms: Optional[float] = None
    floor_device_events: Optional[float] = None
    floor_error: Optional[str] = None
    spec: Any = None
    tokens: Optional[int] = None
    ref64: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eager64: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    """Eager's own error against the float64 reference, per group (worst over the batches)."""
    eager_flips: Optional[float] = None
    ref64_s: Optional[float] = None
    ref64_error: Optional[str] = None
    mem_baseline: Optional[int] = None
    """Device memory allocated when the case's first contender started (alternating timing)."""

    @property
    def key(self) -> str:
        return f"{self.model_name}/{self.mode}" + (f"/{self.tokens}" if self.tokens is not None else "")


def _new_model(case: Case, settings: Settings, contender: Optional[Contender] = None) -> nn.Module:
    if contender is not None and contender.convert is not None:
        model = contender.convert(case.base, settings.device)
    else:
        model = copy.deepcopy(case.base).to(settings.device)
    model.train(case.mode == "train")
    return model


def _restore_weights(model: nn.Module, base: nn.Module) -> None:
    with torch.no_grad():
        for p, b in zip(model.parameters(), base.parameters()):
            p.copy_(b)
        for p, b in zip(model.buffers(), base.buffers()):
            p.copy_(b)


class Runner:
    """Calls one contender on one case, rotating through the inputs."""

    def __init__(self, contender: Contender, case: Case, model: nn.Module, fn: Callable[..., Any],
                 settings: Settings) -> None:
        self.contender = contender
        self.case = case
        self.model = model
        self.fn = fn
        self.settings = settings
        self.train = case.mode == "train"
        self.opt = torch.optim.SGD(model.parameters(), lr=settings.lr) if self.train else None
        self.next_index = 0

    def call(self, x: torch.Tensor) -> Any:
        if self.contender.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with self.contender.call_context():
            return self.fn(x)

    def loss(self, out: Any, x: torch.Tensor) -> torch.Tensor:
        return self.case.spec.loss(out, x)

    def step(self, index: Optional[int] = None) -> None:
        """One timed unit: an inference call, or a full training step (forward, loss, backward, SGD)."""
        if index is None:
            index = self.next_index % len(self.case.inputs)
            self.next_index += 1
        x = self.case.inputs[index]
        if self.train:
            self.opt.zero_grad(set_to_none=True)
            out = self.call(x)
            loss = self.loss(out, x)
            loss.backward()
            self.opt.step()
        else:
            with torch.no_grad():
                self.call(x)

    def results_for(self, index: int, x: Optional[torch.Tensor] = None) -> dict[str, Any]:
        """What accuracy compares, for batch ``index`` (or the given ``x``): the output, or the loss
        and every gradient of one step from the seed weights (no SGD step); and the MoE routing.
        The tensors stay on the device, uncopied: compare or store them before the next call."""
        spec = self.case.spec
        x = self.case.inputs[index] if x is None else x
        if not self.train:
            with torch.no_grad():
                out = self.call(x)
                return {"output": spec.output(out).detach(), "routing": spec.routing(out)}
        if self.contender.restore is not None:
            self.contender.restore(self.model, self.case.base)
        else:
            _restore_weights(self.model, self.case.base)
        self.opt.zero_grad(set_to_none=True)
        out = self.call(x)
        loss = self.loss(out, x)
        loss.backward()
        named = (self.contender.named_grads(self.model) if self.contender.named_grads is not None
                 else ((n, p.grad) for n, p in self.model.named_parameters()))
        grads = {name: (None if g is None else g.detach()) for name, g in named}
        routing = spec.routing(out)
        return {"loss": loss.detach(), "grads": grads, "routing": None if routing is None else routing.detach()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b| (absolute when b is all zeros); inf for a shape mismatch or a NaN."""
    if a.shape != b.shape:
        return math.inf
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    scale = b.abs().max().item() if b.numel() else 0.0
    err = diff / scale if scale > 0 else diff
    return math.inf if math.isnan(err) else err


def _eager_floor(case: Case, settings: Settings) -> tuple[Optional[float], Optional[float]]:
    """Per-step device time of eager: the device events (kernels, memcpy, memset) recorded by
    torch.profiler over ``floor_steps`` eager steps, summed and divided by the step count."""
    if settings.device.type != "cuda" or settings.floor_steps == 0:
        return None, None
    from torch.profiler import ProfilerActivity, profile
    model = _new_model(case, settings)
    runner = Runner(CONTENDERS["eager"], case, model, model, settings)
    try:
        for _ in range(3):
            runner.step()
        _sync(settings.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(settings.floor_steps):
                runner.step()
            _sync(settings.device)
        total_us, count = 0.0, 0
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                total_us += event.self_device_time_total or event.time_range.elapsed_us()
                count += 1
        if count == 0:
            raise RuntimeError("the profiler recorded no CUDA device events")
        return total_us / 1e3 / settings.floor_steps, count / settings.floor_steps
    finally:
        del runner, model
        _cleanup(settings.device)


def _reference64(case: Case, settings: Settings) -> None:
    """The float64 run: a copy of the seed weights in float64 on the run device, the accuracy
    batches upcast; fills ``case.ref64``, eager's own errors against it and eager's routing flips."""
    from .bench_accuracy import flip_fraction, group_errors, merge, store, upcast_inputs
    t0 = time.perf_counter()
    model = copy.deepcopy(case.base).to(device=settings.device, dtype=torch.float64)
    model.train(case.mode == "train")
    runner = Runner(CONTENDERS["eager"], case, model, model, settings)
    flips = []
    try:
        for j, i in enumerate(case.acc_indices):
            got = runner.results_for(i, upcast_inputs(case.inputs[i]))
            merge(case.eager64, group_errors(case.ref[j], got))
            flips.append(flip_fraction(case.ref[j].get("routing"), got.get("routing")))
            case.ref64.append(store(got, settings.dtype))
            del got
    finally:
        del runner, model
        _cleanup(settings.device)
    case.eager_flips = max(flips) if flips and None not in flips else None
    case.ref64_s = time.perf_counter() - t0


def prepare_case(spec: Any, mode: str, settings: Settings, tokens: Optional[int] = None) -> Case:
    from .bench_accuracy import store
    if isinstance(spec, str):
        from .bench_models import MODELS
        spec = MODELS[spec]
    base = spec.build(settings)
    inputs = spec.inputs(base, settings, tokens)
    step = max(1, len(inputs) // max(settings.acc_batches, 1))
    acc_indices = [i * step for i in range(settings.acc_batches)]
    case = Case(spec.name, mode, base, inputs, acc_indices, ref=[], spec=spec, tokens=tokens)
    _cleanup(settings.device)
    model = _new_model(case, settings)
    runner = Runner(CONTENDERS["eager"], case, model, model, settings)
    case.ref = [store(runner.results_for(i), settings.dtype) for i in acc_indices]
    del runner, model
    _cleanup(settings.device)
    if settings.reference == "fp64" and acc_indices:
        try:
            _reference64(case, settings)
            _log(f"{case.key}: float64 reference in {case.ref64_s:.1f}s; eager's error against it "
                 + ", ".join(f"{g} {e:.1e}" for g, (e, _) in case.eager64.items())
                 + ("" if case.eager_flips is None else f", routing flips {case.eager_flips:.2%}"))
        except Exception as exc:  # judged against eager instead, and said so in every row
            case.ref64, case.eager64 = [], {}
            case.ref64_error = _error_text(exc)
            _log(f"{case.key}: float64 reference failed ({case.ref64_error}); accuracy falls back to --tol")
    try:
        case.floor_ms, case.floor_device_events = _eager_floor(case, settings)
    except Exception as exc:  # the floor is informative; never fatal
        case.floor_error = _error_text(exc)
        _log(f"{case.key}: floor failed: {case.floor_error}")
    return case


def _empty_row(case: Case, contender: Contender, settings: Settings) -> dict[str, Any]:
    return {
        "model": case.model_name, "mode": case.mode, "contender": contender.name, "stock": contender.stock,
        "family": case.spec.family if case.spec is not None else None, "tokens": case.tokens,
        "median_ms": None, "p10_ms": None, "p90_ms": None, "mean_ms": None, "floor_ms": case.floor_ms,
        "floor_device_events_per_step": case.floor_device_events, "timed_iters": None,
        "accuracy_ok": None, "accuracy_err": None, "accuracy_worst": None, "accuracy_tol": settings.tol,
        "accuracy_rule": "fp64" if case.ref64 else "eager-tol",
        "ref64_err": None, "ref64_ratio": None, "ref64_worst": None, "ref64_limit": None,
        "eager_ref64_err": ({g: e for g, (e, _) in case.eager64.items()} if case.ref64 else None),
        "ref64_error": case.ref64_error, "routing_flip_frac": None,
        "peak_mem_bytes": None, "peak_reserved_bytes": None, "mem_baseline_bytes": None,
        "peak_mem_over_baseline_bytes": None,
        "compile_s": None, "first_call_s": None,
        "graphs": None, "graph_breaks": None, "graph_break_reasons": None, "recompiles": None,
        "rerecords": None, "dynamo_graphs": None,
        "cudagraph_skips": None, "backend_stats": None,
        "ratio_to_eager": None, "ratio_to_best_stock": None, "ratio_to_floor": None, "beats_best_stock": None,
        "error": None, "error_stage": None, "skip_reason": None,
    }


_STATS_KEYS = ("graphs_captured", "static_regions", "dynamic_regions", "replays", "eager_calls",
               "capture_time_s", "capture_failures", "pool_bytes", "nothing_captured_reason",
               "handout_graphs", "handout_replays", "outputs_handed", "output_clones", "fast_replays")


def skip_reason(contender: Contender, spec: Any, settings: Settings) -> Optional[str]:
    """Why ``contender`` does not run on this model/device/dtype, or None."""
    if spec is not None and contender.applies_to is not None:
        reason = contender.applies_to(spec)
        if reason:
            return reason
    if contender.unsupported is not None:
        return contender.unsupported(settings.device, settings.dtype)
    return None


def timed_iterations(settings: Settings, warm_s: Sequence[float]) -> int:
    """``--iters``, lowered to fit ``--time-budget`` seconds at the pace of the fastest of the last
    three warm-up calls (at least 5)."""
    if not settings.time_budget or not warm_s:
        return settings.iters
    pace = min(warm_s[-3:])  # the fastest of the last warm-up calls: the first ones compile
    if pace <= 0:
        return settings.iters
    return max(min(5, settings.iters), min(settings.iters, int(settings.time_budget / pace)))


def _judge_row(row: dict[str, Any], case: Case, settings: Settings, errs: dict, errs64: dict,
               flips: list[Optional[float]]) -> None:
    from .bench_accuracy import LIMIT, judge, worst
    if not case.acc_indices:
        row["accuracy_ok"] = None
        return
    err, where = worst(errs)
    row["accuracy_err"], row["accuracy_worst"] = err, where
    if case.ref64:
        verdict = judge(errs64, case.eager64, settings.dtype)
        row["ref64_err"], row["ref64_ratio"], row["ref64_worst"] = verdict.errors, verdict.ratio, verdict.worst
        row["ref64_limit"] = LIMIT
        row["accuracy_ok"] = verdict.ok
    else:
        row["accuracy_ok"] = bool(err <= settings.tol)
    if flips and None not in flips:
        row["routing_flip_frac"] = max(flips)


class _Tally:
    """Dynamo's and Inductor's global counters, read around the windows in which one contender ran
    (its compile, warm-up and accuracy calls, then each of its timing blocks): the row's counts are
    the sums of its own windows' deltas, whatever other contenders ran between them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.breaks: dict[str, int] = {}
        self.unique_graphs = self.cudagraph_skips = 0
        self.frames: dict[Any, int] = {}
        self.tree_graphs: Optional[int] = 0
        self.rerecords: Optional[int] = 0
        self._before: Optional[tuple] = None

    def _read(self) -> tuple:
        return (_graph_breaks(), _counter("stats", "unique_graphs"), _counter("inductor", "cudagraph_skips"),
                _frame_compiles(), _cudagraph_tree_counts(self.device))

    def __enter__(self) -> "_Tally":
        self._before = self._read()
        return self

    def __exit__(self, *exc: Any) -> None:
        (breaks0, unique0, skips0, frames0, trees0), (breaks1, unique1, skips1, frames1, trees1) = \
            self._before, self._read()
        _add_increases(self.breaks, breaks0, breaks1)
        self.unique_graphs += unique1 - unique0
        self.cudagraph_skips += skips1 - skips0
        if frames0 is None or frames1 is None:
            self.frames = None  # type: ignore[assignment]
        elif self.frames is not None:
            _add_increases(self.frames, frames0, frames1)
        for i, name in enumerate(("tree_graphs", "rerecords")):
            a, b, total = trees0[i], trees1[i], getattr(self, name)
            setattr(self, name, None if None in (a, b, total) else total + b - a)

    def graph_breaks(self) -> tuple[int, dict[str, int]]:
        """The total and the count per reason (first line)."""
        return _by_first_line(self.breaks)

    def recompiles(self) -> Optional[int]:
        """Compiles of a frame beyond its first, in this contender's windows."""
        return None if self.frames is None else int(sum(max(0, n - 1) for n in self.frames.values()))


def _add_increases(into: dict, before: dict, after: dict) -> None:
    """Adds to ``into`` each count of ``after`` by which it grew since ``before``."""
    for key, n in after.items():
        d = int(n - before.get(key, 0))
        if d > 0:
            into[key] = into.get(key, 0) + d


def _frame_compiles() -> Optional[dict]:
    try:
        from torch._dynamo import convert_frame
        return dict(convert_frame.FRAME_COMPILE_COUNTER)
    except Exception:
        return None


@dataclasses.dataclass
class _Pending:
    """A contender ready to be timed: compiled, warmed up and judged (``prepare_contender``)."""

    row: dict[str, Any]
    contender: Contender
    runner: Runner
    warm: list[float]
    tally: _Tally
    iters: int
    times: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    """Wall time spent on this contender so far (preparing and its timing blocks)."""


TIMING_ROUNDS = 5
"""Blocks per contender in alternating timing (``--timing alternate``)."""


def prepare_contender(case: Case, contender: Contender, settings: Settings,
                      alone: bool = True) -> tuple[dict[str, Any], Optional[_Pending]]:
    """Steps 1-3 of the module docstring for one contender: its row, and what timing it needs (None
    when it failed or was skipped: the row says why). ``alone``: nothing else is held, so Dynamo
    and the device are reset first; otherwise earlier contenders stay compiled and in memory, and
    the peak memory is read now, less the memory they hold."""
    from .bench_accuracy import flip_fraction, group_errors, merge
    row = _empty_row(case, contender, settings)
    device = settings.device
    if contender.needs_cuda and device.type != "cuda":
        row["error"], row["error_stage"] = "needs CUDA", "setup"
        return row, None
    reason = skip_reason(contender, case.spec, settings)
    if reason:
        row["error"], row["error_stage"], row["skip_reason"] = f"skipped: {reason}", "setup", reason
        return row, None
    stage = "setup"
    runner = None
    cuda = device.type == "cuda"
    tally = _Tally(device)
    try:
        if alone:
            _cleanup(device)
        elif cuda:
            # Garbage of the contenders before (autograd cycles holding activations) would count in
            # this one's baseline and be freed during its calls: a peak of 1 MiB in run 38.
            gc.collect()
            torch.cuda.synchronize(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            row["mem_baseline_bytes"] = int(torch.cuda.memory_allocated(device))
        with tally:
            stage = "compile"
            model = _new_model(case, settings, contender)
            fn = contender.make(model)
            runner = Runner(contender, case, model, fn, settings)
            del model, fn

            # Warm-up: the first call compiles (Dynamo + backend), CUDA-graph contenders capture within.
            warm: list[float] = []
            for _ in range(settings.warmup):
                _sync(device)
                t0 = time.perf_counter()
                runner.step()
                _sync(device)
                warm.append(time.perf_counter() - t0)

            stage = "accuracy"
            errs: dict[str, tuple[float, str]] = {}
            errs64: dict[str, tuple[float, str]] = {}
            flips: list[Optional[float]] = []
            for j, i in enumerate(case.acc_indices):
                got = runner.results_for(i)
                merge(errs, group_errors(got, case.ref[j]))
                if case.ref64:
                    merge(errs64, group_errors(got, case.ref64[j]))
                    flips.append(flip_fraction(got.get("routing"), case.ref64[j].get("routing")))
                del got
            _judge_row(row, case, settings, errs, errs64, flips)
        row["graph_breaks"], row["graph_break_reasons"] = tally.graph_breaks()
        if cuda and not alone:
            _read_peak(row, case, device)
        row["timed_iters"] = timed_iterations(settings, warm)
        return row, _Pending(row, contender, runner, warm, tally, row["timed_iters"])
    except Exception as exc:
        row["error"], row["error_stage"] = _error_text(exc), stage
        if settings.verbose:
            traceback.print_exc()
        del runner
        if alone:
            _cleanup(device)
        return row, None


def _read_peak(row: dict[str, Any], case: Case, device: torch.device) -> None:
    """Peak memory since this contender's start, less what earlier contenders of the case still
    held then (``case.mem_baseline``: what the first one started with)."""
    held = row["mem_baseline_bytes"] - (case.mem_baseline if case.mem_baseline is not None
                                        else row["mem_baseline_bytes"])
    row["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device)) - held
    row["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device)) - held
    row["peak_mem_over_baseline_bytes"] = row["peak_mem_bytes"] - (row["mem_baseline_bytes"] - held)


def _time_block(pending: _Pending, n: int, settings: Settings) -> None:
    """``n`` timed steps of one contender; an exception is recorded in its row (stage ``timing``)."""
    t0 = time.perf_counter()
    try:
        _timed_steps(pending, n, settings.device)
    except Exception as exc:
        pending.row["error"], pending.row["error_stage"] = _error_text(exc), "timing"
        if settings.verbose:
            traceback.print_exc()
    pending.seconds += time.perf_counter() - t0


def _timed_steps(pending: _Pending, n: int, device: torch.device) -> None:
    runner, times = pending.runner, pending.times
    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with pending.tally:
        for _ in range(n):
            if cuda:
                torch.cuda.synchronize(device)
                start.record()
                runner.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                runner.step()
                times.append((time.perf_counter() - t0) * 1e3)
        _sync(device)


def put_times(row: dict[str, Any], times: list[float]) -> None:
    """The row's timing statistics from its timed steps (ms)."""
    row["median_ms"] = statistics.median(times)
    row["p10_ms"] = _percentile(times, 0.10)
    row["p90_ms"] = _percentile(times, 0.90)
    row["mean_ms"] = statistics.fmean(times)
    row["timed_iters"] = len(times)


def put_counts(row: dict[str, Any], tally: _Tally, contender: Contender, fn: Any) -> None:
    """The row's Dynamo and Inductor counts over the contender's own windows, and its graphs:
    the backend's own counters where it has them, else cudagraph trees'."""
    row["dynamo_graphs"] = tally.unique_graphs
    row["cudagraph_skips"] = tally.cudagraph_skips
    row["recompiles"] = tally.recompiles()
    if contender.backend_stats is not None:
        stats = contender.backend_stats(fn) or {}
        row["backend_stats"] = {k: stats[k] for k in _STATS_KEYS if k in stats}
        row["graphs"] = stats.get("graphs_captured")
    else:
        row["graphs"], row["rerecords"] = tally.tree_graphs, tally.rerecords


def block_share(total: int, r: int) -> int:
    """How many of ``total`` timed units block ``r`` of ``TIMING_ROUNDS`` alternating blocks runs."""
    return total // TIMING_ROUNDS + (1 if r < total % TIMING_ROUNDS else 0)


def finish_row(pending: _Pending, case: Case, settings: Settings, alone: bool = True) -> dict[str, Any]:
    """Timing statistics and counters into the row; the contender's model and code are dropped."""
    row, times, warm, tally = pending.row, pending.times, pending.warm, pending.tally
    device = settings.device
    try:
        if row["error"] is None:
            put_times(row, times)  # eager's, timed beside each group, can be more than --iters
            if warm:
                row["first_call_s"] = warm[0]
                row["compile_s"] = max(0.0, sum(warm) - len(warm) * row["median_ms"] / 1e3)
            if device.type == "cuda" and alone:
                _read_peak(row, case, device)
        put_counts(row, tally, pending.contender, pending.runner.fn)
    except Exception as exc:
        row["error"], row["error_stage"] = _error_text(exc), "counters"
        if settings.verbose:
            traceback.print_exc()
    finally:
        pending.runner = None  # type: ignore[assignment]
        if alone:
            _cleanup(device)
    return row


def run_contender(case: Case, contender: Contender, settings: Settings) -> dict[str, Any]:
    """One contender alone: prepared, timed in one block, its row finished (``--timing sequential``)."""
    row, pending = prepare_contender(case, contender, settings)
    if pending is None:
        return row
    _time_block(pending, pending.iters, settings)
    return finish_row(pending, case, settings)


def run_contenders(case: Case, names: Sequence[str], settings: Settings,
                   log_row: Callable[[str, dict[str, Any], float], None]) -> list[dict[str, Any]]:
    """Every contender of one case, rows in the order of ``names``.

    ``--timing sequential``: each alone, one after the other. ``--timing alternate`` (the default):
    each is prepared in turn (compile, warm-up, accuracy, peak memory) and kept; then they are
    timed in ``TIMING_ROUNDS`` alternating blocks (A's block, B's, ..., A's again), so a change of
    the machine's pace during the run (another tenant, clocks, the CPU of a host-bound model) shows
    in every contender alike rather than in whichever ran then: two sequential runs of one
    host-bound model had put cgbackend at 0.83x and 0.60x eager.

    Compiled contenders share Dynamo's per-code state: a graph break in a loop makes Dynamo skip
    the whole function from then on, for every backend, also where another contender's compiled
    code was cached (each model object fails the others' guards, but the skip is the code's). So a
    contender whose compile broke the graph is timed in a group of its own with eager, Dynamo is
    reset after it, and the contenders prepared before it are prepared again. Eager comes first
    and is timed beside every group (its times from all of them make its row; it holds no compiled
    state); the stock contenders, which break graphs, come before cgbackend's."""
    if settings.timing == "sequential":
        rows = []
        for name in names:
            t0 = time.perf_counter()
            rows.append(run_contender(case, CONTENDERS[name], settings))
            log_row(case.key, rows[-1], time.perf_counter() - t0)
        return rows
    device = settings.device
    _cleanup(device)
    case.mem_baseline = int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    order = sorted(names, key=lambda n: (n != "eager", not CONTENDERS[n].stock))
    rows: dict[str, dict[str, Any]] = {}
    group: list[_Pending] = []
    eager: list[_Pending] = []
    # Each compiled contender adds Dynamo cache entries for the same code objects (its own model
    # object fails the others' guards): room for all of them, or later ones would run eagerly.
    limit = max(torch._dynamo.config.recompile_limit, 8 * len(names))

    def prepare(name: str) -> Optional[_Pending]:
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=limit):
            row, ready = prepare_contender(case, CONTENDERS[name], settings, alone=False)
        rows[name] = row
        if ready is None:
            log_row(case.key, row, time.perf_counter() - t0)
        else:
            ready.seconds = time.perf_counter() - t0
            _log(f"{case.key} {name}: warmed up and judged in {ready.seconds:.1f}s; timed with the others")
        return ready

    try:
        for name in order:
            ready = prepare(name)
            if ready is None:
                continue
            if name == "eager":
                eager.append(ready)
            elif not ready.row["graph_breaks"]:
                group.append(ready)
            else:
                _time_group(eager + [ready], case, settings, log_row, limit)
                _cleanup(device)
                if group:
                    _log(f"{case.key} {name} broke the graph: preparing "
                         f"{', '.join(p.contender.name for p in group)} again after a reset")
                    again = [p.contender.name for p in group]
                    group.clear()
                    group.extend(p for p in map(prepare, again) if p is not None)
        if group or (eager and not eager[0].times):
            _time_group(eager + group, case, settings, log_row, limit)
        for p in eager:
            finish_row(p, case, settings, alone=False)
            log_row(case.key, p.row, p.seconds)
    finally:
        group.clear()
        eager.clear()
        _cleanup(device)
    return [rows[n] for n in names]


def _time_group(group: list[_Pending], case: Case, settings: Settings,
                log_row: Callable[[str, dict[str, Any], float], None], limit: int) -> None:
    """Times ``group`` in alternating blocks and finishes the rows of all but eager's."""
    with torch._dynamo.config.patch(recompile_limit=limit):
        for r in range(TIMING_ROUNDS):
            for p in group:
                if p.row["error"] is not None:
                    continue
                _time_block(p, block_share(p.iters, r), settings)
    for p in group:
        if p.contender.name != "eager":
            finish_row(p, case, settings, alone=False)
            log_row(case.key, p.row, p.seconds)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """ratio_to_X = median_ms / X's median (below 1: faster than X). best stock: the fastest stock
    contender of the same model x mode (x token count) that ran and passed accuracy. Rows that
    failed accuracy get no ratio_to_best_stock and never count as a win."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["mode"], row.get("tokens")), []).append(row)
    for group in groups.values():
        ok = [r for r in group if r["error"] is None and r["median_ms"] is not None]
        eager = next((r for r in ok if r["contender"] == "eager"), None)
        stock = [r for r in ok if r["contender"] in STOCK_CONTENDERS and r["accuracy_ok"] is not False]
        best = min(stock, key=lambda r: r["median_ms"]) if stock else None
        for r in group:
            r["best_stock"] = best["contender"] if best else None
            r["ratio_to_eager"] = r["ratio_to_best_stock"] = r["ratio_to_floor"] = None
            r["beats_best_stock"] = False
            if not any(r is o for o in ok):
                continue
            if eager is not None and eager["median_ms"] > 0:
                r["ratio_to_eager"] = r["median_ms"] / eager["median_ms"]
            if r.get("floor_ms"):
                r["ratio_to_floor"] = r["median_ms"] / r["floor_ms"]
            if best is not None and r["accuracy_ok"] is not False and best["median_ms"] > 0:
                r["ratio_to_best_stock"] = r["median_ms"] / best["median_ms"]
                r["beats_best_stock"] = bool(r["ratio_to_best_stock"] < 1.0 and r["contender"] != best["contender"])
        # The yardsticks of issues 16 and 17: the hand-written grouped form and reduce-overhead.
        for key, names in (("ratio_to_grouped", GROUPED_CONTENDERS), ("ratio_to_reduce_overhead", ("reduce-overhead",))):
            other = next((o for o in ok if o["contender"] in names and o["median_ms"] > 0), None)
            for r in group:
                r[key] = (r["median_ms"] / other["median_ms"]
                          if other is not None and any(r is o for o in ok) else None)


# ------------------------------------------------------------------------------------- output


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine() or "cpu"
    return f"CPU ({name}, {os.cpu_count()} cores)"


def _command_line(argv: Sequence[str]) -> str:
    orig = list(getattr(sys, "orig_argv", []) or [])
    argv = list(argv)
    tail_matches = orig[-len(argv):] == argv if argv else bool(orig) and orig[-1].endswith(("bench", "run.py"))
    if orig and tail_matches:
        return shlex.join(orig)
    return shlex.join(["python", "-m", "cgbackend", "bench", *argv]) + "  # called in-process"


def build_meta(settings: Settings, argv: Sequence[str], cases: list[Case],
               skipped: Optional[list[dict[str, Any]]] = None, rows: Sequence[dict[str, Any]] = ()
               ) -> dict[str, Any]:
    from .bench_models import MODELS
    _ran = {r["contender"] for r in rows}
    try:
        import cgbackend
        version = cgbackend.__version__
    except Exception:
        version = None
    return {
        "schema": SCHEMA_VERSION,
        "device": _device_name(settings.device),
        "device_type": settings.device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cgbackend": version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "command": _command_line(argv),
        "argv": list(argv),
        "settings": settings.to_meta(),
        "timing": ("CUDA events around each call, synchronized before and after" if settings.device.type == "cuda"
                   else "time.perf_counter around each call"),
        "compile_s": "sum of the --warmup call times minus --warmup x median_ms",
        "floor": {c.key: {"floor_ms": c.floor_ms, "error": c.floor_error} for c in cases},
        "reference64": {c.key: {"seconds": c.ref64_s, "eager_err": {g: e for g, (e, _) in c.eager64.items()},
                                "eager_routing_flip_frac": c.eager_flips, "error": c.ref64_error}
                        for c in cases if c.ref64 or c.ref64_error},
        "contenders": {name: c.description for name, c in CONTENDERS.items()
                       if name in settings.contenders or name in _ran},
        "models": {name: MODELS[name].description for name in settings.models},
        "skipped": list(skipped or []),
    }


def _fmt(value: Any, spec: str = ".3f", none: str = "-") -> str:
    if value is None:
        return none
    if spec == "ratio" and isinstance(value, float):
        return format(value, ".2f") if value >= 0.1 else format(value, ".2g")
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _acc(row: dict[str, Any]) -> str:
    """"ok 1.3x64" (fp64 rule: worst error against float64 over eager's own), or "ok 3.0e-03" (error
    against eager, --tol rule); ", flips 0.4%" for MoE routing that differs from float64's."""
    flips = row.get("routing_flip_frac")
    tail = "" if flips is None else f", flips {flips:.1%}"
    if row.get("tokens_equal_frac") is not None:
        tail += f", tokens {row['tokens_equal_frac']:.0%}"
    if row["accuracy_ok"] is None:
        return "-" + tail
    verdict = "ok" if row["accuracy_ok"] else "FAIL"
    if row.get("accuracy_rule") == "fp64":
        ratio = row.get("ref64_ratio")
        return f"{verdict} {'inf' if ratio is None or math.isinf(ratio) else format(ratio, '.2f')}x64" + tail
    err = "inf" if row["accuracy_err"] is None else f"{row['accuracy_err']:.1e}"
    return f"{verdict} {err}" + tail


_COLUMNS = ("contender", "median ms", "p10", "p90", "x eager", "x best stock", "x floor", "accuracy",
            "peak MiB", "compile s", "graphs", "breaks", "error")


def _cells(row: dict[str, Any]) -> list[str]:
    name = row["contender"] + (" *" if row.get("beats_best_stock") else "")
    return [name, _fmt(row["median_ms"]), _fmt(row["p10_ms"]), _fmt(row["p90_ms"]),
            _fmt(row["ratio_to_eager"], "ratio"), _fmt(row["ratio_to_best_stock"], "ratio"),
            _fmt(row["ratio_to_floor"], "ratio"), _acc(row), _mib(row["peak_mem_bytes"]),
            _fmt(row["compile_s"], ".2f"), _fmt(row["graphs"]), _fmt(row["graph_breaks"]),
            (row["error"] or "")[:80]]


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(title, rows) per model x mode (x token count for the shape models)."""
    out: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault((row["model"], row["mode"], row.get("tokens")), []).append(row)
    titles = []
    for (model, mode, tokens), group in out.items():
        shown = tokens is not None and group[0].get("family") == "shape"
        titles.append((f"{model} / {mode}" + (f" / {tokens} tokens" if shown else ""), group))
    return titles


def render_table(results: dict[str, Any]) -> str:
    """Plain-text tables (one per model x mode) for stdout."""
    meta = results["meta"]
    lines = [f"device: {meta['device']}  torch {meta['torch']}  {meta['date']}",
             f"command: {meta['command']}"]
    for title, rows in _groups(results["rows"]):
        floor = rows[0]["floor_ms"]
        best = rows[0].get("best_stock")
        lines.append("")
        lines.append(f"== {title}   floor {_fmt(floor)} ms   best stock: {best or '-'}")
        table = [list(_COLUMNS)] + [_cells(r) for r in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(_COLUMNS))]
        for i, cells in enumerate(table):
            lines.append("  ".join(c.ljust(w) if j in (0, 7, 12) else c.rjust(w)
                                   for j, (c, w) in enumerate(zip(cells, widths))).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("x = median / reference median (below 1 is faster); * = faster than the best stock "
                 "contender with accuracy ok; accuracy 'ok 1.3x64' = worst error against the float64 run "
                 "over eager's own (limit 2); decode rows: ms per token")
    return "\n".join(lines)


def render_markdown(results: dict[str, Any]) -> str:
    """RESULTS.md: header (device, torch, date, command) and one table per model x mode."""
    meta = results["meta"]
    s = meta.get("settings", {})
    out = ["# Benchmark results", "",
           "Generated by `cgbackend.bench` from the JSON results; see `benchmarks/README.md` for what each "
           "column measures.", "",
           f"- device: {meta['device']}",
           f"- torch: {meta['torch']}" + (f" (CUDA {meta['cuda']})" if meta.get("cuda") else ""),
           f"- cgbackend: {meta.get('cgbackend')}",
           f"- date: {meta['date']}",
           f"- command: `{meta['command']}`",
           f"- dtype {s.get('dtype')}, batch {s.get('batch')}, seq {s.get('seq')}, {s.get('batches')} "
           f"distinct batches, {s.get('warmup')} warm-up + {s.get('iters')} timed calls, size "
           f"{s.get('size')} {s.get('size_overrides') or ''}".rstrip(),
           f"- timing: {meta.get('timing')}; ratios are median / reference median (below 1 is faster)",
           ""]
    for title, rows in _groups(results["rows"]):
        out.append(f"## {title}")
        out.append("")
        out.append(f"Eager kernel-time floor: {_fmt(rows[0]['floor_ms'])} ms/step. "
                   f"Best stock contender: {rows[0].get('best_stock') or '-'}.")
        out.append("")
        header = ["contender", "median ms", "p10 / p90 ms", "x eager", "x best stock", "x floor", "accuracy",
                  "peak MiB", "compile s", "graphs", "graph breaks", "error"]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            name = f"**{r['contender']}**" if r.get("beats_best_stock") else r["contender"]
            err = (r["error"] or "").replace("|", "\\|")[:120]
            cells = [name, _fmt(r["median_ms"]), f"{_fmt(r['p10_ms'])} / {_fmt(r['p90_ms'])}",
                     _fmt(r["ratio_to_eager"], "ratio"), _fmt(r["ratio_to_best_stock"], "ratio"),
                     _fmt(r["ratio_to_floor"], "ratio"), _acc(r), _mib(r["peak_mem_bytes"]),
                     _fmt(r["compile_s"], ".2f"), _fmt(r["graphs"]), _fmt(r["graph_breaks"]), err]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out.append("Bold: faster than the best stock contender, with accuracy ok. Accuracy `ok 1.31x64`: worst error "
               "against the float64 run over eager's own (limit 2); `ok 3.0e-03`: error against eager "
               "(--reference eager); flips: MoE routing that differs from float64's; tokens: decode tokens "
               "equal to eager's. Decode rows: ms per token.")
    out.append("")
    return "\n".join(out)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_sanitize(results), indent=2, allow_nan=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------- main


def _contenders_for(spec: Any, mode: str, settings: Settings) -> list[str]:
    """The command line's contenders, else the model's own list (every contender when it has none)."""
    if "contenders" in settings.explicit:
        names = settings.contenders
    else:  # the defaults: contenders that do not apply to this model are left out without a row
        names = list(spec.contenders) if spec.contenders is not None else [
            n for n in settings.contenders
            if CONTENDERS[n].applies_to is None or CONTENDERS[n].applies_to(spec) is None]
    return [n for n in names if mode in CONTENDERS[n].modes]


def _log_row(key: str, row: dict[str, Any], seconds: float) -> None:
    name = row["contender"]
    if row["error"]:
        _log(f"{key} {name}: ERROR ({row['error_stage']}) {row['error'][:200]} [{seconds:.1f}s]")
    else:
        _log(f"{key} {name}: compile {_fmt(row['compile_s'], '.2f')}s, median {_fmt(row['median_ms'])} ms "
             f"({_fmt(row.get('timed_iters'))} calls), accuracy {_acc(row)}, graphs {_fmt(row['graphs'])}, "
             f"breaks {_fmt(row['graph_breaks'])}, peak {_mib(row['peak_mem_bytes'])} MiB [{seconds:.1f}s]")


def run(settings: Settings, argv: Sequence[str]) -> dict[str, Any]:
    from .bench_models import MODELS
    rows: list[dict[str, Any]] = []
    cases: list[Case] = []
    skipped: list[dict[str, Any]] = []
    for model_name in settings.models:
        spec = MODELS[model_name]
        ms = settings.for_model(spec)
        for mode in settings.modes:
            if mode not in spec.modes:
                skipped.append({"model": model_name, "mode": mode,
                                "reason": f"{model_name} runs modes {', '.join(spec.modes)}"})
                _log(f"{model_name}/{mode}: skipped ({skipped[-1]['reason']})")
                continue
            names = _contenders_for(spec, mode, settings)
            if spec.family == "decode":
                from .bench_decode import run_decode
                t_case = time.perf_counter()
                rows.extend(run_decode(spec, ms, names, log_row=_log_row))
                _log(f"{model_name}/{mode}: done [{time.perf_counter() - t_case:.1f}s]")
                continue
            for tokens in (ms.tokens or (4096,)) if spec.family == "shape" else (None,):
                t_case = time.perf_counter()
                label = f"{model_name}/{mode}" + (f"/{tokens}" if tokens is not None else "")
                _log(f"{label}: preparing inputs, eager reference and floor")
                case = prepare_case(spec, mode, ms, tokens)
                cases.append(case)
                if case.floor_ms is not None:
                    _log(f"{label}: floor {case.floor_ms:.3f} ms/step")
                rows.extend(run_contenders(case, names, ms, _log_row))
                # Free the case's device inputs before the next one.
                case.inputs = []
                case.base = None
                _cleanup(settings.device)
                _log(f"{label}: done [{time.perf_counter() - t_case:.1f}s]")
    add_ratios(rows)
    return {"meta": build_meta(settings, argv, cases, skipped, rows), "rows": rows}


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m cgbackend bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse already printed it)
        return int(exc.code or 0)
    if args.list_models:
        from .bench_models import MODELS
        for name, spec in MODELS.items():
            print(f"{name:26s} {spec.family:9s} {','.join(spec.modes):12s} {spec.description}")
        return 0
    if args.list_contenders:
        for name, c in CONTENDERS.items():
            kind = "stock" if c.stock else ("model rewritten by hand" if c.convert else "cgbackend")
            flags = kind + (", needs CUDA" if c.needs_cuda else "")
            print(f"{name:24s} {c.description} ({flags})")
        return 0
    try:
        settings = resolve_settings(args)
    except UsageError as exc:
        print(f"cgbackend bench: error: {exc}", file=sys.stderr)
        return 2
    if settings.verbose:
        import logging
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    _log(f"device {settings.device} ({_device_name(settings.device)}), dtype {_dtype_name(settings.dtype)}, "
         f"models {','.join(settings.models)}, modes {','.join(settings.modes)}, "
         f"contenders {','.join(settings.contenders)}")
    print(f"cgbackend bench: results will be written to {settings.out}", flush=True)
    saved_threads = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    try:
        results = run(settings, argv)
    finally:
        torch.set_num_threads(saved_threads)
    write_json(results, settings.out)
    _log(f"wrote {settings.out}")
    if settings.markdown is not None:
        settings.markdown.parent.mkdir(parents=True, exist_ok=True)
        settings.markdown.write_text(render_markdown(_sanitize(results)), encoding="utf-8")
        _log(f"wrote {settings.markdown}")
    print(render_table(results))
    print(f"results: {settings.out}" + (f", {settings.markdown}" if settings.markdown is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
