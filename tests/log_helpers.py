"""Reading cgbackend's log records in tests."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def records_of(name: str, level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    """The log records of logger ``name``, by a handler on that logger itself (caplog's handler on
    the root misses them once torch's logging set the ``cgbackend`` logger not to propagate)."""
    logger = logging.getLogger(name)
    kept: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    handler, previous = Keep(level=level), logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield kept
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
