"""Where the serving loop's time goes: ms per call at one batch size at a time (100 calls, 4 rotating
inputs, synchronized at the end), eager vs cgbackend (padded to capture_sizes), cgbackend with
exact sizes (capture_sizes=()) and with inner="inductor"; in parentheses the host time of the 100
calls before the final synchronize (it includes waiting once the launch queue is full).

    python benchmarks/per_size.py        # on a CUDA machine; dense reference model, bench size, bf16
"""
import time, torch, cgbackend
from cgbackend.models import build_model
torch.manual_seed(0)
m = build_model("dense", size="bench", device="cuda", dtype=torch.bfloat16).eval()
sizes = [2, 5, 8, 12, 16, 20, 28, 33, 40, 52, 60, 64]
def tok(n, s=0):
    return torch.randint(0, 1024, (n, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(s))
def bench(fn, n, iters=100):
    xs = [tok(n, i) for i in range(4)]
    with torch.no_grad():
        for i in range(5): fn(xs[i % 4])
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for i in range(iters): fn(xs[i % 4])
        t_cpu = time.perf_counter() - t0
        torch.cuda.synchronize(); t = time.perf_counter() - t0
    return 1e3 * t / iters, 1e3 * t_cpu / iters
variants = {"eager": m, "cg": cgbackend.compile(m), "cg_exact": cgbackend.compile(m, capture_sizes=(), max_graphs_per_region=64),
            "cg_ind": cgbackend.compile(m, inner="inductor")}
with torch.no_grad():
    for name, fn in variants.items():
        if name != "eager":
            for n in (3, 4, 6):
                x = tok(n); torch._dynamo.mark_dynamic(x, 0); fn(x)
print("size " + " ".join(f"{k:>16}" for k in variants))
for n in sizes:
    row = []
    for name, fn in variants.items():
        ms, cpu = bench(fn, n)
        row.append(f"{ms:7.3f} ({cpu:6.3f})")
    print(f"{n:4d} " + " ".join(row), flush=True)
