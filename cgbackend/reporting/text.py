"""The report as text (``Report.to_text()``, ``str(report)``, ``python -m cgbackend explain``): one
renderer of the data in report.py, which it reads and never changes."""

from __future__ import annotations

import collections
from typing import Any

from ..common.reasons import EagerReason, Rule
from ..runtime.memory import released_kinds
from ..runtime.region_timer import timing_text
from ..common.wording import count
from .figures import summary_figures
from .entry import entry_text
from .hints import hints_text
from .memory_estimate import memory_text

__all__ = ["render_text", "roles_text"]


def _io_text(items: list[dict[str, str]], limit: int = 2) -> str:
    if not items:
        return "-"
    shown = [i["spec"] for i in items if i["spec"].startswith("[")][:limit]
    rest = len(items) - len(shown)
    text = ", ".join(shown)
    if rest > 0:
        text += f"{', ' if shown else ''}+{rest}"
    return text


def roles_text(roles: dict[str, int]) -> str:
    """"attention 84 (35%), experts 60 (25%)": each role's ops and share, most first."""
    total = sum(roles.values()) or 1
    return ", ".join(f"{k} {v} ({100 * v / total:.0f}%)" for k, v in sorted(roles.items(), key=lambda kv: -kv[1]))


def _paths_text(paths: list[str], limit: int = 3) -> str:
    if not paths:
        return "(root)"
    text = ", ".join(paths[:limit])
    if len(paths) > limit:
        text += f", +{len(paths) - limit} more"
    return text


def _buckets_text(buckets: dict[str, dict[str, Any]]) -> list[str]:
    """"keyed on" line of a static region: what each symbol does to its graph cache."""
    parts, why = [], []
    for name, b in buckets.items():
        if b["padded"]:
            parts.append(f"{name} padded to capture_sizes (row-independent)")
            continue
        parts.append(f"{name} exact")
        if b["bucketable"]:
            why.append(f"{name}: {b['why']}")
        else:
            where = f" ({b['op']} at {b['source']})" if b["source"] else ""
            why.append(f"{name} not bucketable: {b['why']}{where}")
    lines = [f"{'':<10}graphs keyed on: {', '.join(parts)}"]
    lines.extend(f"{'':<12}{w}" for w in why)
    return lines


def _uncompiled_text(summary: dict[str, Any]) -> list[str]:
    """The lines under the launch coverage: where a call ran uncompiled code (explain's measurement)."""
    lines = []
    for src in ((summary.get("launches") or {}).get("uncompiled_sources") or [])[:6]:
        ops = ", ".join(f"{op} x{n}" for op, n in src["ops"].items())
        lines.append(f"{'':<4}uncompiled: {count(src['launches'], 'launch')} at {src['source']} ({ops})")
        if src["code"]:
            lines.append(f"{'':<8}`{src['code']}`")
    return lines


