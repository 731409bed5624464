"""The Dynamo settings that keep data-dependent ops (``nonzero``, ``.item()``) inside the graph,
scoped to a call of a model compiled by ``cgbackend.compile`` (and to ``explain``): Dynamo's
``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs``, switched on while Dynamo compiles
a frame of such a call and restored afterwards, never globally."""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from ..common.progress import compile_started

__all__ = ["TraceDynamicOps", "CompileScope", "dynamic_ops_config", "trace_scope_missed",
           "data_dependent_failure", "is_data_dependent"]


class TraceDynamicOps:
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


def dynamic_ops_config() -> TraceDynamicOps:
    return TraceDynamicOps()


class CompileScope:
    """The same Dynamo settings as :class:`TraceDynamicOps`, switched on only while Dynamo compiles
    a frame inside a ``cgbackend.compile`` call: Dynamo's compile callbacks
    (``torch._dynamo.callback_handler``, in torch 2.11 and 2.13) set them at the start of a compile
    when this thread is inside such a call, and they are restored at its end (or, at the latest,
    when the call returns, on the thread that set them). A call that compiles nothing costs a
    thread-local count instead of six reads and writes of Dynamo's config (15 us a call less on the
    zoo's llama on a CI machine: host time before the graph launches).

    Dynamo runs start callbacks only for the outermost of overlapping compiles (of any thread), so
    a compile can start without them; the backend notices (the settings are off while it compiles
    a graph of a cgbackend call, :func:`trace_scope_missed`), counts it (``trace_scope_missed``)
    and that instance switches the settings around each call from then on.

    A frame compiled after a graph of the call has run (the code after a graph break, a regional
    layer after the embedding's graph) is compiled with Dynamo's ``suppress_errors`` on as well: if
    its trace fails (a ``.tolist()`` of a data-dependent length, which plain torch.compile meets as
    a graph break), Dynamo runs that frame as it is, this once, instead of raising out of a call
    whose earlier graphs (and their effects: writes, prints, random draws) cannot be run again.
    :meth:`failure` then names what failed, so the caller traces as plain torch.compile does from
    then on."""

    __slots__ = ("_counters",)
    local = threading.local()

    def __init__(self, counters: Any = None) -> None:
        self._counters = counters
        """The calling instance's counters: their ``graph_calls`` tell that a graph of the call ran."""

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
        compile_started()
        cfg = torch._dynamo.config
        keys = [k for k in TraceDynamicOps._KEYS if not getattr(cfg, k)]
        counters, calls = getattr(here, "entry", (None, 0))
        if counters is not None and counters.graph_calls != calls and not cfg.suppress_errors:
            # Until the call returns: Dynamo reads it once the compile has ended (and raised).
            cfg.suppress_errors = True
            here.suppressing = True
            if here.frames is None:  # Dynamo counted this compile's frame before it started it
                total, ok = _frame_counts()
                here.frames = (total - 1, ok)
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
        depth = getattr(here, "depth", 0)
        if depth == 0:
            counters = self._counters
            here.entry = (counters, counters.graph_calls if counters is not None else 0)
            here.frames = None
        here.depth = depth + 1

    def __exit__(self, *exc: Any) -> None:
        here = self.local
        here.depth -= 1
        if here.depth == 0:
            if getattr(here, "applied", None):
                self._ended()
            if getattr(here, "suppressing", False):
                here.suppressing = False
                torch._dynamo.config.suppress_errors = False

    def failure(self) -> Optional[tuple[str, str]]:
        """After the outermost scope of this thread ended: (error type, message) of a compile that
        failed in it and ran its frame as it is (see the class docstring), else None."""
        here = self.local
        start = getattr(here, "frames", None)
        if start is None or getattr(here, "depth", 0) != 0:
            return None
        here.frames = None
        total, ok = _frame_counts()
        if total - start[0] <= ok - start[1]:
            return None
        for metrics in reversed(_compilation_metrics()):
            kind = getattr(metrics, "fail_type", None)
            if kind:
                kind = str(kind).rsplit(".", 1)[-1].strip("'>")
                if kind in _SOFT:  # Dynamo runs the frame as it is with or without suppress_errors
                    return None
                return kind, str(getattr(metrics, "fail_reason", "") or "")
        return ("an error", "")


_SOFT = ("Unsupported", "UserError")
"""Compile failures Dynamo itself answers by running the frame as it is (a graph break it cannot
resume from, its recompile limit): not ours to report as a failure."""


def _frame_counts() -> tuple[int, int]:
    """Dynamo's count of frames it started to compile and of those it compiled."""
    frames = torch._dynamo.utils.counters["frames"]
    return frames["total"], frames["ok"]


def _compilation_metrics() -> list:
    """Dynamo's records of its latest compiles (private API, feature-tested: none where absent)."""
    get = getattr(torch._dynamo.utils, "get_compilation_metrics", None)
    return list(get()) if get is not None else []


def is_data_dependent(kind: str) -> bool:
    """An error type name (a compile's ``fail_type``) of a data-dependent value Dynamo could not trace."""
    return kind in ("GuardOnDataDependentSymNode", "DataDependentOutputException")


def trace_scope_missed() -> bool:
    """True when Dynamo compiles a graph for a ``cgbackend.compile`` call of this thread without
    the data-dependent settings on (its compile callbacks did not run for it); read by the
    backend while it compiles."""
    if getattr(CompileScope.local, "depth", 0) <= 0:
        return False
    cfg = torch._dynamo.config
    return not all(getattr(cfg, k) for k in TraceDynamicOps._KEYS)


def data_dependent_failure(exc: BaseException) -> Optional[BaseException]:
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
