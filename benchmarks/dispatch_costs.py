"""Measure the static-dispatch cost model's constants on this GPU, and time the four ways to run a
MoE layer (masked dense, grouped, small batch, the eager loop) at a real expert shape over token
counts, expert counts and top-k.

    python benchmarks/dispatch_costs.py --out DIR [--constants-only | --quick]

Writes DIR/costs.json: the package's cgbackend/moe/costs.json (the constants
cgbackend/moe/form_choice.py reads, one set per GPU by its torch.cuda.get_device_name) with this
GPU's set added or replaced, the other GPUs' kept: to be committed as cgbackend/moe/costs.json.
``--constants-only`` stops there (about a minute: four Inductor compiles and a few hundred timed
calls); otherwise it also writes DIR/dispatch_crossover.json (measured milliseconds per form,
shape and token count, next to the cost model's estimate with the constants just measured) and
prints a table.
Static forms are timed as CUDA-graph replays (as cgbackend runs them), the loop eagerly (as it runs
when left dynamic), bf16, inputs rotated, medians of CUDA-event timings. The grouped and small-batch
forms are compiled by Inductor first, as cgbackend's rewrites are (the small-batch product exists
only as Inductor's reduction kernel: run as ATen ops it would materialize a weight matrix per row);
masked dense and the loop run as ATen ops.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cgbackend.moe import form_choice as cost  # noqa: E402

DEV, DT = "cuda", torch.bfloat16


def _time(fn, n_inputs: int, reps: int = 20, warm: int = 3) -> float:
    """Median ms of fn(i) over rotating inputs i."""
    for i in range(warm):
        fn(i % n_inputs)
    torch.cuda.synchronize()
    times = []
    for r in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r % n_inputs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _graphed(fn, inputs: list):
    """A CUDA graph per input set (static inputs), replayed by index."""
    graphs = []
    for args in inputs:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*args)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn(*args)
        graphs.append(g)
    return lambda i: graphs[i].replay()


def _layer(E: int, H: int, Fd: int):
    w1 = torch.randn(E, Fd, H, device=DEV, dtype=DT) * H ** -0.5
    w3 = torch.randn(E, Fd, H, device=DEV, dtype=DT) * H ** -0.5
    w2 = torch.randn(E, H, Fd, device=DEV, dtype=DT) * Fd ** -0.5
    return w1, w3, w2


def masked_dense(x, ids, w, W):
    w1, w3, w2 = W
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        c = torch.where(ids == e, w, 0).sum(-1, keepdim=True).to(x.dtype)
        h = F.linear(F.silu(F.linear(x, w1[e])) * F.linear(x, w3[e]), w2[e])
        out += torch.where(c != 0, h, 0) * c
    return out


def grouped(x, ids, w, W):
    w1, w3, w2 = W
    E, k = w1.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    sid, perm = torch.sort(flat, stable=True)
    tok = perm // k
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = x.index_select(0, tok)
    a = torch._grouped_mm(h, w1.transpose(-2, -1), offs=offs)
    b = torch._grouped_mm(h, w3.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(F.silu(a) * b, w2.transpose(-2, -1), offs=offs)
    y = y * w.reshape(-1).index_select(0, perm).unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


def small_batch(x, ids, w, W):
    """The small-batch form as cgbackend builds it (grouped.py, per_row): the grouped routing, each
    routed row times its own expert's weights as a product summed over the input width in float32."""
    w1, w3, w2 = W
    k = ids.shape[1]
    flat = ids.reshape(-1)
    sid, perm = torch.sort(flat, stable=True)
    tok = perm // k
    h = x.index_select(0, tok)

    def per_row(rows, wt):  # wt [E, out, in] (linear layout) -> rows [S, in] @ wt[e].T
        return (rows.float().unsqueeze(-1) * wt.transpose(-2, -1)[sid].float()).sum(1).to(rows.dtype)

    y = per_row(F.silu(per_row(h, w1)) * per_row(h, w3), w2)
    y = y * w.reshape(-1).index_select(0, perm).unsqueeze(-1).to(y.dtype)
    slots = torch.empty_like(y).index_copy(0, perm, y)
    return slots.reshape(-1, k, y.shape[-1]).sum(1)