def _runtime_text(runtime: dict[str, Any]) -> list[str]:
    lines = ["  runtime:"]
    seen: set[str] = set()
    for name, r in runtime.get("regions", {}).items():
        eager = ", ".join(f"{k} {v}" for k, v in r["eager_calls"].items()) or "none"
        held = ""
        if r.get("evicted") or r.get("recaptured") or r.get("held", r["graphs"]) != r["graphs"]:
            held = f" ({r['held']} held, {r['evicted']} evicted"
            held += f", {r['recaptured']} recaptured after newer graphs)" if r.get("recaptured") else ")"
        pad = f", padded along {r['bucketed']}" if r.get("bucketed") else ""
        if r.get("captured_sizes"):
            pad += f" (sizes {', '.join(map(str, r['captured_sizes']))} captured)"
        mib = f", pool {r['pool_bytes'] / 2**20:.1f} MiB" if r.get("pool_bytes") else ""
        mem = r.get("memory") or {}
        if mem.get("held") or mem.get("released"):
            mib += f", holds {mem['held'] / 2**20:.1f} MiB between calls"
            mib += "".join(f" ({v / 2**20:.1f} MiB of {k} released)" for k, v in released_kinds(mem).items())
        handout = (f" + {r['handout_graphs']} handout graph(s) (outputs to the caller without a copy)"
                   if r.get("handout_graphs") else "")
        lines.append(f"{'':<4}{name.split('.', 1)[-1]}: {r['graphs']} graph(s){handout}{held}{pad}{mib}, "
                     f"{r['replays']} replays, eager calls: {eager}")
        if r.get("disabled"):
            lines.append(f"{'':<8}runs eagerly for good: {r['disabled']} ({r['disabled_detail']})")
        if r.get("thrashing"):
            lines.append(f"{'':<8}graph cache stopped evicting: {r['thrashing']}")
        if r.get("shapes_vary"):
            lines.append(f"{'':<8}shapes vary at every call: {r['shapes_vary']}")
        inner = r.get("inner") or {}
        if inner.get("reason"):
            lines.append(f"{'':<8}eager's kernels, not Inductor's: {inner['reason']} ({inner['detail']})")
        seen.update(r["eager_calls"])
    if runtime.get("inner"):
        lines.append(f"{'':<4}inner compiler: {runtime['inner']}")
    for c in runtime.get("constants") or ():
        where = f" at {c['source']}" if c["source"] else ""
        lines.append(f"{'':<4}constant made once: {c['op']}{where} -> {c['shape']}@{c['dtype']}")
    for key in ("gather_rewrites",):
        if runtime.get(key):
            lines.append(f"{'':<4}gathers rewritten for a cheap backward: {runtime[key]}")
    for reason in sorted(seen):
        text = EagerReason.DESCRIPTIONS.get(reason)
        if text:
            lines.append(f"{'':<4}{reason}: {text}")
    return lines


