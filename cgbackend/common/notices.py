"""cgbackend's warning categories, for ``warnings.filterwarnings`` (a model that runs with nothing
captured is worth a warning, not an error: its results are right, only slow)."""

from __future__ import annotations

__all__ = ["CGBackendWarning", "NothingCapturedWarning", "UncompiledCallsWarning"]


class CGBackendWarning(UserWarning):
    """Base class of cgbackend's warnings."""


class NothingCapturedWarning(CGBackendWarning):
    """A compiled model ran past its warm-up and nothing was captured as a CUDA graph: every call runs
    eagerly. The message names the reason (runtime/capture_watch.py). Once per backend instance."""


class UncompiledCallsWarning(NothingCapturedWarning):
    """Dynamo ran calls of a compiled model (or of one of its regional layers) without cgbackend: a
    function at Dynamo's recompile limit, a frame whose compile failed. Their results are eager's;
    ``cgbackend.stats()["uncompiled_calls"]`` counts them and the report names where and why
    (uncompiled.py). Once per backend instance."""
