"""Warm-up calls of a static region: run eagerly, watch for host synchronization, find the op.

A region that synchronizes with the host cannot be captured (a CUDA graph records no host work).
The classifier knows the usual suspects (``.item()``, ``nonzero``); an op it does not know (a
custom op that reads a value back, ``torch.tensor(0.0, device="cuda")`` copying a Python number
to the device) shows up only when it runs. Each warm-up call therefore runs under a
:class:`SyncDetector`; where a detector exists and the region still runs its FX module, the call
goes node by node (an ``fx.Interpreter``: same ops, same kernels, same results) and the first node
after which the detector saw a synchronization is the one to blame. A region compiled by Inductor
runs its compiled code from its first warm-up call; if that synchronizes, the region keeps eager's
kernels and gets one more warm-up call, node by node, to find the op. :func:`warmup_call` returns
what it saw; the runner then asks the executor to split the region there (``runtime/syncsplit.py``):
that op runs eagerly, the rest is captured. Without a located node the whole region runs eagerly
(``host_sync_in_warmup``).

Detectors: :func:`cuda_sync_detector` (``torch.cuda.set_sync_debug_mode("warn")``, the warning
PyTorch gives for every synchronizing call) wherever CUDA graphs are captured; for simulated graphs
on a CPU there is none, and tests install an :class:`OpSyncDetector` that treats given operators
as synchronizing, so the split runs the same code on a CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from typing import Any, Callable, Iterable, Iterator, Optional, Protocol

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..common.fx_utils import op_name, source_location
from .inner import InnerFallback, LazyInner

__all__ = ["SyncDetector", "SyncLog", "SyncHit", "CudaSyncDetector", "OpSyncDetector",
           "cuda_sync_detector", "run_located", "sync_location", "warmup_call"]

log = logging.getLogger(__name__)

_SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncLog:
    """What a detector saw while it watched: one message per synchronization, in order."""

    def __init__(self) -> None:
        self.messages: list[str] = []

    def count(self) -> int:
        return len(self.messages)


class SyncDetector(Protocol):
    def watch(self) -> "contextlib.AbstractContextManager[SyncLog]":
        """A context in which every host synchronization is appended to the yielded log (read
        after each node while the context is open)."""


@dataclasses.dataclass(frozen=True)
class SyncHit:
    """A synchronization seen in a warm-up call; ``node`` is the region node that caused it (None
    when it could not be located, e.g. in compiled code)."""

    node: Optional[torch.fx.Node]
    detail: str


class _CaughtLog(SyncLog):
    """A SyncLog read from the list warnings.catch_warnings(record=True) fills."""

    def __init__(self, caught: list) -> None:
        super().__init__()
        self._caught = caught
        self._read = 0

    def count(self) -> int:
        caught = self._caught
        while self._read < len(caught):
            text = str(caught[self._read].message)
            self._read += 1
            if _SYNC_WARNING in text:
                self.messages.append(text.strip().splitlines()[0])
        return len(self.messages)


class CudaSyncDetector:
    """CUDA's sync debug mode in "warn" for the duration of the watch: PyTorch warns at each
    synchronizing call. Other warnings (its one-time notice that the mode is a prototype among them)
    are passed on afterwards."""

    @contextlib.contextmanager
    def watch(self) -> Iterator[SyncLog]:
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sync = _CaughtLog(caught)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield sync
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        sync.count()
        for w in caught:
            text = str(w.message)
            if _SYNC_WARNING in text:
                continue
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def cuda_sync_detector() -> Optional[CudaSyncDetector]:
    """The detector for real CUDA graphs, or None without CUDA."""
    return CudaSyncDetector() if torch.cuda.is_available() else None


class _OpWatch(TorchDispatchMode):
    def __init__(self, ops: frozenset, sync: SyncLog) -> None:
        super().__init__()
        self.ops = ops
        self.sync = sync

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.ops or func.overloadpacket in self.ops:
            self.sync.messages.append(f"{func} synchronizes with the host (OpSyncDetector)")
        return func(*args, **(kwargs or {}))


class OpSyncDetector:
    """Test aid for simulated graphs: the given ATen operators (overloads or packets, e.g.
    ``torch.ops.aten._local_scalar_dense``) count as host synchronizations, as CUDA's sync debug mode
    would report them on a GPU. Install with ``cgbackend.find_backend(m).shared.sync_detector = ...``."""

    def __init__(self, ops: Iterable[Any]) -> None:
        self.ops = frozenset(ops)

    @contextlib.contextmanager
    def watch(self) -> Iterator[SyncLog]:
        sync = SyncLog()
        with _OpWatch(self.ops, sync):
            yield sync


class _Locator(torch.fx.Interpreter):
    """Runs a region module node by node and remembers the first node that synchronized."""

    def __init__(self, module: torch.fx.GraphModule, sync: SyncLog) -> None:
        super().__init__(module)
        self.sync = sync
        self.hit: Optional[SyncHit] = None

    def run_node(self, n: torch.fx.Node) -> Any:
        before = self.sync.count()
        result = super().run_node(n)
        if self.hit is None and self.sync.count() > before:
            self.hit = SyncHit(n, self.sync.messages[before])
        return result


def run_located(module: torch.fx.GraphModule, ins: list, detector: SyncDetector) -> tuple[Any, Optional[SyncHit]]:
    """Run ``module(*ins)`` watched; (outputs, the first synchronization and its node, or None)."""
    with detector.watch() as sync:
        locator = _Locator(module, sync)
        out = locator.run(*ins)
    hit = locator.hit
    if hit is None and sync.count():
        hit = SyncHit(None, sync.messages[0])
    return out, hit


def _run_watched(fn: Callable[[], Any], detector: Optional[SyncDetector]) -> tuple[Any, Optional[SyncHit]]:
    if detector is None:
        return fn(), None
    with detector.watch() as sync:
        out = fn()
    return out, (SyncHit(None, sync.messages[0]) if sync.count() else None)


def warmup_call(code: Any, ins: list, detector: Optional[SyncDetector], strict: bool
                ) -> tuple[Any, Optional[SyncHit], bool]:
    """One warm-up call of a region whose code is ``code`` (a RegionCode: ``fn`` and ``lazy``);
    the first compiles its code (``code.lazy``) and runs it, watched: every warm-up call then runs
    the code the graph will capture (its memory too: in training, eager's kernels would set the
    step's peak). Returns (outputs, the synchronization seen or None, again): ``again`` when the
    compiled code synchronized and the region fell back to eager's kernels, whose next warm-up
    call (one more, uncounted) finds the op."""
    lazy: Optional[LazyInner] = code.lazy
    if lazy is not None and lazy.state == "pending":
        fn = code.fn = lazy.compile()
        if fn is not lazy.module:
            out, hit = _run_watched(lambda: lazy.first_call(fn, ins), detector)
            kept, out = out
            code.fn = kept
            if hit is not None and kept is not lazy.module and not strict:
                # The compiled code synchronized: keep eager's kernels for this region, and give it
                # one more (eager) warm-up call, which finds the op so the region can be split.
                code.fn = lazy.fall_back(InnerFallback.HOST_SYNC, hit.detail)
                return out, None, True
            return out, hit, False
    if detector is None:
        return code.fn(*ins), None, False
    fn = code.fn
    if isinstance(fn, torch.fx.GraphModule):
        out, hit = run_located(fn, ins, detector)
    else:
        out, hit = _run_watched(lambda: fn(*ins), detector)
    return out, hit, False


def sync_location(node: Optional[torch.fx.Node]) -> str:
    """`` at <op> (node <name>, <source line>)`` for a log line, or "" without a node."""
    if node is None:
        return ""
    source = source_location(node)[0]
    return f" at {op_name(node)} (node {node.name}{', ' + source if source else ''})"
