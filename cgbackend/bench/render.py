"""The bench's output: the run's metadata, the stdout table, the Markdown tables and the JSON file."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .cases import Case
from .contenders import CONTENDERS
from .measure import sanitize
from .settings import Settings
from .verdict import verdict_cell

SCHEMA_VERSION = 1
"""Version of the results file's layout (``meta.schema_version``)."""


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine() or "cpu"
    return f"CPU ({name}, {os.cpu_count()} cores)"


def command_line(argv: Sequence[str]) -> str:
    orig = list(getattr(sys, "orig_argv", []) or [])
    argv = list(argv)
    tail_matches = orig[-len(argv):] == argv if argv else bool(orig) and orig[-1].endswith(("bench", "run.py"))
    if orig and tail_matches:
        return shlex.join(orig)
    return shlex.join(["python", "-m", "cgbackend", "bench", *argv]) + "  # called in-process"


def build_meta(settings: Settings, argv: Sequence[str], cases: list[Case],
               skipped: Optional[list[dict[str, Any]]] = None, rows: Sequence[dict[str, Any]] = ()
               ) -> dict[str, Any]:
    from .models import MODELS
    _ran = {r["contender"] for r in rows}
    try:
        import cgbackend
        version = cgbackend.__version__
    except Exception:
        version = None
    return {
        "schema": SCHEMA_VERSION,
        "device": device_name(settings.device),
        "device_type": settings.device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cgbackend": version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat(),
        "command": command_line(argv),
        "argv": list(argv),
        "settings": settings.to_meta(),
        "timing": ("CUDA events around each call, synchronized before and after" if settings.device.type == "cuda"
                   else "time.perf_counter around each call"),
        "compile_s": "sum of the --warmup call times minus --warmup x median_ms",
        "floor": {c.key: {"floor_ms": c.floor_ms, "error": c.floor_error} for c in cases},
        "reference64": {c.key: {"seconds": c.ref64_s, "eager_err": {g: e for g, (e, _) in c.eager64.items()},
                                "eager_routing_flip_frac": c.eager_flips, "error": c.ref64_error}
                        for c in cases if c.ref64 or c.ref64_error},
        "contenders": {name: c.description for name, c in CONTENDERS.items()
                       if name in settings.contenders or name in _ran},
        "models": {name: MODELS[name].description for name in settings.models},
        "skipped": list(skipped or []),
    }


def fmt(value: Any, spec: str = ".3f", none: str = "-") -> str:
    if value is None:
        return none
    if spec == "ratio" and isinstance(value, float):
        return format(value, ".2f") if value >= 0.1 else format(value, ".2g")
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def mib(value: Optional[int]) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def acc(row: dict[str, Any]) -> str:
    """"ok 1.3x64" (fp64 rule: worst error against float64 over eager's own), or "ok 3.0e-03" (error
    against eager, --tol rule); ", flips 0.4%" for MoE routing that differs from float64's."""
    flips = row.get("routing_flip_frac")
    tail = "" if flips is None else f", flips {flips:.1%}"
    if row.get("tokens_equal_frac") is not None:
        tail += f", tokens {row['tokens_equal_frac']:.0%}"
    if row["accuracy_ok"] is None:
        return "-" + tail
    verdict = "ok" if row["accuracy_ok"] else "FAIL"
    if row.get("accuracy_rule") == "fp64":
        ratio = row.get("ref64_ratio")
        return f"{verdict} {'inf' if ratio is None or math.isinf(ratio) else format(ratio, '.2f')}x64" + tail
    err = "inf" if row["accuracy_err"] is None else f"{row['accuracy_err']:.1e}"
    return f"{verdict} {err}" + tail


_COLUMNS = ("contender", "median ms", "p10", "p90", "x eager", "x best stock", "x floor", "accuracy",
            "peak / held MiB", "compile s", "graphs", "breaks", "error")


def _memory(row: dict[str, Any]) -> str:
    """Peak memory, and what the contender holds between calls or steps over its start (rows of
    older runs have no held figure)."""
    return f"{mib(row['peak_mem_bytes'])} / {mib(row.get('held_mem_over_baseline_bytes'))}"


