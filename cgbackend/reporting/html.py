"""The report as one self-contained HTML page (``Report.to_html()``, ``explain --html PATH``).

One more renderer of the same Report data, top to bottom:

* the summary, and the line that says whose partition it shows (by name or cgbackend.compile);
* the hints, each with the option to paste (``--option`` and the Python keyword) and its line;
* graph breaks and notes, each break folded (``<details>``: its line in the summary, Dynamo's long
  text inside), so they never push the hints and the timeline out of sight;
* the timeline: the regions in the order they run in one call, each box sized by the region's
  measured time (option profile, after a run), else its measured launches (explain), else its
  estimated kernels. Where explain counted the call (``launches.sequence``), a graph that runs
  several times per call (a layer's graph once per layer) is drawn once per run and uncompiled code
  sits where it ran; otherwise each graph is drawn once, in the order Dynamo compiled it, and the
  caption says so. A box carries its label only where the label fits at the narrowest page
  (800 px); every box names itself, its role, modules, reasons and runtime split on hover (the
  ``title`` attribute: no script needed);
* the table of regions (scrolling inside its box rather than widening the page), with the runtime
  split per region after a run: replays, eager calls by reason, and with ``profile=True`` the time
  in eager calls, replays and captures.

Inline CSS only: no script, font, image or link to fetch.

Structure the tests rely on: ``<section id="summary">``, ``<section id="hints">`` (one
``<li class="hint" data-kind=...>`` per hint) before ``<section id="breaks">`` (one
``<details class="break">`` per graph break), ``<section id="timeline">`` with one ``<div
class="region KIND" data-id=... data-kind=... data-weight=...>`` per region run in order and one
``<div class="region uncompiled" data-source=...>`` per stretch of uncompiled code,
``<table id="regions">`` inside ``<div class="scroll">``.
"""

from __future__ import annotations

import html
from typing import Any, Optional

from .entry import entry_text
from .hints import hint_option, option_cli, option_python, source_text
from ..common.wording import count
from .figures import summary_figures
from .text import roles_text

__all__ = ["render_html"]

_CSS = """
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222;
  overflow-wrap: anywhere; }
h1 { font-size: 20px; margin: 0 0 12px; } h2 { font-size: 16px; margin: 20px 0 8px; }
table { border-collapse: collapse; } td, th { padding: 3px 10px; border-bottom: 1px solid #ddd;
  text-align: left; vertical-align: top; }
.scroll { max-width: 100%; overflow-x: auto; }
.scroll td, .scroll th { overflow-wrap: normal; white-space: nowrap; }
.scroll td.long { white-space: normal; min-width: 16em; overflow-wrap: anywhere; }
#summary td:first-child { color: #555; } .num { text-align: right; font-variant-numeric: tabular-nums; }
.hint { margin: 4px 0; } .hint .kind { font-weight: 600; color: #6a3d9a; }
code { background: #f3f3f3; padding: 0 3px; border-radius: 3px; }
.note, .entry { color: #555; } details.break { margin: 4px 0; } details.break p { margin: 4px 0 4px 18px; }
.legend span { display: inline-block; margin-right: 16px; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px;
  border-radius: 2px; }
.row { display: flex; width: 100%; height: 54px; margin: 4px 0; }
.graphlabel { font-size: 12px; color: #555; margin-top: 10px; }
.region { box-sizing: border-box; min-width: 2px; border: 1px solid #fff; border-radius: 3px;
  overflow: hidden; white-space: nowrap; font-size: 12px; padding: 3px 2px; color: #fff; }
.region .role { display: block; font-size: 11px; opacity: .9; }
.region:hover { outline: 2px solid #222; } .region.start { border-left: 3px solid #222; }
.region .wide { display: none; }
@media (min-width: 1200px) { .region .wide { display: inline; } .region .wide.role { display: block; } }
.static { background: #2e8b57; } .dynamic { background: #e07b00; } .uncompiled { background: #8a8a8a; }
"""

_NARROWEST = 800 - 2 * 24 - 16
"""Pixels of the timeline row at the narrowest page the labels must fit (margins, a scroll bar)."""

_WIDE = 1200
"""From this page width on (a CSS media query) a box also shows a label that fits only there."""

_CHAR_PX = {"label": 8.0, "role": 7.0}
"""A generous width per character of a box's label (12 px) and role (11 px) text."""


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fits(text: str, px: float, kind: str) -> bool:
    return len(text) * _CHAR_PX[kind] + 8 <= px


