"""Hints: what a user can change to graph more, read off a report and the analyses behind it.

Each hint is ``{"kind", "message", "option", "source"}``: ``option`` is the cgbackend option to
set, ``{"option": "static_dispatch", "value": "auto"}`` (null where the fix is a code change),
``source`` the user's line it is about, ``{"path", "line", "function", "code"}`` (the full path;
null where no line is known). The text names the option as a command-line flag
(``--option static_dispatch=auto``) and as Python (``cgbackend.compile(model,
static_dispatch="auto")``), both ready to paste (:func:`option_cli`, :func:`option_python`). Kinds:

* ``static_dispatch``: dynamic regions hold MoE dispatch loops that ``static_dispatch="auto"``
  rewrites. Found by running the passes again on a copy of each graph with that option (nothing
  else changes); the estimated launch coverage after scales each graph's launches (measured where
  the report measured them) by the rewritten graph's static kernel fraction.
* ``data_dependent_loop``: a graph break at a ``for`` loop over a tensor whose length is data
  dependent (``for e in mask.nonzero():``): Dynamo cannot unroll it and runs the rest of the frame
  uncompiled. Where static dispatch's loop rewrite (moe/source_rewrite.py) proves the loop
  equal to its fixed-length form, the hint names ``static_dispatch="auto"``; else a loop over
  ``range(E)`` has a fixed length (and the hint says why the rewrite declined).
* ``inner_compiler``: static regions run eager's kernels (``inner="eager"`` in effect);
  ``inner="inductor"`` fuses them.
* ``graph_memory``: a bucketed region's graph at its largest capture size is estimated
  (memory_estimate.py) at :data:`MEMORY_HINT_BYTES` or more and at least twice the graph the
  traced sizes use: ``max_capture_size`` at the traced sizes' capture size bounds the pool there
  (larger calls run the region's compiled code without a graph); fewer ``capture_sizes`` cut the
  static input copies every captured size keeps.
"""

from __future__ import annotations

import ast
import re
import shlex
from typing import Any, Optional

import torch.fx

from ..config import Config, DispatchMode
from ..common.wording import count
from ..common.fx_utils import copy_module, source_frame, source_location, user_function

__all__ = ["MEMORY_HINT_BYTES", "build_hints", "hint_option", "hints_text", "option_cli", "option_python",
           "source_text"]

MEMORY_HINT_BYTES = 256 * 2 ** 20
"""A bucketed region's largest graph from which the report suggests ``max_capture_size``."""

_FOR_LOOP = re.compile(r"^\s*for\s+.+?\s+in\s+(?P<iter>.+):\s*(#.*)?$")
_DATA_DEPENDENT = re.compile(r"data.dependent|unbacked|nonzero|dynamic shape operator|\bu\d+\b", re.I)
_DATA_DEPENDENT_ITER = re.compile(r"nonzero\(|\.unique\(|torch\.unique\(|torch\.where\(|\.tolist\(")


