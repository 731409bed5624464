"""Progress of long compiles, on one logger (``cgbackend.progress``, under ``cgbackend``: shown at
INFO with ``TORCH_LOGS=cgbackend``; the command line's ``bench`` and ``explain`` show it on stderr).

A compile that takes more than :data:`SLOW_S` seconds says what it is doing: Dynamo's trace of a
graph and cgbackend's analysis of it, an inner (Inductor) compile of a region, and while graphs
are being captured, every :data:`SLOW_S` seconds, how many so far (a 48-layer model captures a
graph per layer and region)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Optional

__all__ = ["SLOW_S", "log", "CaptureProgress", "compile_started", "seconds_since_compile_start"]

SLOW_S = 2.0
"""A step taking at least this long is logged at INFO; shorter ones at DEBUG."""

log = logging.getLogger("cgbackend.progress")

_local = threading.local()


def compile_started() -> None:
    """Dynamo started compiling a frame on this thread (called from its compile callback)."""
    _local.started = time.perf_counter()


def seconds_since_compile_start() -> Optional[float]:
    started = getattr(_local, "started", None)
    return None if started is None else time.perf_counter() - started


def level(seconds: float) -> int:
    return logging.INFO if seconds >= SLOW_S else logging.DEBUG


class CaptureProgress:
    """Counts the captures of one backend instance and, during a burst of them (captures less than
    SLOW_S seconds apart), logs every SLOW_S seconds how many it has captured so far."""

    __slots__ = ("count", "seconds", "_burst_start", "_burst_count", "_last_capture", "_last_log")

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._burst_start = self._last_capture = self._last_log = float("-inf")
        self._burst_count = 0

    def captured(self, name: str, seconds: float) -> None:
        now = time.perf_counter()
        if now - self._last_capture > SLOW_S:  # after a quiet spell: a new burst
            self._burst_start = self._last_log = now - seconds
            self._burst_count = 0
        self._last_capture = now
        self.count += 1
        self._burst_count += 1
        self.seconds += seconds
        if now - self._last_log >= SLOW_S:
            self._last_log = now
            log.info("cgbackend: %d graphs captured in %.1f s so far (latest: %s)", self._burst_count,
                     now - self._burst_start, name)
