"""Public entry points: backend(), compile(), stats(), report(), reset()."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from . import opaque
from .passes.dispatch.forwards import LoopForwards
from .passes.dispatch.layout import stack_expert_params
from .backend import CGBackend
from .by_name import (backend_of_wrapper, by_name_backends, default_backend, dynamo_entry, is_compile_wrapper,
                      reset_default_backend)
from .report import Report

__all__ = ["backend", "compile", "prepare", "stats", "report", "find_backend", "dynamic_ops_config", "reset"]


def backend(**options: Any) -> CGBackend:
    """A configured backend instance: ``torch.compile(model, backend=cgbackend.backend(warmup=2))``.

    Unknown options raise ConfigError listing the valid ones (see cgbackend.Config)."""
    return CGBackend(**options)


class _TraceDynamicOps:
    """Dynamo settings that keep data-dependent ops (nonzero, .item()) inside the graph, so the
    partitioner sees them instead of a graph break; scoped to one call and restored afterwards.

    Dynamo only reads them while tracing, but nobody can tell beforehand whether a call will
    trace, so every call sets them. Plain attribute writes cost about half of config.patch, and
    nothing is written when the user already turned them on."""

    __slots__ = ("_saved",)
    _KEYS = ("capture_dynamic_output_shape_ops", "capture_scalar_outputs")

    def __enter__(self) -> None:
        cfg = torch._dynamo.config
        saved = []
        for key in self._KEYS:
            if not getattr(cfg, key):
                setattr(cfg, key, True)
                saved.append(key)
        self._saved = saved

    def __exit__(self, *exc: Any) -> None:
        cfg = torch._dynamo.config
        for key in self._saved:
            setattr(cfg, key, False)


def dynamic_ops_config() -> _TraceDynamicOps:
    return _TraceDynamicOps()


class _CompileScope:
    """The same Dynamo settings as :class:`_TraceDynamicOps`, switched on only while Dynamo compiles
    a frame inside a ``cgbackend.compile`` call: Dynamo's compile callbacks
    (``torch._dynamo.callback_handler``, in torch 2.11 and 2.13) set them at the start of a compile
    when this thread is inside such a call, and they are restored at its end (or, at the latest,
    when the call returns, on the thread that set them). A call that compiles nothing costs a
    thread-local count instead of six reads and writes of Dynamo's config (15 us a call less on the
    zoo's llama on a CI machine: host time before the graph launches).

    Dynamo runs start callbacks only for the outermost of overlapping compiles (of any thread), so
    a compile can start without them; the backend notices (the settings are off while it compiles
    a graph of a cgbackend call, :func:`trace_scope_missed`), counts it (``trace_scope_missed``)
    and that instance switches the settings around each call from then on."""

    __slots__ = ()
    local = threading.local()

    @classmethod
    def install(cls) -> bool:
        """Register the callbacks (again after ``torch._dynamo.reset()``, which clears them); False
        where this torch lacks them."""
        hooks = cls.__dict__.get("_hooks")
        if hooks is None:
            handler = getattr(getattr(torch, "_dynamo", None), "callback_handler", None)
            names = ("register_start_callback", "register_end_callback", "start_callbacks", "end_callbacks")
            hooks = (handler, cls._started, cls._ended) if all(hasattr(handler, n) for n in names) else ()
            cls._hooks = hooks
        if not hooks:
            return False
        handler, started, ended = hooks
        if started not in handler.start_callbacks:
            if ended in handler.end_callbacks:
                handler.end_callbacks.remove(ended)
            handler.register_start_callback(started)
            handler.register_end_callback(ended)
        return True

    @classmethod
    def _started(cls, args: Any) -> None:
        here = cls.local
        if getattr(here, "depth", 0) <= 0 or getattr(here, "applied", None):
            return
        cfg = torch._dynamo.config
        keys = [k for k in _TraceDynamicOps._KEYS if not getattr(cfg, k)]
        for key in keys:
            setattr(cfg, key, True)
        here.applied = keys

    @classmethod
    def _ended(cls, args: Any = None) -> None:
        keys = getattr(cls.local, "applied", None)
        if keys:
            cls.local.applied = None
            cfg = torch._dynamo.config
            for key in keys:
                setattr(cfg, key, False)

    def __enter__(self) -> None:
        here = self.local
        here.depth = getattr(here, "depth", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        here = self.local
        here.depth -= 1
        if here.depth == 0 and getattr(here, "applied", None):
            self._ended()


def trace_scope_missed() -> bool:
    """True when Dynamo compiles a graph for a ``cgbackend.compile`` call of this thread without
    the data-dependent settings on (its compile callbacks did not run for it); read by the
    backend while it compiles."""
    if getattr(_CompileScope.local, "depth", 0) <= 0:
        return False
    cfg = torch._dynamo.config
    return not all(getattr(cfg, k) for k in _TraceDynamicOps._KEYS)


def _data_dependent_failure(exc: BaseException) -> Optional[BaseException]:
    """The error when Dynamo failed on a data-dependent value that plain torch.compile would have
    met as a graph break (``.tolist()`` of a tensor whose length depends on the data, a branch on an
    unbacked value); None for any other error."""
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    except ImportError:  # pragma: no cover - present on every supported torch
        return None
    seen: set[int] = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, GuardOnDataDependentSymNode):
            return e
        e = e.__cause__ or e.__context__
    return None


def _call_tracing_dynamic_ops(instance: CGBackend, fn: Callable[..., Any], args: tuple,
                              kwargs: dict) -> Any:
    """Call ``fn`` with data-dependent ops traced into the graph; if Dynamo fails on a data-dependent
    value, trace as plain torch.compile does (a graph break there) from then on, counted and shown
    in the report. The call is retried only when no compiled graph ran during the failed attempt
    (tracing itself runs none of the model's code)."""
    if instance.trace_fallback is not None:
        return fn(*args, **kwargs)
    counters = instance.shared.counters
    calls = counters.graph_calls
    scope = dynamic_ops_config() if instance.switch_per_call or not _CompileScope.install() else _CompileScope()
    try:
        with scope:
            return fn(*args, **kwargs)
    except Exception as exc:
        cause = _data_dependent_failure(exc)
        if cause is None or counters.graph_calls != calls:
            raise
        instance.note_trace_fallback(cause)
    return fn(*args, **kwargs)


class _NoLoops:
    """A model without rewritten loops: calls go straight through."""

    @staticmethod
    def call(fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


_NO_LOOPS = _NoLoops()


def prepare(model: torch.nn.Module) -> opaque.InstallResult:
    """Make the modules of ``model`` that Dynamo cannot trace but cgbackend knows (Transformer
    Engine's) one opaque graph call each, for ``torch.compile(model, backend="cgbackend")``;
    ``cgbackend.compile`` does this itself. Returns what was wrapped and what was left alone (with
    why). ``cgbackend.opaque.uninstall(model)`` undoes it; eager calls behave the same either way."""
    return opaque.install(model)


def compile(model: Any, *, dynamic: Optional[bool] = None, fullgraph: bool = False,
            **options: Any) -> Any:
    """``torch.compile`` with a fresh cgbackend instance, tracing data-dependent ops into the graph.

    Dynamo's ``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` are switched on
    while Dynamo compiles a frame of a call of the returned model (never globally; see
    ``_CompileScope``), so a dropless MoE arrives as one graph
    and cgbackend decides what runs eagerly. Returns what torch.compile returns; cgbackend.stats()
    and cgbackend.report() accept it. With static dispatch, the dispatch loops it rewrites live on
    the returned wrapper: ``model`` and its modules keep their own methods (forwards.py).
    """
    instance = CGBackend(**options)
    if instance.config.opaque_modules and isinstance(model, torch.nn.Module):
        instance.opaque = opaque.install(model)
    loops: Any = _NO_LOOPS
    if instance.config.static_dispatch != "off" and isinstance(model, torch.nn.Module):
        loops = LoopForwards(model)  # installed only around each compiled call (forwards.py)
        instance.loops = loops.records
        if instance.config.static_dispatch in ("auto", "grouped"):
            instance.relayouts = stack_expert_params(model)
    elif isinstance(model, torch.nn.Module):
        instance.survey_target = weakref.ref(model)  # surveyed for the report's hints, when one is asked for
    if isinstance(model, torch.nn.Module):
        from .distributed import track_fsdp
        track_fsdp(instance, model)  # FSDP2's parameters: copied into the graphs (distributed.py)
    compiled = torch.compile(model, backend=instance, dynamic=dynamic, fullgraph=fullgraph)
    if isinstance(compiled, torch.nn.Module):
        traced_forward = compiled.forward
        from .distributed import WholeGraphUnderDDP, is_ddp
        whole = WholeGraphUnderDDP if is_ddp(model) else contextlib.nullcontext

        @functools.wraps(traced_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with whole():
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


def find_backend(obj: Any = None) -> CGBackend:
    """The CGBackend behind a compiled model or function. A model compiled by name
    (``torch.compile(model, backend="cgbackend")``) has its own instance, one per torch.compile
    call; None gives the instance used by name where torch's compile wrapper cannot be found."""
    if obj is None:
        return default_backend()
    if isinstance(obj, CGBackend):
        return obj
    # Only the object's own attribute: an OptimizedModule's getattr falls through to the module.
    found = getattr(obj, "__dict__", {}).get("_cgbackend")
    if isinstance(found, CGBackend):
        return found
    # torch.compile(model, backend=...): the backend sits behind the OptimizeContext's callback; a
    # compiled function keeps that context (or its callback) in its closure.
    starts = [getattr(getattr(obj, "dynamo_ctx", None), "callback", None)]
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # empty cell
            continue
        starts.append(getattr(content, "callback", None) or content)
    for candidate in starts:
        for _ in range(8):
            if candidate is None:
                break
            if isinstance(candidate, CGBackend):
                return candidate
            if is_compile_wrapper(candidate):
                return backend_of_wrapper(candidate)
            if candidate is dynamo_entry:
                return default_backend()
            candidate = (getattr(candidate, "_torchdynamo_orig_backend", None)
                         or getattr(candidate, "compiler_fn", None))
    raise TypeError(
        "cgbackend could not find the backend behind this object; pass the backend instance "
        "(cgbackend.backend(...)), a model from cgbackend.compile(...), or a module compiled "
        "with torch.compile(..., backend=...)")


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
    total.update(pending_forwards=0, nothing_captured_reason=None)
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                for k, v in value.items():
                    total[key][k] = total[key].get(k, 0) + v
            elif isinstance(value, list):
                total[key] = total[key] + value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] += value
            elif total.get(key) is None:
                total[key] = value
    return total


def report(obj: Any = None) -> Report:
    """Partition report of everything the backend behind ``obj`` compiled, with runtime counters
    (a :class:`cgbackend.Report`; its fields: ``help(cgbackend.Report)``, the JSON Schema
    ``cgbackend/report.schema.json``; the module with the text renderer is ``cgbackend.report``,
    importable as ``import cgbackend.report``, which this function's name hides)."""
    return find_backend(obj).report()


def reset() -> None:
    """Forget the backend instances made by name (their graphs stay alive as long as Dynamo's
    caches hold them); ``torch._dynamo.reset()`` drops those and zeroes every instance's counters."""
    for instance in by_name_backends():
        instance.reset()
    reset_default_backend()