def _timing(report: Any) -> dict[str, dict[str, Any]]:
    """Region id -> ``{"replay" | "capture" | "eager": {"calls", "total_ms", "mean_ms"}}``."""
    out: dict[str, dict[str, Any]] = {}
    for g in report.graphs:
        for name, parts in ((g.runtime or {}).get("timing") or {}).items():
            out[f"g{g.index}.{name}"] = parts
    return out


def _runtime(report: Any) -> dict[str, dict[str, Any]]:
    """Region id -> the static region's runtime counters (replays, eager calls by reason, ...)."""
    out: dict[str, dict[str, Any]] = {}
    for g in report.graphs:
        for name, counters in ((g.runtime or {}).get("regions") or {}).items():
            out[f"g{g.index}.{name.split('.', 1)[-1]}"] = counters
    return out


def _weights(report: Any, timing: dict[str, dict[str, Any]]) -> tuple[dict[str, float], str]:
    """Weight of each region id (all its runs in one call, or all calls with timing) and the unit."""
    if timing:
        return ({rid: sum(p["total_ms"] for p in parts.values()) for rid, parts in timing.items()},
                "ms measured (profile=True), all calls")
    launches = report.summary.get("launches") or {}
    if launches.get("basis") == "measured" and launches.get("by_region") is not None:
        return {k: float(v) for k, v in launches["by_region"].items()}, "measured launches of one call"
    return ({r.id: float(r.est_kernels) * g.runs_per_call for g in report.graphs for r in g.regions},
            "estimated kernels per call")


def _sequence(report: Any) -> tuple[list[dict[str, Any]], bool]:
    """The call's regions in execution order, and whether that order was measured; consecutive
    stretches of uncompiled code (one per source line in the data) are one step here, with
    ``parts``: [(source, ops)]."""
    launches = report.summary.get("launches") or {}
    if not (launches.get("basis") == "measured" and launches.get("sequence")):
        return [{"kind": "region", "id": r.id} for r in report.regions()], False
    steps: list[dict[str, Any]] = []
    for item in launches["sequence"]:
        if item["kind"] == "uncompiled" and steps and steps[-1]["kind"] == "uncompiled":
            steps[-1]["parts"].append((item["source"], item["ops"]))
        elif item["kind"] == "uncompiled":
            steps.append({"kind": "uncompiled", "parts": [(item["source"], item["ops"])]})
        else:
            steps.append(item)
    return steps, True


def _lines_text(parts: list[tuple[str, int]]) -> str:
    """"line 40" or "lines 32-38" of a stretch of uncompiled code (one file and function) or its
    first line's "file:line"."""
    lines = []
    for source, _ in parts:
        where = source.split(" in ")[0]
        number = where.rsplit(":", 1)[-1]
        lines.append(int(number) if number.isdigit() else None)
    known = [n for n in lines if n is not None]
    if not known:
        return "?"
    low, high = min(known), max(known)
    return f"line {low}" if low == high else f"lines {low}-{high}"


def _split_text(parts: dict[str, Any]) -> str:
    return ", ".join(f"{how} {t['calls']} x {t['mean_ms']} ms = {t['total_ms']} ms"
                     for how, t in sorted(parts.items()))


def _tooltip(region: Any, weight: float, unit: str, timing: Optional[dict[str, Any]],
             counters: Optional[dict[str, Any]]) -> str:
    lines = [f"{region.id}: {region.kind}, role {region.role}, {region.ops} ops, {weight:g} ({unit})",
             f"roles (ops, share): {roles_text(region.roles)}"]
    if timing:
        lines.append("time: " + _split_text(timing))
    if counters:
        eager = ", ".join(f"{k} {v}" for k, v in counters.get("eager_calls", {}).items()) or "none"
        lines.append(f"graphs {counters.get('graphs', 0)}, replays {counters.get('replays', 0)}, eager calls: {eager}")
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
            *summary_figures(s)]  # the text report's figures, in its words (figures.py)
    totals: dict[str, float] = {}
    for parts in _timing(report).values():
        for how, t in parts.items():
            totals[how] = totals.get(how, 0.0) + t["total_ms"]
    if totals:
        rows.append(("time in regions (profile=True)",
                     ", ".join(f"{how} {ms:.3f} ms" for how, ms in sorted(totals.items()))))
    return rows


