"""Ahead-of-time partition report: trace with Dynamo, run the passes, capture nothing."""

from __future__ import annotations

import contextlib
import re
from typing import Any, Optional

import torch

from . import opaque
from .passes.dispatch.forwards import LoopForwards, survey
from .tracing import data_dependent_failure, dynamic_ops_config
from .backend import CGBackend
from .reporting.breaks import break_text, frame_skipped, skipped_frame_source
from .config import Config
from .reporting.coverage import measure_launches
from .reporting.launch_profile import LaunchProfiler
from .reporting.hints import build_hints
from .reporting.report import Report
from .reporting.structured import emit_report

__all__ = ["ExplainError", "explain"]


class ExplainError(RuntimeError):
    """The model could not be traced; the message names the cause."""


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


_USER_CODE_RE = re.compile(r'(?:from user code|User stack):\s*\n\s*File "(?P<file>[^"]+)", line (?P<line>\d+), '
                           r'in (?P<name>\S+)')


def tracing_failure(exc: BaseException) -> str:
    """One line for a failed trace: the root error (the innermost of the exception chain, where
    Dynamo's own wrapper hides it) and the user's line Dynamo names."""
    chain = [exc]
    while True:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or nxt in chain or len(chain) > 16:
            break
        chain.append(nxt)
    root = chain[-1]
    where = ""
    for e in chain:
        match = _USER_CODE_RE.search(str(e))
        if match:
            where = (f" at {match.group('file').replace(chr(92), '/').rsplit('/', 1)[-1]}:"
                     f"{match.group('line')} in {match.group('name')}")
            break
    message = str(root)
    text = break_text(message) if "Explanation:" in message else _first_line(message)
    bullet = next((line.strip()[2:] for line in message.splitlines()[1:] if line.strip().startswith("- ")), "")
    if bullet:
        text = f"{text} {bullet}"
    if type(root).__name__ == "ConstraintViolationError":
        fix = ("mark the dimensions that must stay equal to it dynamic too ("
               "torch._dynamo.mark_dynamic on each; CLI: --dynamic NAME:DIM for each), or leave it static")
    else:
        fix = "check that the model runs eagerly on these inputs"
    wrapped = f" (inside {type(exc).__name__})" if root is not exc else ""
    return f"tracing the model failed{where}: {type(root).__name__}: {text}{wrapped}; {fix}"


def _mode_reason(training: Optional[bool], traced: set[bool]) -> dict[str, Any]:
    """What explain traced (inference or training) and why, for the report."""
    if not traced:
        return {"mode": "none", "why": "Dynamo produced no graph"}
    mode = "training" if traced == {True} else "inference" if traced == {False} else "mixed"
    if training is True:
        why = ("training=True (CLI: --training): traced with grad mode on; where parameters or inputs "
               "require grad, each static region gets a forward and a backward graph")
    elif training is False:
        why = ("training=False (the CLI's default): traced under torch.no_grad(), inference graphs "
               "only; training=True (CLI: --training) traces for training")
    elif torch.is_grad_enabled():
        why = ("grad mode was on (the default) and inputs or parameters require grad, so autograd "
               "records the graph: cgbackend captures a forward and a backward graph per region. "
               "Pass training=False (CLI: the default) or call under torch.no_grad() for inference")
    else:
        why = "grad mode was off (torch.no_grad()): inference graphs only. Pass training=True for training"
    if mode == "inference" and torch.is_grad_enabled() and training is None:
        why = "grad mode was on, but no input or parameter requires grad: inference graphs only"
    return {"mode": mode, "why": why}


