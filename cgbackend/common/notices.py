"""cgbackend's warning categories, for ``warnings.filterwarnings`` (a model that runs with nothing
captured is worth a warning, not an error: its results are right, only slow)."""

from __future__ import annotations

__all__ = ["CGBackendWarning", "NothingCapturedWarning"]


class CGBackendWarning(UserWarning):
    """Base class of cgbackend's warnings."""


class NothingCapturedWarning(CGBackendWarning):
    """A compiled model ran past its warm-up and nothing was captured as a CUDA graph: every call runs
    eagerly. The message names the reason (runtime/capture_watch.py). Once per backend instance."""
