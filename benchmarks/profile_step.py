"""Where does a step's time go? Profiles eager and cgbackend variants on one reference model with
torch.profiler (host and device): per variant, the median wall time of a synchronized step, the
GPU kernel time per step, the top kernels by GPU time and the top host entries; for cgbackend
variants also cgbackend's own Python functions from cProfile (``--cprofile``).

    python benchmarks/profile_step.py --model moe --mode train --variants eager,cgbackend,eager-kernels
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import cgbackend
from cgbackend.models import build_model, make_inputs

VARIANTS = {
    "eager": None,
    "cgbackend": {},
    "eager-kernels": {"inner": "eager"},
    "inductor": {"inner": "inductor"},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moe")
    p.add_argument("--mode", default="train", choices=("train", "infer"))
    p.add_argument("--variants", default="eager,cgbackend", help="comma-separated: " + ",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--cprofile", action="store_true", help="also cProfile cgbackend variants")
    args = p.parse_args(argv)
    base = build_model(args.model, size="bench", device="cuda", dtype=torch.bfloat16)
    inputs = make_inputs(args.model, base, batch=4, seq=128, n=16, device="cuda", seed=3)
    train = args.mode == "train"
    for label in args.variants.split(","):
        options = VARIANTS[label]
        torch._dynamo.reset()
        model = copy.deepcopy(base).train(train)
        fn = model if options is None else cgbackend.compile(model, **options)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(i):
            x = inputs[i % len(inputs)]
            if train:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(fn(x).flatten(0, 1).float(), x.flatten()).backward()
                opt.step()
            else:
                with torch.no_grad():
                    fn(x)

        for i in range(8):
            step(i)
        walls = []
        for i in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(i)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) * 1e3)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps):
                step(i)
            torch.cuda.synchronize()
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"===== {label} {args.model} {args.mode}: step median {statistics.median(walls):.3f} ms, "
              f"GPU time {kernel_us / args.steps / 1e3:.3f} ms/step")
        print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
        if options is not None:
            print(cgbackend.stats(fn)["eager_calls"])
        if options is not None and args.cprofile:
            prof_py = cProfile.Profile()
            prof_py.enable()
            for i in range(args.steps):
                step(i)
            torch.cuda.synchronize()
            prof_py.disable()
            out = io.StringIO()
            pstats.Stats(prof_py, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"===== cProfile (tottime) over {args.steps} steps")
            print(out.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
