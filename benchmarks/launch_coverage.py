"""Launch coverage of a demo model on a GPU, three ways.

1. ``cgbackend.explain`` on CUDA tensors: the dispatched aten ops of coverage.py, each weighed by
   the launches the profiler saw it make (``launches.weights``: "profiled"; what the report says).
2. ``cgbackend.report(compiled)`` after a run: runtime counters x estimated kernels per region,
   over the calls after warm-up.
3. The profiler: CUDA launch API calls (kernel launches, memcpy, memset) of one eager call versus
   those of one compiled call made outside graph replays (``cudaGraphLaunch`` counted apart):
   1 - compiled / eager is the fraction of the eager call's launches that the graphs absorbed
   (``cgbackend.reporting.launch_profile.count_launch_calls``, as tests/reporting/test_launch_profile.py counts them).

    python benchmarks/launch_coverage.py --demo moe
"""

from __future__ import annotations

import argparse
import json

import torch

import cgbackend
from cgbackend.reporting.launch_profile import count_launch_calls
from cgbackend.models import demo_model


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
        eager = count_launch_calls(lambda: model(x))
        graphed = count_launch_calls(lambda: compiled(x))
    runtime = cgbackend.report(compiled).summary
    eager_total = eager["kernels"] + eager["copies"]
    outside = graphed["kernels"] + graphed["copies"]
    result = {
        "demo": args.demo,
        "options": options,
        "explain_launch_coverage": explained.get("launch_coverage"),
        "explain_launches": {k: v for k, v in (explained.get("launches") or {}).items()
                             if k not in ("by_region", "uncompiled_sources")},
        "explain_notes": [n for n in report.notes if n.startswith("launch coverage")],
        "runtime_launch_coverage": runtime.get("launch_coverage"),
        "profiler_eager_call": eager,
        "profiler_compiled_call": graphed,
        "profiler_launch_coverage": round(1 - outside / eager_total, 4) if eager_total else None,
        "hints": [h["kind"] for h in report.hints],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
