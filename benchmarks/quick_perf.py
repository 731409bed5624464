"""Quick side-by-side timing of eager vs cgbackend on the reference models (the full harness is
``python -m cgbackend bench``). Inputs rotate every call, accuracy is checked before timing.

    python benchmarks/quick_perf.py --models moe,dense --modes infer,train
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch

import cgbackend
from cgbackend.models import build_model, make_inputs


def _time_calls(step, inputs, iters, warmup):
    for i in range(warmup):
        step(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        x = inputs[i % len(inputs)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="moe,dense")
    p.add_argument("--modes", default="infer,train")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--batches", type=int, default=64)
    p.add_argument("--calls", type=int, default=200, help="inference calls for the graph-count check")
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    rows = []
    for name in args.models.split(","):
        base = build_model(name, size="bench", device="cuda", dtype=dtype)
        inputs = make_inputs(name, base, batch=4, seq=128, n=args.batches, device="cuda", seed=3)
        for mode in args.modes.split(","):
            torch._dynamo.reset()
            eager = copy.deepcopy(base).train(mode == "train")
            mine = copy.deepcopy(base).train(mode == "train")
            compiled = cgbackend.compile(mine)
            t0 = time.perf_counter()
            if mode == "infer":
                with torch.no_grad():
                    for x in inputs[:4]:
                        compiled(x)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    err = max(((compiled(x).float() - eager(x).float()).abs().max()
                               / eager(x).float().abs().max()).item() for x in inputs[4:12])
                    t_e = _time_calls(lambda x: eager(x), inputs, args.iters, 5)
                    t_c = _time_calls(lambda x: compiled(x), inputs, args.iters, 5)
                    g0 = cgbackend.stats(compiled)["graphs_captured"]
                    for i in range(args.calls):
                        compiled(inputs[i % len(inputs)])
                    g1 = cgbackend.stats(compiled)["graphs_captured"]
            else:
                opt_e = torch.optim.SGD(eager.parameters(), lr=1e-4)
                opt_c = torch.optim.SGD(mine.parameters(), lr=1e-4)

                def step(model, fn, opt, x):
                    opt.zero_grad(set_to_none=True)
                    loss = torch.nn.functional.cross_entropy(fn(x).flatten(0, 1).float(), x.flatten())
                    loss.backward()
                    opt.step()
                    return loss

                for x in inputs[:4]:
                    step(mine, compiled, opt_c, x)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                e2, c2 = copy.deepcopy(eager), copy.deepcopy(mine)
                c2.load_state_dict(e2.state_dict())
                cc = cgbackend.compile(c2)
                errs = []
                for x in inputs[4:10]:
                    for m in (e2, c2):
                        m.zero_grad(set_to_none=True)
                    torch.nn.functional.cross_entropy(e2(x).flatten(0, 1).float(), x.flatten()).backward()
                    torch.nn.functional.cross_entropy(cc(x).flatten(0, 1).float(), x.flatten()).backward()
                    for a, b in zip(e2.parameters(), c2.parameters()):
                        if a.grad is not None:
                            errs.append(((a.grad.float() - b.grad.float()).abs().max()
                                         / a.grad.float().abs().max().clamp_min(1e-12)).item())
                err = max(errs[-len(list(e2.parameters())):])
                t_e = _time_calls(lambda x: step(eager, eager, opt_e, x), inputs, args.iters, 5)
                t_c = _time_calls(lambda x: step(mine, compiled, opt_c, x), inputs, args.iters, 5)
                g0 = g1 = cgbackend.stats(compiled)["graphs_captured"]
            st = cgbackend.stats(compiled)
            rows.append((name, mode, t_e, t_c, t_c / t_e, err, first, g0, g1, st["static_regions"],
                         dict(st["eager_calls"])))
            print(f"[quick_perf] {name} {mode}: eager {t_e:.3f} ms cgbackend {t_c:.3f} ms "
                  f"ratio {t_c / t_e:.3f} err {err:.2e}", file=sys.stderr, flush=True)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'model':<7}{'mode':<7}{'eager ms':>10}{'cgb ms':>10}{'ratio':>8}{'rel err':>10}"
          f"{'first4 s':>10}{'graphs':>8}{'after':>7}{'regions':>8}  eager calls")
    for r in rows:
        print(f"{r[0]:<7}{r[1]:<7}{r[2]:>10.3f}{r[3]:>10.3f}{r[4]:>8.3f}{r[5]:>10.2e}{r[6]:>10.2f}"
              f"{r[7]:>8}{r[8]:>7}{r[9]:>8}  {r[10]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
