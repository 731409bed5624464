"""Host time per call of a compiled callable, inference: median host time of a call (returned, not
synchronized), median synchronized time, and a cProfile of 50 calls sorted by own time. Shared by
diag3.py and diag4.py."""
import cProfile
import pstats
import statistics
import time

import torch


def measure(fn, xs, label, profile_lines=28):
    """``fn`` takes one element of ``xs``; calls rotate through ``xs``."""
    with torch.no_grad():
        for i in range(8):
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % len(xs)])
        torch.cuda.synchronize()
        host, wall = [], []
        for i in range(40):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % len(xs)])
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
            fn(xs[i % len(xs)])
            pr.disable()
        torch.cuda.synchronize()
    print(f"===== {label}: host {statistics.median(host):.3f} ms, synchronized {statistics.median(wall):.3f} ms",
          flush=True)
    if profile_lines:
        pstats.Stats(pr).sort_stats("tottime").print_stats(profile_lines)
