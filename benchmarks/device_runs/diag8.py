"""Issue 17: where cgbackend's GPU time per step differs from reduce-overhead's, kernel by kernel.

Per case, each contender (fresh copy of the same weights) is warmed up, then K steps on rotating
batches run under torch.profiler, each synchronized before and after (as the zoo and the bench time
them). Printed per contender: wall per step (host start to last kernel end), GPU busy time, kernels
per step, the host time before the first kernel, and the kernel table (per step: count, us); then
the kernels whose time differs most between the two, by name.

    python diag8.py zoo:qwen2_moe:infer llama8b:train
"""
from __future__ import annotations

import collections
import copy
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
import cgbackend  # noqa: E402

K = 12


def zoo_case(name: str, mode: str):
    from zoo import ZOO, _forward, _inputs, _loss
    kind, make = ZOO[name]
    torch.manual_seed(0)
    base = make().to("cuda", torch.bfloat16)
    xs = _inputs(kind, 4, "cuda", torch.bfloat16, torch.Generator().manual_seed(1))
    train = mode == "train"

    def build(label):
        model = copy.deepcopy(base).train(train)
        if label == "eager":
            fn = model
        else:
            fn = torch.compile(model, mode="reduce-overhead") if label == "reduce-overhead" else cgbackend.compile(model)

        def step(i):
            x = xs[i % len(xs)]
            if train:
                model.zero_grad(set_to_none=True)
                _loss(kind, _forward(kind, fn, x), x).backward()
            else:
                with torch.no_grad():
                    _forward(kind, fn, x)
        return step, fn
    return build


def llama8b_case(mode: str):
    from cgbackend.models import realsize
    cfg = realsize.SHAPES["dense-llama8b-shape"]["full"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = realsize.RealModel(cfg).to(torch.bfloat16)
    xs = realsize.make_hidden_inputs(cfg, tokens=4096, n=4, device="cuda", dtype=torch.bfloat16, seed=1,
                                     max_seq=4096)
    train = mode == "train"

    def build(label):
        model = realsize.RealModel(cfg).to("cuda", torch.bfloat16)
        model.load_state_dict(base.state_dict())
        model.train(train)
        fn = torch.compile(model, mode="reduce-overhead") if label == "reduce-overhead" else cgbackend.compile(model)

        def step(i):
            x = xs[i % len(xs)]
            if train:
                model.zero_grad(set_to_none=True)
                out = fn(x)
                out = out[0] if isinstance(out, tuple) else out
                out.float().pow(2).mean().backward()
            else:
                with torch.no_grad():
                    fn(x)
        return step, fn
    return build


def profile(step):
    for i in range(6):
        step(i)
    torch.cuda.synchronize()
    walls, busy, firsts, counts = [], [], [], []
    names: dict = collections.defaultdict(lambda: [0, 0.0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(K):
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"step{i}"):
                step(i)
            torch.cuda.synchronize()
    events = prof.events()
    marks = sorted((e.time_range.start, e.time_range.end) for e in events if e.name.startswith("step")
                   and e.device_type == torch.autograd.DeviceType.CPU)
    gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    for j, (s, e) in enumerate(marks):
        nxt = marks[j + 1][0] if j + 1 < len(marks) else float("inf")
        mine = [g for g in gpu if s <= g[0] < nxt]
        if not mine:
            continue
        walls.append(max(g[1] for g in mine) - s)
        busy.append(sum(g[1] - g[0] for g in mine))
        firsts.append(mine[0][0] - s)
        counts.append(len(mine))
        for g in mine:
            names[g[2]][0] += 1
            names[g[2]][1] += g[1] - g[0]
    n = max(1, len(walls))
    table = {k: (c / n, us / n) for k, (c, us) in names.items()}
    summary = dict(wall=statistics.median(walls), busy=statistics.median(busy), first=statistics.median(firsts),
                   kernels=statistics.median(counts))
    return summary, table


def main(argv):
    for spec in argv:
        parts = spec.split(":")
        build = zoo_case(parts[1], parts[2]) if parts[0] == "zoo" else llama8b_case(parts[1])
        results = {}
        for label in ("reduce-overhead", "cgbackend"):
            torch._dynamo.reset()
            step, fn = build(label)
            results[label] = profile(step)
            if label == "cgbackend":
                s = cgbackend.stats(fn)
                from cgbackend.bench import _STATS_KEYS
                print("   cgbackend stats:", {k: s.get(k) for k in _STATS_KEYS + ("inner_compiled", "inner_fallbacks")})
            del step, fn
            torch.cuda.empty_cache()
        print(f"== {spec}")
        for label, (summary, table) in results.items():
            print(f"  {label:16s} wall {summary['wall']:9.1f} us  busy {summary['busy']:9.1f} us  "
                  f"first kernel at {summary['first']:7.1f} us  kernels {summary['kernels']}")
        for label, (summary, table) in results.items():
            print(f"  -- {label}: top kernels (per step: count, us)")
            for name, (c, us) in sorted(table.items(), key=lambda kv: -kv[1][1])[:30]:
                print(f"     {c:5.1f} {us:9.1f}  {name[:110]}")
        ro, cg = results["reduce-overhead"][1], results["cgbackend"][1]
        diff = []
        for name in set(ro) | set(cg):
            a, b = ro.get(name, (0, 0.0)), cg.get(name, (0, 0.0))
            diff.append((b[1] - a[1], name, a, b))
        diff.sort(key=lambda d: -abs(d[0]))
        print("  -- largest differences (cgbackend - reduce-overhead, us per step; counts ro/cg)")
        for d, name, a, b in diff[:30]:
            print(f"     {d:+9.1f}  {a[0]:5.1f}/{b[0]:5.1f}  {name[:110]}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