def _hints(report: Any) -> list[str]:
    out = ['<section id="hints"><h2>Hints</h2>']
    if not report.hints:
        return out + ['<p class="note">none</p>', "</section>"]
    out.append("<ul>")
    for h in report.hints:
        option = hint_option(h)
        extra = (f"<br>set <code>{_e(option_cli(*option))}</code> or <code>cgbackend.compile(model, "
                 f"{_e(option_python(*option))})</code>" if option is not None else "")
        extra += f"<br>at <code>{_e(source_text(h['source']))}</code>" if h.get("source") else ""
        out.append(f'<li class="hint" data-kind="{_e(h["kind"])}"><span class="kind">{_e(h["kind"])}</span>: '
                   f"{_e(h['message'])}{extra}</li>")
    return out + ["</ul>", "</section>"]


def _breaks_and_notes(report: Any) -> list[str]:
    out = [f'<section id="breaks"><h2>Graph breaks ({len(report.graph_breaks)})</h2>']
    for brk in report.graph_breaks:
        where = f" at {brk['source']}" if brk.get("source") else ""
        headline = brk["reason"].split(":", 1)[0]
        out.append(f'<details class="break"><summary>graph break{_e(where)}: {_e(headline)}</summary>'
                   f"<p>{_e(brk['reason'])}</p></details>")
    if not report.graph_breaks:
        out.append('<p class="note">none</p>')
    for note in report.notes:
        out.append(f'<p class="note">note: {_e(note)}</p>')
    return out + ["</section>"]


def _labels(region: Any, px: float) -> tuple[str, str]:
    """A box's id and role text: what fits at the narrowest page always, what fits only from _WIDE
    px on in a span the CSS shows there, nothing that would be cut."""
    wide_px = px * (_WIDE - (800 - _NARROWEST)) / _NARROWEST
    label = role = ""
    if _fits(region.id, px, "label"):
        label = _e(region.id)
        if _fits(region.role, px, "role"):
            role = f'<span class="role">{_e(region.role)}</span>'
        elif _fits(region.role, wide_px, "role"):
            role = f'<span class="role wide">{_e(region.role)}</span>'
    elif _fits(region.id, wide_px, "label"):
        label = f'<span class="wide">{_e(region.id)}</span>'
        if _fits(region.role, wide_px, "role"):
            role = f'<span class="role wide">{_e(region.role)}</span>'
    return label, role


def _timeline(report: Any, weights: dict[str, float], unit: str, timing: dict[str, Any],
              counters: dict[str, Any]) -> list[str]:
    sequence, measured = _sequence(report)
    regions = {r.id: r for r in report.regions()}
    runs: dict[str, int] = {}
    for item in sequence:
        if item["kind"] == "region":
            runs[item["id"]] = runs.get(item["id"], 0) + 1
    launches = report.summary.get("launches") or {}
    sources = {s["source"]: s for s in launches.get("uncompiled_sources") or ()}
    per_op = {src: s["launches"] / max(sum(s["ops"].values()), 1) for src, s in sources.items()}

    def weight(item: dict[str, Any]) -> float:
        if item["kind"] == "region":
            return weights.get(item["id"], 0.0) / max(runs.get(item["id"], 1), 1)
        if not unit.startswith("measured launches"):
            return 0.0
        return sum(ops * per_op.get(source, 1.0) for source, ops in item["parts"])

    total = sum(weight(item) for item in sequence) or 1.0
    caption = (f"{count(len(sequence), 'step')} of one call as explain ran it: a graph that runs several times "
               "per call (a layer's graph once per layer) appears once per run, uncompiled code where it ran"
               if measured else
               f"{count(len(report.graphs), 'graph')} in the order Dynamo compiled them, each once (the order of one "
               "call was not measured: cgbackend.explain measures it)")
    out = ['<section id="timeline"><h2>Regions in the order they run in one call</h2>',
           '<div class="legend"><span><i class="swatch static"></i>static (CUDA graph)</span>'
           '<span><i class="swatch dynamic"></i>dynamic (eager)</span>'
           '<span><i class="swatch uncompiled"></i>uncompiled code (outside Dynamo\'s graphs)</span>'
           f"<span>width: {_e(unit)}; hover a box for its details</span></div>",
           f'<div class="graphlabel">{_e(caption)}; a dark edge starts another graph</div>', '<div class="row">']
    previous_graph = None
    for item in sequence:
        w = weight(item)
        px = _NARROWEST * w / total
        style = f"width:{100.0 * w / total:.3f}%"
        if item["kind"] == "uncompiled":
            tip = "uncompiled code (Dynamo left it to Python):\n" + "\n".join(
                f"{source}: {ops} launching op(s)  {sources.get(source, {}).get('code', '')}".rstrip()
                for source, ops in item["parts"][:12])
            tip += f"\n... {len(item['parts']) - 12} more lines" if len(item["parts"]) > 12 else ""
            line = _lines_text(item["parts"])
            label = _e(line) if _fits(line, px, "label") else ""
            out.append(f'<div class="region uncompiled" data-source="{_e(item["parts"][0][0])}" '
                       f'data-lines="{len(item["parts"])}" data-weight="{w:g}" style="{style}" '
                       f'title="{_e(tip)}">{label}</div>')
            previous_graph = None
            continue
        r = regions.get(item["id"])
        if r is None:
            continue
        graph = r.id.split(".", 1)[0]
        start = " start" if previous_graph is not None and graph != previous_graph else ""
        previous_graph = graph
        label, role = _labels(r, px)
        tip = _tooltip(r, w, unit, timing.get(r.id), counters.get(r.id))
        out.append(f'<div class="region {_e(r.kind)}{start}" data-id="{_e(r.id)}" data-kind="{_e(r.kind)}" '
                   f'data-weight="{w:g}" style="{style}" title="{_e(tip)}">{label}{role}</div>')
    return out + ["</div>", "</section>"]


