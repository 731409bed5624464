"""Timing contenders: each is prepared (compiled, warmed up, judged for accuracy), then timed alone
or in alternating blocks with the case's other contenders, and its row filled with medians,
percentiles, counts and memory."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch

from ..runtime.capture import clear_blas_workspaces
from .cases import Case, Runner, STATS_KEYS, empty_row, judge_row, new_model, skip_reason, timed_iterations
from .contenders import Contender, GROUPED_CONTENDERS, STOCK_CONTENDERS, YARDSTICKS
from .measure import (by_first_line, cleanup, counter, cudagraph_tree_counts, error_text, graph_breaks, log,
                      memory_baseline, percentile, sync, PeakWindow)
from .settings import Settings
from .verdict import block_medians, contender_named, put_verdicts


class Tally:
    """Dynamo's and Inductor's global counters, read around the windows in which one contender ran
    (its compile, warm-up and accuracy calls, then each of its timing blocks): the row's counts are
    the sums of its own windows' deltas, whatever other contenders ran between them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.breaks: dict[str, int] = {}
        self.unique_graphs = self.cudagraph_skips = 0
        self.frames: dict[Any, int] = {}
        self.tree_graphs: Optional[int] = 0
        self.rerecords: Optional[int] = 0
        self._before: Optional[tuple] = None

    def _read(self) -> tuple:
        return (graph_breaks(), counter("stats", "unique_graphs"), counter("inductor", "cudagraph_skips"),
                _frame_compiles(), cudagraph_tree_counts(self.device))

    def __enter__(self) -> "Tally":
        self._before = self._read()
        return self

    def __exit__(self, *exc: Any) -> None:
        (breaks0, unique0, skips0, frames0, trees0), (breaks1, unique1, skips1, frames1, trees1) = \
            self._before, self._read()
        _add_increases(self.breaks, breaks0, breaks1)
        self.unique_graphs += unique1 - unique0
        self.cudagraph_skips += skips1 - skips0
        if frames0 is None or frames1 is None:
            self.frames = None  # type: ignore[assignment]
        elif self.frames is not None:
            _add_increases(self.frames, frames0, frames1)
        for i, name in enumerate(("tree_graphs", "rerecords")):
            a, b, total = trees0[i], trees1[i], getattr(self, name)
            setattr(self, name, None if None in (a, b, total) else total + b - a)

    def graph_breaks(self) -> tuple[int, dict[str, int]]:
        """The total and the count per reason (first line)."""
        return by_first_line(self.breaks)

    def recompiles(self) -> Optional[int]:
        """Compiles of a frame beyond its first, in this contender's windows."""
        return None if self.frames is None else int(sum(max(0, n - 1) for n in self.frames.values()))


def _add_increases(into: dict, before: dict, after: dict) -> None:
    """Adds to ``into`` each count of ``after`` by which it grew since ``before``."""
    for key, n in after.items():
        d = int(n - before.get(key, 0))
        if d > 0:
            into[key] = into.get(key, 0) + d


def _frame_compiles() -> Optional[dict]:
    try:
        from torch._dynamo import convert_frame
        return dict(convert_frame.FRAME_COMPILE_COUNTER)
    except Exception:
        return None


