"""The partition report: plain dataclasses filled from the analyses, rendered by one function
(text.py; html.py for the HTML page).

JSON schema ``cgbackend.report/1`` (stable; fields are only added). The machine-readable schema is
``cgbackend/reporting/report.schema.json`` (checked against real reports by tests/reporting/test_report_schema.py;
``cgbackend.reporting.schema.validate_report(report)`` checks one); in short:

``{"schema", "config", "notes": [str], "graph_breaks": [{"reason", "source"}],
"summary": {...}, "graphs": [{"index", "ops", "static_ops", "compute_device", "training",
"break_reason", "notes", "runtime", "regions": [...]}]}``

``summary``: ``graphs``, ``graph_breaks``, ``ops``, ``static_ops``,
``static_op_fraction`` (static ops / all ops, 0..1), ``static_regions`` (graphs
to capture per call), ``dynamic_regions``, ``est_kernels_eager`` (estimated
kernel launches per call if nothing is graphed), ``est_launches_graphed``
(graph launches + kernel launches left eager), ``top_reasons`` (``[{"rule",
"op", "source", "count"}]``, most frequent first).

``regions[]`` (execution order): ``id`` ("g0.S0"), ``index``, ``kind``
("static" | "dynamic"), ``role``, ``roles`` ({role: ops}), ``ops``,
``est_kernels``, ``module_paths``, ``inputs`` / ``outputs`` (``[{"name",
"spec"}]``, spec like ``[s0, 512]@bfloat16``), ``symbols`` ({name: "backed" |
"unbacked"}), ``reasons[]`` (``{"rule", "op", "source", "code", "module_path",
"detail", "count"}``; empty for static regions), ``nodes[]`` (``{"name", "op",
"role", "rule"}``; ``rule`` is null for nodes that are graphed), ``hoisted_syncs``
(dynamic regions: host syncs the scheduler moved earlier), ``buckets`` (static regions with
size symbols: ``{symbol: {"bucketable", "padded", "why", "op", "source", "code"}}``; the padded
symbol keys graphs on capture sizes, the others on exact values), ``memory`` (static regions: the
estimated pool bytes of one captured graph, per capture size where bucketed: ``[{"size", "bytes",
"peak_bytes", "output_bytes", "copied_input_bytes", "unknown_values", "traced"}]``,
memory_estimate.py; ``summary["est_graph_bytes"]`` adds each region's largest over a call:
``est_graphs`` graphs, one per static region and run of its Dynamo graph, the largest
``est_graph_bytes_largest`` bytes).

Regions also have ``opaque`` (module calls Dynamo cannot trace, made one node each: ``{"module",
"kind", "node", "graphed", "why"}``); the report has ``opaque_modules`` (``{"wrapped",
"skipped"}``) and the summary ``opaque_calls_graphed`` / ``opaque_calls_eager``.

``summary`` also has ``symbolic_regions`` (static regions with size symbols) and
``bucketed_regions`` (those that pad one), ``dispatch_rewrites`` and ``dispatch_left_dynamic``.

``summary`` also has ``launch_coverage`` (0..1, of the launches of a call through cgbackend, the
fraction that runs inside graphs: ``in_graphs / with_cgbackend``; null when not measured) and ``launches`` (coverage.py): ``{"basis":
"measured" | "runtime", "weights", "eager_call", "with_cgbackend", "in_graphs",
"in_dynamic_regions", "uncompiled", "dispatched_ops", "by_region": {region id: launches},
"uncompiled_sources": [{"source", "code", "launches", "ops": {op: count}}], "upper_bound",
"calls", "warmup_calls"}``. "measured" (explain): aten ops dispatched by one eager call and by one
call through the compiled graphs, each weighing ``weights``: "profiled" on CUDA tensors (the
kernel launches, memcpy and memset calls ``torch.profiler`` saw the op make, launch_profile.py),
"one per op" on CPU tensors or when the profiler failed (a note says why); ``dispatched_ops``
(``{"eager_call", "with_cgbackend"}``) counts the ops themselves; "uncompiled" counts launches
outside every compiled graph (after a graph break that skipped the rest of a frame). "runtime"
(``cgbackend.report(compiled)``, ``weights`` "estimated kernels"): the calls after warm-up
(``calls``; the ``warmup_calls`` are left out, the capture call counts with the replays) x
estimated kernels per region; ``eager_call`` and ``uncompiled`` are null, ``upper_bound`` is true
when Dynamo broke a graph; ``launch_coverage`` is null until a call after warm-up ran.

``hints[]`` (top level, hints.py): ``{"kind": "static_dispatch" | "data_dependent_loop" |
"inner_compiler" | "graph_memory", "message", "option", "source"}``; ``option`` is the option to set (``{"option":
name, "value": value}``), ``source`` the user's line (``{"path", "line", "function", "code"}``);
either may be null.

``runtime`` is null in an ahead-of-time report; for a compiled model it holds, per static
region, ``graphs`` (captured, evicted ones included), ``held``, ``evicted``, ``recaptured``
(captured again to replay after newer graphs), ``pool_bytes`` (growth
of reserved memory while its held graphs were captured), ``bucketed`` (the padded symbol),
``thrashing``, ``shapes_vary`` (why it stopped capturing per shape: runtime/churn.py),
``replays``, ``eager_calls`` by reason, ``disabled``; with the option
``profile``, ``timing``: ``{region name: {"replay" | "eager": {"calls", "total_ms", "mean_ms"}}}``
(runtime/region_timer.py).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Any, Optional

from ..passes.pipeline import Analysis
from ..common.fx_utils import module_path, op_name
from .memory_estimate import analysis_memory
from ..integrations.opaque import opaque_info
from ..passes.launch_estimate import estimate_kernels
from ..common.reasons import Rule
from .text import render_text
from ..passes.collectives import collectives_by_op

__all__ = ["SCHEMA", "Report", "GraphReport", "RegionReport", "build_report", "render_text"]

SCHEMA = "cgbackend.report/1"

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RegionReport:
    id: str
    index: int
    kind: str
    role: str
    roles: dict[str, int]
    ops: int
    est_kernels: int
    module_paths: list[str]
    inputs: list[dict[str, str]]
    outputs: list[dict[str, str]]
    symbols: dict[str, str]
    reasons: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    hoisted_syncs: int = 0
    """Dynamic regions: host synchronizations issued earlier than in program order (passes/schedule)."""
    buckets: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Static regions with backed symbols: per symbol ``{"bucketable", "padded", "why", "op",
    "source", "code"}`` (passes/bucket.py). A padded symbol's graphs are keyed on its capture size,
    the others on their exact values."""
    collectives: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Static regions: the collectives its graphs issue (passes/collectives.py), ``{"op", "count",
    "source"}`` per op (source: its first call's line)."""
    opaque: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Opaque module calls in this region (opaque.py: Transformer Engine modules): ``{"module",
    "kind", "node", "graphed", "why"}``; ``why`` says why a call in a dynamic region runs eagerly."""
    memory: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Static regions: the estimated pool memory of one captured graph (memory_estimate.py), one
    entry per capture size of a bucketed region, else one at the traced sizes: ``{"size", "bytes",
    "peak_bytes", "output_bytes", "copied_input_bytes", "unknown_values", "traced"}``."""


@dataclasses.dataclass
class GraphReport:
    index: int
    ops: int
    static_ops: int
    compute_device: str
    training: bool
    regions: list[RegionReport]
    break_reason: Optional[dict[str, str]] = None
    notes: list[str] = dataclasses.field(default_factory=list)
    runtime: Optional[dict[str, Any]] = None
    dispatch: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Static MoE dispatch (moe/): ``{"mode", "rewrites": [...], "skipped": [...]}``."""
    runs_per_call: int = 1
    """How often this graph ran in the model call explain traced (a layer's code compiled once runs
    once per layer); the summary's per-call figures count these runs."""


@dataclasses.dataclass
class Report:
    """What cgbackend did (or would do) with a model: from ``cgbackend.explain(model, *inputs)``
    (ahead of time, nothing captured) or ``cgbackend.report(compiled)`` (with runtime counters).

    ``print(report)`` / ``report.to_text()`` renders it for people; ``report.to_json()`` /
    ``to_dict()`` give the data, whose every field is described by the JSON Schema
    ``cgbackend/reporting/report.schema.json`` (``cgbackend.reporting.schema.load_schema()``; schema name in
    ``report.schema``). Fields: ``graphs`` (one GraphReport per Dynamo graph, each with its
    ``regions``: id, kind static|dynamic, role, ops, estimated kernels, inputs/outputs as
    shape@dtype, symbols, reasons with source lines), ``graph_breaks`` (``{"reason", "source"}``),
    ``summary`` (counts and per-call estimates), ``config`` (the options), ``notes``,
    ``traced_as`` (explain: inference or training, and why) and ``opaque_modules``.
    ``report.regions()`` lists the regions of all graphs in execution order.
    """

    graphs: list[GraphReport]
    graph_breaks: list[dict[str, str]]
    summary: dict[str, Any]
    config: dict[str, Any]
    notes: list[str] = dataclasses.field(default_factory=list)
    schema: str = SCHEMA
    traced_as: dict[str, Any] = dataclasses.field(default_factory=dict)
    """explain only: ``{"mode": "inference" | "training" | "mixed" | "none", "why"}``."""
    traced_via: dict[str, Any] = dataclasses.field(default_factory=dict)
    """explain only: whose partition the report shows, ``{"entry": "compile" | "by_name", "calls",
    "trace_dynamic_ops", "other": {"entry", "graphs", "graph_breaks"} | null, "other_may_differ"}``:
    ``cgbackend.compile(model)`` or ``torch.compile(model, backend="cgbackend")``, and the other
    entry point's counts where explain traced it too (``compare=True``; entry.py renders it)."""
    opaque_modules: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What ``cgbackend.compile`` / ``explain`` made opaque (opaque.py): ``{"wrapped": [{"module",
    "kind"}], "skipped": [{"module", "kind", "reason"}]}``; skipped modules keep their own forward
    (Dynamo breaks the graph at them and they run eagerly)."""
    loop_rewrites: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Dispatch loops rewritten in the model's source before tracing (moe/source_rewrite.py,
    with static_dispatch on): ``[{"function", "source", "form", "reason"}]``; ``form`` is "hit_loop"
    or "count_skip" when rewritten, "" with the ``reason`` when left as it is."""
    hints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """What to change to graph more (hints.py): ``{"kind", "message", "option": {"option", "value"},
    "source": {"path", "line", "function", "code"}}``."""
    regional: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Stacks of identical layers compiled once each (cgbackend.compile, regional.py): ``[{"path",
    "layers", "class", "key", "groups"}]``: the layers at ``path`` share one compiled layer (one Dynamo
    graph, one analysis), each capturing its own graphs; ``groups`` (``[{"layers", "why"}]``) are the
    layers Dynamo specialises apart, each group compiled on its own (regional_calls.py);
    ``with_model``: the stack is compiled with the rest of the model now, ``why`` says why
    (regional_modes.py)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_text(self) -> str:
        return render_text(self)

    def to_html(self) -> str:
        """One self-contained HTML page: summary, hints, regions as a timeline (html.py)."""
        from .html import render_html
        return render_html(self)

    def __str__(self) -> str:
        return render_text(self)

    def regions(self) -> list[RegionReport]:
        return [r for g in self.graphs for r in g.regions]


def _is_op(node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def _aggregate_reasons(reasons) -> list[dict[str, Any]]:
    """``reasons``: (Reason, estimated kernels of its node); one entry per (rule, op, source)."""
    counts: collections.OrderedDict = collections.OrderedDict()
    for reason, kernels in reasons:
        key = (reason.rule, reason.op, reason.source)
        if key in counts:
            counts[key][1] += 1
            counts[key][2] += kernels
        else:
            counts[key] = [reason, 1, kernels]
    out = []
    for reason, count, kernels in counts.values():
        d = reason.to_dict()
        d.pop("node")
        d["count"] = count
        d["est_kernels"] = kernels
        out.append(d)
    # Root causes first (the ops to act on), then what merely follows from them.
    out.sort(key=lambda d: (not Rule(d["rule"]).is_root_cause, -d["count"]))
    return out


def graph_report(analysis: Analysis, index: int, break_reason: Optional[dict[str, str]] = None,
                 notes: Optional[list[str]] = None) -> GraphReport:
    regions = []
    for region in analysis.partition.regions:
        rs = analysis.shapes.regions[region.index]
        paths: list[str] = []
        nodes = []
        reasons = []
        opaque = []
        for node in region.nodes:
            info = opaque_info(node)
            if info is not None:
                why = analysis.reason_of(node)
                opaque.append({"module": info.path or "<model>", "kind": info.kind, "node": node.name,
                               "graphed": region.is_static,
                               "why": None if region.is_static or why is None
                               else f"{why.rule.value}: {why.detail or why.op}"})
            path = module_path(node)
            if path and path not in paths:
                paths.append(path)
            reason = analysis.reason_of(node)
            if not region.is_static and reason is not None:
                reasons.append((reason, estimate_kernels(node)))
            nodes.append({"name": node.name, "op": op_name(node),
                          "role": analysis.labels.node_roles[node],
                          "rule": reason.rule.value if (reason is not None and not region.is_static) else None})
        regions.append(RegionReport(
            id=f"g{index}.{region.name}",
            index=region.index,
            kind=region.kind,
            role=analysis.labels.region_roles[region.index],
            roles=analysis.labels.region_role_ops[region.index],
            ops=sum(1 for n in region.nodes if _is_op(n)),
            est_kernels=sum(estimate_kernels(n) for n in region.nodes),
            module_paths=paths,
            inputs=[{"name": n, "spec": s} for n, s in rs.inputs],
            outputs=[{"name": n, "spec": s} for n, s in rs.outputs],
            symbols=rs.symbols,
            reasons=_aggregate_reasons(reasons),
            nodes=nodes,
            hoisted_syncs=analysis.schedule.moved.get(region.index, 0),
            buckets=_buckets_of(analysis, region.index),
            collectives=collectives_by_op(region.nodes) if region.is_static else [],
            opaque=opaque,
            memory=_memory_of(analysis, region) if region.is_static else [],
        ))
    ops = sum(r.ops for r in regions)
    static_ops = sum(r.ops for r in regions if r.kind == "static")
    return GraphReport(index=index, ops=ops, static_ops=static_ops,
                       compute_device=analysis.classification.compute_device,
                       training=analysis.classification.training, regions=regions,
                       break_reason=break_reason, notes=list(notes or []),
                       dispatch=analysis.dispatch.to_dict())


def _memory_of(analysis: Analysis, region: Any) -> list[dict[str, Any]]:
    """A static region's graph memory estimate; none (logged) where a traced value defeats it: the
    report stands without it."""
    try:
        return [m.to_dict() for m in analysis_memory(analysis, region)]
    except Exception as exc:  # an estimate: never the reason a report fails
        log.debug("cgbackend: no graph memory estimate for region %s: %s", region.name, exc)
        return []


def _static_of(graph: GraphReport) -> list[RegionReport]:
    return [r for r in graph.regions if r.kind == "static"]


def _largest_graph(region: RegionReport) -> int:
    """Estimated bytes of the region's largest graph (its largest capture size), 0 without an estimate."""
    return max((m["bytes"] for m in region.memory), default=0)


def summarize(graphs: list[GraphReport], graph_breaks: list[dict[str, str]]) -> dict[str, Any]:
    ops = sum(g.ops for g in graphs)
    static_ops = sum(g.static_ops for g in graphs)
    static_regions = [r for g in graphs for r in g.regions if r.kind == "static"]
    dynamic_regions = [r for g in graphs for r in g.regions if r.kind == "dynamic"]
    # Per call: each graph counts as often as it ran in the traced call.
    launches = sum(g.runs_per_call for g in graphs for r in g.regions if r.kind == "static")
    kernels_static = sum(g.runs_per_call * r.est_kernels for g in graphs for r in g.regions if r.kind == "static")
    kernels_dynamic = sum(g.runs_per_call * r.est_kernels for g in graphs for r in g.regions
                          if r.kind == "dynamic")
    top: collections.Counter = collections.Counter()
    example: dict[tuple[str, str], str] = {}
    for region in dynamic_regions:
        for reason in region.reasons:
            key = (reason["rule"], reason["op"])
            top[key] += reason["count"]
            example.setdefault(key, reason["source"])
    ranked = sorted(top.items(), key=lambda kv: (not Rule(kv[0][0]).is_root_cause, -kv[1]))
    return {
        "graphs": len(graphs),
        "graph_breaks": len(graph_breaks),
        "dispatch_rewrites": sum(len(g.dispatch.get("rewrites", ())) for g in graphs),
        "dispatch_left_dynamic": sum(len(g.dispatch.get("skipped", ())) for g in graphs),
        "ops": ops,
        "static_ops": static_ops,
        "static_op_fraction": round(static_ops / ops, 4) if ops else 0.0,
        "static_regions": len(static_regions),
        "dynamic_regions": len(dynamic_regions),
        "symbolic_regions": sum(1 for r in static_regions if r.buckets),
        "bucketed_regions": sum(1 for r in static_regions if any(b["padded"] for b in r.buckets.values())),
        "graph_runs_per_call": sum(g.runs_per_call for g in graphs),
        "graph_launches_per_call": launches,
        "est_kernels_eager": kernels_static + kernels_dynamic,
        "est_launches_graphed": launches + kernels_dynamic,
        "opaque_calls_graphed": sum(len(r.opaque) for r in static_regions),
        "est_graph_bytes": sum(g.runs_per_call * _largest_graph(r) for g in graphs for r in _static_of(g)),
        "est_graphs": sum(g.runs_per_call for g in graphs for r in _static_of(g) if _largest_graph(r)),
        "est_graph_bytes_largest": max((_largest_graph(r) for g in graphs for r in _static_of(g)), default=0),
        "opaque_calls_eager": sum(len(r.opaque) for r in dynamic_regions),
        "static_kernel_fraction": round(kernels_static / (kernels_static + kernels_dynamic), 4)
        if kernels_static + kernels_dynamic else 0.0,
        "top_reasons": [{"rule": rule, "op": op, "source": example[(rule, op)], "count": count}
                        for (rule, op), count in ranked[:8]],
    }


def build_report(analyses: list[tuple[Analysis, Optional[dict[str, str]]]],
                 graph_breaks: list[dict[str, str]], config: dict[str, Any],
                 notes: Optional[list[str]] = None, runs: Optional[dict[int, int]] = None) -> Report:
    graphs = [graph_report(a, i, br) for i, (a, br) in enumerate(analyses)]
    for g in graphs:
        g.runs_per_call = (runs or {}).get(g.index, 1)
    return Report(graphs=graphs, graph_breaks=graph_breaks, summary=summarize(graphs, graph_breaks),
                  config=config, notes=list(notes or []))


def _buckets_of(analysis: Analysis, index: int) -> dict[str, dict[str, Any]]:
    entry = analysis.buckets.regions.get(index)
    if entry is None:
        return {}
    out = {}
    for name, b in entry.symbols.items():
        d = b.to_dict()
        del d["symbol"]
        out[name] = d
    return out
