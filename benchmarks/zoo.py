"""Model zoo: real Hugging Face transformers and timm models, built from small configs with random
weights, under cgbackend in inference and a training step, each judged against a float64 run of the
same weights.

    python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --out benchmarks/ZOO.md
    python benchmarks/zoo.py --device cpu --simulate          # logic check without a GPU

Per model and mode: the partition (static op fraction, static/dynamic regions), graphs captured,
static-region calls that ran eagerly after warm-up (by reason), and accuracy by the rule of
``cgbackend.bench.accuracy``: a float64 copy of the same weights runs the same inputs
(floating inputs upcast, token ids as they are); eager in the run dtype and cgbackend are each
compared with it per group (outputs in inference; the loss and every gradient in training), and
cgbackend matches when, in every group, its error is at most ``LIMIT`` (2) times eager's own (floor:
the dtype's unit roundoff), with no error and the same gradients present as eager. The error against
eager is reported too (informational). MoE models also report the fraction of tokens whose top-k
experts in the first MoE layer differ from the float64 run's (a forward hook on the first router),
never judged. With ``--time``: median times of eager, cgbackend and
``torch.compile(mode="reduce-overhead")`` (judged by the same rule first), timed in alternating
blocks on rotating batches, and their ratios.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import math
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

import cgbackend
from cgbackend.bench.accuracy import (LIMIT, Judgement, flip_fraction, group_errors, judge, merge, store,
                                      upcast_inputs, worst)


def _lm(cls_name: str, cfg_name: str, **kw: Any) -> Callable[..., torch.nn.Module]:
    def make(layers: Optional[int] = None) -> torch.nn.Module:
        import transformers
        cfg = getattr(transformers, cfg_name)(**kw)
        if layers is not None:  # the configs' own depth otherwise (GPT-2 maps the name to n_layer)
            cfg.num_hidden_layers = layers
        cfg._attn_implementation = "sdpa"
        return getattr(transformers, cls_name)(cfg)
    return make


_SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
_MOE = dict(num_experts_per_tok=2)

ZOO: dict[str, tuple[str, Callable[[], torch.nn.Module]]] = {
    # Dropout off: eager and cgbackend would draw different random numbers (dropout has its own tests).
    "gpt2": ("lm", _lm("GPT2LMHeadModel", "GPT2Config", vocab_size=512, n_embd=128, n_layer=2, n_head=4,
                       n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": ("lm", _lm("LlamaForCausalLM", "LlamaConfig", **_SMALL)),
    "mistral": ("lm", _lm("MistralForCausalLM", "MistralConfig", **_SMALL)),
    "mixtral": ("lm", _lm("MixtralForCausalLM", "MixtralConfig", num_local_experts=8, **_MOE, **_SMALL)),
    "qwen2_moe": ("lm", _lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_experts=8, moe_intermediate_size=128,
                            shared_expert_intermediate_size=128, **_MOE, **_SMALL)),
    "olmoe": ("lm", _lm("OlmoeForCausalLM", "OlmoeConfig", num_experts=8, **_MOE, **_SMALL)),
    "vit_tiny": ("vision", lambda: __import__("timm").create_model("vit_tiny_patch16_224", pretrained=False,
                                                                   num_classes=100, drop_rate=0.0)),
    "resnet18": ("vision", lambda: __import__("timm").create_model("resnet18", pretrained=False, num_classes=100)),
}


def _inputs(kind: str, n: int, device: str, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    if kind == "lm":
        return [torch.randint(0, 512, (2, 64), generator=gen).to(device) for _ in range(n)]
    return [torch.randn(4, 3, 224, 224, generator=gen).to(device, dtype) for _ in range(n)]


def _forward(kind: str, fn: Callable, x: torch.Tensor) -> torch.Tensor:
    return fn(input_ids=x).logits if kind == "lm" else fn(x)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """float32, or float64 for the float64 copy."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _loss(kind: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kind == "lm":
        return F.cross_entropy(_wide(out[:, :-1].flatten(0, 1)), x[:, 1:].flatten())
    return _wide(out).logsumexp(-1).mean()


