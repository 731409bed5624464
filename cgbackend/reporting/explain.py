"""Ahead-of-time partition report: trace with Dynamo, run the passes, capture nothing."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Optional

import torch

from ..frontend.compile_model import compile_model
from ..moe.loop_forwards import survey
from ..backend import CGBackend
from .breaks import break_text, frame_skipped, skipped_frame_source
from ..config import Config
from ..config.suggest import check_callable
from .coverage import measure_launches
from .launch_profile import LaunchProfiler
from .hints import build_hints
from .isolation import Isolated
from .report import Report
from .structured import emit_report
from .trace_errors import eager_failure, quiet_meta_failures, tracing_failure

__all__ = ["ExplainError", "call_inputs", "explain", "tracing_failure"]


class ExplainError(RuntimeError):
    """The model could not be traced; the message names the cause and the user's line. The error
    torch raised is ``torch_error`` (left out of the traceback: its frames are torch's)."""

    torch_error: Optional[BaseException] = None


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def call_inputs(model: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``explain(model, inputs)`` with ``inputs`` a tuple of positional inputs (any values: tensors,
    lists, dicts), as the CLI's factories return them: unpacked where the model's signature takes
    them one by one (a model whose one parameter takes a tuple gets it as it is). A lone list is
    unpacked only where its items are tensors the signature takes one by one and the list itself
    does not fit (as before: ``explain(model, [x, mask])``); a model taking a list gets it whole."""
    if kwargs or len(args) != 1 or not isinstance(args[0], (tuple, list)) or not args[0]:
        return args, kwargs
    unpacked = tuple(args[0])
    try:
        signature = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)
    except (TypeError, ValueError):  # no signature to check (a builtin): as the CLI does
        return unpacked, kwargs
    try:
        signature.bind(*unpacked)
    except TypeError:
        return args, kwargs
    if isinstance(args[0], tuple):
        return unpacked, kwargs
    try:
        signature.bind(args[0])
    except TypeError:
        return unpacked, kwargs
    # Both bind (forward(self, x, mask=None) and a list of two inputs): tensors are the inputs, a
    # list of them is not one input.
    return (unpacked, kwargs) if all(isinstance(a, torch.Tensor) for a in unpacked) else (args, kwargs)


def _mode_reason(training: Optional[bool], traced: set[bool]) -> dict[str, Any]:
    """What explain traced (inference or training) and why, for the report."""
    if not traced:
        return {"mode": "none", "why": "Dynamo produced no graph"}
    mode = "training" if traced == {True} else "inference" if traced == {False} else "mixed"
    if training is True:
        why = ("training=True (CLI: --training): traced with grad mode on; where parameters or inputs "
               "require grad, each static region gets a forward and a backward graph")
    elif training is False:
        why = ("training=False (CLI: without --training): traced under torch.no_grad(), inference graphs "
               "only; training=True (CLI: --training) traces for training")
    elif torch.is_grad_enabled():
        why = ("grad mode was on (the default) and inputs or parameters require grad, so autograd "
               "records the graph: cgbackend captures a forward and a backward graph per region. "
               "Pass training=False (CLI: without --training) or call under torch.no_grad() for inference")
    else:
        why = "grad mode was off (torch.no_grad()): inference graphs only. Pass training=True for training"
    if mode == "inference" and torch.is_grad_enabled() and training is None:
        why = "grad mode was on, but no input or parameter requires grad: inference graphs only"
    return {"mode": mode, "why": why}


def explain(model: Any, *args: Any, options: Optional[dict[str, Any]] = None,
            trace_dynamic_ops: bool = True, training: Optional[bool] = None, count_launches: bool = True,
            by_name: bool = False, compare: bool = False, **kwargs: Any) -> Report:
    """Report how cgbackend would split ``model(*args, **kwargs)``: every region, its role, what stays
    eager and why, with source lines. Runs the model through Dynamo (eagerly, on whatever device
    its inputs are on) and captures nothing. ``explain(model, inputs)`` with ``inputs`` a tuple of
    positional inputs works too (``call_inputs``).

    ``by_name`` picks the entry point whose partition the report shows: False (default) that of
    ``cgbackend.compile(model)``, which traces data-dependent ops into the graph (Dynamo's
    capture_dynamic_output_shape_ops and capture_scalar_outputs, scoped to this call) and makes
    known untraceable modules opaque calls; True that of ``torch.compile(model,
    backend="cgbackend")``, Dynamo's settings as they are (a graph break at each data-dependent
    op). The report's first lines (``traced_via``) say which one it shows and how the other
    differs: ``compare=True`` traces the other one too (without counting launches) and gives its
    graph and break counts where it can differ (``other_may_differ``); else they say whether it can
    differ and how to see it.
    ``trace_dynamic_ops=False`` alone traces as by name but keeps cgbackend.compile's preparations.
    ``options`` are cgbackend options (as for cgbackend.backend).
    ``training``: True traces with grad mode on (a training graph where parameters or inputs
    require grad), False under ``torch.no_grad()`` (inference), None (default) in the caller's grad
    mode. The module's own ``train()``/``eval()`` mode is left as it is. The report's
    ``traced_as`` says which it was and why.
    ``count_launches`` (default on) measures the launch coverage (coverage.py): the model then runs
    twice more, once eagerly and once through the traced graphs, each from the buffers' state
    before tracing (on CUDA tensors both under ``torch.profiler`` too, so each op weighs the
    launches it made: launch_profile.py); False runs it only once and leaves ``launch_coverage`` out.
    Returns a :class:`cgbackend.Report` (``help(cgbackend.Report)``). The module is
    ``cgbackend.reporting.explain``.
    Models compiled before are left alone: the model is compiled with an instance of its own, whose
    Dynamo cache entries are invalidated afterwards (no ``torch._dynamo.reset()``: isolation.py).
    Static dispatch lays the experts' parameters out as ``cgbackend.compile`` does (the same
    Parameter objects and values, in one block each). The model's buffers (batch-norm statistics)
    and the RNG state are restored afterwards; loops rewritten for static dispatch are restored too.
    """
    check_callable(model, "cgbackend.explain")
    args, kwargs = call_inputs(model, args, kwargs)
    report = _explain(model, args, kwargs, options, trace_dynamic_ops and not by_name, training,
                      count_launches, by_name)
    other = None
    may_differ = other_may_differ(report, by_name)
    if compare and may_differ:  # where it cannot differ, the line says so without a second trace
        shown = _explain(model, args, kwargs, options, by_name, training, False, not by_name)
        other = {"entry": "compile" if by_name else "by_name", "graphs": shown.summary["graphs"],
                 "graph_breaks": shown.summary["graph_breaks"]}
    report.traced_via = {"entry": "by_name" if by_name else "compile", "calls": report.traced_via["calls"],
                         "trace_dynamic_ops":
                         trace_dynamic_ops and not by_name, "other": other, "other_may_differ": may_differ}
    emit_report(report, "cgbackend_explain_report")
    return report


def other_may_differ(report: Report, by_name: bool) -> bool:
    """Can the other entry point's partition differ from this report's? By name, Dynamo breaks the
    graph at data-dependent ops and host syncs that cgbackend.compile traces, and it wraps no
    module as an opaque call; a by-name trace without a graph break is what cgbackend.compile
    traces too. Static dispatch's graph rewrites count: they replace data-dependent ops (by name,
    graph breaks) that the report no longer shows."""
    if by_name:
        return bool(report.graph_breaks)
    data_dependent = {"data_dependent_shape", "host_sync"}
    return (any(v == "unbacked" for r in report.regions() for v in r.symbols.values())
            or any(x["rule"] in data_dependent for r in report.regions() for x in r.reasons)
            or bool(report.opaque_modules.get("wrapped")) or any(r["form"] for r in report.loop_rewrites)
            or bool(report.summary.get("dispatch_rewrites"))
            or bool(report.graph_breaks))


def _explain(model: Any, args: tuple, kwargs: dict, options: Optional[dict[str, Any]],
             trace_dynamic_ops: bool, training: Optional[bool], count_launches: bool, by_name: bool) -> Report:
    """One trace of ``explain``: the model compiled as ``cgbackend.compile`` compiles it
    (frontend/compile_model.py: the same preparation, layer stacks and Dynamo settings) or, by name,
    as ``torch.compile(model, backend="cgbackend")`` does, with an instance that captures nothing,
    called until a call compiles no new graph (the stacks' mode settles at the second call,
    regional_modes.py). Its Dynamo cache entries are invalidated afterwards (isolation.py)."""
    config = Config.from_options(options or {})
    # explain is the report: nothing captured, and capturing nothing is its point, not a warning
    quiet = config.replace(capture=False, dryrun=False)
    counters = torch._dynamo.utils.counters
    before = dict(counters["graph_break"])
    before_unsupported = dict(counters["unimplemented"])
    grad = (contextlib.nullcontext() if training is None
            else torch.enable_grad() if training else torch.no_grad())
    # Tracing runs the model: leave no trace of it (batch-norm statistics, counters, RNG).
    buffers = ([(b, b.detach().clone()) for b in model.buffers()]
               if isinstance(model, torch.nn.Module) else [])
    devices = sorted({b.device.index or 0 for b, _ in buffers if b.is_cuda})
    analyses: list = []
    calls: dict[int, int] = {}
    runs = 0
    launches, skipped, after, after_unsupported = None, None, None, None
    isolated = Isolated()

    def eager() -> Any:
        """The model as the user wrote it (without cgbackend's loop rewrites), for the launch count."""
        try:
            return model(*args, **kwargs)
        except Exception as exc:  # Dynamo traced what eager rejects (a NumPy array for a tensor)
            error = ExplainError(f"the model raised when called eagerly on these inputs, so there is nothing "
                                 f"to compile: {eager_failure(exc)}")
            error.torch_error = exc
            raise error from None

    try:
        with grad, torch.random.fork_rng(devices=devices), quiet_meta_failures(), isolated:
            if by_name:
                instance = CGBackend(quiet, keep_analyses=True, warn_nothing_captured=False, by_name=True)
                compiled = torch.compile(model, backend=instance)
            else:
                compiled, instance = compile_model(model, quiet, keep_analyses=True, warn_nothing_captured=False,
                                                   trace_dynamic_ops=trace_dynamic_ops)
            isolated.instances.append(instance)
            calls, runs = _settle(compiled, args, kwargs, instance, buffers)
            analyses = instance.kept_analyses()
            after = dict(counters["graph_break"])
            after_unsupported = dict(counters["unimplemented"])
            if count_launches:
                launches, skipped = _measure(eager, compiled, args, kwargs, instance, buffers,
                                             launch_profiler(analyses, args, kwargs))
    except ExplainError:
        raise
    except Exception as exc:
        error = ExplainError(tracing_failure(exc))
        error.torch_error = exc
        raise error from None  # one line naming the user's code; torch's frames stay in torch_error
    finally:
        if after is None:
            after = dict(counters["graph_break"])
            after_unsupported = dict(counters["unimplemented"])
        _restore(buffers)

    breaks = [b for b in (br for _, br in analyses) if b]
    seen = {(b["reason"], b["source"]) for b in breaks}
    seen_reasons = {b["reason"] for b in breaks}
    for message, count in after.items():
        text = break_text(message)
        if count > before.get(message, 0) and text not in seen_reasons:
            breaks.append({"reason": text, "source": ""})
            seen_reasons.add(text)
    notes = []
    for message, count in after_unsupported.items():
        if count <= before_unsupported.get(message, 0) or not frame_skipped(message):
            continue
        entry = {"reason": break_text(message), "source": skipped_frame_source(message)}
        if (entry["reason"], entry["source"]) not in seen:
            breaks.append(entry)
            seen.add((entry["reason"], entry["source"]))
            notes.append(f"Dynamo skipped the frame at {entry['source'] or '?'} after a graph break "
                         "inside a loop: that function runs eagerly, nothing of it is compiled "
                         "(torch._dynamo.explain counts no graph and no break for it)")
    devices = {a.classification.compute_device for a, _ in analyses}
    if devices and devices <= {"cpu"}:
        notes.append("traced on CPU tensors: static regions are what would be captured on a CUDA "
                     "device; nothing ran on a GPU")
    if not analyses:
        notes.append("Dynamo produced no graph: the whole model ran eagerly (see graph breaks)")
    if skipped:
        notes.append(skipped)
    notes.extend(isolated.notes)
    if runs > 2:
        notes.append(f"the model was called {runs} times: a call compiled new graphs (a stack of layers compiled "
                     "with the model from its second call on, a recompile), and the report shows every graph "
                     "compiled, its per-call figures from the last call; cgbackend.stats() after as many calls of "
                     "cgbackend.compile(model) counts the same graphs and regions")
    report = instance.build_report(breaks, notes, analyses=analyses, calls=calls)
    report.config = config.to_dict()
    report.traced_as = _mode_reason(training, {a.classification.training for a, _ in analyses})
    if launches is not None:
        report.summary.update(launches.to_summary())
    report.traced_via = {"calls": runs}
    loops = (survey(model) if (not config.static_dispatch.enabled or by_name)
             and isinstance(model, torch.nn.Module) else instance.loops)
    report.hints = build_hints(report, [a for a, _ in analyses], config, loops)
    return report


_MAX_RUNS = 3
"""Calls of the model explain makes at most until one compiles no new graph."""


def _settle(compiled: Any, args: tuple, kwargs: dict, instance: CGBackend, buffers: list) -> tuple[dict[int, int], int]:
    """Call ``compiled`` (each call from the buffers' state before tracing) until a call compiles
    no new graph, at most ``_MAX_RUNS`` times; returns how often each graph ran in the last call,
    and the number of calls."""
    runs = 0
    while True:
        runs += 1
        graphs = len(instance.kept_analyses())
        before = {g.index: g.calls for g in instance.compiled_graphs()}
        _restore(buffers)
        compiled(*args, **kwargs)
        calls = {g.index: g.calls - before.get(g.index, 0) for g in instance.compiled_graphs()}
        if runs >= _MAX_RUNS or (runs > 1 and len(instance.kept_analyses()) == graphs):
            _restore(buffers)
            return calls, runs


def _restore(buffers: list) -> None:
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def launch_profiler(analyses: list, args: tuple, kwargs: dict) -> Optional[LaunchProfiler]:
    """The profiler that weighs each counted op by its CUDA launches (launch_profile.py) when the
    model computes on CUDA tensors (a traced graph's device, else an input's); None on CPU (one
    launch per op)."""
    if not torch.cuda.is_available():
        return None
    devices = {a.classification.compute_device for a, _ in analyses}
    if not devices:
        leaves = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        devices = {v.device.type for v in leaves}
    return LaunchProfiler() if "cuda" in devices else None


def _measure(eager: Any, compiled: Any, args: tuple, kwargs: dict, instance: CGBackend,
             buffers: list, profiler: Optional[LaunchProfiler] = None) -> tuple[Any, Optional[str]]:
    """Launch coverage (coverage.py): one eager call and one more call of the traced model, each
    from the buffers' state before tracing; under ``profiler`` too where it is given."""
    graphs = len(instance.kept_analyses())
    try:
        launches, skipped = measure_launches(eager,
                                             lambda: compiled(*args, **kwargs), instance.shared,
                                             reset=lambda: _restore(buffers), profiler=profiler)
    except ExplainError:
        raise
    except Exception as exc:  # the report stands without it; say why it is missing
        return None, f"launch coverage not measured: {type(exc).__name__}: {_first_line(exc)}"
    if len(instance.kept_analyses()) != graphs:
        instance.forget_analyses(keep=graphs)
        return None, "launch coverage not measured: the second call compiled new graphs (recompiled)"
    return launches, skipped
