"""Where the host time of a zoo model's inference call goes, cgbackend against reduce-overhead
(issue 17, item 4). Per model (bf16, batch 2x64, inference):

1. host time per call (returned, not synchronized) of cgbackend and reduce-overhead, in alternating
   blocks on rotating batches, and of cgbackend variants with one cost taken away (unsafe, for
   measurement only): no output ownership (graph memory returned as it is); the forms of copying
   the outputs out (runtime/outputs.copy_out);
2. cgbackend's phases (mean us per call of the functions wrapped with a timer);
3. each CUDA graph's replay alone (host time of graph.replay(), synchronized before each);
4. the floor of cgbackend's design: input copy + replay + output copies, written out by hand;
5. CUDA runtime calls per call of each contender (torch.profiler, CPU side).

Usage: diag5.py llama,gpt2"""
import copy
import functools
import gc
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
import cgbackend  # noqa: E402
from cgbackend.runtime import executor, outputs, region  # noqa: E402
from zoo import ZOO  # noqa: E402

PHASES = {}


def timed(cls, name, label):
    orig = getattr(cls, name)

    @functools.wraps(orig)
    def wrapper(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return orig(*a, **k)
        finally:
            acc = PHASES.setdefault(label, [0, 0])
            acc[0] += time.perf_counter_ns() - t0
            acc[1] += 1
    setattr(cls, name, wrapper)
    return orig


def host_times(fns, xs, blocks=5, n=60):
    out = {k: [] for k in fns}
    with torch.no_grad():
        for _ in range(blocks):
            for k, fn in fns.items():
                for i in range(n):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter_ns()
                    torch.compiler.cudagraph_mark_step_begin()
                    fn(xs[i % len(xs)])
                    out[k].append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in out.items()}


def cuda_api(fn, xs, label):
    with torch.no_grad():
        for i in range(5):
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % len(xs)])
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for i in range(20):
                torch.cuda.synchronize()
                torch.compiler.cudagraph_mark_step_begin()
                fn(xs[i % len(xs)])
            torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith("cuda") and "Synchronize" not in e.key]
    print(f"  {label}: CUDA runtime calls per call: "
          + ", ".join(f"{e.key} {e.count / 20:.1f}x {e.cpu_time_total / max(e.count, 1):.1f}us"
                      for e in sorted(rows, key=lambda e: -e.cpu_time_total)))
    aten = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    print(f"  {label}: aten ops per call: "
          + ", ".join(f"{e.key} {e.count / 20:.1f}x" for e in sorted(aten, key=lambda e: -e.count)[:10]))


def replay_alone(graphs, label):
    for tag, g in graphs:
        ts = []
        for _ in range(60):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            g.replay()
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        torch.cuda.synchronize()
        print(f"  {label} graph {tag}: replay alone {statistics.median(ts[10:]):.1f} us host")


