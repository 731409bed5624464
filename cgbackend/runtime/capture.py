"""Capturing one callable into a graph: CUDA graphs on the GPU, or a simulated graph for CPU tests.

Both kinds return ``(graph, outputs)`` where ``graph.replay()`` recomputes
``outputs`` in place (same tensors, same memory). A simulated graph re-runs
the callable and copies the results into the first call's tensors, so code
built on top sees the same buffer reuse as with CUDA graphs.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch

from ..fx_utils import iter_tensors
from .pool import PoolState

__all__ = ["CaptureError", "Capturer", "SimulatedGraph"]

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """Capturing a region failed; the message says why (the CUDA or Python error)."""


class SimulatedGraph:
    """Stands in for torch.cuda.CUDAGraph on machines without a GPU (option simulate_graphs)."""

    def __init__(self, fn: Callable[[], Any], outputs: Any) -> None:
        self._fn = fn
        self.outputs = outputs
        self.last = outputs
        """What the latest replay computed (with its autograd graph, for a training forward)."""

    def replay(self) -> None:
        result = self._fn()
        with torch.no_grad():
            for static, new in zip(iter_tensors(self.outputs), iter_tensors(result)):
                if static is not new:
                    static.copy_(new)
        self.last = result


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    # Autocast caches casted weights until the outermost autocast exits. A cast cached while
    # capturing would live in the graph pool and be freed on exit; one cached before would be
    # read by the graph after it is freed. With the cache off the casts happen inside the graph.
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


class Capturer:
    def __init__(self, simulate: bool) -> None:
        self.simulate = simulate
        self._streams: dict[str, "torch.cuda.Stream"] = {}

    def _stream(self, device: str) -> "torch.cuda.Stream":
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=torch.device(device))
            self._streams[device] = stream
        return stream

    def capture(self, fn: Callable[[], Any], pool: PoolState) -> tuple[Any, Any]:
        """Capture ``fn`` into a graph drawing memory from ``pool``; raise CaptureError on failure."""
        if self.simulate:
            try:
                # A CUDA capture draws no random numbers; neither does its stand-in.
                with torch.random.fork_rng(devices=[]):
                    outputs = fn()
            except Exception as exc:
                raise CaptureError(f"{type(exc).__name__}: {exc}") from exc
            return SimulatedGraph(fn, outputs), outputs

        stream = self._stream(pool.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with _autocast_cache_off(), torch.cuda.device(torch.device(pool.device)):
                with torch.cuda.graph(graph, pool=pool.handle, stream=stream,
                                      capture_error_mode="thread_local"):
                    outputs = fn()
        except Exception as exc:
            self._recover(graph, stream)
            raise CaptureError(_first_line(exc)) from exc
        return graph, outputs

    @staticmethod
    def _recover(graph: "torch.cuda.CUDAGraph", stream: "torch.cuda.Stream") -> None:
        """After a failed capture make sure the stream is no longer capturing and errors are drained."""
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                try:
                    graph.capture_end()
                except Exception:  # the capture was already invalidated; ending it is all we need
                    log.debug("cgbackend: capture_end after a failed capture raised", exc_info=True)
        try:
            torch.cuda.synchronize()
        except Exception:  # a sticky error would surface here; report it with the capture failure
            log.warning("cgbackend: CUDA reported an error after a failed capture", exc_info=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
