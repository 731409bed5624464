"""The partition report as a structured-trace artifact (``TORCH_TRACE`` / tlparse), when PyTorch's
structured tracing is on. ``torch._logging.trace_structured`` is private API: feature-tested, and
nothing happens without it."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["emit_report", "structured_tracing_on"]

log = logging.getLogger(__name__)


def structured_tracing_on() -> bool:
    """Whether structured-trace records go anywhere. PyTorch keeps a ``LazyTraceHandler`` on its
    trace log at DEBUG in every process; it writes only once it has a directory (``TORCH_TRACE``,
    or a platform default it resolves lazily), so that handler alone, without a directory and
    without an open file, means tracing is off."""
    try:
        from torch._logging._internal import trace_log
    except ImportError:
        return False
    if not trace_log.handlers or not trace_log.isEnabledFor(logging.DEBUG):
        return False
    for handler in trace_log.handlers:
        if type(handler).__name__ != "LazyTraceHandler":
            return True  # a handler someone attached on purpose (tests, tools)
        if getattr(handler, "root_dir", None) is not None or getattr(handler, "stream", None) is not None:
            return True
    return False


def emit_report(report: Any, name: str) -> bool:
    """Emit ``report`` (a Report) as the JSON artifact ``name``; True if it was emitted."""
    try:
        from torch._logging import trace_structured
    except ImportError:
        return False
    if not structured_tracing_on():
        return False
    try:
        trace_structured("artifact",
                         metadata_fn=lambda: {"name": name, "encoding": "json"},
                         payload_fn=report.to_json)
    except Exception:  # a tracing failure must never break compilation
        log.debug("cgbackend: structured trace artifact %s not emitted", name, exc_info=True)
        return False
    return True
