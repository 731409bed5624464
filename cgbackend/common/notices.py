"""cgbackend's warning categories, for ``warnings.filterwarnings`` (a model that runs with nothing
captured is worth a warning, not an error: its results are right, only slow)."""

from __future__ import annotations

__all__ = ["CGBackendWarning", "MoELoopOutsideGraphWarning", "NothingCapturedWarning", "UncompiledCallsWarning"]


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


class MoELoopOutsideGraphWarning(CGBackendWarning):
    """Used by name (``torch.compile(model, backend="cgbackend")``), Dynamo broke the graph at a
    data-dependent op of an MoE dispatch loop that ``cgbackend.compile(model)`` would rewrite into
    static code: the loop runs eagerly, outside the graphs. The message names the loop's file and
    line (reporting/left_out.py). Once per backend instance."""