@dataclasses.dataclass
class _Pending:
    """A contender ready to be timed: compiled, warmed up and judged (``prepare_contender``)."""

    row: dict[str, Any]
    contender: Contender
    runner: Runner
    warm: list[float]
    tally: Tally
    iters: int
    window: Optional[PeakWindow] = None
    """The contender's peak memory, the accuracy comparisons left out (read by ``finish_row``)."""
    times: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    """Wall time spent on this contender so far (preparing and its timing blocks)."""
    blocks: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(the case's block index, timed steps) of each alternating block, in order (``times`` holds
    their steps one block after the other)."""


TIMING_ROUNDS = 5


"""Blocks per contender in alternating timing (``--timing alternate``)."""


def prepare_contender(case: Case, contender: Contender, settings: Settings,
                      alone: bool = True) -> tuple[dict[str, Any], Optional[_Pending]]:
    """Steps 1-3 of the module docstring for one contender: its row, and what timing it needs (None
    when it failed or was skipped: the row says why). ``alone``: nothing else is held, so Dynamo
    and the device are reset first; otherwise earlier contenders stay compiled and in memory, and
    the peak memory is read now, less the memory they hold."""
    from .accuracy import flip_fraction, group_errors, merge
    row = empty_row(case, contender, settings)
    device = settings.device
    if contender.needs_cuda and device.type != "cuda":
        row["error"], row["error_stage"] = "needs CUDA", "setup"
        return row, None
    reason = skip_reason(contender, case.spec, settings)
    if reason:
        row["error"], row["error_stage"], row["skip_reason"] = f"skipped: {reason}", "setup", reason
        return row, None
    stage = "setup"
    runner = None
    cuda = device.type == "cuda"
    tally = Tally(device)
    window = PeakWindow(device)
    try:
        memory_baseline(device, alone, row)
        with tally:
            stage = "compile"
            model = new_model(case, settings, contender)
            fn = contender.make(model)
            runner = Runner(contender, case, model, fn, settings)
            del model, fn

            # Warm-up: the first call compiles (Dynamo + backend), CUDA-graph contenders capture within.
            warm: list[float] = []
            for _ in range(settings.warmup):
                sync(device)
                t0 = time.perf_counter()
                runner.step()
                sync(device)
                warm.append(time.perf_counter() - t0)

            stage = "accuracy"
            judged = contender.name not in YARDSTICKS  # a yardstick computes no model: nothing to judge
            errs: dict[str, tuple[float, str]] = {}
            errs64: dict[str, tuple[float, str]] = {}
            flips: list[Optional[float]] = []
            for j, i in enumerate(case.acc_indices if judged else ()):
                got = runner.results_for(i)
                with window.excluded():  # the harness's own memory, not the contender's
                    merge(errs, group_errors(got, case.ref[j]))
                    if case.ref64:
                        merge(errs64, group_errors(got, case.ref64[j]))
                        flips.append(flip_fraction(got.get("routing"), case.ref64[j].get("routing")))
                del got
            if judged:
                judge_row(row, case, settings, errs, errs64, flips)
        row["graph_breaks"], row["graph_break_reasons"] = tally.graph_breaks()
        if cuda and not alone:
            read_peak(row, case, device, window)
        row["timed_iters"] = timed_iterations(settings, warm)
        return row, _Pending(row, contender, runner, warm, tally, row["timed_iters"], window)
    except Exception as exc:
        row["error"], row["error_stage"] = error_text(exc), stage
        if settings.verbose:
            traceback.print_exc()
        del runner
        if alone:
            cleanup(device)
        return row, None


def read_peak(row: dict[str, Any], case: Case, device: torch.device,
              window: Optional[PeakWindow] = None) -> None:
    """Peak memory since this contender's start (over ``window``'s calls: the accuracy comparisons
    left out), less what earlier contenders of the case still held then (``case.mem_baseline``:
    what the first one started with); and what it holds now, between calls or steps
    (``read_held``)."""
    held = row["mem_baseline_bytes"] - (case.mem_baseline if case.mem_baseline is not None
                                        else row["mem_baseline_bytes"])
    allocated, reserved = (window or PeakWindow(device)).peaks()
    row["peak_mem_bytes"] = allocated - held
    row["peak_reserved_bytes"] = reserved - held
    row["peak_mem_over_baseline_bytes"] = row["peak_mem_bytes"] - (row["mem_baseline_bytes"] - held)
    read_held(row, device)


def read_held(row: dict[str, Any], device: torch.device) -> None:
    """``held_mem_over_baseline_bytes``: the memory this contender holds between calls or steps, over
    what was allocated before its model was made: its weights, gradients and optimizer state, what
    its compiled code keeps allocated (CUDA-graph buffers, saved activations), and anything else
    it leaves alive. Read after a finished call or step, with garbage collected and cuBLAS's
    workspaces (made again at the next product) dropped first, as before the baseline."""
    gc.collect()
    torch.cuda.synchronize(device)
    clear_blas_workspaces()
    row["held_mem_over_baseline_bytes"] = int(torch.cuda.memory_allocated(device)) - row["mem_baseline_bytes"]


def _time_block(pending: _Pending, n: int, settings: Settings, block: Optional[int] = None) -> None:
    """``n`` timed steps of one contender; an exception is recorded in its row (stage ``timing``).
    ``block``: the case's index of this alternating block, which the steps are recorded under."""
    t0 = time.perf_counter()
    before = len(pending.times)
    try:
        _timed_steps(pending, n, settings.device)
    except Exception as exc:
        pending.row["error"], pending.row["error_stage"] = error_text(exc), "timing"
        if settings.verbose:
            traceback.print_exc()
    if block is not None:
        pending.blocks.append((block, len(pending.times) - before))
    pending.seconds += time.perf_counter() - t0


def _timed_steps(pending: _Pending, n: int, device: torch.device) -> None:
    runner, times = pending.runner, pending.times
    cuda = device.type == "cuda"
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with pending.tally:
        for _ in range(n):
            if cuda:
                torch.cuda.synchronize(device)
                start.record()
                runner.step()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                runner.step()
                times.append((time.perf_counter() - t0) * 1e3)
        sync(device)


def put_times(row: dict[str, Any], times: list[float]) -> None:
    """The row's timing statistics from its timed steps (ms)."""
    row["median_ms"] = statistics.median(times)
    row["p10_ms"] = percentile(times, 0.10)
    row["p90_ms"] = percentile(times, 0.90)
    row["mean_ms"] = statistics.fmean(times)
    row["timed_iters"] = len(times)


