"""Public entry points: backend(), compile(), stats(), report(), reset()."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch

from .backend import CGBackend
from .by_name import by_name_backends, find_backend, reset_default_backend
from .config import Config
from .config.suggest import check_callable
from .frontend.prepare import prepare_for_compile
from .frontend.regional import regional_overrides
from .frontend.tracing import CompileScope, data_dependent_failure, dynamic_ops_config
from .integrations import opaque
from .integrations.distributed import WholeGraphUnderDDP, is_ddp
from .reporting.report import Report

__all__ = ["backend", "compile", "prepare", "stats", "report", "find_backend", "dynamic_ops_config", "reset"]


def backend(**options: Any) -> CGBackend:
    """A configured backend instance: ``torch.compile(model, backend=cgbackend.backend(warmup=2))``.

    Unknown options raise ConfigError listing the valid ones (see cgbackend.Config)."""
    return CGBackend(**options)


def _call_tracing_dynamic_ops(instance: CGBackend, fn: Callable[..., Any], args: tuple,
                              kwargs: dict) -> Any:
    """Call ``fn`` with data-dependent ops traced into the graph; if Dynamo fails on a data-dependent
    value, trace as plain torch.compile does (a graph break there) from then on, counted and shown
    in the report. The call is retried only when no compiled graph ran during the failed attempt
    (tracing itself runs none of the model's code); a frame that fails after a graph of the call
    ran is run as it is by Dynamo instead (tracing.CompileScope), and the fallback starts with the
    next call. A call during which no graph of the instance ran was run by Dynamo without it:
    counted (uncompiled.py)."""
    counters = instance.shared.counters
    calls = counters.graph_calls
    if instance.trace_fallback is not None:
        out = fn(*args, **kwargs)
        if counters.graph_calls == calls:
            _ran_uncompiled(instance)
        return out
    scope = dynamic_ops_config() if instance.switch_per_call or not CompileScope.install() else CompileScope(counters)
    try:
        with scope:
            out = fn(*args, **kwargs)
    except Exception as exc:
        cause = data_dependent_failure(exc)
        if cause is None or counters.graph_calls != calls:
            raise
        instance.note_trace_fallback(cause)
        return fn(*args, **kwargs)
    failure = scope.failure() if isinstance(scope, CompileScope) else None
    if failure is not None:
        instance.note_frame_failure(*failure)
    if counters.graph_calls == calls:
        _ran_uncompiled(instance)
    return out


def _ran_uncompiled(instance: CGBackend) -> None:
    instance.uncompiled.note("model", "no compiled graph of cgbackend ran during the call: Dynamo ran the "
                                      "model's code as it is (a function at its recompile limit, or nothing it "
                                      "could compile)")


class _NoLoops:
    """A model without rewritten loops: calls go straight through."""

    @staticmethod
    def call(fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    @staticmethod
    def function_of(module: torch.nn.Module) -> None:
        return None

    def __bool__(self) -> bool:
        return False


_NO_LOOPS = _NoLoops()


def prepare(model: torch.nn.Module) -> opaque.InstallResult:
    """Make the modules of ``model`` that Dynamo cannot trace but cgbackend knows (Transformer
    Engine's) one opaque graph call each, for ``torch.compile(model, backend="cgbackend")``;
    ``cgbackend.compile`` does this itself. Returns what was wrapped and what was left alone (with
    why). ``cgbackend.integrations.opaque.uninstall(model)`` undoes it; eager calls behave the same either way."""
    return opaque.install(model)


def compile(model: Any, *, dynamic: Optional[bool] = None, fullgraph: bool = False,
            **options: Any) -> Any:
    """``torch.compile`` with a fresh cgbackend instance, tracing data-dependent ops into the graph.

    Dynamo's ``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` are switched on
    while Dynamo compiles a frame of a call of the returned model (never globally; see
    ``CompileScope``), so a dropless MoE arrives as one graph
    and cgbackend decides what runs eagerly. Returns what torch.compile returns; cgbackend.stats()
    and cgbackend.report() accept it. With static dispatch, the dispatch loops it rewrites live on
    the returned wrapper: ``model`` and its modules keep their own methods (moe/loop_forwards.py).
    """
    check_callable(model, "cgbackend.compile")
    config = Config.from_options(options)
    prepared = prepare_for_compile(model, config, fullgraph=fullgraph)  # frontend/prepare.py
    instance = CGBackend(config, prepared=prepared)
    loops: Any = prepared.forwards if prepared.forwards is not None else _NO_LOOPS
    overrides = regional_overrides(prepared.stacks, instance, dynamic=dynamic,
                                   forward_of=lambda layer: loops.function_of(layer) or type(layer).forward)
    compiled = torch.compile(model, backend=instance, dynamic=dynamic, fullgraph=fullgraph)
    if isinstance(compiled, torch.nn.Module):
        traced_forward = compiled.forward
        whole = WholeGraphUnderDDP if is_ddp(model) else contextlib.nullcontext

        if whole is contextlib.nullcontext and not overrides:
            # Only the contexts a call needs (no DDP, no regional forwards; rewritten loops only where
            # there are some): the host time before the graph launches is a decode step's time,
            # and each context entered here is part of it (2.4 us a call on the CI machine's Llama
            # decode step).
            call = functools.partial(loops.call, _call_tracing_dynamic_ops) if loops else _call_tracing_dynamic_ops

            @functools.wraps(traced_forward)
            def forward(*args: Any, **kwargs: Any) -> Any:
                return call(instance, traced_forward, args, kwargs)
        else:
            @functools.wraps(traced_forward)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with whole(), overrides:
                    return loops.call(_call_tracing_dynamic_ops, instance, traced_forward, args, kwargs)

        compiled.forward = forward
        # On the wrapper itself: torch's OptimizedModule forwards other attribute writes to the
        # user's module, where a later torch.compile of it would find this instance.
        object.__setattr__(compiled, "_cgbackend", instance)
        return compiled

    @functools.wraps(model)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return _call_tracing_dynamic_ops(instance, compiled, args, kwargs)

    wrapper._cgbackend = instance
    return wrapper


def stats(obj: Any = None) -> dict[str, Any]:
    """Counters of the backend behind ``obj``: regions, graphs captured, replays, eager calls by
    reason, copies made/avoided, output clones, pool bytes, capture time. See runtime.stats.

    Without ``obj``: every model compiled by name (``backend="cgbackend"``) in this process, added
    up. The same numbers, summed over all instances, are in
    ``torch._dynamo.utils.counters["cgbackend"]``."""
    if obj is None:
        return _sum_stats([b.stats() for b in by_name_backends()])
    return find_backend(obj).stats()


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    from .runtime.stats import Counters
    total = Counters().to_dict()
    total.update(pending_forwards=0, nothing_captured_reason=None, captured_sizes={}, memory={})
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                _add_dict(total[key], value)
            elif isinstance(value, list):
                total[key] = total[key] + value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] += value
            elif total.get(key) is None:
                total[key] = value
    return total


def _add_dict(into: dict, part: dict) -> None:
    """Add ``part``'s numbers into ``into``, key by key, nested dicts (memory by size) too."""
    for k, v in part.items():
        if isinstance(v, dict):
            _add_dict(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0) + v


def report(obj: Any = None) -> Report:
    """Partition report of everything the backend behind ``obj`` compiled, with runtime counters
    (a :class:`cgbackend.Report`; its fields: ``help(cgbackend.Report)``, the JSON Schema
    ``cgbackend/reporting/report.schema.json``; the data classes are in
    ``cgbackend.reporting.report``, the text renderer in ``cgbackend.reporting.text``)."""
    return find_backend(obj).report()


def reset() -> None:
    """Forget the backend instances made by name (their graphs stay alive as long as Dynamo's
    caches hold them); ``torch._dynamo.reset()`` drops those and zeroes every instance's counters."""
    for instance in by_name_backends():
        instance.reset()
    reset_default_backend()
