"""``cgbackend.summary(compiled)``: a short table of what a compiled model did, in the manner of
``torch._dynamo.utils.compile_times()``: per region, in execution order, its graphs, replays,
eager calls by reason and pool memory, then the totals and what the eager reasons mean.

Data from the backend's compiled graphs and counters (runtime/stats.py), rendered here; it builds
no report (no hints, nothing analysed again), so it is cheap to call after every step.
"""

from __future__ import annotations

from typing import Any

__all__ = ["summary"]


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f}"


def _eager_text(calls: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(calls.items(), key=lambda kv: -kv[1])) or "-"


def _rows(backend: Any) -> list[list[str]]:
    rows = []
    for graph in backend.compiled_graphs():
        roles = graph.analysis.labels.region_roles
        for step in graph.steps:
            region, runner = step.region, step.runner
            role = roles.get(region.index, "other")
            if runner is None:
                rows.append([f"g{graph.index}.{region.name}", "dynamic", role, "-", "-",
                             f"every call ({graph.calls})", "-"])
                continue
            pool = sum(e.nbytes for e in runner.cache.entries.values())
            counts = runner.counts
            rows.append([runner.name, "static", role, str(counts.graphs), str(counts.replays),
                         _eager_text(counts.eager_calls), _mib(pool)])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {3, 4, 6}  # numbers

    def fmt(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def summary(obj: Any = None) -> str:
    """A short text table of the model compiled with cgbackend behind ``obj`` (as cgbackend.stats
    takes it; None: every model compiled by name): regions in execution order with their graphs,
    replays, eager calls by reason and pool memory, then the totals."""
    from ..api import stats
    from ..by_name import by_name_backends, find_backend
    from ..runtime.memory import KINDS, released_kinds
    from ..common.reasons import EagerReason
    backends = by_name_backends() if obj is None else [find_backend(obj)]
    counters = stats(obj)
    rows = [row for b in backends for row in _rows(b)]
    lines = ["cgbackend summary:"]
    if not rows:
        return "cgbackend summary: nothing compiled yet (the model has not been called)"
    lines.extend("  " + line for line in _table(
        ["region", "kind", "role", "graphs", "replays", "eager calls (by reason)", "pool MiB"], rows))
    eager = counters["eager_calls"]
    lines.append("")
    lines.append(f"  compiled graphs {counters['compiled_graphs']} (calls {counters['graph_calls']}), "
                 f"static regions {counters['static_regions']}, dynamic regions {counters['dynamic_regions']}")
    lines.append(f"  captured {counters['graphs_captured']} graph(s) in {counters['capture_time_s']:.2f} s, "
                 f"replays {counters['replays']}, static-region calls run eagerly {sum(eager.values())}")
    lines.append(f"  pool {_mib(counters['pool_bytes'])} MiB ({_mib(counters['pool_bytes_held'])} MiB held); "
                 f"inputs copied {counters['copies_made']}, read in place {counters['copies_avoided']}"
                 + (f", copied into a compiled layout {counters['layout_copies']}" if counters.get("layout_copies") else ""))
    mem = counters.get("memory") or {}
    if mem.get("held") or mem.get("released"):
        parts = ", ".join(f"{k} {_mib(mem[k])}" for k in KINDS if mem.get(k))
        lines.append(f"  held between calls {_mib(mem['held'])} MiB ({parts or 'nothing'})"
                     + "".join(f"; {k} released {_mib(v)} MiB" for k, v in released_kinds(mem).items()))
    if counters.get("uncompiled_calls"):
        lines.append(f"  calls Dynamo ran without cgbackend {counters['uncompiled_calls']} "
                     f"({', '.join(f'{k} {v}' for k, v in counters['uncompiled_by'].items())})")
    if counters.get("frames_as_written"):
        names = ", ".join(counters["frames_as_written_by"])
        lines.append(f"  functions run as written (nothing to graph, compiled again by Dynamo): {names}")
    if counters.get("nothing_captured_reason"):
        lines.append(f"  nothing captured: {counters['nothing_captured_reason']}")
    for reason in sorted(eager, key=lambda r: -eager[r]):
        text = EagerReason.DESCRIPTIONS.get(reason)
        if text:
            lines.append(f"  {reason}: {text}")
    return "\n".join(lines)
