"""The bench's settings: command-line flags, their defaults (a run, ``--smoke``, a model's own) and
the one :class:`Settings` object every part of the harness reads."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

from .contenders import CONTENDERS


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


SIZE_FLAGS = {"d_model": "d_model", "layers": "n_layers", "heads": "n_heads", "experts": "n_experts",
              "top_k": "top_k", "vocab": "vocab"}


SMOKE_DEFAULTS = dict(size="tiny", batch=2, seq=16, batches=4, warmup=2, iters=3, acc_batches=2,
                      contenders="eager,cgbackend", device="cpu", floor_steps=2,
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
    append: bool = False
    threads: Optional[int] = None
    scale: str = "full"
    tokens: Optional[tuple[int, ...]] = None
    reference: str = "fp64"
    time_budget: Optional[float] = None
    timing: str = "alternate"
    """alternate: contenders timed in alternating blocks; sequential: each timed alone (run_contenders)."""
    share_weights: bool = False
    """Inference: every contender runs on one device copy of the weights (contenders that rebuild the
    model view it), for models too large for one copy per contender."""
    twins: tuple[str, ...] = ()
    """``--twin``: contenders that get a second, independent instance in each case (``NAME:twin``),
    timed in the same alternating blocks: the harness's own resolution (``harness_spread``)."""
    explicit: frozenset = frozenset()
    """Settings given on the command line: a model's own defaults (bench/models.py) never override them."""

    def to_meta(self) -> dict[str, Any]:
        return {
            "models": self.models, "modes": self.modes, "contenders": self.contenders, "size": self.size,
            "size_overrides": self.overrides, "batch": self.batch, "seq": self.seq, "batches": self.batches,
            "warmup": self.warmup, "iters": self.iters, "acc_batches": self.acc_batches,
            "floor_steps": self.floor_steps, "device": str(self.device), "dtype": dtype_name(self.dtype),
            "tolerance": self.tol, "seed": self.seed, "lr": self.lr, "smoke": self.smoke,
            "threads": self.threads if self.threads is not None else torch.get_num_threads(),
            "scale": self.scale, "tokens": list(self.tokens) if self.tokens else None,
            "reference": self.reference, "time_budget_s": self.time_budget, "timing": self.timing,
            "share_weights": self.share_weights, "twins": list(self.twins),
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


def dtype_name(dtype: torch.dtype) -> str:
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
                                    "(default 4096; above 4096, sequences of 4096); decode models: decode "
                                    "batches, one token per sequence a step (default: the scale's, 8 or 2)")
    p.add_argument("--reference", choices=("fp64", "eager"),
                   help="accuracy rule: fp64 (default: error against a float64 run at most 2x eager's own) "
                        "or eager (error against eager at most --tol)")
    p.add_argument("--time-budget", type=float,
                   help="seconds of timed calls per row: --iters is lowered to fit, never below 5 "
                        "(default: none for the reference models, 3 s for shape and decode models)")
    p.add_argument("--timing", choices=("alternate", "sequential"),
                   help="alternate (default): a case's contenders are compiled, warmed up and judged one "
                        "after the other and kept, then timed in 5 alternating blocks; sequential: each is "
                        "timed alone right after its warm-up and dropped (less memory held); decode rows "
                        "follow it too: their timed rounds alternate by the same rule")
    p.add_argument("--twin", action="append", metavar="NAME",
                   help="add a second, independent instance of contender NAME to each case where NAME runs "
                        "(row NAME:twin: its own compile and warm-up, timed in the same alternating blocks); "
                        "its spread against NAME is the case's harness_spread, which the tie verdicts use "
                        "(repeatable or comma-separated)")
    p.add_argument("--share-weights", action="store_true", default=None,
                   help="inference: all contenders share one device copy of the weights (default for models "
                        "that set it, such as moe-128e-deep)")
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
    p.add_argument("--device", help="cuda (the default; without a CUDA device the bench refuses unless "
                                    "--smoke or --device cpu is given) or cpu")
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
    p.add_argument("--append", action="store_true",
                   help="add this run's rows to the --out file: its rows of other model/mode/contender/"
                        "tokens stay, each row names the run that made it (meta.runs: command, device, date)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU smoke run: tiny sizes, eager and the cgbackend contenders with the eager "
                        "inner compiler, few iterations")
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks and cgbackend INFO logs")
    return p


def no_cuda_refusal(command: str, args: argparse.Namespace) -> Optional[str]:
    """The one line a benchmark command prints on a machine without CUDA, unless the run asked for
    the CPU (``--device cpu``, or ``--smoke`` where the command has it); None where it may run.
    Checked before anything heavy is imported or built."""
    if getattr(args, "smoke", False) or args.device is not None or torch.cuda.is_available():
        return None
    from ..common.machine import no_cuda_line
    return no_cuda_line(command, smoke=hasattr(args, "smoke"))


def resolve_settings(args: argparse.Namespace) -> Settings:
    from ..models import SIZES

    defaults = dict(RUN_DEFAULTS)
    if args.smoke:
        defaults.update(SMOKE_DEFAULTS)

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults.get(name) if value is None else value

    from .models import MODELS
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
    twins = tuple(dict.fromkeys(n for text in args.twin or () for n in _csv(text)))
    for c in twins:
        if c not in CONTENDERS:
            raise UsageError(f"unknown --twin contender {c!r}; choose from {', '.join(CONTENDERS)}")
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
                                           "contenders", "share_weights", "floor_steps")
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
                    out=out, markdown=markdown, smoke=args.smoke, verbose=args.verbose, append=args.append, threads=threads,
                    scale=args.scale or ("tiny" if args.smoke else "full"), tokens=tokens,
                    reference=args.reference or "fp64", time_budget=args.time_budget,
                    timing=args.timing or "alternate", share_weights=bool(args.share_weights),
                    twins=twins, explicit=explicit)