_YARDSTICK_COLUMNS = (("x grouped", "grouped"), ("x reduce-overhead", "reduce_overhead"))
"""Ratio columns a table shows only where a row of it has a verdict against that contender (rows of
runs before verdicts show none)."""


def _ratio(row: dict[str, Any], key: str) -> str:
    """``ratio_to_<key>`` with its verdict where the row has one: ``1.02 (tie)``."""
    return verdict_cell(fmt(row.get(f"ratio_to_{key}"), "ratio"), row, key)


def _yardsticks(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(title, key) for title, key in _YARDSTICK_COLUMNS if any(r.get(f"verdict_{key}") for r in rows)]


def _spread(rows: list[dict[str, Any]]) -> str:
    """The case's harness resolution, from its ``--twin`` rows (empty without one)."""
    spread = next((r["harness_spread"] for r in rows if r.get("harness_spread") is not None), None)
    twins = ", ".join(r["contender"] for r in rows if r["contender"].endswith(":twin"))
    return "" if spread is None else f"{spread:.1%} ({twins})"


def _cells(row: dict[str, Any], extra: Sequence[tuple[str, str]] = ()) -> list[str]:
    name = row["contender"] + (" *" if row.get("beats_best_stock") else "")
    return [name, fmt(row["median_ms"]), fmt(row["p10_ms"]), fmt(row["p90_ms"]),
            _ratio(row, "eager"), _ratio(row, "best_stock"), fmt(row["ratio_to_floor"], "ratio"),
            *(_ratio(row, key) for _, key in extra), acc(row), _memory(row),
            fmt(row["compile_s"], ".2f"), fmt(row["graphs"]), fmt(row["graph_breaks"]),
            (row["error"] or "")[:80]]


