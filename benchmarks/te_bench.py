"""Transformer Engine training step: eager TE, TE's make_graphed_callables per layer by hand, and
cgbackend, side by side in one run on one model.

    python benchmarks/te_bench.py [--layers 4] [--seq 128] [--batch 4] [--steps 50] [--fp8 delayed]
                                  [--out FILE.json] [--append benchmarks/results/latest.json]

Model: ``--layers`` x te.TransformerLayer(1024, 4096, 16 heads), bf16 parameters, inputs
seq x batch x 1024, FP8 autocast with the chosen recipe ("delayed", "current" or "off"). A step
is forward, a float32 mean-square loss and backward (no optimizer), the gradients set to None
before it (warm-up steps too). Each contender trains its own
copy of the same initial weights on the same rotating inputs (16 distinct batches). Accuracy
first: the first checked step's loss and gradients of every contender are compared with eager
TE's on a fresh copy; then each contender's median step time over ``--steps`` timed steps after
warm-up, with its peak memory over the warm-up and timed steps and what it holds after a step (both over what was
allocated before it was made). Writes ``--out`` (a JSON file) if given, and with ``--append`` puts
the run into that bench results file's ``te`` section under its recipe (``latest.json``: RESULTS.md
renders it, cgbackend.bench.render.render_te).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--fp8", choices=("delayed", "current", "off"), default="delayed")
    ap.add_argument("--out", default=None, help="write this run's JSON here")
    ap.add_argument("--append", default=None,
                    help="a bench results file (benchmarks/results/latest.json) whose 'te' section gets this run")
    args = ap.parse_args()
    if args.append and not os.path.isfile(args.append):  # before the run, not after it
        raise SystemExit(f"--append: no such results file {args.append}")

    import transformer_engine as te_pkg
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as R

    import cgbackend

    autocast = getattr(te, "autocast", None) or te.fp8_autocast
    params = inspect.signature(autocast).parameters
    en_kw = "enabled" if "enabled" in params else "fp8_enabled"
    rec_kw = "recipe" if "recipe" in params else "fp8_recipe"
    recipe = {"delayed": R.DelayedScaling, "current": getattr(R, "Float8CurrentScaling", None),
              "off": R.DelayedScaling}[args.fp8]()
    enabled = args.fp8 != "off"

    def ctx():
        return autocast(**{en_kw: enabled, rec_kw: recipe})

    torch.manual_seed(0)
    base = torch.nn.ModuleList(
        te.TransformerLayer(1024, 4096, 16, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0) for _ in range(args.layers)).cuda()

    class Stack(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = [torch.randn(args.seq, args.batch, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
              .requires_grad_(True) for _ in range(16)]

    def make_eager():
        return Stack(copy.deepcopy(base))

    def make_cgbackend():
        model = Stack(copy.deepcopy(base))
        return cgbackend.compile(model)

    def make_graphed():
        layers = copy.deepcopy(base)
        gp = inspect.signature(te.make_graphed_callables).parameters
        kw = {"enabled": enabled, "recipe": recipe} if "enabled" in gp else {"fp8_enabled": enabled,
                                                                            "fp8_recipe": recipe}
        sample = tuple((torch.randn_like(inputs[0]).requires_grad_(True),) for _ in layers)
        graphed = te.make_graphed_callables(tuple(layers), sample, **kw)
        return Stack(torch.nn.ModuleList(graphed))

    def step(model, x):
        with ctx():
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    contenders = {"eager": make_eager, "te-graphed-per-layer": make_graphed, "cgbackend": make_cgbackend}
    rows = []
    # Accuracy: every contender's 5th step (graphs replaying by then) against eager on fresh copies.
    reference = None
    for name, make in contenders.items():
        model = make()
        loss = None
        for i in range(5):
            for p in model.parameters():
                p.grad = None
            loss = step(model, inputs[i])
        grads = [p.grad.detach().float().clone() for p in model.parameters()]
        if reference is None:
            reference = (loss.item(), grads)
        ref_loss, ref_grads = reference
        # Over all gradients at once: a parameter whose gradient is ~0 in theory (attention's key
        # bias) would make a per-parameter relative error meaningless.
        diff = sum(((a - b) ** 2).sum() for a, b in zip(grads, ref_grads)) ** 0.5
        grad_err = (diff / sum((b ** 2).sum() for b in ref_grads) ** 0.5).item()
        loss_err = abs(loss.item() - ref_loss) / abs(ref_loss)
        ok = grad_err < 5e-2 and loss_err < 1e-2
        rows.append({"contender": name, "loss_rel_err": loss_err, "grad_rel_err": grad_err, "accuracy_ok": ok})
        del model
        torch.cuda.empty_cache()

    mib = 2 ** 20
    for row in rows:
        # Memory over what was allocated before the contender was made (weights and inputs): its
        # peak over the warm-up and timed steps, and what it holds after a step (gradients included,
        # as eagerly), with garbage collected.
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
        model = contenders[row["contender"]]()
        t0 = time.perf_counter()
        for i in range(args.warmup):
            for p in model.parameters():  # as in the timed steps: no gradient is accumulated
                p.grad = None
            step(model, inputs[i % len(inputs)])
        torch.cuda.synchronize()
        row["setup_s"] = time.perf_counter() - t0
        times = []
        for i in range(args.steps):
            for p in model.parameters():
                p.grad = None
            x = inputs[(i + 3) % len(inputs)]
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(model, x)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
        gc.collect()
        torch.cuda.synchronize()
        row["peak_mem_over_baseline_bytes"] = torch.cuda.max_memory_allocated() - baseline
        row["held_mem_over_baseline_bytes"] = torch.cuda.memory_allocated() - baseline
        row["median_ms"] = statistics.median(times)
        row["p10_ms"] = sorted(times)[len(times) // 10]
        if row["contender"] == "cgbackend":
            st = cgbackend.stats(model)
            row["graphs"] = st["graphs_captured"]
            row["eager_calls"] = dict(st["eager_calls"])
            row["capture_failures"] = len(st["capture_failures"])
        del model
        torch.cuda.empty_cache()

    eager_ms = rows[0]["median_ms"]
    graphed_ms = rows[1]["median_ms"]
    for row in rows:
        row["vs_eager"] = row["median_ms"] / eager_ms
        row["vs_te_graphed"] = row["median_ms"] / graphed_ms
        row["peak_vs_te_graphed"] = row["peak_mem_over_baseline_bytes"] / rows[1]["peak_mem_over_baseline_bytes"]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "transformer_engine": te_pkg.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": "python " + " ".join(sys.argv), "layers": args.layers, "seq": args.seq,
            "batch": args.batch, "fp8": args.fp8, "steps": args.steps}
    print(f"TE train step, {args.layers} x TransformerLayer(1024, 4096, 16), {args.seq}x{args.batch} tokens, "
          f"fp8={args.fp8}, {meta['device']}, torch {meta['torch']}, TE {meta['transformer_engine']}")
    print(f"{'contender':<24}{'median ms':>10}{'p10 ms':>9}{'x eager':>9}{'x TE-graphed':>14}"
          f"{'peak / held MiB':>17}{'loss err':>10}{'grad err':>10}  ok")
    for row in rows:
        mem = f"{row['peak_mem_over_baseline_bytes'] / mib:.0f} / {row['held_mem_over_baseline_bytes'] / mib:.0f}"
        print(f"{row['contender']:<24}{row['median_ms']:>10.3f}{row['p10_ms']:>9.3f}{row['vs_eager']:>9.3f}"
              f"{row['vs_te_graphed']:>14.3f}{mem:>17}{row['loss_rel_err']:>10.2e}{row['grad_rel_err']:>10.2e}"
              f"  {row['accuracy_ok']}")
    cg = rows[2]
    print(f"cgbackend: graphs {cg.get('graphs')}, eager calls {cg.get('eager_calls')}, "
          f"capture failures {cg.get('capture_failures')}")
    run = {"meta": meta, "rows": rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(run, f, indent=2)
    if args.append:  # read again now: another run may have written it meanwhile
        from pathlib import Path

        from cgbackend.bench.render import write_json
        with open(args.append) as f:
            bench = json.load(f)
        bench.setdefault("te", {})[args.fp8] = run
        write_json(bench, Path(args.append))


if __name__ == "__main__":
    main()
