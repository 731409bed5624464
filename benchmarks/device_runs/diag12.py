"""Issue 17: is the measured ratio cgbackend / reduce-overhead an effect of the harness's order?

Both contenders compiled in one process (as the zoo and the bench do), then timed as the zoo times
(perf_counter around a step synchronized before and after, 5 alternating blocks). Varied: which
contender compiles first (Dynamo's cache for the shared code object holds both; guards of the
other's entry may be checked first), and which contender's block runs first in each round.

    python diag12.py zoo:qwen2_moe:infer llama8b:train
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
from diag8 import llama8b_case, zoo_case  # noqa: E402

LABELS = ("reduce-overhead", "cgbackend")


def timed(steps: dict, order: tuple, rounds: int, per: int) -> dict:
    out = {k: [] for k in steps}
    for r in range(rounds):
        for label in order:
            step = steps[label]
            for i in range(per):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(r * per + i)
                torch.cuda.synchronize()
                out[label].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def main(argv) -> None:
    for spec in argv:
        parts = spec.split(":")
        build = zoo_case(parts[1], parts[2]) if parts[0].startswith("zoo") else llama8b_case(parts[1])
        per = 20 if parts[0].startswith("zoo") else 8
        labels = LABELS
        compile_orders = [LABELS, LABELS[::-1]] if parts[0] == "zoo" else [LABELS]
        if parts[0] == "zoo3":  # the zoo's own order: eager, cgbackend, reduce-overhead
            labels = ("eager", "cgbackend", "reduce-overhead")
            compile_orders = [labels]
        for corder in compile_orders:
            torch._dynamo.reset()
            steps, keep = {}, []
            for label in corder:
                step, fn = build(label)
                for i in range(4):
                    step(i)
                steps[label] = step
                keep.append(fn)
            torch.cuda.synchronize()
            for border in (labels, labels[::-1], labels):
                ms = timed(steps, border, 5, per)
                print(f"== {spec}: compiled {corder[0]} first, blocks {' '.join(border)}: "
                      f"RO {ms['reduce-overhead']:.4f} ms, cgbackend {ms['cgbackend']:.4f} ms, "
                      f"x RO {ms['cgbackend'] / ms['reduce-overhead']:.3f}")
                sys.stdout.flush()
            del steps, keep
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
