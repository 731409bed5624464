"""The report's summary figures in words, each labelled estimated or measured, written in one place:
the text (text.py) and the HTML page (html.py) show the same lines, so they cannot disagree.

Each figure comes from one field of ``report.summary`` (report.py, coverage.py) and names its basis:

* **kernel launches per call, estimated**: from the traced graphs' ops (passes/launch_estimate.py),
  before anything runs; a graph launch counts one, each op of a dynamic region its kernels.
* **launch coverage, measured** (explain) or **from runtime counters** (a compiled model): of the
  launches one call through cgbackend makes, the share that runs inside graphs; the rest ran in
  dynamic regions or in code Dynamo left uncompiled. An eager call's own launches are given beside
  it, not mixed into it: a call through the graphs can launch more or fewer (static dispatch's forms
  run other ops than the loop they replace).
* **graph memory, estimated**: one graph per static region and per run of its Dynamo graph in a
  call (a layer compiled once and run for each of N layers captures N graphs), each at its largest
  capture size (memory_estimate.py).
"""

from __future__ import annotations

from typing import Any, Optional

from ..common.wording import count

__all__ = ["count", "coverage_detail", "estimated_launches", "graph_memory", "launch_coverage", "summary_figures"]


def estimated_launches(s: dict[str, Any]) -> tuple[str, str]:
    """(label, text) of the estimated kernel launches per call."""
    graphs = s["graph_launches_per_call"]
    eager = s["est_launches_graphed"] - graphs
    text = (f"{s['est_kernels_eager']} all eager -> {s['est_launches_graphed']} with graphs "
            f"({count(graphs, 'graph launch')} + {count(eager, 'kernel')} in dynamic regions)")
    if s.get("graph_runs_per_call", s["graphs"]) != s["graphs"]:
        text += f"; Dynamo graphs run {s['graph_runs_per_call']} times per call"
    return "kernel launches per call (estimated from the traced ops)", text


def coverage_detail(info: dict[str, Any]) -> str:
    """What a launch coverage figure counts, in words (the part in brackets)."""
    if info["basis"] == "measured":
        weights = ("launches per op measured by torch.profiler" if info.get("weights") == "profiled"
                   else "one launch per dispatched op")
        total = info["with_cgbackend"]
        text = (f"measured, {weights}: {info['in_graphs']} of the {count(total, 'launch')} of a call through "
                f"cgbackend run inside graphs, {info['in_dynamic_regions']} in dynamic regions, "
                f"{info['uncompiled']} in uncompiled code")
        if info.get("eager_call") is not None:
            text += f"; an eager call makes {count(info['eager_call'], 'launch')}"
            if info["eager_call"] != total:
                text += " (the compiled call runs other ops, such as static dispatch's forms)"
        return text
    calls = info.get("calls")
    after = f" of the {count(calls, 'call')} after warm-up" if calls is not None else ""
    text = (f"from runtime counters: {info['in_graphs']} of the {count(info['with_cgbackend'], 'launch')} "
            f"(estimated per region call){after} ran in graph replays")
    if info.get("upper_bound"):
        text += ("; an upper bound: Dynamo broke the graph, and launches outside compiled graphs are not "
                 "seen at runtime (cgbackend.explain measures them)")
    return text


def launch_coverage(s: dict[str, Any]) -> Optional[tuple[str, str]]:
    """(label, text) of the launch coverage, or None where the report has no launch counts."""
    cov, info = s.get("launch_coverage"), s.get("launches")
    if info is None:
        return None
    if cov is None:
        if info.get("basis") == "runtime" and info.get("warmup_calls"):
            return "launch coverage", (f"no call after warm-up yet ({count(info['warmup_calls'], 'warm-up call')} "
                                       "left out)")
        return "launch coverage", "not measured"
    return "launch coverage", f"{cov:.3f} ({coverage_detail(info)})"


def graph_memory(s: dict[str, Any]) -> Optional[tuple[str, str]]:
    """(label, text) of the estimated graph memory, or None without an estimate."""
    total = s.get("est_graph_bytes")
    if not total:
        return None
    graphs = s.get("est_graphs", 0)
    largest = s.get("est_graph_bytes_largest", total)
    text = (f"at most {total / 2**20:.1f} MiB for {count(graphs, 'graph')}: one per static region and per run "
            f"of its Dynamo graph in a call, each at its largest capture size; the largest "
            f"{largest / 2**20:.1f} MiB")
    return "graph memory (estimated before capture)", text


def summary_figures(s: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of each summary figure the report has, in the order both renderers show them."""
    figures = [estimated_launches(s), launch_coverage(s), graph_memory(s)]
    return [f for f in figures if f is not None]
