"""dense-llama8b-shape training (issue 17): where is cgbackend's GPU idle inside a step? diag6 (run 35)
found cgbackend's step as long as reduce-overhead's with 1.1 ms less GPU busy time. Per contender:
one profiled step (CPU and CUDA), the GPU idle gaps over 30 us (between kernels, from the step's
first to its last kernel, and before the first), and the host ops running during each gap.

    python diag7.py
"""
from __future__ import annotations

import sys

import torch

import cgbackend
from cgbackend.models import realsize


def main() -> None:
    cfg = realsize.SHAPES["dense-llama8b-shape"]["full"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = realsize.RealModel(cfg).to(torch.bfloat16)
    xs = realsize.make_hidden_inputs(cfg, tokens=4096, n=4, device="cuda", dtype=torch.bfloat16, seed=1,
                                     max_seq=4096)
    for label in ("reduce-overhead", "cgbackend"):
        model = realsize.RealModel(cfg).to("cuda", torch.bfloat16)
        model.load_state_dict(base.state_dict())
        model.train(True)
        fn = torch.compile(model, mode="reduce-overhead") if label == "reduce-overhead" else cgbackend.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(i):
            x = xs[i % len(xs)]
            opt.zero_grad(set_to_none=True)
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().pow(2).mean().backward()
            opt.step()
        for i in range(6):
            step(i)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(7)
            torch.cuda.synchronize()
        events = prof.events()
        gpu = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA)
        cpu = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU]
        t0 = min(c[0] for c in cpu)
        busy = sum(e - s for s, e, _ in gpu)
        print(f"== {label}: host start to last kernel end {(gpu[-1][1] - t0) / 1e3:.3f} ms, "
              f"first kernel at {(gpu[0][0] - t0) / 1e3:.3f} ms, GPU busy {busy / 1e3:.3f} ms, {len(gpu)} kernels")
        overlaps: dict = {}
        latest = gpu[0]
        for item in gpu[1:]:
            if item[0] < latest[1] - 1:
                key = (latest[2][:50], item[2][:50])
                n, us = overlaps.get(key, (0, 0.0))
                overlaps[key] = (n + 1, us + min(latest[1], item[1]) - item[0])
            if item[1] > latest[1]:
                latest = item
        for (a, b), (n, us) in sorted(overlaps.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"  overlap x{n} {us:8.1f} us: {b} starts while {a} runs")
        end = gpu[0][0]
        gaps = [(t0, gpu[0][0], "(before the first kernel)")]
        for s, e, name in gpu:
            if s - end > 30:
                gaps.append((end, s, name))
            end = max(end, e)
        for s, e, name in gaps:
            during = [c for c in cpu if c[0] < e and c[1] > s and c[1] - c[0] > 20]
            during.sort(key=lambda c: c[0])
            print(f"  gap {(e - s):8.1f} us at {(s - t0) / 1e3:7.3f} ms before {name[:60]}")
            for cs, ce, cname in during[:12]:
                print(f"      host {cname[:90]} {(ce - cs):.0f} us from {(cs - t0) / 1e3:.3f} ms")
        del fn, model, opt
        torch._dynamo.reset()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