def loop(x, ids, w, W):
    w1, w3, w2 = W
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        h = x[tok]
        y = F.linear(F.silu(F.linear(h, w1[e])) * F.linear(h, w3[e]), w2[e]) * w[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def _inputs(T: int, E: int, k: int, H: int, n: int):
    out = []
    for _ in range(n):
        x = torch.randn(T, H, device=DEV, dtype=DT)
        w, ids = torch.topk(torch.softmax(torch.randn(T, E, device=DEV), -1), k)
        out.append((x, ids, w / w.sum(-1, keepdim=True)))
    return out


H_EXPERT, F_EXPERT = 2048, 768
"""The expert shape of the crossover grid: hidden 2048, expert FFN 768 (Qwen3-30B-A3B's experts,
the moe-128e benchmark model's)."""
GRID = [(8, 2), (64, 2), (64, 8), (128, 2), (128, 8)]
"""(experts, top-k) of the crossover grid."""


def _compiled(fn):
    """fn compiled by Inductor with a fresh Dynamo cache (the token count becomes dynamic at its
    second size, so one expert count costs two compiles)."""
    torch._dynamo.reset()
    return torch.compile(fn)


def constants(quick: bool) -> dict:
    c: dict = {}
    a = torch.randn(8192, 4096, device=DEV, dtype=DT)
    b = torch.randn(14336, 4096, device=DEV, dtype=DT)
    ms = _time(lambda i: F.linear(a, b), 1)
    c["dense_tflops"] = round(2 * 8192 * 4096 * 14336 / (ms * 1e9), 1)
    E, rows, H, Fd = 64, 384, 2048, 1408
    x = torch.randn(E * rows, H, device=DEV, dtype=DT)
    w = torch.randn(E, H, Fd, device=DEV, dtype=DT)
    offs = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * rows
    ms = _time(lambda i: torch._grouped_mm(x, w, offs=offs), 1)
    c["grouped_tflops"] = round(2 * E * rows * H * Fd / (ms * 1e9), 1)
    # rates by rows per product (per expert): small products run far below the peak
    c["rate_by_rows"] = {"dense": {}, "grouped": {}}
    H, Fd, G = 4096, 4096, 8
    wd = torch.randn(Fd, H, device=DEV, dtype=DT)
    wg = torch.randn(G, H, Fd, device=DEV, dtype=DT)
    for m in (16, 64, 256, 1024, 4096):
        xd = torch.randn(m, H, device=DEV, dtype=DT)
        ms = _time(lambda i: F.linear(xd, wd), 1)
        c["rate_by_rows"]["dense"][m] = round(2 * m * H * Fd / (ms * 1e9), 1)
        xg = torch.randn(G * m, H, device=DEV, dtype=DT)
        offs_g = torch.arange(1, G + 1, device=DEV, dtype=torch.int32) * m
        ms = _time(lambda i: torch._grouped_mm(xg, wg, offs=offs_g), 1)
        c["rate_by_rows"]["grouped"][m] = round(2 * G * m * H * Fd / (ms * 1e9), 1)
    big = torch.empty(1 << 29, device=DEV, dtype=torch.uint8)
    dst = torch.empty_like(big)
    ms = _time(lambda i: dst.copy_(big), 1)
    c["bandwidth_gbs"] = round(2 * big.numel() / (ms * 1e6), 1)
    # fixed costs at tiny expert sizes: what is left is the forms' own work and launches
    E, k, H, Fd, T = 64, 6, 64, 64, 4096
    W = _layer(E, H, Fd)
    inp = _inputs(T, E, k, H, 4)
    c["masked_fixed_us"] = round(1000 * _time(_graphed(lambda *a: masked_dense(*a, W), inp), 4) / E, 1)
    # the grouped form's launches (a decode step's 16 tokens) and its routing's cost per routed row
    # (from 16 to 4096 tokens; the products at these sizes are a small part of either)
    # (compiled by Inductor, as cgbackend's rewrite is)
    fn = _compiled(lambda *a: grouped(*a, W))
    us_16 = 1000 * _time(_graphed(fn, _inputs(16, E, k, H, 4)), 4)
    us_big = 1000 * _time(_graphed(fn, inp), 4)
    c["routing_row_ns"] = round(max(us_big - us_16, 0.0) * 1e3 / ((T - 16) * k), 2)
    c["grouped_fixed_us"] = round(us_16 - 16 * k * c["routing_row_ns"] / 1e3, 1)
    c["loop_expert_us"] = round(1000 * _time(lambda i: loop(*inp[i], W), 4) / E, 1)
    # the small-batch form: its fixed cost at tiny expert sizes (a decode step's token count), and
    # the rate at which its per-row products read expert weights at the real expert shape
    E, k, T = 64, 8, 16
    W = _layer(E, 64, 64)
    inp = _inputs(T, E, k, 64, 4)
    c["small_fixed_us"] = round(1000 * _time(_graphed(_compiled(lambda *a: small_batch(*a, W)), inp), 4)
                                - T * k * c["routing_row_ns"] / 1e3, 1)
    E, k, T = 128, 8, 64
    W = _layer(E, H_EXPERT, F_EXPERT)
    inp = _inputs(T, E, k, H_EXPERT, 4)
    us = (1000 * _time(_graphed(_compiled(lambda *a: small_batch(*a, W)), inp), 4) - c["small_fixed_us"]
          - T * k * c["routing_row_ns"] / 1e3)
    c["small_gbs"] = round(T * k * 3 * H_EXPERT * F_EXPERT * 2 / (max(us, 1.0) * 1e3), 1)
    c["device"] = torch.cuda.get_device_name()
    c["date"] = datetime.date.today().isoformat()
    c["torch"] = torch.__version__
    return c


def crossover(tokens: list[int]) -> list[dict]:
    rows = []
    for E, k in GRID:
        H, Fd = H_EXPERT, F_EXPERT
        W = _layer(E, H, Fd)
        forms = {"small_batch": _compiled(lambda *a: small_batch(*a, W)),
                 "grouped": _compiled(lambda *a: grouped(*a, W)),
                 "masked_dense": lambda *a: masked_dense(*a, W)}
        for T in tokens:
            inp = _inputs(T, E, k, H, 3)
            ref = loop(*inp[0], W).float()
            row = {"shape": f"{E} experts top-{k}, {H} x {Fd}", "experts": E, "k": k, "hidden": H, "ffn": Fd,
                   "tokens": T}
            for form, fn in forms.items():
                err = ((fn(*inp[0]).float() - ref).norm() / ref.norm()).item()
                assert err < 2e-2, (E, k, T, form, err)
                row[f"{form}_ms"] = round(_time(_graphed(fn, inp), 3), 3)
            row["dynamic_ms"] = round(_time(lambda i: loop(*inp[i], W), 3), 3)
            est = cost.estimate(T, E, k, 3 * 2 * H * Fd, E * 3 * H * Fd * 2, 0, small_batch=True)
            row["estimate_ms"] = {f: round(v / 1000, 3) for f, v in est.items()}
            measured = {f: row[f"{f}_ms"] for f in ("masked_dense", "grouped", "small_batch", "dynamic")}
            row["fastest"] = min(measured, key=measured.get)
            row["model_picks"] = min(est, key=est.get)
            rows.append(row)
            print(f"E={E:3d} k={k} T={T:5d} " + " ".join(f"{f}={v}" for f, v in measured.items())
                  + f"  fastest={row['fastest']} model={row['model_picks']}", flush=True)
            torch.cuda.empty_cache()
    return rows


_NAMES = {"masked_dense": "masked dense", "grouped": "grouped", "small_batch": "small batch", "dynamic": "loop"}


def table(doc: dict) -> str:
    """The crossover table in Markdown: every form's ms per row with the fastest and the cost
    model's pick (docs/static-dispatch.md)."""
    rows = doc["rows"]
    forms = ("small_batch", "grouped", "masked_dense", "dynamic")
    out = ["| experts | top-k | tokens | " + " | ".join(_NAMES[f] for f in forms) + " | fastest | cost model picks |",
           "|---" * (len(forms) + 5) + "|"]
    for r in rows:
        out.append(f"| {r['experts']} | {r['k']} | {r['tokens']} | "
                   + " | ".join(f"{r[f + '_ms']:.3f}" for f in forms)
                   + f" | {_NAMES[r['fastest']]} | {_NAMES[r['model_picks']]} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="the crossover at 5 token counts rather than 7")
    ap.add_argument("--constants-only", action="store_true",
                    help="measure the constants and write DIR/costs.json only (no crossover table)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    c = constants(args.quick)
    print("constants:", json.dumps(c), flush=True)
    sets = cost.measured_sets()
    sets[c["device"]] = c
    with open(os.path.join(args.out, "costs.json"), "w") as f:
        json.dump({"devices": sets}, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.join(args.out, 'costs.json')} (devices: {', '.join(sets)})", flush=True)
    if args.constants_only:
        return
    cost.use_measured(c)  # estimates below use what was just measured
    tokens = [1, 8, 64, 512, 4096] if args.quick else [1, 4, 16, 64, 256, 1024, 4096]
    rows = crossover(tokens)
    with open(os.path.join(args.out, "dispatch_crossover.json"), "w") as f:
        json.dump({"meta": {"device": c["device"], "date": c["date"], "torch": c["torch"],
                            "command": "python benchmarks/dispatch_costs.py --out DIR"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