_SHORT_UNIT = {"ms measured (profile=True), all calls": "ms, all calls",
               "measured launches of one call": "launches per call",
               "estimated kernels per call": "~kernels per call"}


def _table(report: Any, weights: dict[str, float], unit: str, timing: dict[str, Any],
           counters: dict[str, Any]) -> list[str]:
    """The regions, one row each: the runtime split first (after a run), then the sizes, modules and
    reasons; the table scrolls inside its box where the page is narrower."""
    head = ["<th>region</th><th>kind</th><th>role</th>"]
    if timing:
        head.append('<th class="num">eager ms</th><th class="num">replay ms</th><th class="num">capture ms</th>')
    if counters:
        head.append('<th class="num">replays</th><th>eager calls</th>')
    head.append(f'<th class="num">ops</th><th class="num">~kernels</th><th class="num">{_e(_SHORT_UNIT.get(unit, unit))}'
                "</th><th>modules</th><th>why eager</th>")
    out = ['<section id="details"><h2>Regions</h2><div class="scroll"><table id="regions">',
           f"<tr>{''.join(head)}</tr>"]
    for r in report.regions():
        cells = [f"<td>{_e(r.id)}</td><td>{_e(r.kind)}</td><td title=\"{_e(roles_text(r.roles))}\">{_e(r.role)}</td>"]
        if timing:
            parts = timing.get(r.id, {})
            cells.append("".join(f'<td class="num">{parts[how]["total_ms"]:.3f}</td>' if how in parts
                                 else '<td class="num">-</td>' for how in ("eager", "replay", "capture")))
        if counters:
            c = counters.get(r.id)
            eager = ", ".join(f"{k} {v}" for k, v in (c or {}).get("eager_calls", {}).items())
            cells.append(f'<td class="num">{c["replays"] if c else "-"}</td>'
                         f"<td>{_e(eager or ('-' if c else 'every call (dynamic)'))}</td>")
        why = "; ".join(f"{x['op']} [{x['rule']}] at {x['source'] or '?'} x{x['count']}" for x in r.reasons[:3])
        mods = ", ".join(r.module_paths[:4]) + (f" +{len(r.module_paths) - 4}" if len(r.module_paths) > 4 else "")
        cells.append(f'<td class="num">{r.ops}</td><td class="num">{r.est_kernels}</td>'
                     f'<td class="num">{weights.get(r.id, 0.0):g}</td>'
                     f'<td class="long">{_e(mods)}</td><td class="long">{_e(why)}</td>')
        out.append(f'<tr data-id="{_e(r.id)}">{"".join(cells)}</tr>')
    return out + ["</table></div></section>"]


def render_html(report: Any, title: str = "cgbackend partition report") -> str:
    timing = _timing(report)
    counters = _runtime(report)
    weights, unit = _weights(report, timing)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{_e(title)}</h1>"]
    for line in entry_text(report.traced_via, report.summary):
        out.append(f'<p class="entry">{_e(line.strip())}</p>')
    out.append('<section id="summary"><div class="scroll"><table>')
    for label, value in _summary_rows(report):
        out.append(f'<tr><td>{_e(label)}</td><td class="long">{_e(value)}</td></tr>')
    out.append("</table></div></section>")
    out.extend(_hints(report))
    out.extend(_breaks_and_notes(report))
    out.extend(_timeline(report, weights, unit, timing, counters))
    out.extend(_table(report, weights, unit, timing, counters))
    out.append("</body></html>")
    return "\n".join(out)
