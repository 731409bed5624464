"""Issue 17: does launching two CUDA graphs in turn cost more than launching one again? And what
does it do to the hf-llama decode step, where the caller holds the previous step's logits during the
next call (so cgbackend's two handout graphs alternate)?

A. Raw graphs (no cgbackend): a function of N small kernels captured twice (graphs A and B, each
   in its own pool); latency (CUDA events around replay, synchronized) and host time of replay()
   for A A A ... against A B A B ..., in alternating blocks.
B. The decode step (bench_decode's model and session): reduce-overhead and cgbackend with
   handout_graphs 2 (default), 1 and 0, each with the caller holding the previous logits ("hold",
   as bench_decode and transformers' generate do) or dropping them ("drop"); all compiled in one
   process, timed in alternating blocks.

    python diag10.py
"""
from __future__ import annotations

import copy
import os
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


def raw_graphs(n_kernels: int) -> None:
    x = torch.randn(8, 512, device="cuda")

    def f():
        y = x
        for _ in range(n_kernels):
            y = y * 1.0001 + 0.5
        return y

    f()
    torch.cuda.synchronize()
    graphs = []
    for _ in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs.append(g)
    a, b = graphs
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = {"same": ([], []), "alternate": ([], [])}
    for rnd in range(6):
        for label in res:
            lat, host = res[label]
            for i in range(200):
                g = a if label == "same" or i % 2 == 0 else b
                torch.cuda.synchronize()
                start.record()
                t0 = time.perf_counter_ns()
                g.replay()
                host.append((time.perf_counter_ns() - t0) / 1e3)
                end.record()
                end.synchronize()
                lat.append(start.elapsed_time(end) * 1e3)
    print(f"== raw graphs, {n_kernels} kernels: " + "; ".join(
        f"{label}: latency {statistics.median(l):.1f} us, replay() host {statistics.median(h):.1f} us"
        for label, (l, h) in res.items()))


def decode() -> None:
    s = types.SimpleNamespace(scale="full", seed=0, dtype=torch.bfloat16)
    shape = bd.DECODE_SHAPES["full"]
    base = bd.build_hf("hf-llama", s)
    prompt = torch.randint(0, shape["vocab"], (shape["batch"], shape["prompt"]),
                           generator=torch.Generator().manual_seed(1)).cuda()
    ro = bench.CONTENDERS["reduce-overhead"]
    makers = {"reduce-overhead": (ro.make, ro.mark_step)}
    for k in (2, 1, 0):
        makers[f"cgbackend handout_graphs={k}"] = ((lambda m, k=k: cgbackend.compile(m, handout_graphs=k)), False)
    sessions = {}
    for label, (make, mark) in makers.items():
        session = bd._Session(copy.deepcopy(base).cuda().eval(), make, shape, torch.device("cuda"),
                              torch.bfloat16, mark)
        for _ in range(3):
            session.generate(prompt)
        sessions[label] = session
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = {(label, hold): [] for label in sessions for hold in ("hold", "drop")}
    with torch.no_grad():
        for rnd in range(4):
            for (label, hold), acc in times.items():
                session = sessions[label]
                ids = session.step.prefill(prompt).argmax(-1, keepdim=True)
                out = None
                for i in range(session.new_tokens - 1):
                    if hold == "drop":
                        out = None
                    torch.cuda.synchronize()
                    start.record()
                    out = session.call(ids, i)
                    ids = out.argmax(-1, keepdim=True)
                    end.record()
                    end.synchronize()
                    acc.append(start.elapsed_time(end) * 1e3)
    base_ro = {h: statistics.median(times[("reduce-overhead", h)]) for h in ("hold", "drop")}
    for (label, hold), acc in times.items():
        med = statistics.median(acc)
        print(f"== decode {label:32s} {hold}: median {med:7.1f} us per token, x reduce-overhead({hold}) "
              f"{med / base_ro[hold]:.3f}")
    for label, session in sessions.items():
        if label.startswith("cgbackend"):
            st = cgbackend.stats(session.fn)
            print(f"   {label}: handout_graphs {st['handout_graphs']} handout_replays {st['handout_replays']} "
                  f"output_clones {st['output_clones']} replays {st['replays']} fast_replays {st.get('fast_replays')}")


def main() -> None:
    for n in (16, 64, 256):
        raw_graphs(n)
    sys.stdout.flush()
    decode()


if __name__ == "__main__":
    main()
