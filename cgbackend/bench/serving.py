"""Serving-loop benchmark: inference calls with batch sizes drawn at random, as a server sees them.

``python benchmarks/serving.py [FLAGS]`` (or ``python -m cgbackend serve-bench``). For each model
and contender, in one process:

1. a *warm* loop of ``--calls`` calls (batch sizes drawn from 1..``--max-batch``, fresh tokens each
   call, so MoE routing changes): every output is judged against a float64 run of the same weights
   on the same input (``--reference fp64``, the default: the worst error over the calls at most 2x
   eager's own, MoE routing flips included on both sides) or against eager (``--reference eager``),
   and the first outputs are checked again at the end against what they were when returned (no
   later replay overwrote them: ``outputs_overwritten``);
2. a *timed* loop of ``--calls`` new draws, synchronized before and after: its total time is the
   figure, and its ratio to eager's time over the same draws.

Counters after both loops: graphs captured, graphs per static region, eager calls by reason,
evictions, and the bound on graphs: (capture sizes hit) x (static regions). Every row has the
latency of its first request (``first_request_ms``: a compile and warm-up for a compiled
contender); ``cgbackend-warm-up`` captures every capture size up to ``--max-batch`` first
(``cgbackend.warm_up``: ``warm_up_s``, ``graph_memory_bytes``), so its first request replays; it
also captures the largest of those sizes alone in a compile of its own first
(``largest_alone_bytes``) and gives the ratio of the two (``graph_memory_vs_largest``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .accuracy import LIMIT, rel_err
from .measure import cudagraph_tree_counts, log, sync
from .render import command_line, device_name, read_results, render_serving as render_markdown, write_json
from .settings import DTYPES, TOLERANCE, no_cuda_refusal
from ..config import Config
from ..models import build_model

__all__ = ["main", "render_markdown", "run"]

CONTENDERS = ("eager", "cgbackend", "cgbackend-warm-up", "cgbackend-inductor", "cgbackend-exact",
              "cgbackend-entry-point", "reduce-overhead")


def _make(name: str, model: torch.nn.Module) -> Callable[..., Any]:
    import cgbackend
    if name == "eager":
        return model
    # cgbackend.compile: Dynamo traces the data-dependent dispatch into the graph (one graph per
    # forward; the same API as the `bench` contender cgbackend).
    if name in ("cgbackend", "cgbackend-warm-up"):  # the second: sizes captured before the loop
        return cgbackend.compile(model)
    if name == "cgbackend-inductor":
        return cgbackend.compile(model, inner="inductor")
    if name == "cgbackend-exact":  # no bucketing: one graph per batch size, LRU-bounded
        return cgbackend.compile(model, capture_sizes=())
    if name == "cgbackend-entry-point":  # the registered backend: Dynamo's default configuration,
        return torch.compile(model, backend="cgbackend")  # so data-dependent ops break the graph
    if name == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead")
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}")


def _draws(n: int, max_batch: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, max_batch) for _ in range(n)]


def _inputs(sizes: list[int], seq: int, vocab: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randint(0, vocab, (n, seq), generator=g).to(device) for n in sizes]


def _bucket(ladder: Sequence[int], n: int) -> int:
    """The capture size a call of ``n`` rows pads to (``n`` itself above the ladder)."""
    return next((b for b in ladder if b >= n), n)


def _loop(fn: Callable[..., Any], xs: list[torch.Tensor], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        for x in xs:
            fn(x)
    sync(device)
    return time.perf_counter() - start


def _graph_memory(model: torch.nn.Module, make: Callable[[int], tuple], sizes: list[int],
                  device: torch.device) -> int:
    """Pool bytes ``cgbackend.warm_up`` reports for ``sizes`` in a compile of their own, which is
    then dropped with its graphs (and the allocator's cached blocks) before the caller goes on."""
    import cgbackend
    from ..runtime.capture import clear_blas_workspaces
    fn = cgbackend.compile(model)
    pool_bytes = cgbackend.warm_up(fn, make, sizes).pool_bytes
    del fn
    torch._dynamo.reset()
    cgbackend.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        clear_blas_workspaces()
        torch.cuda.empty_cache()
    return pool_bytes


def run_model(model_name: str, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    import cgbackend
    dtype = DTYPES[args.dtype]
    tol = args.tol if args.tol is not None else TOLERANCE[dtype]
    model = build_model(model_name, size=args.size, device=device, dtype=dtype).eval()
    # The float64 rule (bench/accuracy.py): every contender, eager included, against a float64 run
    # of the same weights; a compiled contender passes at most LIMIT x eager's own error.
    model64 = copy.deepcopy(model).double() if args.reference == "fp64" else None
    eager64: Optional[float] = None
    vocab = model.tok_emb.num_embeddings
    warm_sizes = _draws(args.calls, args.max_batch, args.seed)
    timed_sizes = _draws(args.calls, args.max_batch, args.seed + 1)
    warm_xs = _inputs(warm_sizes, args.seq, vocab, device, args.seed)
    timed_xs = _inputs(timed_sizes, args.seq, vocab, device, args.seed + 1)
    ladder = Config().capture_sizes
    hit = {_bucket(ladder, n) for n in warm_sizes + timed_sizes}
    buckets_hit = len(hit)
    rows = []
    eager_s = None
    for position, name in enumerate(args.contenders, 1):
        log(f"{model_name} {name} (contender {position} of {len(args.contenders)}): {args.calls} warm calls, "
            f"each judged against {'a float64 run' if model64 is not None else 'eager'}, then {args.calls} timed calls")
        torch._dynamo.reset()
        cgbackend.reset()
        row: dict[str, Any] = {"model": model_name, "contender": name, "calls": args.calls,
                               "max_batch": args.max_batch, "seq": args.seq, "distinct_sizes":
                               len(set(warm_sizes + timed_sizes)), "capture_sizes_hit": buckets_hit}
        try:
            if name == "cgbackend-warm-up":
                sizes = [b for b in ladder if b <= max(hit)]

                def make(n: int) -> tuple:
                    return tuple(_inputs([n], args.seq, vocab, device, args.seed + 2))

                # The graph memory of the largest size alone, in a compile of its own, against which
                # that of every size is judged (they share one pool: docs/dynamic-shapes.md). Off
                # CUDA nothing is captured: there is none to measure.
                alone = _graph_memory(model, make, sizes[-1:], device) if device.type == "cuda" else 0
                row["largest_alone_bytes"] = alone
                fn = _make(name, model)
                done = cgbackend.warm_up(fn, make, sizes)
                row.update(warm_up_s=round(done.seconds, 3), warm_up_sizes=len(sizes),
                           graph_memory_bytes=done.pool_bytes,
                           graph_memory_vs_largest=round(done.pool_bytes / alone, 3) if alone else None)
            else:
                fn = _make(name, model)
            worst, worst64, kept = 0.0, 0.0, []
            start = time.perf_counter()
            with torch.no_grad():
                for i, x in enumerate(warm_xs):
                    if i == 0:
                        sync(device)
                        first = time.perf_counter()
                    out = fn(x)
                    if i == 0:
                        sync(device)
                        row["first_request_ms"] = round(1e3 * (time.perf_counter() - first), 3)
                    if model64 is not None:
                        worst64 = max(worst64, rel_err(out, model64(x)))
                    if name != "eager":
                        ref = model(x)
                        worst = max(worst, rel_err(out, ref))
                        if i < 8:
                            # cgbackend's outputs are the caller's to keep; PyTorch's CUDA graph
                            # trees overwrite theirs at a later replay unless the caller clones.
                            kept.append((out.clone() if name == "reduce-overhead" else out, out.clone()))
            sync(device)
            row["warm_loop_s"] = round(time.perf_counter() - start, 3)
            # The first outputs again, against what they were when returned: no later replay wrote them.
            row["outputs_overwritten"] = sum(not torch.equal(o, c) for o, c in kept)
            row["accuracy_err"] = worst  # against eager in the run's dtype
            row["accuracy_rule"] = args.reference
            if model64 is None:
                row["accuracy_ok"] = bool(worst <= tol and not row["outputs_overwritten"])
            elif name == "eager":
                eager64 = row["ref64_err"] = worst64
            else:
                floor = torch.finfo(dtype).eps / 2  # unit roundoff, as bench's judge floors eager's error
                ratio = worst64 / max(eager64 if eager64 is not None else 0.0, floor)
                row.update(ref64_err=worst64, eager_ref64_err=eager64, ref64_ratio=round(ratio, 3),
                           ref64_limit=LIMIT,
                           accuracy_ok=bool(ratio <= LIMIT and not row["outputs_overwritten"]))
            seconds = _loop(fn, timed_xs, device)
            row["loop_s"] = round(seconds, 4)
            row["ms_per_call"] = round(1e3 * seconds / len(timed_xs), 4)
            if name == "eager":
                eager_s = seconds
            if eager_s:
                row["vs_eager"] = round(seconds / eager_s, 3)
            if name == "reduce-overhead":  # the CUDA graphs its graph trees recorded, re-records
                row["graphs_captured"], row["rerecords"] = cudagraph_tree_counts(device)
            if name.startswith("cgbackend"):
                st = cgbackend.stats(fn)
                row.update({k: st[k] for k in ("static_regions", "graphs_captured", "graphs_evicted",
                                                "replays", "compiled_graphs", "pool_bytes")})
                row["eager_calls"] = st["eager_calls"]
                row["graph_bound"] = buckets_hit * st["static_regions"]
                row["within_bound"] = st["graphs_captured"] <= row["graph_bound"]
                rep = cgbackend.report(fn)
                row["bucketed_regions"] = rep.summary["bucketed_regions"]
                row["symbolic_regions"] = rep.summary["symbolic_regions"]
        except Exception as exc:  # a contender that fails is recorded, not fatal
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def build_parser(prog: str = "python -m cgbackend serve-bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--models", default="dense,moe", help="comma-separated reference models (default %(default)s)")
    p.add_argument("--contenders", default="eager,cgbackend",
                   help="comma-separated, eager first (default %(default)s; choices: "
                        + ", ".join(CONTENDERS) + ")")
    p.add_argument("--size", default="bench", help="model size from cgbackend.models.SIZES (default %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="default %(default)s")
    p.add_argument("--calls", type=int, default=500, help="calls in the warm and in the timed loop (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=64,
                   help="batch sizes are drawn uniformly from 1..MAX_BATCH (default %(default)s)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and batch sizes (default %(default)s)")
    p.add_argument("--reference", default="fp64", choices=("fp64", "eager"),
                   help="accuracy rule: each contender's worst error over the warm calls against a float64 "
                        "run of the same weights, at most 2x eager's own (fp64, the default), or against "
                        "eager in the run's dtype, at most --tol (eager)")
    p.add_argument("--tol", type=float, default=None,
                   help="with --reference eager: tolerance on max|diff|/max|ref| (default by dtype)")
    p.add_argument("--device", default=None, help="cuda (the default; without a CUDA device serve-bench "
                                                  "refuses unless --device cpu is given) or cpu")
    p.add_argument("--out", default=None, help="write the JSON results here (default: not written)")
    p.add_argument("--markdown", default=None, help="write the Markdown table here (default: stdout only)")
    p.add_argument("--append", default=None, metavar="RESULTS_JSON",
                   help="also store the results as the 'serving' section of this bench results file "
                        "(benchmarks/results/latest.json), replacing its earlier serving section; its "
                        "RESULTS.md renders the section")
    return p


def run(argv: Sequence[str], prog: str = "python -m cgbackend serve-bench") -> dict[str, Any]:
    args = build_parser(prog).parse_args(list(argv))
    refusal = no_cuda_refusal("serve-bench", args)
    if refusal is not None:
        raise SystemExit(refusal)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    for c in args.contenders:
        if c not in CONTENDERS:
            raise SystemExit(f"unknown contender {c!r}; choose from {', '.join(CONTENDERS)}")
    if args.contenders[0] != "eager":
        raise SystemExit("the first contender must be eager (the ratios are to it)")
    if args.append:
        read_results(Path(args.append))  # before the run: a wrong path fails now, not after it
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for model_name in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows.extend(run_model(model_name, args, device))
    meta = {"device": device_name(device), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
            "command": command_line(argv).replace("cgbackend bench", "cgbackend serve-bench"),
            "calls": args.calls, "max_batch": args.max_batch, "seq": args.seq, "dtype": args.dtype,
            "size": args.size, "seed": args.seed, "reference": args.reference}
    results = {"meta": meta, "rows": rows}
    if args.out:
        write_json(results, Path(args.out))
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(results))
    if args.append:  # read again: a bench run may have appended rows to it meanwhile
        bench = read_results(Path(args.append))
        bench["serving"] = results
        write_json(bench, Path(args.append))
    print(render_markdown(results))
    return results


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m cgbackend serve-bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse already printed it)
        return int(exc.code or 0)
    refusal = no_cuda_refusal("serve-bench", args)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    results = run(argv, prog)
    return 0 if all("error" not in r and r.get("accuracy_ok", True) for r in results["rows"]) else 1