for name in sys.argv[1].split(","):
    torch.manual_seed(0)
    base = ZOO[name][1]().cuda().to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 512, (2, 64), generator=gen).cuda() for _ in range(3)]
    torch._dynamo.reset()
    mine = copy.deepcopy(base)
    c = cgbackend.compile(mine)
    ro = torch.compile(copy.deepcopy(base), mode="reduce-overhead")
    with torch.no_grad():
        for i in range(6):
            c(input_ids=xs[i % 3])
            torch.compiler.cudagraph_mark_step_begin()
            ro(input_ids=xs[i % 3])
    torch.cuda.synchronize()
    inst = cgbackend.find_backend(c)
    ours = []
    for g in gc.get_objects():
        try:
            if isinstance(g, torch.cuda.CUDAGraph):
                ours.append(g)
        except ReferenceError:  # a dead weakref.proxy
            pass
    graph_ids = set()
    for ref in inst._graphs:
        cgraph = ref()
        for r in cgraph.runners if cgraph is not None else ():
            for e in r.entries.values():
                graph_ids.add(id(e.graph))
    mine_graphs = [(f"cg{i}", g) for i, g in enumerate(g for g in ours if id(g) in graph_ids)]
    ro_graphs = [(f"ro{i}", g) for i, g in enumerate(g for g in ours if id(g) not in graph_ids)]

    fns = {"cgbackend": lambda x: c(input_ids=x), "reduce-overhead": lambda x: ro(input_ids=x)}
    base_t = host_times(fns, xs)
    print(f"===== {name}: host per call: cgbackend {base_t['cgbackend']:.1f} us, reduce-overhead "
          f"{base_t['reduce-overhead']:.1f} us ({base_t['cgbackend'] / base_t['reduce-overhead']:.2f}x)", flush=True)

    # Variants with one cost removed (unsafe: for measurement only).
    own = outputs.OutputBuilder._own_memory
    outputs.OutputBuilder._own_memory = lambda self, nodes, values: None
    t = host_times({"no-own": fns["cgbackend"], "reduce-overhead": fns["reduce-overhead"]}, xs)
    outputs.OutputBuilder._own_memory = own
    print(f"  without output ownership: {t['no-own']:.1f} us (reduce-overhead {t['reduce-overhead']:.1f})")
    for form in ("mul", "copy"):  # runtime/outputs.copy_out: the forms of one foreach call
        outputs.OUTPUT_COPY = form
        t = host_times({form: fns["cgbackend"], "reduce-overhead": fns["reduce-overhead"]}, xs)
        print(f"  outputs copied with form {form}: {t[form]:.1f} us (reduce-overhead {t['reduce-overhead']:.1f})")
    outputs.OUTPUT_COPY = "auto"
    # Phases.
    origs = [(executor.CompiledGraph, "__call__", timed(executor.CompiledGraph, "__call__", "CompiledGraph.__call__")),
             (region.RegionRunner, "__call__", timed(region.RegionRunner, "__call__", "RegionRunner.__call__")),
             (region.RegionRunner, "_keys", timed(region.RegionRunner, "_keys", "RegionRunner._keys")),
             (region.RegionRunner, "_stage_inputs", timed(region.RegionRunner, "_stage_inputs", "_stage_inputs")),
             (torch.cuda.CUDAGraph, "replay", timed(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay (both)")),
             (outputs.OutputBuilder, "build", timed(outputs.OutputBuilder, "build", "OutputBuilder.build")),
             (outputs.OutputBuilder, "_own_memory", timed(outputs.OutputBuilder, "_own_memory", "_own_memory"))]
    PHASES.clear()
    t = host_times({"cgbackend": fns["cgbackend"]}, xs, blocks=1, n=200)
    for cls, attr, orig in origs:
        setattr(cls, attr, orig)
    calls = PHASES.get("CompiledGraph.__call__", [0, 1])[1]
    print(f"  phases (host {t['cgbackend']:.1f} us per call with timers): "
          + ", ".join(f"{k} {v[0] / 1e3 / calls:.1f}" for k, v in PHASES.items()))

    replay_alone(mine_graphs, "cgbackend")
    replay_alone(ro_graphs, "reduce-overhead")

    # The floor of the design: copy the input in, replay, copy the outputs out (one foreach).
    cgraph = inst._graphs[0]()
    runner = cgraph.runners[0]
    entry = next(iter(runner.entries.values()))
    static_in = [entry.static_ins[p] for p in entry.copy_pos]
    outs_t = [o for o in entry.outputs if isinstance(o, torch.Tensor)]

    def floor(x, own=True):
        static_in[0].copy_(x)
        entry.graph.replay()
        if own == "mul":
            return torch._foreach_mul(outs_t, True)
        if own:
            fresh = [torch.empty_like(o) for o in outs_t]
            torch._foreach_copy_(fresh, outs_t)
            return fresh
        return outs_t
    t = host_times({"floor": floor, "floor-no-own": lambda x: floor(x, False), "floor-mul": lambda x: floor(x, "mul"),
                    "cgbackend": fns["cgbackend"], "reduce-overhead": fns["reduce-overhead"]}, xs)
    print("  by hand: " + ", ".join(f"{k} {v:.1f} us" for k, v in t.items())
          + f" ({len(static_in)} input copies, {len(outs_t)} outputs)")
    cuda_api(fns["cgbackend"], xs, "cgbackend")
    cuda_api(fns["reduce-overhead"], xs, "reduce-overhead")
    print(flush=True)
    del c, ro, mine
    torch._dynamo.reset()
