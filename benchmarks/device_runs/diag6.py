"""dense-llama8b-shape (issue 17): where does cgbackend's last 1-1.5% against reduce-overhead go?
For inference and training, each contender's GPU time per step and its kernels (by GPU time, with
counts), from torch.profiler; peak memory; the steps timed in alternating blocks.

    python diag6.py [infer,train]
"""

from __future__ import annotations

import collections
import statistics
import sys
import time

import torch

import cgbackend
from cgbackend.models import realsize


def main() -> None:
    modes = (sys.argv[1] if len(sys.argv) > 1 else "infer,train").split(",")
    cfg = realsize.SHAPES["dense-llama8b-shape"]["full"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = realsize.RealModel(cfg).to(torch.bfloat16)
    xs = realsize.make_hidden_inputs(cfg, tokens=4096, n=4, device="cuda", dtype=torch.bfloat16, seed=1,
                                     max_seq=4096)
    for mode in modes:
        train = mode == "train"
        fns = {}
        for label in ("reduce-overhead", "cgbackend"):
            model = realsize.RealModel(cfg).to("cuda", torch.bfloat16)
            model.load_state_dict(base.state_dict())
            model.train(train)
            fn = torch.compile(model, mode="reduce-overhead") if label == "reduce-overhead" else cgbackend.compile(model)

            def step(i, fn=fn, model=model, label=label):
                x = xs[i % len(xs)]
                if label == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                if train:
                    model.zero_grad(set_to_none=True)
                    out = fn(x)
                    out = out[0] if isinstance(out, tuple) else out
                    out.float().pow(2).mean().backward()
                else:
                    with torch.no_grad():
                        fn(x)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            for i in range(6):
                step(i)
            torch.cuda.synchronize()
            print(f"== {mode} {label}: peak over start {(torch.cuda.max_memory_allocated() - before) / 2**20:.0f} MiB")
            fns[label] = step
        times = collections.defaultdict(list)
        for r in range(5):
            for label, step in fns.items():
                for i in range(8):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(i)
                    torch.cuda.synchronize()
                    times[label].append((time.perf_counter() - t0) * 1e3)
        for label, step in fns.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for i in range(10):
                    step(i)
                torch.cuda.synchronize()
            kernels = collections.Counter()
            counts = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("cgbackend"):
                    kernels[e.name[:90]] += e.device_time_total
                    counts[e.name[:90]] += 1
            total = sum(kernels.values()) / 10 / 1e3
            print(f"== {mode} {label}: step median {statistics.median(times[label]):.3f} ms, GPU busy {total:.3f} ms/step, "
                  f"{sum(counts.values()) / 10:.0f} device events/step")
            for name, us in kernels.most_common(14):
                print(f"   {us / 10:9.1f} us/step  x{counts[name] / 10:4.1f}  {name}")
        del fns
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