def _float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in float64. transformers' default experts implementation (grouped_mm) takes no
    float64: the copy runs the same experts through their loop over experts
    (``experts_implementation="eager"``), the same function."""
    model = model.to(torch.float64)
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if c is not None}
    for config in configs.values():
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return model


def _time(steps: dict[str, Callable[[int], None]], n: int, device: str, rounds: int = 5) -> dict[str, float]:
    """Median ms of each contender's step, timed in ``rounds`` alternating blocks of about ``n /
    rounds`` steps each (contender A's block, then B's, then A's again, ...): a change of the
    machine's pace during the run (another process, clocks) shows in every contender alike rather
    than in whichever was timed then. Each step is timed alone, synchronized before and after."""
    times: dict[str, list] = {label: [] for label in steps}
    per = max(1, n // rounds)
    for r in range(rounds):
        for label, step in steps.items():
            for i in range(per):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(r * per + i)
                if device == "cuda":
                    torch.cuda.synchronize()
                times[label].append((time.perf_counter() - t0) * 1e3)
    return {label: statistics.median(t) for label, t in times.items()}


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


class _RoutingProbe:
    """The expert ids chosen by a model's first MoE router in its latest call: a forward hook on the
    first module whose class name ends in ``Router`` (transformers' ``*TopKRouter`` returns
    ``(logits, weights, expert ids)``); models without one get no hook. The hook only sets an
    attribute, which Dynamo traces as one more graph output with no guard that would recompile."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.last: Optional[torch.Tensor] = None
        router = next((m for m in model.modules() if type(m).__name__.endswith("Router")), None)
        self._handle = None if router is None else router.register_forward_hook(self._hook)

    @property
    def installed(self) -> bool:
        return self._handle is not None

    def _hook(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        ids = out[-1] if isinstance(out, tuple) and out else None
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
            self.last = ids

    def take(self) -> Optional[torch.Tensor]:
        ids, self.last = self.last, None
        return ids

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@dataclasses.dataclass
class _Scores:
    """One contender's accuracy over the batches: the worst error per group against the float64 run
    and against eager, and each batch's routing flips against the float64 run."""
    vs64: dict = dataclasses.field(default_factory=dict)
    vs_eager: dict = dataclasses.field(default_factory=dict)
    flips: list = dataclasses.field(default_factory=list)

    def add(self, got: dict, ref64: dict, eager: Optional[dict] = None) -> None:
        merge(self.vs64, group_errors(got, ref64))
        if eager is not None:
            merge(self.vs_eager, group_errors(got, eager))
        self.flips.append(flip_fraction(got.get("routing"), ref64.get("routing")))

    def flip_frac(self) -> Optional[float]:
        """The mean over the batches (all of one size): the fraction of all their tokens."""
        if not self.flips or None in self.flips:
            return None
        return statistics.fmean(self.flips)


def _same_grads_present(got: dict, eager: dict) -> None:
    for name, grad in eager.get("grads", {}).items():
        if (grad is None) != (got["grads"].get(name) is None):
            raise AssertionError(f"gradient of {name} present in one model only")


@dataclasses.dataclass
class _Case:
    """One model and mode: its seed weights, batches, and the float64 run's results to judge by."""
    kind: str
    train: bool
    base: torch.nn.Module
    xs: list
    dtype: torch.dtype
    args: argparse.Namespace
    refs64: list = dataclasses.field(default_factory=list)
    """The float64 run's results, one per batch (cgbackend.bench.accuracy.store)."""
    eager64: dict = dataclasses.field(default_factory=dict)
    """Eager's own error against the float64 run, worst per group over the batches."""

    def fresh(self, float64: bool = False) -> torch.nn.Module:
        model = copy.deepcopy(self.base)
        return (_float64_copy(model) if float64 else model).train(self.train)

    def results(self, model: torch.nn.Module, fn: Callable, x: torch.Tensor,
                probe: Optional[_RoutingProbe] = None) -> dict:
        """One batch through ``fn`` (``model``'s forward, compiled or not): the output (inference) or
        the loss and every parameter's gradient (training; None where autograd left none), and the
        routing; copied to the CPU (cgbackend.bench.accuracy.store)."""
        if self.train:
            model.zero_grad(set_to_none=True)
            loss = _loss(self.kind, _forward(self.kind, fn, x), x)
            loss.backward()
            got: dict = {"loss": loss, "grads": {n: p.grad for n, p in model.named_parameters()}}
        else:
            with torch.no_grad():
                got = {"output": _forward(self.kind, fn, x)}
        if probe is not None:
            got["routing"] = probe.take()
        return store(got, self.dtype)

    def judged(self, model: torch.nn.Module, fn: Callable) -> Judgement:
        """Every batch through a contender (its warm-up), judged against the float64 run."""
        scores = _Scores()
        for x, ref64 in zip(self.xs, self.refs64):
            scores.add(self.results(model, fn, x), ref64)
        return judge(scores.vs64, self.eager64, self.dtype)

    def step(self, model: torch.nn.Module, fn: Callable) -> Callable[[int], None]:
        """Step ``i``: a call (inference) or a forward + loss + backward (training) on batch ``i``
        (rotating), after three untimed steps."""
        def step(i: int) -> None:
            x = self.xs[i % len(self.xs)]
            if self.train:
                model.zero_grad(set_to_none=True)
                _loss(self.kind, _forward(self.kind, fn, x), x).backward()
            else:
                with torch.no_grad():
                    _forward(self.kind, fn, x)
        for i in range(3):
            step(i)
        return step


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """cgbackend.compile's options; ``inner`` only when given (else cgbackend's default)."""
    options: dict[str, Any] = dict(warmup=args.warmup, static_dispatch=getattr(args, "static_dispatch", "off"))
    if getattr(args, "inner", None) is not None:
        options["inner"] = args.inner
    if args.simulate:
        options["simulate_graphs"] = True
    return options


def _reduce_overhead(model: torch.nn.Module) -> Callable:
    return torch.compile(model, mode="reduce-overhead")


def _reduce_overhead_skipped(args: argparse.Namespace) -> Optional[str]:
    if args.simulate:
        return "simulated graphs"
    if not getattr(args, "reduce_overhead", True):
        return "--no-reduce-overhead"
    return None


def run_one(name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    kind, make = ZOO[name]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    layers = getattr(args, "layers", None)
    base = (make(layers) if layers is not None and kind == "lm" else make()).to(args.device, dtype)
    case = _Case(kind, mode == "train", base, _inputs(kind, args.batches, args.device, dtype, gen), dtype, args)
    # Each copy updates its own batch-norm statistics from the same batches: they stay equal.
    ref, ref64, mine = case.fresh(), case.fresh(float64=True), case.fresh()
    probes = {label: _RoutingProbe(m) for label, m in (("eager", ref), ("fp64", ref64), ("cgbackend", mine))}
    torch._dynamo.reset()
    options = _options(args)
    compiled = cgbackend.compile(mine, **options)
    row: dict[str, Any] = {"model": name, "mode": mode, "error": None, "ok": False}
    try:
        cg, eager_flips = _Scores(), []
        for x in case.xs:
            eager = case.results(ref, ref, x, probes["eager"])
            ref64_got = case.results(ref64, ref64, upcast_inputs(x), probes["fp64"])
            got = case.results(mine, compiled, x, probes["cgbackend"])
            _same_grads_present(got, eager)
            merge(case.eager64, group_errors(eager, ref64_got))
            eager_flips.append(flip_fraction(eager.get("routing"), ref64_got.get("routing")))
            cg.add(got, ref64_got, eager)
            case.refs64.append(ref64_got)
        unlike = [note for err, note in case.eager64.values() if math.isinf(err)]
        if unlike:  # judge() would take an infinite error of eager's as a pass for anything
            raise RuntimeError(f"eager and its float64 copy differ in kind (NaN, shape, gradients): {unlike[0]}")
        verdict = judge(cg.vs64, case.eager64, dtype)
        stats = cgbackend.stats(compiled)
        report = cgbackend.report(compiled)
        row.update(static_op_fraction=report.summary["static_op_fraction"],
                   regions=f"{stats['static_regions']}/{stats['dynamic_regions']}",
                   graphs=stats["graphs_captured"],
                   eager_after_warmup={k: v for k, v in stats["eager_calls"].items() if k != "warmup"},
                   dynamo_graphs=stats["compiled_graphs"],
                   err=worst(cg.vs_eager)[0], err64=worst(cg.vs64)[0], eager_err64=worst(case.eager64)[0],
                   ratio=verdict.ratio, worst=verdict.worst, ok=verdict.ok,
                   flips=cg.flip_frac(), eager_flips=None if None in eager_flips else statistics.fmean(eager_flips),
                   dispatch_rewrites=report.summary["dispatch_rewrites"],
                   dispatch_left_dynamic=report.summary["dispatch_left_dynamic"])
        if args.time:
            probes["eager"].remove()
            row.update(_timings(case, ref, mine, compiled, probes["cgbackend"].installed, options))
    except Exception as exc:
        row["error"] = _error_text(exc)
    row["match"] = row["error"] is None and row["ok"] and row.get("timed_ok", True)
    return row


def _timings(case: _Case, ref: torch.nn.Module, mine: torch.nn.Module, compiled: Callable,
             probed: bool, options: dict[str, Any]) -> dict[str, Any]:
    """Eager, cgbackend and reduce-overhead timed on the same batches, in alternating blocks
    (``_time``). The routing probe's compile is dropped with ``torch._dynamo.reset()`` before
    cgbackend's timed compile; reduce-overhead compiles after it without a reset (a reset would
    drop cgbackend's compiled code; the two compiles are of different model objects under
    different backends, so neither reuses the other's code)."""
    out: dict[str, Any] = {}
    if probed:
        # The routing probe is one more output of cgbackend's graphs (a copy out of graph memory):
        # time a fresh compile without it, judged by the same rule (its first calls are its warm-up).
        torch._dynamo.reset()
        mine = case.fresh()
        compiled = cgbackend.compile(mine, **options)
        timed = case.judged(mine, compiled)
        out.update(timed_ratio=timed.ratio, timed_ok=timed.ok)
    steps = {"eager": case.step(ref, ref), "cgbackend": case.step(mine, compiled)}
    skipped = _reduce_overhead_skipped(case.args)
    if skipped:
        out["ro_skipped"] = skipped
    else:
        try:  # a contender's failure is a finding for its row, not the end of the run
            model = case.fresh()
            fn = _reduce_overhead(model)
            verdict = case.judged(model, fn)
            out.update(ro_ratio=verdict.ratio, ro_ok=verdict.ok)
            steps["ro"] = case.step(model, fn)
        except Exception as exc:
            out["ro_error"] = _error_text(exc)
    try:
        ms = _time(steps, case.args.iters, case.args.device)
    finally:
        torch._dynamo.reset()
    out.update(eager_ms=ms["eager"], cgbackend_ms=ms["cgbackend"])
    out["speedup"] = out["eager_ms"] / out["cgbackend_ms"]
    if "ro" in ms:
        out["ro_ms"] = ms["ro"]
        out["x_ro"] = out["cgbackend_ms"] / out["ro_ms"]
    return out


def _cell(r: dict[str, Any], key: str, fmt: str) -> str:
    return "-" if r.get(key) is None else format(r[key], fmt)


def _flips_cell(r: dict[str, Any]) -> str:
    if r.get("flips") is None:
        return "-"
    eager = "-" if r.get("eager_flips") is None else f"{r['eager_flips']:.1%}"
    return f"{r['flips']:.1%} (eager {eager})"


def _ro_cell(r: dict[str, Any]) -> str:
    if r.get("ro_error"):
        return f"error: {r['ro_error']}"
    if r.get("ro_skipped"):
        return f"skipped: {r['ro_skipped']}"
    if r.get("ro_ms") is None:
        return "-"
    return f"{r['ro_ms']:.2f}" + ("" if r.get("ro_ok") else f" (inaccurate: ratio {r['ro_ratio']:.1f})")


def _match_cell(r: dict[str, Any]) -> str:
    if r["match"]:
        return "yes"
    if r.get("error"):
        return f"no: {r['error']}"
    if not r["ok"]:
        return f"NO: ratio {r['ratio']:.1f} at {r['worst']}"
    return f"NO: timed compile's ratio {r['timed_ratio']:.1f}"


def _options_text(args: argparse.Namespace) -> str:
    options = _options(args)
    options.pop("simulate_graphs", None)
    options.setdefault("inner", "(default)")
    return ", ".join(f"{k}={v}" for k, v in options.items())


def render(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (simulated graphs)"
    dtype = getattr(args, "dtype", "float32")
    roundoff = torch.finfo(getattr(torch, dtype)).eps / 2
    lines = [
        "# Model zoo under cgbackend",
        "",
        f"- device: {device}; torch {torch.__version__}; date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `{command}`",
        f"- models: small configs, random weights, {dtype}, SDPA attention; cgbackend options: {_options_text(args)};"
        " inference under no_grad, training = forward + loss (float32) + backward",
        "- accuracy (`cgbackend/bench/accuracy.py`): a float64 copy of the same weights runs the same inputs"
        " (floating inputs upcast, token ids as they are); err = max|diff| / max|float64| per tensor, worst per"
        " group (outputs in inference; loss, and every gradient in training) over the batches."
        f" ratio = max over groups of cgbackend's err vs fp64 over eager's own ({dtype}; floor: the unit roundoff"
        f" {roundoff:.1e}). match: ratio <= {LIMIT:g}, no error, the same gradients present as eager"
        " (and, where a routing probe made cgbackend's timed model a fresh compile, its ratio too)."
        " err vs eager: informational",
        "- flips (MoE): fraction of tokens whose top-k experts in the first MoE layer differ from the float64"
        " run's, cgbackend (eager); reported, never judged",
        "- RO: `torch.compile(mode=\"reduce-overhead\")` on a fresh copy of the weights, judged by the same rule"
        " before timing; x RO = cgbackend ms / RO ms; times: medians of --iters synchronized steps per contender,"
        " timed in 5 alternating blocks (eager, cgbackend, RO, eager, ...) on rotating batches",
        "- eager after warm-up: static-region calls that ran eagerly after warm-up, by reason",
        "",
        "| model | mode | static op fraction | static/dynamic regions | graphs | eager after warm-up |"
        " err vs fp64 | eager err vs fp64 | ratio | err vs eager | flips |"
        " eager ms | cgbackend ms | speedup | RO ms | x RO | match |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "regions" not in r:
            lines.append(f"| {r['model']} | {r['mode']} |" + " - |" * 14 + f" {_match_cell(r)} |")
            continue
        eager = ", ".join(f"{k} {v}" for k, v in r["eager_after_warmup"].items()) or "none"
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['static_op_fraction']:.2f} | {r['regions']} | {r['graphs']} |"
            f" {eager} | {_cell(r, 'err64', '.1e')} | {_cell(r, 'eager_err64', '.1e')} | {_cell(r, 'ratio', '.2f')} |"
            f" {_cell(r, 'err', '.1e')} | {_flips_cell(r)} | {_cell(r, 'eager_ms', '.2f')} |"
            f" {_cell(r, 'cgbackend_ms', '.2f')} | {_cell(r, 'speedup', '.2f')} | {_ro_cell(r)} |"
            f" {_cell(r, 'x_ro', '.2f')} | {_match_cell(r)} |")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(ZOO))
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--simulate", action="store_true", help="simulated graphs (CPU logic check)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--time", action=argparse.BooleanOptionalAction, default=None,
                   help="time eager, cgbackend and reduce-overhead (default: on CUDA)")
    p.add_argument("--iters", type=int, default=40, help="timed steps per contender, in 5 alternating blocks")
    p.add_argument("--reduce-overhead", action=argparse.BooleanOptionalAction, default=True,
                   help="with --time, also torch.compile(mode='reduce-overhead') (never with --simulate)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--static-dispatch", default="off", help="cgbackend option static_dispatch")
    p.add_argument("--inner", default=None, help="cgbackend option inner (default: cgbackend's default)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers of the transformers models (default: their configs' 2)")
    p.add_argument("--out", default=None, help="write the markdown table here")
    args = p.parse_args(argv)
    if args.time is None:
        args.time = args.device == "cuda"
    command = "python benchmarks/zoo.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            row = run_one(name, mode, args)
            rows.append(row)
            print(f"[zoo] {name} {mode}: match={row['match']} ratio={_cell(row, 'ratio', '.2f')} "
                  f"err64={_cell(row, 'err64', '.1e')} eager_err64={_cell(row, 'eager_err64', '.1e')} "
                  f"err={_cell(row, 'err', '.1e')} flips={_flips_cell(row)} "
                  f"graphs={row.get('graphs')} regions={row.get('regions')} eager={row.get('eager_after_warmup')} "
                  f"rewrites={row.get('dispatch_rewrites')} left={row.get('dispatch_left_dynamic')} "
                  f"speedup={_cell(row, 'speedup', '.2f')} ro={_ro_cell(row)} x_ro={_cell(row, 'x_ro', '.2f')} "
                  f"{row.get('error') or ''}", flush=True)
            if args.out:  # after every row: a run cut short still leaves its table
                with open(args.out, "w", encoding="utf-8") as f:
                    f.write(render(rows, args, command))
    print(render(rows, args, command))
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