def _hint(kind: str, message: str, option: Optional[tuple[str, Any]] = None,
          source: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    return {"kind": kind, "message": message,
            "option": None if option is None else {"option": option[0], "value": option[1]},
            "source": source}


def option_cli(name: str, value: Any) -> str:
    """``--option name=value`` as the command line parses it (cli.py)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    else:
        text = str(value)
    return f"--option {shlex.quote(f'{name}={text}')}"


def option_python(name: str, value: Any) -> str:
    """``name="value"``: the keyword of cgbackend.compile / cgbackend.backend."""
    text = f'"{value}"' if isinstance(value, str) else repr(tuple(value) if isinstance(value, list) else value)
    return f"{name}={text}"


def hint_option(hint: dict[str, Any]) -> Optional[tuple[str, Any]]:
    """(name, value) of a hint's option; also reads the older one-string form ``name="value"``."""
    option = hint.get("option")
    if isinstance(option, dict):
        return option["option"], option["value"]
    if isinstance(option, str) and "=" in option:
        name, _, text = option.partition("=")
        try:
            return name.strip(), ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            return name.strip(), text.strip()
    return None


def source_text(source: Any) -> str:
    """"path:line in function" of a hint's source (older reports: the string itself)."""
    if isinstance(source, dict):
        return f"{source['path']}:{source['line']} in {source['function']}"
    return source or ""


def _frame_of(analyses: list, where: str) -> Optional[dict[str, Any]]:
    """The full frame of the first node whose short source ("gpt.py:40 in forward") is ``where``."""
    for analysis in analyses:
        for node in analysis.gm.graph.nodes:
            if where and source_location(node)[0] == where:
                return source_frame(node)
    return None


def _static_fraction(analysis: Any) -> float:
    from ..passes.launch_estimate import estimate_kernels
    static = total = 0
    for region in analysis.partition.regions:
        k = sum(estimate_kernels(n) for n in region.nodes)
        total += k
        if region.is_static:
            static += k
    return static / total if total else 1.0


def _static_dispatch_hint(report: Any, analyses: list, config: Config) -> Optional[dict[str, Any]]:
    if config.static_dispatch.enabled or not analyses:
        return None
    from ..passes.pipeline import analyze
    auto = config.replace(static_dispatch=DispatchMode.AUTO)
    rewrites = regions_before = regions_after = 0
    fractions = []
    where = ""
    for analysis in analyses:
        try:
            after = analyze(copy_module(analysis.gm), auto, training=analysis.classification.training,
                            compute_device=analysis.classification.compute_device)
        except Exception:  # an estimate: a graph the copy cannot analyze gets no hint
            return None
        rewrites += len(after.dispatch.rewrites)
        where = where or next((r.source for r in after.dispatch.rewrites if r.source), "")
        regions_before += len(analysis.partition.dynamic_regions())
        regions_after += len(after.partition.dynamic_regions())
        fractions.append(_static_fraction(after) if after.dispatch.rewrites else None)
    if not rewrites:
        return None
    summary = report.summary
    launches = summary.get("launches") or {}
    by_region = launches.get("by_region") or {}
    # as launch_coverage: 1 - (launches left outside graphs) / (the call's launches)
    outside = total = 0.0
    for g, fraction in zip(report.graphs, fractions):
        n = sum(by_region.get(r.id, r.est_kernels if not by_region else 0) for r in g.regions)
        static_now = sum(by_region.get(r.id, r.est_kernels if not by_region else 0)
                         for r in g.regions if r.kind == "static")
        outside += n * (1.0 - fraction) if fraction is not None else n - static_now
        total += n
    measured = launches.get("basis") == "measured"
    if measured:
        outside += launches.get("uncompiled") or 0
        total += launches.get("uncompiled") or 0
    estimate = 1.0 - outside / total if total else 0.0
    now = summary.get("launch_coverage")
    now_text = f", now {100 * now:.0f}%" if now is not None else ""
    regions = regions_before - regions_after
    return _hint(
        "static_dispatch",
        f"{regions} dynamic region(s) hold {rewrites} MoE dispatch loop(s) that static_dispatch=\"auto\" "
        f"rewrites into static code (masked dense; outputs equal the loop's): estimated launch coverage "
        f"after {100 * estimate:.0f}%{now_text}",
        option=("static_dispatch", "auto"), source=_frame_of(analyses, where))


def _break_site(gm: torch.fx.GraphModule) -> Optional[tuple[str, str, str, dict[str, Any]]]:
    """(source, code, reason, frame) of the graph break that ended this graph, if it ended at one."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = getattr(reason, "user_stack", None) or []
    if not stack:
        return None
    frame = stack[-1]
    base = str(frame.filename).replace("\\", "/").rsplit("/", 1)[-1]
    code = (getattr(frame, "line", None) or "").strip()
    name = user_function(str(frame.name))
    full = {"path": str(frame.filename), "line": int(frame.lineno), "function": name, "code": code}
    return f"{base}:{frame.lineno} in {name}", code, str(getattr(reason, "reason", "")), full


def _loop_hints(report: Any, analyses: list, loops: list) -> list[dict[str, Any]]:
    """``loops``: loop_forwards.survey's records (what static dispatch's loop rewrite would do)."""
    by_source = {r.source: r for r in loops}
    hints, seen = [], set()
    launches = report.summary.get("launches") or {}
    uncompiled = launches.get("uncompiled")
    for analysis in analyses:
        site = _break_site(analysis.gm)
        if site is None:
            continue
        source, code, reason, frame = site
        match = _FOR_LOOP.match(code)
        if match is None or source in seen:
            continue
        if not (_DATA_DEPENDENT.search(reason) or _DATA_DEPENDENT_ITER.search(match.group("iter"))):
            continue
        seen.add(source)
        cost = f" ({count(uncompiled, 'launch')} of a call ran uncompiled)" if uncompiled else ""
        what = (f"this graph break comes from iterating a data-dependent tensor at {source} (`{code}`): "
                f"Dynamo cannot unroll a loop whose length only the device knows, so the rest of the frame "
                f"runs uncompiled{cost}. ")
        survey = by_source.get(source)
        if survey is not None and survey.form:
            hints.append(_hint(
                "data_dependent_loop",
                what + f"static_dispatch=\"auto\" rewrites this loop ({survey.form}: proven to skip only "
                f"experts whose body has no effect) into the fixed-length loop over every expert before "
                f"tracing, and then the dispatch into static code", option=("static_dispatch", "auto"),
                source=frame))
            continue
        declined = (f" (static dispatch's loop rewrite leaves it as written: {survey.reason})"
                    if survey is not None and survey.reason else "")
        hints.append(_hint(
            "data_dependent_loop",
            what + f"Iterating over `range(E)` instead (every expert; one that received no token "
            f"contributes nothing) gives the loop a fixed length, so cgbackend can graph it and "
            f"static_dispatch=\"auto\" can rewrite the dispatch{declined}",
            source=frame))
    return hints


def _inner_hint(report: Any, config: Config) -> Optional[dict[str, Any]]:
    if config.inner != "eager" or not report.summary.get("static_regions"):
        return None
    return _hint(
        "inner_compiler",
        f"the {report.summary['static_regions']} static region(s) run eager's kernels inside their graphs "
        f"(inner=\"eager\" in effect, bitwise equal to eager); inner=\"inductor\" compiles them first: "
        f"fused kernels, fewer launches per replay, results within rounding of eager",
        option=("inner", "inductor"))


def _memory_hint(report: Any, config: Config) -> Optional[dict[str, Any]]:
    """The bucketed region whose largest graph is the largest, where a max_capture_size at the
    traced sizes would cut it at least in half (see the module docstring)."""
    best = None
    for region in report.regions():
        memory = region.memory
        if len(memory) < 2 or memory[0]["size"] is None:
            continue
        largest = max(memory, key=lambda m: m["bytes"])
        traced = next((m for m in memory if m["traced"]), None)
        if traced is None or traced["size"] >= largest["size"] or largest["bytes"] < MEMORY_HINT_BYTES \
                or largest["bytes"] < 2 * traced["bytes"]:
            continue
        if config.max_capture_size and config.max_capture_size <= traced["size"]:
            continue
        if best is None or largest["bytes"] > best[1]["bytes"]:
            best = (region, largest, traced, sum(m["copied_input_bytes"] for m in memory), len(memory))
    if best is None:
        return None
    region, largest, traced, copies, sizes = best
    mib = 2 ** 20
    return _hint(
        "graph_memory",
        f"{region.id}'s graphs grow with its padded size: about {largest['bytes'] / mib:.0f} MiB of pool at "
        f"capture size {largest['size']}, {traced['bytes'] / mib:.1f} MiB at {traced['size']} (the size traced "
        f"here; estimates before capture). max_capture_size={traced['size']} keeps the pool there: a call "
        f"above it runs the region's compiled code without a graph (counted). Each captured size also keeps "
        f"its own copies of the inputs, {copies / mib:.1f} MiB over all {sizes} sizes: fewer capture_sizes "
        f"cut those", option=("max_capture_size", traced["size"]))


def build_hints(report: Any, analyses: list, config: Config, loops: Optional[list] = None) -> list[dict[str, Any]]:
    """Hints for a report built from ``analyses`` (in graph order) under ``config``; ``loops``:
    what static dispatch's loop rewrite would do to the model's loops (loop_forwards.survey)."""
    hints = []
    dispatch = _static_dispatch_hint(report, analyses, config)
    if dispatch is not None:
        hints.append(dispatch)
    hints.extend(_loop_hints(report, analyses, loops or []))
    inner = _inner_hint(report, config)
    if inner is not None:
        hints.append(inner)
    memory = _memory_hint(report, config)
    if memory is not None:
        hints.append(memory)
    return hints


def hints_text(hints: list[dict[str, Any]]) -> list[str]:
    """The text report's hints: the message, then the option to paste (command line and Python)
    and the line it is about."""
    if not hints:
        return []
    lines = ["  hints:"]
    for h in hints:
        lines.append(f"    - [{h['kind']}] {h['message']}")
        option = hint_option(h)
        if option is not None:
            lines.append(f"{'':<8}set: {option_cli(*option)}  or  cgbackend.compile(model, "
                         f"{option_python(*option)})")
        if h.get("source"):
            lines.append(f"{'':<8}at: {source_text(h['source'])}")
    return lines
