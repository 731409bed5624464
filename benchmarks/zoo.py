"""Model zoo: real Hugging Face transformers and timm models, built from small configs with random
weights, under cgbackend in inference and a training step, each compared with eager.

    python benchmarks/zoo.py --device cuda --out benchmarks/ZOO.md
    python benchmarks/zoo.py --device cpu --simulate          # logic check without a GPU

Per model and mode: the partition (static op fraction, static/dynamic regions), graphs captured,
static-region calls that ran eagerly after warm-up (by reason), the largest error against eager
(outputs, or loss and every gradient), median time against eager, and whether it matched.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import cgbackend


def _lm(cls_name: str, cfg_name: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        import transformers
        cfg = getattr(transformers, cfg_name)(**kw)
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


def _inputs(kind: str, n: int, device: str, gen: torch.Generator) -> list[torch.Tensor]:
    if kind == "lm":
        return [torch.randint(0, 512, (2, 64), generator=gen).to(device) for _ in range(n)]
    return [torch.randn(4, 3, 224, 224, generator=gen).to(device) for _ in range(n)]


def _forward(kind: str, fn: Callable, x: torch.Tensor) -> torch.Tensor:
    return fn(input_ids=x).logits if kind == "lm" else fn(x)


def _loss(kind: str, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kind == "lm":
        return F.cross_entropy(out[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())
    return out.float().logsumexp(-1).mean()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _time(step: Callable[[int], None], n: int, device: str) -> float:
    times = []
    for i in range(n):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(i)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_one(name: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    kind, make = ZOO[name]
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    base = make().to(args.device, dtype)
    xs = _inputs(kind, args.batches, args.device, gen)
    train = mode == "train"
    # Each copy updates its own batch-norm statistics from the same batches: they stay equal.
    ref, mine = copy.deepcopy(base).train(train), copy.deepcopy(base).train(train)
    torch._dynamo.reset()
    options = dict(warmup=args.warmup, static_dispatch=getattr(args, "static_dispatch", "off"))
    if args.simulate:
        options["simulate_graphs"] = True
    compiled = cgbackend.compile(mine, **options)
    row: dict[str, Any] = {"model": name, "mode": mode}
    err = 0.0
    try:
        if not train:
            with torch.no_grad():
                for x in xs:
                    err = max(err, _rel(_forward(kind, compiled, x), _forward(kind, ref, x)))
        else:
            for x in xs:
                for model, fn in ((ref, ref), (mine, compiled)):
                    model.zero_grad(set_to_none=True)
                    loss = _loss(kind, _forward(kind, fn, x), x)
                    loss.backward()
                    if model is ref:
                        ref_loss = loss.detach()
                err = max(err, _rel(loss.detach(), ref_loss))
                for (pn, a), (_, b) in zip(ref.named_parameters(), mine.named_parameters()):
                    if (a.grad is None) != (b.grad is None):
                        raise AssertionError(f"gradient of {pn} present in one model only")
                    if a.grad is not None:
                        err = max(err, _rel(b.grad, a.grad))
        stats = cgbackend.stats(compiled)
        report = cgbackend.report(compiled)
        row.update(static_op_fraction=report.summary["static_op_fraction"],
                   regions=f"{stats['static_regions']}/{stats['dynamic_regions']}",
                   graphs=stats["graphs_captured"],
                   eager_after_warmup={k: v for k, v in stats["eager_calls"].items() if k != "warmup"},
                   dynamo_graphs=stats["compiled_graphs"], err=err, error=None,
                   dispatch_rewrites=report.summary["dispatch_rewrites"],
                   dispatch_left_dynamic=report.summary["dispatch_left_dynamic"])
        if args.time:
            opt = {}

            def step_for(fn: Callable, model: torch.nn.Module) -> Callable[[int], None]:
                def step(i: int) -> None:
                    x = xs[i % len(xs)]
                    if train:
                        model.zero_grad(set_to_none=True)
                        _loss(kind, _forward(kind, fn, x), x).backward()
                    else:
                        with torch.no_grad():
                            _forward(kind, fn, x)
                return step

            for label, fn, model in (("eager", ref, ref), ("cgbackend", compiled, mine)):
                step = step_for(fn, model)
                for i in range(3):
                    step(i)
                opt[label] = _time(step, args.iters, args.device)
            row.update(eager_ms=opt["eager"], cgbackend_ms=opt["cgbackend"],
                       speedup=opt["eager"] / opt["cgbackend"])
    except Exception as exc:
        row.update(error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
    tol = args.tol if args.tol is not None else (
        5e-2 if dtype == torch.bfloat16 else 2e-2 if args.device == "cuda" else 1e-5)
    row["tol"] = tol
    row["match"] = row.get("error") is None and row.get("err", 1.0) <= tol
    return row


def render(rows: list[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (simulated graphs)"
    lines = [
        "# Model zoo under cgbackend",
        "",
        f"- device: {device}; torch {torch.__version__}; date {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"- command: `{command}`",
        f"- models: small configs, random weights, {getattr(args, 'dtype', 'float32')}, SDPA attention;"
        f" static_dispatch={getattr(args, 'static_dispatch', 'off')}; inference under no_grad,"
        " training = forward + loss + backward, compared with an eager copy (loss and every gradient)",
        "- err: largest |diff| / max|eager| over outputs (inference) or loss and gradients (training);"
        f" match: err <= {rows[0]['tol'] if rows else '-'} and no error",
        "- eager after warm-up: static-region calls that ran eagerly after warm-up, by reason",
        "",
        "| model | mode | static op fraction | static/dynamic regions | graphs | eager after warm-up |"
        " err | eager ms | cgbackend ms | speedup | match |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['mode']} | - | - | - | - | - | - | - | - | no: {r['error']} |")
            continue
        speed = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        eager = ", ".join(f"{k} {v}" for k, v in r["eager_after_warmup"].items()) or "none"
        lines.append(f"| {r['model']} | {r['mode']} | {r['static_op_fraction']:.2f} | {r['regions']} | {r['graphs']} |"
                     f" {eager} | {r['err']:.1e} | {r.get('eager_ms', float('nan')):.2f} |"
                     f" {r.get('cgbackend_ms', float('nan')):.2f} | {speed} | {'yes' if r['match'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(ZOO))
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--simulate", action="store_true", help="simulated graphs (CPU logic check)")
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--time", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--tol", type=float, default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--static-dispatch", default="off", help="cgbackend option static_dispatch")
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
            print(f"[zoo] {name} {mode}: match={row['match']} err={row.get('err', float('nan')):.1e} "
                  f"graphs={row.get('graphs')} regions={row.get('regions')} eager={row.get('eager_after_warmup')} "
                  f"rewrites={row.get('dispatch_rewrites')} left={row.get('dispatch_left_dynamic')} "
                  f"speedup={row.get('speedup', float('nan')):.2f} {row.get('error') or ''}", flush=True)
    text = render(rows, args, command)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0 if all(r["match"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
