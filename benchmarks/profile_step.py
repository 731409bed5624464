"""Where does a step's host time go? Profiles eager and cgbackend on one reference model with
torch.profiler (host and device) and prints the top host-side entries of each, plus cgbackend's
own Python functions from cProfile.

    python benchmarks/profile_step.py --model moe --mode train
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F

import cgbackend
from cgbackend.models import build_model, make_inputs


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moe")
    p.add_argument("--mode", default="train", choices=("train", "infer"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    base = build_model(args.model, size="bench", device="cuda", dtype=torch.bfloat16)
    inputs = make_inputs(args.model, base, batch=4, seq=128, n=16, device="cuda", seed=3)
    train = args.mode == "train"
    for label in ("eager", "cgbackend"):
        torch._dynamo.reset()
        model = copy.deepcopy(base).train(train)
        fn = model if label == "eager" else cgbackend.compile(model)
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
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(args.steps):
                step(i)
            torch.cuda.synchronize()
        print(f"===== {label} {args.model} {args.mode}: top host time per step (profiler)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
        if label == "cgbackend":
            prof_py = cProfile.Profile()
            prof_py.enable()
            for i in range(args.steps):
                step(i)
            torch.cuda.synchronize()
            prof_py.disable()
            out = io.StringIO()
            stats = pstats.Stats(prof_py, stream=out).sort_stats("tottime")
            stats.print_stats(args.top)
            print(f"===== cProfile (tottime) over {args.steps} steps")
            print(out.getvalue()[-6000:])
            print(cgbackend.stats(fn)["eager_calls"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