def put_counts(row: dict[str, Any], tally: Tally, contender: Contender, fn: Any) -> None:
    """The row's Dynamo and Inductor counts over the contender's own windows, and its graphs:
    the backend's own counters where it has them, else cudagraph trees'."""
    row["dynamo_graphs"] = tally.unique_graphs
    row["cudagraph_skips"] = tally.cudagraph_skips
    row["recompiles"] = tally.recompiles()
    if contender.backend_stats is not None:
        stats = contender.backend_stats(fn) or {}
        row["backend_stats"] = {k: stats[k] for k in STATS_KEYS if k in stats}
        row["graphs"] = stats.get("graphs_captured")
    else:
        row["graphs"], row["rerecords"] = tally.tree_graphs, tally.rerecords


def put_blocks(row: dict[str, Any], times: list[float], blocks: list[tuple[int, int]]) -> None:
    """``block_ids`` and ``block_medians_ms``: the case's index and this contender's median of each
    alternating block it was timed in (None when it was timed alone: ``--timing sequential``)."""
    ran = [(b, n) for b, n in blocks if n > 0]
    row["block_ids"] = [b for b, _ in ran] or None
    row["block_medians_ms"] = block_medians(times, [n for _, n in blocks]) or None


def block_share(total: int, r: int) -> int:
    """How many of ``total`` timed units block ``r`` of ``TIMING_ROUNDS`` alternating blocks runs."""
    return total // TIMING_ROUNDS + (1 if r < total % TIMING_ROUNDS else 0)


def finish_row(pending: _Pending, case: Case, settings: Settings, alone: bool = True) -> dict[str, Any]:
    """Timing statistics and counters into the row; the contender's model and code are dropped."""
    row, times, warm, tally = pending.row, pending.times, pending.warm, pending.tally
    device = settings.device
    try:
        if row["error"] is None:
            put_times(row, times)  # eager's, timed beside each group, can be more than --iters
            put_blocks(row, times, pending.blocks)
            if warm:
                row["first_call_s"] = warm[0]
                row["compile_s"] = max(0.0, sum(warm) - len(warm) * row["median_ms"] / 1e3)
            if device.type == "cuda" and alone:
                read_peak(row, case, device, pending.window)
        put_counts(row, tally, pending.contender, pending.runner.fn)
    except Exception as exc:
        row["error"], row["error_stage"] = error_text(exc), "counters"
        if settings.verbose:
            traceback.print_exc()
    finally:
        pending.runner = None  # type: ignore[assignment]
        if alone:
            cleanup(device)
    return row


def run_contender(case: Case, contender: Contender, settings: Settings) -> dict[str, Any]:
    """One contender alone: prepared, timed in one block, its row finished (``--timing sequential``)."""
    row, pending = prepare_contender(case, contender, settings)
    if pending is None:
        return row
    _time_block(pending, pending.iters, settings)
    return finish_row(pending, case, settings)


