"""Capturing one callable into a graph: CUDA graphs on the GPU, or a simulated graph for CPU tests.

Both kinds return ``(graph, outputs)`` where ``graph.replay()`` recomputes
``outputs`` in place (same tensors, same memory). A simulated graph re-runs
the callable and copies the results into the first call's tensors, so code
built on top sees the same buffer reuse as with CUDA graphs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch

from ..common.fx_utils import iter_tensors
from .pool import PoolState

if TYPE_CHECKING:
    from ..integrations.opaque import RegionHooks

__all__ = ["CaptureError", "Capturer", "SimulatedGraph", "first_line", "non_overlapping",
           "clear_blas_workspaces"]

log = logging.getLogger(__name__)


class CaptureError(RuntimeError):
    """Capturing a region failed; the message says why (the CUDA or Python error)."""


class SimulatedGraph:
    """Stands in for torch.cuda.CUDAGraph on machines without a GPU (option simulate_graphs).

    Adversarial about memory: a CUDA graph's temporaries may lie in the static outputs of any graph
    of its pool captured after it, and a later graph may hold anything in the outputs of a graph
    that released them (runtime/loose_outputs.py), so each replay first fills those outputs with
    garbage (NaN, huge integers). Code that respects the replay-order rule (runtime/pool.py) never
    reads them; code that breaks it fails tests on a CPU."""

    def __init__(self, fn: Callable[[], Any], outputs: Any, inputs: Sequence[torch.Tensor] = (),
                 reads: Sequence[torch.Tensor] = (), ran: bool = False) -> None:
        self._fn = fn
        self.outputs = outputs
        self._ran = [(t, t._version) for t in (reads or inputs)] if ran else None
        """The capture's run stands for the first replay (``Capturer.capture(once=True)``): what it
        read, with its versions then. The first replay re-runs nothing while they are unchanged."""
        self._reads = [(t, t.data_ptr(), t.untyped_storage().nbytes()) for t in (reads or inputs) if t.numel()]
        """Inputs with the address and storage size a CUDA graph would have baked in."""
        self._input_storages = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
        """Outputs that alias an input (a parameter's view) live outside the pool: never scribbled."""
        self.last = outputs
        """What the latest replay computed (with its autograd graph, for a training forward)."""
        self.pool: Optional[PoolState] = None
        self.index = -1
        self.released = False
        """Its outputs were released (runtime/loose_outputs.py): any graph of the pool captured
        later may hold anything in them, so every other graph's replay scribbles them."""
        self.loose: Optional[tuple[int, list]] = None
        """Some of its outputs were loosened (runtime/loose_grads.py): (the first capture index that
        may lie in them, those outputs); replays of graphs from that index on scribble them."""

    def attach(self, pool: PoolState, index: int) -> None:
        self.pool, self.index = pool, index
        pool.graphs.append(self)

    def scribble(self, tensors: Any = None) -> None:
        with torch.no_grad():
            for t in iter_tensors(self.outputs if tensors is None else tensors):
                if not t.numel():  # nothing to scribble (and it may be a view of a leaf input)
                    continue
                if not non_overlapping(t):  # an expanded view: its elements share memory
                    continue
                if t.untyped_storage().data_ptr() in self._input_storages:
                    continue
                # A graph captured under inference mode has inference tensors for outputs: written
                # in inference mode (a CUDA replay writes them whatever the mode).
                with torch.inference_mode(t.is_inference()):
                    if t.is_floating_point() or t.is_complex():
                        t.fill_(float("nan"))
                    elif t.dtype != torch.bool:
                        t.fill_(2 ** 30 if t.dtype in (torch.int32, torch.int64) else 100)

    def check_addresses(self) -> None:
        """A CUDA graph reads the addresses it was captured with: replaying after an input's storage
        was freed (``resize_(0)``) or moved is an illegal memory access or silent corruption on a
        GPU. The stand-in fails loudly instead of re-running on the storage's new place."""
        for t, ptr, nbytes in self._reads:
            storage = t.untyped_storage()
            if t.data_ptr() != ptr or storage.nbytes() != nbytes:
                raise RuntimeError(
                    f"cgbackend (simulated graph): replay reads a tensor whose storage moved or was "
                    f"freed since capture (captured at {ptr:#x} with {nbytes} bytes, now at "
                    f"{t.data_ptr():#x} with {storage.nbytes()} bytes); a CUDA graph would read "
                    "stale memory here")

    def replay(self) -> None:
        self.check_addresses()
        ran, self._ran = self._ran, None
        if ran is not None and all(t._version == version for t, version in ran):
            return  # the capture computed this replay's outputs from these very inputs
        if self.pool is not None:
            for other in self.pool.graphs:
                if other.index > self.index or (other.released and other is not self):
                    other.scribble()
                elif other.loose is not None and self.index >= other.loose[0]:
                    other.scribble(other.loose[1])
        result = self._fn()
        written: set[int] = set()
        with torch.no_grad():
            for static, new in zip(iter_tensors(self.outputs), iter_tensors(result)):
                if static is new:
                    continue
                if non_overlapping(static):
                    static.copy_(new)
                    continue
                # An overlapping view (an expand): a CUDA replay rewrites its base, the view follows.
                base, new_base = static._base, new._base
                if base is None or new_base is None or base is new_base or id(base) in written:
                    continue
                base.copy_(new_base)
                written.add(id(base))
        self.last = result


def non_overlapping(t: torch.Tensor) -> bool:
    """No two elements share memory, so the tensor can be written element by element (an expand()
    has stride 0 and fails this)."""
    span = 1
    for st, sz in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if st < span:
            return False
        span = st * sz
    return True


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic garbage collection while capturing.

    A collection inside a capture may destroy an unrelated CUDA graph that only a reference cycle
    kept (TE's make_graphed_callables makes such cycles), and destroying a graph is not permitted
    while a stream captures: it invalidates the capture ("operation failed due to a previous error
    during capture"). torch.cuda.graph no longer collects before capturing (pytorch#158193), so
    nothing else prevents it. Explicit gc.collect() calls still run."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


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


# One capture stream per device for the whole process (a stream per backend instance would only
# multiply what PyTorch keeps per stream).
_CAPTURE_STREAMS: dict[str, "torch.cuda.Stream"] = {}

POOLED_WORKSPACES = True
"""Give every capture its cuBLAS workspace from the graph pool and free it when the capture ends
(see :func:`_blas_workspace_in_pool`). False keeps one process-wide workspace for the capture
stream, made outside any capture (32 MiB on Hopper): the behaviour before, kept for comparison.
Where torch lacks the clear function, the first capture's workspace stays allocated in its pool
(never reused by graph data, so safe) and every later capture shares it."""


def capture_stream(device: str) -> "torch.cuda.Stream":
    stream = _CAPTURE_STREAMS.get(device)
    if stream is None:
        dev = torch.device(device)
        stream = torch.cuda.Stream(device=dev)
        if not POOLED_WORKSPACES:
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                for dtype in (torch.float32, torch.bfloat16):
                    a = torch.ones(16, 16, device=dev, dtype=dtype)
                    torch.addmm(a, a, a)
            stream.synchronize()
        _CAPTURE_STREAMS[device] = stream
    return stream


def clear_blas_workspaces() -> bool:
    """Drop every cuBLAS / cuBLASLt workspace PyTorch keeps (one per handle and stream); False
    where this torch cannot. Safe between kernels: a workspace goes back to the caching allocator
    like any tensor freed on its stream, and the next product on that stream allocates a new one."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


@contextlib.contextmanager
def _blas_workspace_in_pool() -> Iterator[None]:
    """Around a capture, entered on its device: the graph's cuBLAS workspace becomes one of its
    temporaries.

    PyTorch keeps a cuBLAS workspace for every (handle, stream) it has seen (32 MiB on Hopper), so
    a side stream for captures would cost a second one next to the eager stream's for good. Here
    the workspaces are dropped before the capture, so the graph's is allocated inside the capture,
    from the graph pool, by the first product that needs it (on this thread for a forward, on
    autograd's device thread for a backward: cuBLAS handles are per thread), and dropped again
    when the capture ends: a freed temporary, which graphs captured later may reuse under the
    replay-order rule (pool.py) like any other. A capture with no PyTorch product (Transformer
    Engine's GEMMs bring their own workspace) makes none; one made up front on this thread was
    32 MiB at every backward capture's peak that no kernel of the backward used. Dropping the
    eager stream's workspace first keeps the two from coexisting at the capture's peak; the next
    eager product allocates it again."""
    if not POOLED_WORKSPACES:
        yield
        return
    # This thread's cuBLAS handle, made now if it has none (a region whose warm-up ran no product,
    # a fresh autograd thread): creating one inside the capture invalidates it.
    torch.cuda.current_blas_handle()
    clear_blas_workspaces()
    try:
        yield
    finally:
        clear_blas_workspaces()


class Capturer:
    def __init__(self, simulate: bool) -> None:
        self.simulate = simulate

    def capture(self, fn: Callable[[], Any], pool: PoolState,
                restore: Sequence[torch.Tensor] = (), hooks: Optional["RegionHooks"] = None,
                reads: Sequence[torch.Tensor] = (), once: bool = False) -> tuple[Any, Any]:
        """Capture ``fn`` into a graph drawing memory from ``pool``; raise CaptureError on failure.

        ``restore``: tensors ``fn`` may write in place. A CUDA capture executes nothing, so they
        keep their values; the simulated capture runs ``fn`` and puts their values back.
        ``hooks``: the region's opaque-call hooks (opaque.py): their context is entered around the
        capture and their generators are registered with the graph.
        ``reads``: tensors the graph reads by address (default: ``restore``); a simulated graph
        refuses to replay once one of them moved.
        ``once``: ``fn`` issues collectives, which must run exactly once per call on every rank
        (passes/collectives.py). A CUDA capture executes nothing and the replay right after it
        issues them; the simulated capture must issue them itself (it needs the outputs), so its
        run counts as that first replay: its writes and random draws stay, and the first replay
        re-runs nothing while what it reads is unchanged."""
        if hooks is not None:
            with hooks.capturing():
                return self._capture(fn, pool, restore, hooks, reads, once)
        return self._capture(fn, pool, restore, None, reads, once)

    def _capture(self, fn: Callable[[], Any], pool: PoolState, restore: Sequence[torch.Tensor],
                 hooks: Optional["RegionHooks"], reads: Sequence[torch.Tensor] = (),
                 once: bool = False) -> tuple[Any, Any]:
        if self.simulate and once:
            try:
                outputs = fn()
            except Exception as exc:
                raise CaptureError(first_line(exc)) from exc
            return SimulatedGraph(fn, outputs, inputs=restore, reads=reads, ran=True), outputs
        if self.simulate:
            saved = [t.detach().clone() for t in restore]
            try:
                # A CUDA capture draws no random numbers; neither does its stand-in.
                with torch.random.fork_rng(devices=[]):
                    outputs = fn()
            except Exception as exc:
                raise CaptureError(first_line(exc)) from exc
            finally:
                with torch.no_grad():
                    for t, value in zip(restore, saved):
                        # Only what fn wrote, and through .data: a CUDA capture bumps no version
                        # counter, and a bump here would fail the version check of eager autograd
                        # graphs that saved the tensor (batch norm's running statistics).
                        if not torch.equal(t, value):
                            t.data.copy_(value)
            return SimulatedGraph(fn, outputs, inputs=restore, reads=reads), outputs

        try:
            stream = capture_stream(pool.device)
        except torch.OutOfMemoryError as exc:  # its workspaces are part of what capturing costs
            raise CaptureError(first_line(exc)) from None
        graph = torch.cuda.CUDAGraph()
        for generator in (hooks.generators() if hooks is not None else ()):
            graph.register_generator_state(generator)
        inner_errors: list[BaseException] = []

        def guarded() -> Any:
            try:
                return fn()
            except BaseException as exc:  # remember the root cause; capture_end raises its own error
                inner_errors.append(exc)
                raise

        device = torch.device(pool.device)
        try:
            with _gc_paused(), _autocast_cache_off(), torch.cuda.device(device), _blas_workspace_in_pool():
                with torch.cuda.graph(graph, pool=pool.handle, stream=stream,
                                      capture_error_mode="thread_local"):
                    outputs = guarded()
        except Exception as exc:
            self._recover(graph, stream, device)
            message = first_line(inner_errors[0] if inner_errors else exc)
            # The tracebacks hold the half-captured region's frames and tensors: drop them so
            # their memory is free for the eager fallback (it may be short after out-of-memory).
            for error in inner_errors + [exc]:
                error.__traceback__ = None
            inner_errors.clear()
            del exc
            raise CaptureError(message) from None
        return graph, outputs

    @staticmethod
    def _recover(graph: "torch.cuda.CUDAGraph", stream: "torch.cuda.Stream", device: torch.device) -> None:
        """Leave CUDA as it was before a failed capture.

        A failed capture_end skips the RNG generators' capture epilogue, and every later random op
        then fails ("Offset increment outside graph capture"). A small capture that succeeds runs
        prologue and epilogue again and closes that state on the same generator objects, which
        graphs captured earlier keep using."""
        with torch.cuda.device(device), torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                try:
                    graph.capture_end()
                except Exception:  # the capture was already invalidated; ending it is all we need
                    log.debug("cgbackend: capture_end after a failed capture raised", exc_info=True)
        try:
            torch.cuda.synchronize(device)
            closer = torch.cuda.CUDAGraph()
            with torch.cuda.device(device), torch.cuda.graph(closer, stream=stream):
                torch.empty(1, device=device).fill_(0.0)
            torch.cuda.synchronize(device)
            del closer
        except Exception:  # nothing more we can do; report it next to the capture failure
            log.warning("cgbackend: CUDA state after a failed capture could not be restored", exc_info=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
