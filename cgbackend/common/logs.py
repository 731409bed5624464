"""cgbackend's loggers under torch's logging switches: ``TORCH_LOGS="+cgbackend"`` and
``torch._logging.set_logs(cgbackend=logging.DEBUG)``, next to plain ``logging`` as always.

Every module logs to ``logging.getLogger(__name__)``, so all of them sit under the ``cgbackend``
logger. :func:`register` (called once when cgbackend is imported) makes that logger a registered
torch log named ``cgbackend``: ``TORCH_LOGS`` and ``set_logs`` then set its level and give it
torch's handler and format. It sets no level itself.

``torch._logging`` is private API, so each piece is feature-tested (torch 2.11 and 2.13 have
them): ``torch._logging._internal.register_log`` registers the name; ``set_logs`` has a fixed keyword list, so it is
wrapped once by a function that takes ``cgbackend=`` too and passes it on as
``modules={"cgbackend": level}``. Without those pieces nothing changes and plain ``logging``
still works.

At INFO: one line per compiled graph when Dynamo hands it over (ops, regions) and one when its
regions are captured (graphs, capture time, pool memory). At DEBUG: one line per capture.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

__all__ = ["LOG_NAME", "register"]

LOG_NAME = "cgbackend"


def register() -> bool:
    """Register the ``cgbackend`` log with torch._logging; True when TORCH_LOGS / set_logs reach it."""
    try:
        import torch._logging as torch_logging
        from torch._logging import _internal
    except ImportError:
        return False
    register_log = getattr(_internal, "register_log", None)
    if register_log is None:
        return False
    try:
        register_log(LOG_NAME, LOG_NAME)
    except Exception:  # a changed private API: keep plain logging only
        logging.getLogger(__name__).debug("cgbackend: torch._logging.register_log failed", exc_info=True)
        return False
    _wrap_set_logs(torch_logging)
    return True


def _wrap_set_logs(torch_logging: Any) -> None:
    original = getattr(torch_logging, "set_logs", None)
    if original is None or getattr(original, "_cgbackend_wrapped", False):
        return
    try:
        params = inspect.signature(original).parameters
    except (TypeError, ValueError):
        return
    if LOG_NAME in params or "modules" not in params:
        return  # torch takes cgbackend= itself, or cannot pass it on

    @functools.wraps(original)
    def set_logs(*args: Any, cgbackend: Any = None, **kwargs: Any) -> Any:
        if cgbackend is not None:
            modules = dict(kwargs.get("modules") or {})
            modules[LOG_NAME] = cgbackend
            kwargs["modules"] = modules
        return original(*args, **kwargs)

    set_logs._cgbackend_wrapped = True  # type: ignore[attr-defined]
    torch_logging.set_logs = set_logs
