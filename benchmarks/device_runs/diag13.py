"""Issue 17: is a 1-2% gap on dense-llama8b-shape the harness's? Three contenders in one process,
compiled in the order given, timed as the zoo and bench time (diag12.timed, 5 alternating blocks):
reduce-overhead, cgbackend and a second reduce-overhead on its own copy of the weights. If the two
reduce-overheads differ as much as cgbackend does from the first, the gap is the harness's.

    python diag13.py infer train
"""
from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE), HERE]
from diag8 import llama8b_case  # noqa: E402
from diag12 import timed  # noqa: E402


def main(argv) -> None:
    for mode in argv:
        build = llama8b_case(mode)
        for order in (("reduce-overhead", "cgbackend", "reduce-overhead#2"),
                      ("reduce-overhead", "reduce-overhead#2", "cgbackend")):
            torch._dynamo.reset()
            steps, keep = {}, []
            for label in order:
                step, fn = build(label.split("#")[0])
                for i in range(4):
                    step(i)
                steps[label] = step
                keep.append(fn)
            torch.cuda.synchronize()
            for border in (order, order[::-1]):
                ms = timed(steps, border, 5, 8 if mode == "train" else 20)
                ro = ms["reduce-overhead"]
                print(f"== {mode}: compiled {' '.join(order)}; blocks {' '.join(border)}: " +
                      ", ".join(f"{k} {v:.3f} ms ({v / ro:.3f})" for k, v in ms.items()))
                sys.stdout.flush()
            del steps, keep
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
