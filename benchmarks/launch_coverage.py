"""Launch coverage of a demo model on a GPU, three ways (issue 20's closing note).

1. ``cgbackend.explain`` on CUDA tensors: the aten-op count of coverage.py (what the report says).
2. ``cgbackend.report(compiled)`` after a run: runtime counters x estimated kernels per region.
3. The profiler: CUDA launch API calls (kernel launches, memcpy, memset) of one eager call versus
   those of one compiled call made outside graph replays (``cudaGraphLaunch`` counted apart):
   1 - compiled / eager is the fraction of the eager call's launches that the graphs absorbed.

    python benchmarks/launch_coverage.py --demo moe
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

import cgbackend
from cgbackend.models import demo_model

_KERNEL = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
           "cudaLaunchCooperativeKernel")
_COPY = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemsetAsync", "cudaMemset")


def _launch_calls(fn) -> dict[str, int]:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = collections.Counter(e.name for e in prof.events())
    return {"kernels": sum(names[n] for n in _KERNEL), "copies": sum(names[n] for n in _COPY),
            "graph_launches": names["cudaGraphLaunch"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--demo", default="moe", choices=("moe", "dense"))
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    model, x = demo_model(args.demo, device="cuda")
    with torch.no_grad():
        report = cgbackend.explain(model, x, options=options)
        explained = report.summary
        compiled = cgbackend.compile(model, **options)
        for _ in range(6):
            compiled(x)
        eager = _launch_calls(lambda: model(x))
        graphed = _launch_calls(lambda: compiled(x))
    runtime = cgbackend.report(compiled).summary
    eager_total = eager["kernels"] + eager["copies"]
    outside = graphed["kernels"] + graphed["copies"]
    result = {
        "demo": args.demo,
        "options": options,
        "explain_launch_coverage": explained.get("launch_coverage"),
        "explain_launches": {k: v for k, v in (explained.get("launches") or {}).items()
                             if k not in ("by_region", "uncompiled_sources")},
        "runtime_launch_coverage": runtime.get("launch_coverage"),
        "profiler_eager_call": eager,
        "profiler_compiled_call": graphed,
        "profiler_launch_coverage": round(1 - outside / eager_total, 4) if eager_total else None,
        "hints": [h["kind"] for h in report.hints],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
