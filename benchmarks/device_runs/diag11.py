"""Issue 17: dense-llama8b-shape training as the bench runs it (forward, loss, backward, SGD step),
cgbackend against reduce-overhead, phase by phase: CUDA events after the forward call, the loss,
the backward and the optimizer step, each step synchronized before; both contenders kept compiled
and timed in alternating blocks on rotating batches. Also each contender's memory after its steps.

    python diag11.py [blocks] [steps per block]
"""
from __future__ import annotations

import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
import cgbackend  # noqa: E402
from cgbackend.models import realsize  # noqa: E402

PHASES = ("forward", "loss", "backward", "sgd")


def main(blocks: int = 6, per: int = 8) -> None:
    cfg = realsize.SHAPES["dense-llama8b-shape"]["full"]
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = realsize.RealModel(cfg).to(torch.bfloat16)
    xs = realsize.make_hidden_inputs(cfg, tokens=4096, n=4, device="cuda", dtype=torch.bfloat16, seed=1,
                                     max_seq=4096)
    runs = {}
    for label in ("reduce-overhead", "cgbackend"):
        m0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        model = realsize.RealModel(cfg).to("cuda", torch.bfloat16)
        model.load_state_dict(base.state_dict())
        model.train(True)
        fn = torch.compile(model, mode="reduce-overhead") if label == "reduce-overhead" else cgbackend.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        mark = label == "reduce-overhead"
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]

        def step(i, fn=fn, opt=opt, mark=mark, ev=ev):
            x = xs[i % len(xs)]
            torch.cuda.synchronize()
            ev[0].record()
            opt.zero_grad(set_to_none=True)
            if mark:
                torch.compiler.cudagraph_mark_step_begin()
            out = fn(x)
            ev[1].record()
            out = out[0] if isinstance(out, tuple) else out
            loss = out.float().pow(2).mean()
            ev[2].record()
            loss.backward()
            ev[3].record()
            opt.step()
            ev[4].record()
            ev[4].synchronize()
            return [ev[k].elapsed_time(ev[k + 1]) for k in range(4)] + [ev[0].elapsed_time(ev[4])]
        for i in range(6):
            step(i)
        torch.cuda.synchronize()
        runs[label] = dict(step=step, times=[], fn=fn,
                           mem=(torch.cuda.memory_allocated() - m0) / 2**20,
                           peak=(torch.cuda.max_memory_allocated() - m0) / 2**20)
    for b in range(blocks):
        for label, run in runs.items():
            for i in range(per):
                run["times"].append(run["step"](b * per + i))
    ro = runs["reduce-overhead"]["times"]
    for label, run in runs.items():
        t = run["times"]
        parts = [statistics.median([r[k] for r in t]) for k in range(5)]
        rparts = [statistics.median([r[k] for r in ro]) for k in range(5)]
        print(f"== {label:16s} step {parts[4]:8.3f} ms (x RO {parts[4] / rparts[4]:.3f}); " +
              ", ".join(f"{p} {parts[k]:.3f} (x {parts[k] / rparts[k]:.3f})" for k, p in enumerate(PHASES)) +
              f"; memory held {run['mem']:.0f} MiB, peak over start {run['peak']:.0f} MiB")
    st = cgbackend.stats(runs["cgbackend"]["fn"])
    keys = ("graphs_captured", "static_regions", "replays", "copies_made", "copied_by_kind", "output_clones",
            "pool_bytes", "grads_handed", "grad_copies")
    print("   cgbackend stats:", {k: st.get(k) for k in keys if k in st})
    print("   all stat keys:", sorted(st))


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:]])
