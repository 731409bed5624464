"""``cgbackend.compile``'s model, built in one place for every door that runs it: ``cgbackend.compile``
(api.py) and ``cgbackend.explain`` (reporting/explain.py, which captures nothing), so the report
shows the graphs the run gets. The model is prepared (prepare.py: opaque modules, the dispatch loops'
source rewrite, the expert layout, the layer stacks), handed to a fresh :class:`CGBackend` through its
constructor, compiled by ``torch.compile``, and each call runs with data-dependent ops traced into
the graph (Dynamo's settings scoped to the call's compiles, tracing.CompileScope)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch

from ..backend import CGBackend
from ..config import Config
from ..integrations.distributed import WholeGraphUnderDDP, is_ddp
from .prepare import prepare_for_compile
from .regional import regional_overrides
from .tracing import CompileScope, data_dependent_failure, dynamic_ops_config

__all__ = ["compile_model"]


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
        return _call_plain(instance, fn, args, kwargs)
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


def _call_plain(instance: CGBackend, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Call ``fn`` with Dynamo's settings as they are (a graph break at each data-dependent op)."""
    calls = instance.shared.counters.graph_calls
    out = fn(*args, **kwargs)
    if instance.shared.counters.graph_calls == calls:
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


def compile_model(model: Any, config: Config, *, dynamic: Optional[bool] = None, fullgraph: bool = False,
                  keep_analyses: bool = False, warn_nothing_captured: bool = True,
                  trace_dynamic_ops: bool = True) -> tuple[Any, CGBackend]:
    """``model`` prepared and compiled as ``cgbackend.compile`` does, with its backend instance.
    ``keep_analyses`` and ``warn_nothing_captured`` are the backend's (explain keeps every graph's
    analysis and captures nothing by design); ``trace_dynamic_ops=False`` calls with Dynamo's
    settings as they are, as by name, the preparation kept."""
    prepared = prepare_for_compile(model, config, fullgraph=fullgraph)  # frontend/prepare.py
    instance = CGBackend(config, prepared=prepared, keep_analyses=keep_analyses,
                         warn_nothing_captured=warn_nothing_captured)
    traced_call = _call_tracing_dynamic_ops if trace_dynamic_ops else _call_plain
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
            call = functools.partial(loops.call, traced_call) if loops else traced_call

            @functools.wraps(traced_forward)
            def forward(*args: Any, **kwargs: Any) -> Any:
                return call(instance, traced_forward, args, kwargs)
        else:
            @functools.wraps(traced_forward)
            def forward(*args: Any, **kwargs: Any) -> Any:
                with whole(), overrides:
                    return loops.call(traced_call, instance, traced_forward, args, kwargs)

        compiled.forward = forward
        # On the wrapper itself: torch's OptimizedModule forwards other attribute writes to the
        # user's module, where a later torch.compile of it would find this instance.
        object.__setattr__(compiled, "_cgbackend", instance)
        return compiled, instance

    @functools.wraps(model)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return traced_call(instance, compiled, args, kwargs)

    wrapper._cgbackend = instance
    return wrapper, instance
