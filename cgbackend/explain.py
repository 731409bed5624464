"""Ahead-of-time partition report: trace with Dynamo, run the passes, capture nothing."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from . import opaque
from .passes.dispatch import source as loop_source
from .api import _data_dependent_failure, dynamic_ops_config
from .backend import CGBackend
from .config import Config
from .coverage import measure_launches
from .hints import build_hints
from .report import Report

__all__ = ["ExplainError", "explain"]


class ExplainError(RuntimeError):
    """The model could not be traced; the message names the cause."""


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def explain(model: Any, *args: Any, options: Optional[dict[str, Any]] = None,
            trace_dynamic_ops: bool = True, count_launches: bool = True, **kwargs: Any) -> Report:
    """Report how cgbackend would split ``model(*args, **kwargs)``: every region, its role, what stays
    eager and why, with source lines. Runs the model through Dynamo (eagerly, on whatever device
    its inputs are on) and captures nothing.

    ``options`` are cgbackend options (as for cgbackend.backend). ``trace_dynamic_ops`` traces
    data-dependent ops into the graph (Dynamo's capture_dynamic_output_shape_ops and
    capture_scalar_outputs, scoped to this call); False shows what plain torch.compile sees.
    Like torch._dynamo.explain, this resets Dynamo's caches before and after tracing. The model's
    buffers (batch-norm statistics) and the RNG state are restored afterwards.

    ``count_launches`` (default on) measures the launch coverage (coverage.py): the model then runs
    twice more, once eagerly and once through the traced graphs, each from the buffers' state
    before tracing; False runs it only once and leaves ``launch_coverage`` out.
    """
    config = Config.from_options(options or {})
    instance = CGBackend(config=config.replace(capture=False))
    instance._keep_analyses = True
    if config.opaque_modules and isinstance(model, torch.nn.Module):
        instance.opaque = opaque.install(model)
    rewrote_loops = False
    if config.static_dispatch != "off" and isinstance(model, torch.nn.Module):
        instance.loops = loop_source.install(model)
        rewrote_loops = any(r.form for r in instance.loops)
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    before = dict(counters["graph_break"])
    scope = dynamic_ops_config() if trace_dynamic_ops else contextlib.nullcontext()
    # Tracing runs the model once: leave no trace of it (batch-norm statistics, counters, RNG).
    buffers = ([(b, b.detach().clone()) for b in model.buffers()]
               if isinstance(model, torch.nn.Module) else [])
    devices = sorted({b.device.index or 0 for b, _ in buffers if b.is_cuda})
    launches, skipped, after = None, None, None

    def eager() -> Any:
        """The model as the user wrote it (without cgbackend's loop rewrites), for the launch count."""
        if rewrote_loops:
            loop_source.uninstall(model)
        try:
            return model(*args, **kwargs)
        finally:
            if rewrote_loops:
                loop_source.install(model)
    try:
        with torch.random.fork_rng(devices=devices):
            compiled = torch.compile(model, backend=instance)
            try:
                with scope:
                    compiled(*args, **kwargs)
            except Exception as exc:
                cause = _data_dependent_failure(exc) if trace_dynamic_ops else None
                if cause is None:
                    raise
                # as cgbackend.compile does: trace as plain torch.compile, with a graph break there
                instance.note_trace_fallback(cause)
                instance._analyses.clear()
                torch._dynamo.reset()
                scope = contextlib.nullcontext()
                compiled = torch.compile(model, backend=instance)
                compiled(*args, **kwargs)
            after = dict(counters["graph_break"])
            if count_launches:
                with scope:
                    launches, skipped = _measure(eager, compiled, args, kwargs, instance, buffers)
    except ExplainError:
        raise
    except Exception as exc:
        raise ExplainError(f"tracing the model failed: {type(exc).__name__}: {_first_line(exc)}") from exc
    finally:
        if after is None:
            after = dict(counters["graph_break"])
        torch._dynamo.reset()
        _restore(buffers)
        if rewrote_loops:
            loop_source.uninstall(model)

    breaks = [b for b in (br for _, br in instance._analyses) if b]
    seen = {b["reason"] for b in breaks}
    for message, count in after.items():
        if count > before.get(message, 0) and _first_line(message) not in seen:
            breaks.append({"reason": _first_line(message), "source": ""})
            seen.add(_first_line(message))
    notes = []
    devices = {a.classification.compute_device for a, _ in instance._analyses}
    if devices and devices <= {"cpu"}:
        notes.append("traced on CPU tensors: static regions are what would be captured on a CUDA "
                     "device; nothing ran on a GPU")
    if not instance._analyses:
        notes.append("Dynamo produced no graph: the whole model ran eagerly (see graph breaks)")
    if skipped:
        notes.append(skipped)
    report = instance.build_report(breaks, notes)
    report.config = config.to_dict()
    if launches is not None:
        report.summary.update(launches.to_summary())
    report.hints = build_hints(report, [a for a, _ in instance._analyses], config)
    return report


def _restore(buffers: list) -> None:
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def _measure(eager: Any, compiled: Any, args: tuple, kwargs: dict, instance: CGBackend,
             buffers: list) -> tuple[Any, Optional[str]]:
    """Launch coverage (coverage.py): one eager call and one more call of the traced model, each
    from the buffers' state before tracing."""
    graphs = len(instance._analyses)
    try:
        launches, skipped = measure_launches(eager,
                                             lambda: compiled(*args, **kwargs), instance.shared,
                                             reset=lambda: _restore(buffers))
    except Exception as exc:  # the report stands without it; say why it is missing
        return None, f"launch coverage not measured: {type(exc).__name__}: {_first_line(exc)}"
    if len(instance._analyses) != graphs:
        del instance._analyses[graphs:]
        return None, "launch coverage not measured: the second call compiled new graphs (recompiled)"
    return launches, skipped
