"""Issue 17: where a host-bound call's latency goes, cgbackend against reduce-overhead.

Cases: ``decode`` (hf-llama decode step, batch 8, StaticCache, as bench_decode times it) and
``zoo:NAME`` (a zoo model's inference call, synchronized before and after as the zoo times it).
Per case and contender (each compiled after ``torch._dynamo.reset()``; two rounds, alternating):
1. median latency per step (CUDA events around the call, as bench_decode; perf_counter for zoo);
2. one profiled step: the CUDA runtime calls and kernels with their offset from the step's start
   (when does the graph launch happen);
3. cProfile of 100 steps: the top functions by own time and the cumulative time of cgbackend's.

    python diag9.py decode zoo:qwen2_moe
"""
from __future__ import annotations

import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
import cgbackend  # noqa: E402
from cgbackend import bench  # noqa: E402
from cgbackend import bench_decode as bd  # noqa: E402


def decode_case():
    s = types.SimpleNamespace(scale="full", seed=0, dtype=torch.bfloat16)
    shape = bd.DECODE_SHAPES["full"]
    base = bd.build_hf("hf-llama", s)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, shape["vocab"], (shape["batch"], shape["prompt"]), generator=gen).cuda()

    def build(label):
        c = bench.CONTENDERS[label]
        session = bd._Session(copy.deepcopy(base).cuda().eval(), c.make, shape, torch.device("cuda"),
                              torch.bfloat16, c.mark_step, c.call_context)
        for _ in range(3):
            session.generate(prompt)
        torch.cuda.synchronize()
        ids = session.step.prefill(prompt).argmax(-1, keepdim=True)
        state = {"ids": ids}

        @torch.no_grad()
        def step(i):
            j = i % (session.new_tokens - 1)
            if j == 0:
                state["ids"] = session.step.prefill(prompt).argmax(-1, keepdim=True)
            state["ids"] = session.call(state["ids"], j).argmax(-1, keepdim=True)
        return step, session.fn
    return build


def zoo_case(name):
    from diag8 import zoo_case as z

    inner = z(name, "infer")

    def build(label):
        step, fn = inner(label)
        for i in range(6):
            step(i)
        return step, fn
    return build


def latency(step, n=200):
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(n):
        torch.cuda.synchronize()
        start.record()
        step(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def timeline(step, label):
    for i in range(3):
        step(i)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(3, 5):
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"mystep{i}"):
                step(i)
            torch.cuda.synchronize()
    events = prof.events()
    mark = sorted(e.time_range.start for e in events if e.name == "mystep4")[0]
    rows = []
    for e in events:
        if e.time_range.start < mark:
            continue
        gpu = e.device_type == torch.autograd.DeviceType.CUDA
        if gpu or e.name.startswith("cu"):
            rows.append((e.time_range.start - mark, e.time_range.end - e.time_range.start,
                         "GPU" if gpu else "cpu", e.name))
    rows.sort()
    print(f"  -- {label}: one step's CUDA calls and kernels (offset us, duration us)")
    for off, dur, where, name in rows[:60]:
        print(f"     {off:8.1f} {dur:8.1f} {where} {name[:100]}")


def profile_host(step, label, n=100):
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for i in range(n):
        step(i)
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(30)
    print(f"  -- {label}: cProfile, {n} steps, by own time")
    print("\n".join("     " + line for line in buf.getvalue().splitlines()[:50]))
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats("cgbackend|eval_frame|torch/_dynamo|cudagraph", 40)
    print(f"  -- {label}: cProfile, cumulative (cgbackend, dynamo, cudagraph frames)")
    print("\n".join("     " + line for line in buf.getvalue().splitlines()[:60]))


def main(argv):
    for spec in argv:
        build = decode_case() if spec == "decode" else zoo_case(spec.split(":")[1])
        lat = {"reduce-overhead": [], "cgbackend": []}
        for rnd in range(2):
            for label in ("reduce-overhead", "cgbackend"):
                torch._dynamo.reset()
                step, fn = build(label)
                lat[label] += latency(step)
                if rnd == 1:
                    timeline(step, label)
                    profile_host(step, label)
                    if label == "cgbackend":
                        s = cgbackend.stats(fn)
                        print("   cgbackend stats:", {k: s.get(k) for k in bench._STATS_KEYS + ("fast_replays",)})
                del step, fn
                torch.cuda.empty_cache()
        ro, cg = statistics.median(lat["reduce-overhead"]), statistics.median(lat["cgbackend"])
        print(f"== {spec}: latency median us: reduce-overhead {ro:.1f}, cgbackend {cg:.1f}, ratio {cg / ro:.3f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
