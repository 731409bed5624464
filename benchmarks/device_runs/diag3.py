"""Host time per call: cgbackend static dispatch (default options) vs the hand-written grouped layer
under reduce-overhead, one real-size MoE model, inference (usage: diag3.py moe-dsv2lite-shape [tokens]).
Prints, per contender, the median host time of a call (returned, not synchronized), the median
synchronized time, and a cProfile of 50 calls sorted by own time."""
import cProfile
import pstats
import statistics
import sys
import time

import torch

from pair import contenders  # noqa: E402  (it puts the repository root on the path)

import cgbackend  # noqa: E402

tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
xs, c, ro = contenders(sys.argv[1], tokens)


def measure(fn, label):
    with torch.no_grad():
        for i in range(8):
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % 3])
        torch.cuda.synchronize()
        host, wall = [], []
        for i in range(40):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % 3])
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            host.append((t1 - t0) * 1e3)
            wall.append((t2 - t0) * 1e3)
        pr = cProfile.Profile()
        for i in range(50):
            torch.cuda.synchronize()
            pr.enable()
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % 3])
            pr.disable()
        torch.cuda.synchronize()
    print(f"===== {label}: host {statistics.median(host):.3f} ms, synchronized {statistics.median(wall):.3f} ms")
    pstats.Stats(pr).sort_stats("tottime").print_stats(28)


measure(c, "cgbackend static dispatch")
s = cgbackend.stats(c)
print({k: s[k] for k in ("static_regions", "dynamic_regions", "graphs_captured", "replays", "copies_made",
                         "copied_by_kind", "output_clones", "inner_compiled", "inner_fallbacks")})
measure(ro, "grouped reduce-overhead")
