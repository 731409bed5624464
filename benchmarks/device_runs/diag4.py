"""Where the zoo's small transformers models lose to reduce-overhead (issue 17, item 4): per model,
bf16, cgbackend (default options) against torch.compile(mode="reduce-overhead") on a copy of the same
weights. Inference: host time per call and a cProfile (hosttime.py); both modes: synchronized median
and the CUDA kernels a call launches (torch.profiler: count and GPU time, top kernels); cgbackend's
report. Usage: diag4.py gpt2,mistral [infer,train]."""
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
import cgbackend  # noqa: E402
from hosttime import measure  # noqa: E402
from zoo import ZOO  # noqa: E402


def step_fn(model, fn, train):
    def step(x):
        if train:
            model.zero_grad(set_to_none=True)
            out = fn(input_ids=x).logits
            F.cross_entropy(out[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()).backward()
        else:
            with torch.no_grad():
                fn(input_ids=x)
    return step


def kernels(step, xs, label):
    for i in range(5):
        step(xs[i % len(xs)])
    torch.cuda.synchronize()
    times = []
    for i in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(xs[i % len(xs)])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(10):
            step(xs[i % len(xs)])
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    n = sum(e.count for e in evs) / 10
    gpu = sum(e.device_time_total for e in evs) / 10 / 1e3
    print(f"----- {label}: synchronized {statistics.median(times):.3f} ms; per call {n:.0f} kernels, "
          f"GPU {gpu:.3f} ms", flush=True)
    for e in sorted(evs, key=lambda e: -e.device_time_total)[:12]:
        print(f"   {e.count / 10:6.1f} x {e.device_time_total / e.count if e.count else 0:8.1f} us  {e.key[:110]}")


modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["infer"]
for name in sys.argv[1].split(","):
    for mode in modes:
        train = mode == "train"
        torch.manual_seed(0)
        base = ZOO[name][1]().cuda().to(torch.bfloat16).train(train)
        gen = torch.Generator().manual_seed(1)
        xs = [torch.randint(0, 512, (2, 64), generator=gen).cuda() for _ in range(3)]
        torch._dynamo.reset()
        mine = copy.deepcopy(base)
        c = cgbackend.compile(mine)
        if not train:
            measure(lambda x: c(input_ids=x), xs, f"{name} cgbackend", profile_lines=25)
        kernels(step_fn(mine, c, train), xs, f"{name} {mode} cgbackend")
        s = cgbackend.stats(c)
        print({k: s.get(k) for k in ("static_regions", "dynamic_regions", "graphs_captured", "replays",
                                     "copies_made", "copied_by_kind", "output_clones", "inner_compiled",
                                     "inner_fallbacks", "inner_compile_s", "eager_calls", "compiled_graphs")})
        print(cgbackend.report(c), flush=True)
        torch._dynamo.reset()
        ro_model = copy.deepcopy(base)
        ro = torch.compile(ro_model, mode="reduce-overhead")
        if not train:
            measure(lambda x: ro(input_ids=x), xs, f"{name} reduce-overhead", profile_lines=25)
        kernels(step_fn(ro_model, ro, train), xs, f"{name} {mode} reduce-overhead")
        torch._dynamo.reset()
