"""The partition report as a structured-trace artifact (``TORCH_TRACE`` / tlparse), when PyTorch's
structured tracing is on. ``torch._logging.trace_structured`` is private API: feature-tested, and
nothing happens without it."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["emit_report", "structured_tracing_on"]

log = logging.getLogger(__name__)


def structured_tracing_on() -> bool:
    try:
        from torch._logging._internal import trace_log
    except ImportError:
        return False
    return bool(trace_log.handlers) and trace_log.isEnabledFor(logging.DEBUG)


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
