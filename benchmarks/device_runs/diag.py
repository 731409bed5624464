"""Diagnose the gap of static dispatch to the hand-written grouped MoE (moe-mixtral-shape, infer)."""
import sys
import torch
sys.path.insert(0, ".")  # run from the repository root
import cgbackend
from cgbackend.models.realsize import SHAPES, RealModel, grouped_from, make_hidden_inputs
from cgbackend.passes.dispatch import layout
counts = {"view": 0, "stack": 0}
orig_apply, orig_stack = layout._StackedView.apply, torch.stack
def spy(*ws):
    counts["view"] += 1; return orig_apply(*ws)
layout._StackedView.apply = spy
name = sys.argv[1]
cfg = SHAPES[name]["full"]
torch.manual_seed(0)
m = RealModel(cfg).cuda().to(torch.bfloat16).eval()
xs = make_hidden_inputs(cfg, tokens=4096, n=3, device="cuda", dtype=torch.bfloat16, seed=1)
torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
c = cgbackend.compile(m, static_dispatch="auto")
print("after relayout MiB", (torch.cuda.memory_allocated() - base) / 2**20)
with torch.no_grad():
    for i in range(6):
        c(xs[i % 3])
torch.cuda.synchronize()
print("stacked_view calls", counts, "allocated over base MiB", (torch.cuda.memory_allocated() - base) / 2**20,
      "max", (torch.cuda.max_memory_allocated() - base) / 2**20)
r = cgbackend.report(c)
for g in r.graphs:
    for d in g.dispatch["rewrites"]:
        print("rewrite", d["form"], d["why"][:200], d.get("figures", {}).get("grouped_mm"))
print("notes", r.notes)
st = cgbackend.stats(c); print({k: st[k] for k in ("static_regions", "dynamic_regions", "graphs_captured", "replays", "copies_made", "eager_calls")})
from torch.profiler import profile, ProfilerActivity
with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        c(xs[i])
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
g = grouped_from(m).cuda()
with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(3):
        g(xs[i])
    torch.cuda.synchronize()
print("GROUPED EAGER")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