def explain(model: Any, *args: Any, options: Optional[dict[str, Any]] = None,
            trace_dynamic_ops: bool = True, training: Optional[bool] = None, count_launches: bool = True,
            **kwargs: Any) -> Report:
    """Report how cgbackend would split ``model(*args, **kwargs)``: every region, its role, what stays
    eager and why, with source lines. Runs the model through Dynamo (eagerly, on whatever device
    its inputs are on) and captures nothing.

    ``options`` are cgbackend options (as for cgbackend.backend). ``trace_dynamic_ops`` traces
    data-dependent ops into the graph (Dynamo's capture_dynamic_output_shape_ops and
    capture_scalar_outputs, scoped to this call); False shows what plain torch.compile sees.
    ``training``: True traces with grad mode on (a training graph where parameters or inputs
    require grad), False under ``torch.no_grad()`` (inference), None (default) in the caller's grad
    mode. The module's own ``train()``/``eval()`` mode is left as it is. The report's
    ``traced_as`` says which it was and why.
    ``count_launches`` (default on) measures the launch coverage (coverage.py): the model then runs
    twice more, once eagerly and once through the traced graphs, each from the buffers' state
    before tracing (on CUDA tensors both under ``torch.profiler`` too, so each op weighs the
    launches it made: launch_profile.py); False runs it only once and leaves ``launch_coverage`` out.
    Returns a :class:`cgbackend.Report` (``help(cgbackend.Report)``). This function hides the module
    of the same name; ``import cgbackend.explain`` (or ``sys.modules``) reaches it.
    Like torch._dynamo.explain, this resets Dynamo's caches before and after tracing (which also
    zeroes the counters of every cgbackend instance). The model's buffers (batch-norm statistics)
    and the RNG state are restored afterwards; loops rewritten for static dispatch are restored too.
    """
    config = Config.from_options(options or {})
    instance = CGBackend(config=config.replace(capture=False))
    instance._keep_analyses = True
    if config.opaque_modules and isinstance(model, torch.nn.Module):
        instance.opaque = opaque.install(model)
    forwards: Optional[LoopForwards] = None
    if config.static_dispatch != "off" and isinstance(model, torch.nn.Module):
        forwards = LoopForwards(model)  # the rewritten forwards, on the modules only while traced
        instance.loops = forwards.records
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    before = dict(counters["graph_break"])
    before_unsupported = dict(counters["unimplemented"])
    scope = dynamic_ops_config() if trace_dynamic_ops else contextlib.nullcontext()
    grad = (contextlib.nullcontext() if training is None
            else torch.enable_grad() if training else torch.no_grad())
    # Tracing runs the model once: leave no trace of it (batch-norm statistics, counters, RNG).
    buffers = ([(b, b.detach().clone()) for b in model.buffers()]
               if isinstance(model, torch.nn.Module) else [])
    devices = sorted({b.device.index or 0 for b, _ in buffers if b.is_cuda})
    analyses: list = []
    calls: dict[int, int] = {}
    launches, skipped, after, after_unsupported = None, None, None, None

    def eager() -> Any:
        """The model as the user wrote it (without cgbackend's loop rewrites), for the launch count."""
        return model(*args, **kwargs)

    def traced(fn: Any) -> Any:
        """``fn`` called with the rewritten forwards in place."""
        if not forwards:
            return fn

        def call(*a: Any, **k: Any) -> Any:
            with forwards:
                return fn(*a, **k)
        return call

    try:
        with grad, torch.random.fork_rng(devices=devices):
            compiled = traced(torch.compile(model, backend=instance))
            try:
                with scope:
                    compiled(*args, **kwargs)
            except Exception as exc:
                cause = data_dependent_failure(exc) if trace_dynamic_ops else None
                if cause is None:
                    raise
                # as cgbackend.compile does: trace as plain torch.compile, with a graph break there
                instance.note_trace_fallback(cause)
                instance._analyses.clear()
                torch._dynamo.reset()
                scope = contextlib.nullcontext()
                compiled = traced(torch.compile(model, backend=instance))
                compiled(*args, **kwargs)
            analyses = list(instance._analyses)
            calls = {i: g.calls for i, g in enumerate(instance.compiled_graphs())}
            after = dict(counters["graph_break"])
            after_unsupported = dict(counters["unimplemented"])
            if count_launches:
                with scope:
                    launches, skipped = _measure(eager, compiled, args, kwargs, instance, buffers,
                                                 launch_profiler(analyses, args, kwargs))
    except ExplainError:
        raise
    except Exception as exc:
        raise ExplainError(tracing_failure(exc)) from exc
    finally:
        if after is None:
            after = dict(counters["graph_break"])
            after_unsupported = dict(counters["unimplemented"])
        torch._dynamo.reset()
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
    report = instance.build_report(breaks, notes, analyses=analyses, calls=calls)
    report.config = config.to_dict()
    report.traced_as = _mode_reason(training, {a.classification.training for a, _ in analyses})
    if launches is not None:
        report.summary.update(launches.to_summary())
    loops = (survey(model) if config.static_dispatch == "off" and isinstance(model, torch.nn.Module)
             else instance.loops)
    report.hints = build_hints(report, [a for a, _ in analyses], config, loops)
    emit_report(report, "cgbackend_explain_report")
    return report


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
    graphs = len(instance._analyses)
    try:
        launches, skipped = measure_launches(eager,
                                             lambda: compiled(*args, **kwargs), instance.shared,
                                             reset=lambda: _restore(buffers), profiler=profiler)
    except Exception as exc:  # the report stands without it; say why it is missing
        return None, f"launch coverage not measured: {type(exc).__name__}: {_first_line(exc)}"
    if len(instance._analyses) != graphs:
        del instance._analyses[graphs:]
        return None, "launch coverage not measured: the second call compiled new graphs (recompiled)"
    return launches, skipped