def _groups(rows: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """(title, rows) per model x mode (x token count for the shape and hf models, x batch for decode)
    x device: the groups of one model, mode and size on several devices follow each other, and
    their titles name the device where the rows come from more than one."""
    out: dict[tuple[Any, ...], dict[Any, list[dict[str, Any]]]] = {}
    for row in rows:
        out.setdefault((row["model"], row["mode"], row.get("tokens")), {}).setdefault(
            row.get("device"), []).append(row)
    several = len({row.get("device") for row in rows}) > 1
    titles = []
    for (model, mode, tokens), by_device in out.items():
        for device, group in by_device.items():
            family = group[0].get("family")
            what = (f" / {tokens} tokens" if family in ("shape", "hf") else f" / batch {tokens}"
                    if family == "decode" else "")
            on = f" / {device}" if several and device else ""
            titles.append((f"{model} / {mode}" + (what if tokens is not None else "") + on, group))
    return titles


def render_table(results: dict[str, Any]) -> str:
    """Plain-text tables (one per model x mode) for stdout."""
    meta = results["meta"]
    lines = [f"device: {meta['device']}  torch {meta['torch']}  {meta['date']}",
             f"command: {meta['command']}"]
    for title, rows in _groups(results["rows"]):
        floor = rows[0]["floor_ms"]
        best = rows[0].get("best_stock")
        lines.append("")
        spread = _spread(rows)
        lines.append(f"== {title}   floor {fmt(floor)} ms   best stock: {best or '-'}"
                     + (f"   harness spread {spread}" if spread else ""))
        extra = _yardsticks(rows)
        header = [*_COLUMNS[:7], *(t for t, _ in extra), *_COLUMNS[7:]]
        table = [header] + [_cells(r, extra) for r in rows]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        left = {i for i, h in enumerate(header) if h in ("contender", "accuracy", "error")}
        for i, cells in enumerate(table):
            lines.append("  ".join(c.ljust(w) if j in left else c.rjust(w)
                                   for j, (c, w) in enumerate(zip(cells, widths))).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("x = median / reference median (below 1 is faster); * = faster than the best stock "
                 "contender with accuracy ok; accuracy 'ok 1.3x64' = worst error against the float64 run "
                 "over eager's own (limit 2); decode rows: ms per token; (tie): the per-block ratios span 1, "
                 "or the ratio is within the harness spread of --twin")
    return "\n".join(lines)


def _devices(results: dict[str, Any]) -> str:
    """The devices the rows were measured on (several after ``--append`` runs on other GPUs)."""
    names = list(dict.fromkeys(r.get("device") for r in results["rows"] if r.get("device")))
    return ", ".join(names) if names else results["meta"]["device"]


def _letter(run: int) -> str:
    """A run's label in RESULTS.md (A for meta.runs[0], ...)."""
    return chr(ord("A") + run) if run < 26 else str(run)


def _run_lines(results: dict[str, Any]) -> list[str]:
    runs = _runs(results)
    if len(runs) == 1:
        return [f"- date: {runs[0]['date']}", f"- command: `{runs[0]['command']}`"]
    lines = ["- runs (merged with `--append`; each table names its run):"]
    lines += [f"  {_letter(i)}. {r['date']}, {r['device']}, torch {r['torch']}: `{r['command']}`"
              for i, r in enumerate(runs)]
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    """RESULTS.md: header (device, torch, date, command) and one table per model x mode."""
    meta = results["meta"]
    s = meta.get("settings", {})
    merged = len(_runs(results)) > 1
    out = ["# Benchmark results", "",
           "Generated by `cgbackend.bench` from the JSON results; see `benchmarks/README.md` for what each "
           "column measures.", "",
           f"- device: {_devices(results)}",
           f"- torch: {meta['torch']}" + (f" (CUDA {meta['cuda']})" if meta.get("cuda") else ""),
           f"- cgbackend: {meta.get('cgbackend')}",
           *_run_lines(results),
           ("- the last run's settings: " if merged else "- ")
           + f"dtype {s.get('dtype')}, batch {s.get('batch')}, seq {s.get('seq')}, {s.get('batches')} "
           f"distinct batches, {s.get('warmup')} warm-up + {s.get('iters')} timed calls, size "
           f"{s.get('size')} {s.get('size_overrides') or ''}".rstrip(),
           f"- timing: {meta.get('timing')}; ratios are median / reference median (below 1 is faster)",
           ""]
    for title, rows in _groups(results["rows"]):
        run = rows[0].get("run")
        out.append(f"## {title}" + (f" (run {_letter(run)})" if run is not None and merged else ""))
        out.append("")
        spread = _spread(rows)
        out.append(f"Eager kernel-time floor: {fmt(rows[0]['floor_ms'])} ms/step. "
                   f"Best stock contender: {rows[0].get('best_stock') or '-'}."
                   + (f" Harness spread: {spread}." if spread else ""))
        out.append("")
        extra = _yardsticks(rows)
        header = ["contender", "median ms", "p10 / p90 ms", "x eager", "x best stock", "x floor",
                  *(t for t, _ in extra), "accuracy", "peak / held MiB", "compile s", "graphs", "graph breaks",
                  "error"]
        out.append("| " + " | ".join(header) + " |")
        out.append("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            name = f"**{r['contender']}**" if r.get("beats_best_stock") else r["contender"]
            err = (r["error"] or "").replace("|", "\\|")[:120]
            cells = [name, fmt(r["median_ms"]), f"{fmt(r['p10_ms'])} / {fmt(r['p90_ms'])}",
                     _ratio(r, "eager"), _ratio(r, "best_stock"), fmt(r["ratio_to_floor"], "ratio"),
                     *(_ratio(r, key) for _, key in extra), acc(r), _memory(r),
                     fmt(r["compile_s"], ".2f"), fmt(r["graphs"]), fmt(r["graph_breaks"]), err]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out.append("Bold: faster than the best stock contender, with accuracy ok. Accuracy `ok 1.31x64`: worst error "
               "against the float64 run over eager's own (limit 2); `ok 3.0e-03`: error against eager "
               "(--reference eager); flips: MoE routing that differs from float64's; tokens: decode tokens "
               "equal to eager's. Decode rows: ms per token. A verdict after a ratio, `1.02 (tie)`: a tie where "
               "the ratios within the alternating timing blocks span 1 or the ratio is within the harness "
               "spread (a `--twin` against its original), else faster or slower.")
    out.append("")
    if results.get("serving"):  # serve-bench --append: its own run, settings and table
        out.append(render_serving(results["serving"], level="##"))
    if results.get("te"):  # benchmarks/te_bench.py --append: one run per FP8 recipe
        out.append(render_te(results["te"], level="##"))
    if results.get("multigpu"):  # bench-dist --append: its runs, one table
        out.append(render_multigpu(results["multigpu"], level="##"))
    return "\n".join(out)


def _calls(calls: Optional[dict]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) if calls else "-"


def _multigpu_cells(r: dict[str, Any], letter: str) -> list[str]:
    if r.get("error"):
        acc_cell = "skipped" if r["error"].startswith("skipped") else "FAILED"
    elif r["contender"] == "eager":
        acc_cell = "reference"
    else:
        acc_cell = (f"{'ok' if r['accuracy_ok'] else 'FAIL'} {r['loss_rel_err']:.1e} / "
                    f"{r['grad_rel_err']:.1e}")
    graphs = "-" if r.get("graphs") is None else (
        f"{r['graphs']} ({'constant' if r.get('graphs_constant_after_warmup') else 'CHANGED'})")
    calls = _calls(r.get("eager_calls"))
    if r.get("eager_calls_timed"):
        calls += f"; timed: {_calls(r['eager_calls_timed'])}"
    spread = (f" ({fmt(r.get('p10_ms'), '.2f')}-{fmt(r.get('p90_ms'), '.2f')})"
              if r.get("median_ms") is not None else "")
    model = r["model"] + (f" ({r['local_dispatch']})" if r.get("local_dispatch") else "")
    note = (r.get("error") or r.get("memory_error") or "").replace("|", "\\|")[:120]
    peak = fmt(r.get("peak_mb"), ".0f") + (f" ({fmt(r['reserved_mb'], '.0f')})" if r.get("reserved_mb") else "")
    return [r["setup"], model, fmt(r.get("layers")), fmt(r.get("tokens_per_rank")), r["contender"],
            fmt(r.get("median_ms"), ".2f") + spread, fmt(r.get("vs_eager"), "ratio"),
            fmt(r.get("vs_grouped_inductor"), "ratio"), acc_cell, graphs, calls, peak,
            fmt(r.get("peak_vs_eager"), "ratio"), fmt(r.get("alloc_after_fwd_mb"), ".0f"), letter, note]


def render_multigpu(section: dict[str, Any], level: str = "#") -> str:
    """The multi-GPU training rows (``multigpu`` section of ``latest.json``, written by
    ``bench-dist --append``): the runs (device, date, command), then one row per setup x model x
    contender."""
    meta = section["meta"]
    runs = _runs(section)
    out = [f"{level} Multi-GPU training (bench-dist)", "",
           f"{meta.get('world_size')} ranks, {meta.get('dtype')}; per scenario every contender in one run: "
           f"{meta.get('compare_steps')} steps compared with eager (loss and every gradient), then "
           f"{meta.get('timed_steps')} timed steps each in {meta.get('timing_blocks', 5)} alternating blocks (each "
           "step synchronized, ranks aligned before it; a step's time is its slowest rank's); peak memory read "
           "with only that contender resident. See benchmarks/README.md (bench-dist).", ""]
    out += [f"- run {_letter(i)}: {r['date']}, {r['device']}, torch {r['torch']}: `{r['command']}`"
            for i, r in enumerate(runs)]
    out.append("")
    header = ["setup", "model", "layers", "tokens / rank", "contender", "median ms (p10-p90)", "x eager",
              "x grouped-inductor", "accuracy (loss / grad rel. err)", "graphs", "eager calls", "peak MiB (reserved)",
              "peak x eager", "MiB after fwd", "run", "note"]
    out.append("| " + " | ".join(header) + " |")
    out.append("|" + "|".join("---" for _ in header) + "|")
    for r in section["rows"]:
        out.append("| " + " | ".join(_multigpu_cells(r, _letter(r.get("run", 0)))) + " |")
    out.append("")
    return "\n".join(out)


TE_RECIPES = {"delayed": "DelayedScaling", "current": "Float8CurrentScaling", "off": "off (bf16)"}


def render_te(te: dict[str, Any], level: str = "#") -> str:
    """The Transformer Engine training rows (``te`` section of ``latest.json``, written by
    ``benchmarks/te_bench.py --append``): one table, a row per FP8 recipe and contender."""
    out = [f"{level} Transformer Engine training step", ""]
    first = next(iter(te.values()))["meta"]
    out.append(f"{first['layers']} x te.TransformerLayer(1024, 4096, 16), {first['seq']} x {first['batch']} "
               "tokens, forward, float32 mean-square loss and backward; median of "
               f"{first['steps']} timed steps. Memory in MiB over what was allocated before the contender "
               "was made: peak over its warm-up and timed steps, and held after a step.")
    out.append("")
    out.append("| recipe | contender | median ms | x eager | x TE-graphed | peak MiB | peak x TE-graphed "
               "| held MiB | loss / grad rel. error | ok | device, torch, TE, date |")
    out.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for recipe, run in te.items():
        meta = run["meta"]
        where = f"{meta['device']}, {meta['torch']}, TE {meta['transformer_engine']}, {meta['date']}"
        for r in run["rows"]:
            cells = [TE_RECIPES.get(recipe, recipe), r["contender"], fmt(r["median_ms"]), fmt(r["vs_eager"]),
                     fmt(r["vs_te_graphed"]), mib(r["peak_mem_over_baseline_bytes"]),
                     fmt(r["peak_vs_te_graphed"]), mib(r["held_mem_over_baseline_bytes"]),
                     f"{r['loss_rel_err']:.1e} / {r['grad_rel_err']:.1e}", "yes" if r["accuracy_ok"] else "NO", where]
            out.append("| " + " | ".join(cells) + " |")
    out.append("")
    commands = sorted({run["meta"]["command"] for run in te.values()})
    out.append("Commands: " + "; ".join(f"`{c}`" for c in commands))
    out.append("")
    return "\n".join(out)


def render_serving(results: dict[str, Any], level: str = "#") -> str:
    """The serving results as Markdown: a heading at ``level``, the run's settings, one table row per
    model and contender (serve-bench's ``SERVING.md``; ``RESULTS.md`` renders the ``serving`` section of
    ``latest.json`` with ``level="##"``)."""
    meta = results["meta"]
    extra = any("first_request_ms" in r for r in results["rows"])  # (results written before it: without)
    judged = ("each judged against a float64 run: at most 2x eager's own error" if meta.get("reference") == "fp64"
              else "each checked against eager")
    lines = [f"{level} Serving loop: random batch sizes 1..{meta['max_batch']}", "",
             f"- device: {meta['device']}; torch {meta['torch']}; date {meta['date']}",
             f"- command: `{meta['command']}`",
             f"- {meta['calls']} warm calls ({judged}), then {meta['calls']} timed calls "
             f"with new draws; seq {meta['seq']}, dtype {meta['dtype']}, size {meta['size']}", "",
             "| model | contender | timed loop s | ms/call | vs eager | accuracy | graphs (bound) | "
             "static regions | bucketed | eager calls | evicted |" + (" first request ms | warm-up s (graph MiB) |" if extra else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if extra else "")]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['contender']} | failed: {r['error']} |" + " |" * (10 if extra else 8))
            continue
        graphs = str(r.get("graphs_captured", "-"))
        if "graph_bound" in r:
            graphs += f" ({r['graph_bound']})"
        if r["contender"] == "eager":
            acc = "-"
        elif r.get("accuracy_rule") == "fp64":
            acc = f"{'ok' if r['accuracy_ok'] else 'FAIL'} {r['ref64_ratio']:.2f}x64 ({r['accuracy_err']:.1e})"
        else:  # against eager (rows written before the float64 rule: without accuracy_rule)
            acc = f"{'ok' if r['accuracy_ok'] else 'FAIL'} {r['accuracy_err']:.1e}"
        eager_calls = ", ".join(f"{k} {v}" for k, v in r.get("eager_calls", {}).items()) or "-"
        warm = "-"
        if "warm_up_s" in r:
            warm = f"{r['warm_up_s']:.2f} ({r['graph_memory_bytes'] / 2**20:.1f}"
            if r.get("graph_memory_vs_largest") is not None:  # (rows written before it: without)
                warm += f"; largest size alone {r['largest_alone_bytes'] / 2**20:.1f}, {r['graph_memory_vs_largest']}x"
            warm += ")"
        lines.append(f"| {r['model']} | {r['contender']} | {r['loop_s']:.3f} | {r['ms_per_call']:.3f} | "
                     f"{r.get('vs_eager', '-')} | {acc} | {graphs} | {r.get('static_regions', '-')} | "
                     f"{r.get('bucketed_regions', '-')} | {eager_calls} | {r.get('graphs_evicted', '-')} |"
                     + (f" {r.get('first_request_ms', '-')} | {warm} |" if extra else ""))
    return "\n".join(lines) + "\n"


_RUN_KEYS = ("command", "device", "torch", "cuda", "date")


def _runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    meta = results["meta"]
    return meta.get("runs") or [{k: meta.get(k) for k in _RUN_KEYS}]


def _bench_key(row: dict[str, Any]) -> tuple:
    return row.get("device"), row["model"], row["mode"], row["contender"], row.get("tokens")


def _with_devices(results: dict[str, Any]) -> None:
    """Rows written before rows named their device take their run's (``meta.runs``)."""
    runs = _runs(results)
    for row in results["rows"]:
        if row.get("device") is None:
            run = row.get("run", 0)
            row["device"] = runs[run].get("device") if 0 <= run < len(runs) else results["meta"].get("device")


def multigpu_key(row: dict[str, Any]) -> tuple:
    """What a bench-dist row measures: a later run's row of the same key replaces it."""
    return row["setup"], row["model"], row.get("local_dispatch"), row.get("layers"), row["contender"]


def merge_runs(old: dict[str, Any], new: dict[str, Any], key: Callable[[dict[str, Any]], tuple] = _bench_key
               ) -> dict[str, Any]:
    """``bench --append``: ``new``'s rows added to ``old``'s. An old row of the same ``key`` (model,
    mode, contender and token count) is replaced; every row keeps ``run``, its index in
    ``meta.runs``. bench-dist merges its section the same way (``key=multigpu_key``). A bench row's
    key includes its ``device``: a run on one GPU replaces only that GPU's rows."""
    _with_devices(old)
    _with_devices(new)
    runs = _runs(old)
    for row in old["rows"]:
        row.setdefault("run", 0)
    index = len(runs)
    runs.append({k: new["meta"].get(k) for k in _RUN_KEYS})
    fresh = {key(r) for r in new["rows"]}
    rows = [r for r in old["rows"] if key(r) not in fresh] + [dict(r, run=index) for r in new["rows"]]
    used = sorted({r["run"] for r in rows})
    renumber = {old_i: i for i, old_i in enumerate(used)}
    for r in rows:
        r["run"] = renumber[r["run"]]
    meta = dict(new["meta"], runs=[runs[i] for i in used])
    merged = {"meta": meta, "rows": rows}
    for section in ("serving", "te", "multigpu"):  # the other modes' sections stay until they replace them
        if section in old:
            merged[section] = old[section]
    return merged


def read_results(path: Path) -> dict[str, Any]:
    """The bench results file an ``--append`` of another mode stores its section in, or SystemExit
    saying why it cannot."""
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--append {path}: not a readable bench results file ({type(exc).__name__}: {exc})")
    if not (isinstance(results, dict) and "rows" in results and "schema" in results.get("meta", {})):
        raise SystemExit(f"--append {path}: not a bench results file (no 'rows', or no 'schema' in its "
                         "'meta'; `python -m cgbackend bench --out` writes one)")
    return results


def write_json(results: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(sanitize(results), indent=2, allow_nan=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
