"""Releasing a backend's graphs: every graph entry and static buffer of its compiled graphs, at
process exit (before the process group's own teardown: a CUDA graph holding NCCL resources would
make the communicator's destruction wait) and on request (``cgbackend.distributed.release``)."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

__all__ = ["release_graphs", "finalizer"]

log = logging.getLogger(__name__)


def release_graphs(graph_refs: list, simulate: bool) -> int:
    """Drop every graph and static buffer of the compiled graphs in ``graph_refs`` (weak
    references); returns how many graph entries were dropped. Later calls capture again."""
    dropped = 0
    if torch.cuda.is_available() and not simulate:
        try:
            torch.cuda.synchronize()  # no replay may still run
        except Exception:  # a broken context at exit: dropping the Python objects is all we can do
            log.debug("cgbackend: synchronize before releasing graphs failed", exc_info=True)
    for ref in list(graph_refs):
        graph = ref()
        if graph is None:
            continue
        for runner in graph.runners:
            cache = runner.cache
            for entry in list(cache.entries.values()):
                cache.release(entry, sync=False)  # synchronized above
                dropped += 1
            cache.entries.clear()
        graph.shared.handed.clear()
    return dropped


def finalizer(owner: Any, graph_refs: list, simulate: bool) -> Callable[[], Any]:
    """A weakref.finalize releasing ``owner``'s graphs when it dies or the process exits."""
    return weakref.finalize(owner, release_graphs, graph_refs, simulate)
