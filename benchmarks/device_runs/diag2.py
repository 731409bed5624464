"""Kernel profile: cgbackend static dispatch (default options) vs the hand-written grouped layer under
reduce-overhead, one real-size MoE model, inference (usage: diag2.py moe-dsv2lite-shape)."""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")  # run from the repository root
import cgbackend  # noqa: E402
from cgbackend.models.realsize import SHAPES, RealModel, grouped_from, make_hidden_inputs  # noqa: E402

name = sys.argv[1]
cfg = SHAPES[name]["full"]
torch.manual_seed(0)
m = RealModel(cfg).cuda().to(torch.bfloat16).eval()
xs = make_hidden_inputs(cfg, tokens=4096, n=3, device="cuda", dtype=torch.bfloat16, seed=1)
g = grouped_from(m).cuda()
c = cgbackend.compile(m, static_dispatch="auto")
ro = torch.compile(g, mode="reduce-overhead")


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