def run_contenders(case: Case, names: Sequence[str], settings: Settings,
                   log_row: Callable[[str, dict[str, Any], float], None]) -> list[dict[str, Any]]:
    """Every contender of one case, rows in the order of ``names``.

    ``--timing sequential``: each alone, one after the other. ``--timing alternate`` (the default):
    each is prepared in turn (compile, warm-up, accuracy, peak memory) and kept; then they are
    timed in ``TIMING_ROUNDS`` alternating blocks (A's block, B's, ..., A's again), so a change of
    the machine's pace during the run (another tenant, clocks, the CPU of a host-bound model) shows
    in every contender alike rather than in whichever ran then: two sequential runs of one
    host-bound model had put cgbackend at 0.83x and 0.60x eager.

    Compiled contenders share Dynamo's per-code state: a graph break in a loop makes Dynamo skip
    the whole function from then on, for every backend, also where another contender's compiled
    code was cached (each model object fails the others' guards, but the skip is the code's). So a
    contender whose compile broke the graph is timed in a group of its own with eager, Dynamo is
    reset after it, and the contenders prepared before it are prepared again. Eager comes first
    and is timed beside every group (its times from all of them make its row; it holds no compiled
    state); the stock contenders, which break graphs, come before cgbackend's."""
    if settings.timing == "sequential":
        rows = []
        for name in names:
            t0 = time.perf_counter()
            rows.append(run_contender(case, contender_named(name), settings))
            log_row(case.key, rows[-1], time.perf_counter() - t0)
        return rows
    device = settings.device
    cleanup(device)
    case.mem_baseline = int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    order = sorted(names, key=lambda n: (n != "eager", not contender_named(n).stock))
    rows: dict[str, dict[str, Any]] = {}
    group: list[_Pending] = []
    eager: list[_Pending] = []
    # Each compiled contender adds Dynamo cache entries for the same code objects (its own model
    # object fails the others' guards): room for all of them, or later ones would run eagerly.
    limit = max(torch._dynamo.config.recompile_limit, 8 * len(names))
    blocks_done = 0  # alternating blocks timed so far in this case: the next group's first index

    def prepare(name: str) -> Optional[_Pending]:
        t0 = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=limit):
            row, ready = prepare_contender(case, contender_named(name), settings, alone=False)
        rows[name] = row
        if ready is None:
            log_row(case.key, row, time.perf_counter() - t0)
        else:
            ready.seconds = time.perf_counter() - t0
            log(f"{case.key} {name}: warmed up and judged in {ready.seconds:.1f}s; timed with the others")
        return ready

    try:
        for name in order:
            ready = prepare(name)
            if ready is None:
                continue
            if name == "eager":
                eager.append(ready)
            elif not ready.row["graph_breaks"]:
                group.append(ready)
            else:
                blocks_done = _time_group(eager + [ready], case, settings, log_row, limit, blocks_done)
                cleanup(device)
                if group:
                    log(f"{case.key} {name} broke the graph: preparing "
                         f"{', '.join(p.contender.name for p in group)} again after a reset")
                    again = [p.contender.name for p in group]
                    group.clear()
                    group.extend(p for p in map(prepare, again) if p is not None)
        if group or (eager and not eager[0].times):
            _time_group(eager + group, case, settings, log_row, limit, blocks_done)
        for p in eager:
            finish_row(p, case, settings, alone=False)
            log_row(case.key, p.row, p.seconds)
    finally:
        group.clear()
        eager.clear()
        cleanup(device)
    return [rows[n] for n in names]


def _time_group(group: list[_Pending], case: Case, settings: Settings,
                log_row: Callable[[str, dict[str, Any], float], None], limit: int, first_block: int = 0) -> int:
    """Times ``group`` in alternating blocks (the case's blocks ``first_block`` on) and finishes
    the rows of all but eager's; returns the index of the case's next block."""
    with torch._dynamo.config.patch(recompile_limit=limit):
        for r in range(TIMING_ROUNDS):
            for p in group:
                if p.row["error"] is not None:
                    continue
                _time_block(p, block_share(p.iters, r), settings, first_block + r)
    for p in group:
        if p.contender.name != "eager":
            finish_row(p, case, settings, alone=False)
            log_row(case.key, p.row, p.seconds)
    return first_block + TIMING_ROUNDS


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """ratio_to_X = median_ms / X's median (below 1: faster than X). best stock: the fastest stock
    contender of the same model x mode (x token count) that ran and passed accuracy. Rows that
    failed accuracy get no ratio_to_best_stock and never count as a win. Each ratio against a
    contender also gets its per-block ratios and a verdict (``verdict.put_verdicts``)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["mode"], row.get("tokens")), []).append(row)
    for group in groups.values():
        ok = [r for r in group if r["error"] is None and r["median_ms"] is not None]
        eager = next((r for r in ok if r["contender"] == "eager"), None)
        stock = [r for r in ok if r["contender"] in STOCK_CONTENDERS and r["accuracy_ok"] is not False]
        best = min(stock, key=lambda r: r["median_ms"]) if stock else None
        for r in group:
            r["best_stock"] = best["contender"] if best else None
            r["ratio_to_eager"] = r["ratio_to_best_stock"] = r["ratio_to_floor"] = None
            r["beats_best_stock"] = False
            if not any(r is o for o in ok):
                continue
            if eager is not None and eager["median_ms"] > 0:
                r["ratio_to_eager"] = r["median_ms"] / eager["median_ms"]
            if r.get("floor_ms"):
                r["ratio_to_floor"] = r["median_ms"] / r["floor_ms"]
            if best is not None and r["accuracy_ok"] is not False and best["median_ms"] > 0:
                r["ratio_to_best_stock"] = r["median_ms"] / best["median_ms"]
                r["beats_best_stock"] = bool(r["ratio_to_best_stock"] < 1.0 and r["contender"] != best["contender"]
                                             and r["contender"] not in YARDSTICKS)
        # The yardsticks: the hand-written grouped form and reduce-overhead.
        refs = {"eager": eager, "best_stock": best}
        for key, names in (("grouped", GROUPED_CONTENDERS), ("reduce_overhead", ("reduce-overhead",)),
                           ("step_floor", YARDSTICKS)):
            other = refs[key] = next((o for o in ok if o["contender"] in names and o["median_ms"] > 0), None)
            for r in group:
                r[f"ratio_to_{key}"] = (r["median_ms"] / other["median_ms"]
                                        if other is not None and any(r is o for o in ok) else None)
        put_verdicts(group, refs)
