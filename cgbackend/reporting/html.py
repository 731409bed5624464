"""The report as one self-contained HTML page (``Report.to_html()``, ``explain --html PATH``).

One more renderer of the same Report data: the summary and the hints on top, then the regions
of every graph in execution order as one timeline row (static green, dynamic orange), each box sized
by the region's measured time (option profile, after a run), else its measured launches
(explain), else its estimated kernels; launches in uncompiled code (explain) are a grey row on the
same scale, by source line, since where they fall between the graphs is not known. Hovering a
box shows its role, module paths and reasons (the ``title`` attribute: no script needed). A table
of the regions follows. Inline CSS only: no script, font, image or link to fetch.

Structure the tests rely on: ``<section id="summary">``, ``<section id="hints">`` (one
``<li class="hint" data-kind=...>`` per hint), ``<section id="timeline">`` with one
``<div class="region KIND" data-id=... data-kind=... data-weight=...>`` per region in order and
one ``<div class="region uncompiled" ...>`` per uncompiled source, ``<table id="regions">``.
"""

from __future__ import annotations

import html
from typing import Any

from .hints import hint_option, option_cli, option_python, source_text

__all__ = ["render_html"]

_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 12px; } h2 { font-size: 16px; margin: 20px 0 8px; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; border-bottom: 1px solid #ddd;
  text-align: left; vertical-align: top; }