def _opaque_modules_text(opaque: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    wrapped, skipped = opaque.get("wrapped", []), opaque.get("skipped", [])
    if not wrapped and not skipped:
        return []
    lines = [f"  opaque module calls: {len(wrapped)} modules made one graph node each; "
             f"calls in static regions {summary.get('opaque_calls_graphed', 0)}, "
             f"in dynamic regions {summary.get('opaque_calls_eager', 0)}"]
    for item in skipped:
        lines.append(f"  left to Dynamo (graph break, runs eagerly): {item['module']} ({item['kind']}): "
                     f"{item['reason']}")
    return lines


def _loop_rewrites_text(loops: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in loops:
        if r["form"] and r.get("traced") is False:  # nothing of the rewritten loop is in a graph
            lines.append(f"  dispatch loop at {r['source']}: rewritten, but no graph Dynamo traced runs it (the "
                         "model's experts took another path, such as grouped_mm, or the code ran uncompiled)")
            continue
        fold = r.get("fold", "")
        if fold:
            lines.append(f"  dispatch loop at {r['source']}: " + (
                "folded (Dynamo traces one expert; the grouped form runs them all)" if fold == "folded"
                else f"traced unrolled, not folded: {fold}"))
        if r["form"]:
            kept = r.get("kept_skips", 0)
            lines.append(f"  dispatch loop rewritten before tracing: {r['form']} at {r['source']} "
                         "(now a fixed-length loop over every expert)"
                         + (f"; {kept} unit(s) left dynamic keep its skip" if kept else ""))
        elif r["reason"]:
            lines.append(f"  dispatch loop left as written at {r['source']}: {r['reason']}")
    return lines


def _dispatch_text(dispatch: dict[str, Any]) -> list[str]:
    """One line per (pattern, source line, module) of rewritten or skipped dispatch units."""
    lines = []
    groups: collections.OrderedDict = collections.OrderedDict()
    for r in dispatch.get("rewrites", ()):
        groups.setdefault(("rewritten", r["pattern"], r["form"], r["source"], r["module_path"], r["why"]),
                          []).append(r)
    for r in dispatch.get("skipped", ()):
        groups.setdefault(("left dynamic", r["pattern"], "", r["source"], r["module_path"], r["reason"]),
                          []).append(r)
    for (state, pattern, form, source, path, why), items in groups.items():
        count = f" x{len(items)}" if len(items) > 1 else ""
        how = f" -> {form}" if form else ""
        lines.append(f"  static dispatch {state}: {pattern}{how} at {source or '?'}"
                     f"{f' ({path})' if path else ''}{count}")
        lines.append(f"{'':<10}{why}")
        cuda = (items[0].get("figures") or {}).get("on_cuda")
        if cuda and (cuda["form"] or "dynamic") != (form or "dynamic"):
            lines.append(f"{'':<10}on a CUDA device the form would be {cuda['form'] or 'dynamic'}: {cuda['why']}")
    return lines


def _explain_rule_once(rule: str, explained: set[str], indent: int) -> list[str]:
    """The rule's one-line meaning (reasons.py), the first time the text names it."""
    if rule in explained:
        return []
    explained.add(rule)
    try:
        return [f"{'':<{indent}}({rule}: {Rule(rule).description})"]
    except (ValueError, KeyError):  # a rule this version does not know (an older report)
        return []


def _derived_text(derived: list[dict[str, Any]]) -> str:
    """"+ N ops that follow from those": the ops that launch kernels first, by estimated kernels,
    then the bookkeeping (views, tuple elements, size checks) that launches none."""
    ops: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    for x in derived:
        ops[x["op"]] += x["count"]
        kernels[x["op"]] += x.get("est_kernels", 0)
    total = sum(ops.values())
    costly = sorted((op for op in ops if kernels[op] > 0), key=lambda op: (-kernels[op], -ops[op]))
    free = sorted((op for op in ops if kernels[op] == 0), key=lambda op: -ops[op])
    text = f"+ {count(total, 'op')} that follow{'s' if total == 1 else ''} from those"
    if costly:
        text += (f", ~{sum(kernels.values())} kernels: "
                 + ", ".join(f"{op} x{ops[op]} (~{kernels[op]})" for op in costly[:4])
                 + (f", +{len(costly) - 4} more" if len(costly) > 4 else ""))
    if free:
        text += ("; " if costly else ": ") + "no kernel: " + ", ".join(f"{op} x{ops[op]}" for op in free[:3])
        text += f", +{len(free) - 3} more" if len(free) > 3 else ""
    return text


def render_text(report: Any) -> str:
    """The text of ``report`` (a report.Report)."""
    s = report.summary
    lines = [
        "cgbackend partition report",
        *entry_text(report.traced_via, s),
        f"  graphs: {s['graphs']}   graph breaks: {s['graph_breaks']}   ops: {s['ops']}",
        f"  static_op_fraction: {s['static_op_fraction']:.3f} (kernels ~{s['static_kernel_fraction']:.3f})"
        f"   static regions: {s['static_regions']}   dynamic regions: {s['dynamic_regions']}",
    ]
    if report.traced_as:
        lines.append(f"  traced as {report.traced_as['mode']}: {report.traced_as['why']}")
    lines.extend(f"  {label}: {text}" for label, text in summary_figures(s))
    lines.extend(_uncompiled_text(s))
    for note in report.notes:
        lines.append(f"  note: {note}")
    lines.extend(hints_text(report.hints))
    lines.extend(_opaque_modules_text(report.opaque_modules, s))
    lines.extend(_loop_rewrites_text(report.loop_rewrites))
    for stack in report.regional:
        where = f"{stack['path']}.0-{stack['layers'] - 1}" if stack["path"] else f"0-{stack['layers'] - 1}"
        lines.append(f"  regional compilation: {where} ({stack['layers']} x {stack['class']}) share one compiled "
                     "layer: traced, analysed and compiled once, graphs captured per layer")
        apart = {g["why"] for g in stack.get("groups", ()) if g["why"]}
        if apart:
            lines.append(f"    {len(stack['groups'])} groups compiled apart: {'; '.join(sorted(apart))}")
        if stack.get("why"):
            lines.append(f"    {stack['why']}")
    for brk in report.graph_breaks:
        where = f" at {brk['source']}" if brk.get("source") else ""
        lines.append(f"  graph break{where}: {brk['reason']}")
        if brk.get("code"):
            lines.append(f"{'':<4}`{brk['code']}`")
    explained: set[str] = set()  # rules whose meaning the text has given (once each)
    for g in report.graphs:
        mode = "training" if g.training else "inference"
        frac = g.static_ops / g.ops if g.ops else 0.0
        lines.append("")
        lines.append(f"graph {g.index} ({g.compute_device}, {mode}): {g.ops} ops, "
                     f"{sum(r.kind == 'static' for r in g.regions)} static / "
                     f"{sum(r.kind == 'dynamic' for r in g.regions)} dynamic regions, "
                     f"static ops {100 * frac:.1f}%")
        if g.break_reason:
            lines.append(f"  ends at a graph break: {g.break_reason['reason']} "
                         f"({g.break_reason.get('source', '')})")
        for note in g.notes:
            lines.append(f"  note: {note}")
        lines.extend(_dispatch_text(g.dispatch))
        lines.append(f"  {'region':<8}{'kind':<9}{'role':<14}{'ops':>5}{'~kern':>7}  inputs -> outputs")
        for r in g.regions:
            lines.append(f"  {r.id.split('.')[-1]:<8}{r.kind:<9}{r.role:<14}{r.ops:>5}{r.est_kernels:>7}  "
                         f"{_io_text(r.inputs)} -> {_io_text(r.outputs)}")
            lines.append(f"{'':<10}roles (ops, share): {roles_text(r.roles)}")
            lines.append(f"{'':<10}modules: {_paths_text(r.module_paths)}")
            if r.symbols:
                syms = ", ".join(f"{k}({v})" for k, v in r.symbols.items())
                lines.append(f"{'':<10}symbols: {syms}")
            if r.buckets:
                lines.extend(_buckets_text(r.buckets))
            lines.extend(memory_text(r.memory, g.training))
            if r.collectives:
                ops = ", ".join(f"{c['op']}" + (f" x{c['count']}" if c["count"] > 1 else "") for c in r.collectives)
                lines.append(f"{'':<10}collectives captured in this region's graphs (sizes fixed by shapes; "
                             f"every rank issues them at the same point): {ops}")
            for call in r.opaque:
                how = "inside this region's CUDA graphs" if call["graphed"] else f"eager: {call['why']}"
                lines.append(f"{'':<10}opaque call {call['module']} ({call['kind']}): {how}")
            roots = [x for x in r.reasons if Rule(x["rule"]).is_root_cause]
            derived = [x for x in r.reasons if not Rule(x["rule"]).is_root_cause]
            for reason in roots[:6]:
                count = f" x{reason['count']}" if reason["count"] > 1 else ""
                where = f" at {reason['source']}" if reason["source"] else ""
                lines.append(f"{'':<10}eager: {reason['op']} [{reason['rule']}]{where}{count}")
                if reason["code"]:
                    lines.append(f"{'':<17}`{reason['code']}`")
                lines.extend(_explain_rule_once(reason["rule"], explained, 17))
            if len(roots) > 6:
                lines.append(f"{'':<10}... {len(roots) - 6} more causes (see --json)")
            if r.hoisted_syncs:
                lines.append(f"{'':<10}{r.hoisted_syncs} host sync(s) issued before the work that "
                             "precedes them in the code, so later launches overlap the GPU")
            if derived:
                lines.append(f"{'':<10}{_derived_text(derived)}")
                for rule in dict.fromkeys(x["rule"] for x in derived):
                    lines.extend(_explain_rule_once(rule, explained, 12))
        if g.runtime:
            lines.extend(_runtime_text(g.runtime))
            lines.extend(timing_text(g.runtime.get("timing") or {}))
    if s["top_reasons"]:
        lines.append("")
        lines.append("top reasons for eager execution:")
        for t in s["top_reasons"]:
            lines.append(f"  {t['count']:>4} x {t['op']} [{t['rule']}] e.g. at {t['source'] or '?'}")
    return "\n".join(lines)
