"""Kernel profile: cgbackend static dispatch (default options) vs the hand-written grouped layer under
reduce-overhead, one real-size MoE model, inference (usage: diag2.py moe-dsv2lite-shape)."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from pair import contenders  # noqa: E402  (it puts the repository root on the path)

import cgbackend  # noqa: E402

xs, c, ro = contenders(sys.argv[1])


def prof(fn, label):
    with torch.no_grad():
        for i in range(6):
            torch.compiler.cudagraph_mark_step_begin()
            fn(xs[i % 3])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for i in range(3):
                torch.compiler.cudagraph_mark_step_begin()
                fn(xs[i])
            torch.cuda.synchronize()
    print("=====", label)
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=28, max_name_column_width=90))


prof(c, "cgbackend static dispatch")
print(cgbackend.stats(c)["inner_compiled"], cgbackend.stats(c)["inner_fallbacks"])
prof(ro, "grouped reduce-overhead")