#summary td:first-child { color: #555; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.hint { margin: 4px 0; } .hint .kind { font-weight: 600; color: #6a3d9a; }
.hint code, td code { background: #f3f3f3; padding: 0 3px; border-radius: 3px; }
.note { color: #555; }
.legend span { display: inline-block; margin-right: 16px; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px;
  border-radius: 2px; }
.row { display: flex; width: 100%; height: 54px; margin: 4px 0; }
.graphlabel { font-size: 12px; color: #555; margin-top: 10px; }
.region { box-sizing: border-box; min-width: 3px; border: 1px solid #fff; border-radius: 3px;
  overflow: hidden; white-space: nowrap; font-size: 12px; padding: 3px 4px; color: #fff; }
.region .role { display: block; font-size: 11px; opacity: .9; }
.region:hover { outline: 2px solid #222; } .region.start { border-left: 3px solid #222; }
.static { background: #2e8b57; } .dynamic { background: #e07b00; } .uncompiled { background: #8a8a8a; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _weights(report: Any) -> tuple[dict[str, float], str]:
    """Weight of each region id and what the weights are."""
    timing: dict[str, float] = {}
    for g in report.graphs:
        for name, parts in ((g.runtime or {}).get("timing") or {}).items():
            timing[f"g{g.index}.{name}"] = sum(p["total_ms"] for p in parts.values())
    if timing:
        return timing, "ms measured (profile=True), all calls"
    launches = report.summary.get("launches") or {}
    if launches.get("basis") == "measured" and launches.get("by_region") is not None:
        return {k: float(v) for k, v in launches["by_region"].items()}, "measured launches of one call"
    return {r.id: float(r.est_kernels) for r in report.regions()}, "estimated kernels per call"


def _tooltip(region: Any, weight: float, unit: str, timing: Any = None) -> str:
    lines = [f"{region.id}: {region.kind}, role {region.role}, {region.ops} ops, {weight:g} ({unit})"]
    for how, t in (timing or {}).items():
        lines.append(f"{how}: {t['calls']} x {t['mean_ms']} ms")
    if region.module_paths:
        more = f" +{len(region.module_paths) - 6} more" if len(region.module_paths) > 6 else ""
        lines.append("modules: " + ", ".join(region.module_paths[:6]) + more)
    for reason in region.reasons[:4]:
        where = f" at {reason['source']}" if reason.get("source") else ""
        lines.append(f"eager: {reason['op']} [{reason['rule']}]{where} x{reason['count']}")
    if region.kind == "static" and not region.reasons:
        lines.append("captured as a CUDA graph")
    return "\n".join(lines)


def _summary_rows(report: Any) -> list[tuple[str, str]]:
    s = report.summary
    rows = [("graphs / graph breaks", f"{s['graphs']} / {s['graph_breaks']}"),
            ("ops (static fraction)", f"{s['ops']} ({s['static_op_fraction']:.3f})"),
            ("static / dynamic regions", f"{s['static_regions']} / {s['dynamic_regions']}"),
            ("kernel launches per call (estimated)",
             f"{s['est_kernels_eager']} all eager -> {s['est_launches_graphed']} with graphs")]
    cov = s.get("launch_coverage")
    info = s.get("launches") or {}
    if cov is not None:
        if info.get("basis") == "measured":
            weights = "profiled launches per op" if info.get("weights") == "profiled" else "one launch per op"
            detail = (f"measured, {weights}: {info['in_graphs']} of {info['eager_call']} launches of an eager "
                      f"call in graphs, {info['in_dynamic_regions']} in dynamic regions, {info['uncompiled']} uncompiled")
        else:
            after = f" of the {info['calls']} calls after warm-up" if info.get("calls") is not None else ""
            detail = f"runtime: {info['in_graphs']} of {info['with_cgbackend']} estimated launches{after} in replays"
            if info.get("upper_bound"):
                detail += " (upper bound: code outside compiled graphs not seen)"
        rows.insert(2, ("launch coverage", f"{cov:.3f} ({detail})"))
    return rows


def render_html(report: Any, title: str = "cgbackend partition report") -> str:
    weights, unit = _weights(report)
    launches = report.summary.get("launches") or {}
    uncompiled = launches.get("uncompiled_sources") or [] if launches.get("basis") == "measured" else []
    total = sum(weights.get(r.id, 0.0) for r in report.regions())
    total += sum(src["launches"] for src in uncompiled) if unit.startswith("measured launches") else 0
    total = total or 1.0
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]

    out.append('<section id="summary"><table>')
    for label, value in _summary_rows(report):
        out.append(f"<tr><td>{_e(label)}</td><td>{_e(value)}</td></tr>")
    out.append("</table>")
    for note in report.notes:
        out.append(f'<p class="note">note: {_e(note)}</p>')
    for brk in report.graph_breaks:
        where = f" at {brk['source']}" if brk.get("source") else ""
        out.append(f'<p class="note">graph break{_e(where)}: {_e(brk["reason"])}</p>')
    out.append("</section>")

    out.append('<section id="hints"><h2>Hints</h2>')
    if report.hints:
        out.append("<ul>")
        for h in report.hints:
            option = hint_option(h)
            extra = (f" (set <code>{_e(option_cli(*option))}</code> or <code>{_e(option_python(*option))}</code>)"
                     if option is not None else "")
            extra += f" (at <code>{_e(source_text(h['source']))}</code>)" if h.get("source") else ""
            out.append(f'<li class="hint" data-kind="{_e(h["kind"])}"><span class="kind">{_e(h["kind"])}</span>: '
                       f"{_e(h['message'])}{extra}</li>")
        out.append("</ul>")
    else:
        out.append('<p class="note">none</p>')
    out.append("</section>")

    out.append('<section id="timeline"><h2>Regions in execution order</h2>')
    out.append('<div class="legend"><span><i class="swatch static"></i>static (CUDA graph)</span>'
               '<span><i class="swatch dynamic"></i>dynamic (eager)</span>'
               '<span><i class="swatch uncompiled"></i>uncompiled code (outside Dynamo\'s graphs)</span>'
               f"<span>width: {_e(unit)}</span></div>")
    devices = sorted({g.compute_device for g in report.graphs})
    modes = sorted({"training" if g.training else "inference" for g in report.graphs})
    out.append(f'<div class="graphlabel">{len(report.graphs)} graph(s) in the order Dynamo compiled them '
               f'({_e(", ".join(devices))}, {_e(", ".join(modes))}); a dark edge starts a graph</div>')
    out.append('<div class="row">')
    for g in report.graphs:
        timing = (g.runtime or {}).get("timing") or {}
        for i, r in enumerate(g.regions):
            w = weights.get(r.id, 0.0)
            start = " start" if i == 0 and len(report.graphs) > 1 else ""
            label = r.id if len(report.graphs) > 1 else r.id.split(".")[-1]
            out.append(f'<div class="region {_e(r.kind)}{start}" data-id="{_e(r.id)}" data-kind="{_e(r.kind)}" '
                       f'data-weight="{w:g}" style="width:{100.0 * w / total:.3f}%" '
                       f'title="{_e(_tooltip(r, w, unit, timing.get(r.id.split(".")[-1])))}">{_e(label)}'
                       f'<span class="role">{_e(r.role)}</span></div>')
    out.append("</div>")
    if uncompiled:
        out.append('<div class="graphlabel">uncompiled code, by source line (where it falls between the '
                   'graphs is not recorded)</div><div class="row">')
        for src in uncompiled:
            ops = ", ".join(f"{op} x{n}" for op, n in src["ops"].items())
            tip = f"{src['source']}: {src['launches']} launches ({ops})\n{src['code']}"
            out.append(f'<div class="region uncompiled" data-source="{_e(src["source"])}" '
                       f'data-weight="{src["launches"]}" style="width:{100.0 * src["launches"] / total:.3f}%" '
                       f'title="{_e(tip)}">line {_e(src["source"].split(" in ")[0].rsplit(":", 1)[-1])}</div>')
        out.append("</div>")
    out.append("</section>")

    out.append('<section id="details"><h2>Regions</h2><table id="regions"><tr><th>region</th><th>kind</th>'
               '<th>role</th><th class="num">ops</th><th class="num">~kernels</th>'
               f'<th class="num">{_e(unit)}</th><th>modules</th><th>why eager</th></tr>')
    for r in report.regions():
        why = "; ".join(f"{x['op']} [{x['rule']}] at {x['source'] or '?'} x{x['count']}" for x in r.reasons[:3])
        mods = ", ".join(r.module_paths[:4]) + (f" +{len(r.module_paths) - 4}" if len(r.module_paths) > 4 else "")
        out.append(f'<tr data-id="{_e(r.id)}"><td>{_e(r.id)}</td><td>{_e(r.kind)}</td><td>{_e(r.role)}</td>'
                   f'<td class="num">{r.ops}</td><td class="num">{r.est_kernels}</td>'
                   f'<td class="num">{weights.get(r.id, 0.0):g}</td><td>{_e(mods)}</td><td>{_e(why)}</td></tr>')
    out.append("</table></section></body></html>")
    return "\n".join(out)
