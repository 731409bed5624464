"""Small measuring helpers shared by the harness: progress lines, device sync, percentiles, error
texts, Dynamo's and cudagraph trees' counters, clean-up between contenders."""

from __future__ import annotations

import contextlib
import gc
import math
import sys
from typing import Any, Iterator, Optional, Sequence

import torch
from ..runtime.capture import clear_blas_workspaces


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def error_text(exc: BaseException, limit: int = 600) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    # Dynamo appends long hints; the first few lines carry the cause.
    text = " | ".join(lines[:6])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def graph_breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def by_first_line(counts: dict[Any, int]) -> tuple[int, dict[str, int]]:
    """Counts per graph-break reason, summed per first line: (total, per line)."""
    reasons: dict[str, int] = {}
    for reason, n in counts.items():
        key = (str(reason).strip().splitlines() or [""])[0][:200]
        reasons[key] = reasons.get(key, 0) + n
    return sum(reasons.values()), reasons


def counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters
    return int(counters[group][key])


def cudagraph_tree_counts(device: torch.device) -> tuple[Optional[int], Optional[int]]:
    """(CUDA graphs recorded, re-records) held by Inductor's cudagraph-tree manager for this device;
    reduce-overhead and backend="cudagraphs" both record through it. (0, 0) when no manager exists;
    (None, None) when it cannot be inspected. Must be read before torch._dynamo.reset()."""
    if device.type != "cuda":
        return 0, 0
    try:
        from torch._inductor import cudagraph_trees
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = cudagraph_trees.get_manager(index, create_if_none_exists=False)
        if manager is None:
            return 0, 0
        count = 0
        stack = list(manager.get_roots())
        while stack:
            node = stack.pop()
            count += 1
            for children in node.children.values():
                stack.extend(children)
        rerecords = sum(sum(per_fn.values()) for per_fn in manager.num_rerecord.values())
        return count, int(rerecords)
    except Exception:
        return None, None


def cleanup(device: torch.device) -> None:
    try:
        torch._dynamo.reset()
    except Exception:
        pass
    try:
        import cgbackend
        cgbackend.reset()
    except Exception:
        pass
    gc.collect()
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            # cuBLAS workspaces (32 MiB per stream on Hopper) outlive the contender that made them:
            # dropped, each contender's peak includes the workspaces it needs, whatever ran before.
            clear_blas_workspaces()
            torch.cuda.empty_cache()
        except Exception:
            pass


def memory_baseline(device: torch.device, alone: bool, row: dict) -> None:
    """Before a contender's compile: a clean device (``alone``: Dynamo and cgbackend reset too),
    the peak counter reset and the memory already held in ``row["mem_baseline_bytes"]``."""
    cuda = device.type == "cuda"
    if alone:
        cleanup(device)
    elif cuda:
        # Garbage of the contenders before (autograd cycles holding activations) would count in
        # this one's baseline and be freed during its calls (1 MiB of peak memory seen that way);
        # so would their cuBLAS workspaces, which a later clear frees (held memory below zero).
        gc.collect()
        torch.cuda.synchronize(device)
        clear_blas_workspaces()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        row["mem_baseline_bytes"] = int(torch.cuda.memory_allocated(device))


class PeakWindow:
    """A contender's peak device memory over its own calls, leaving out what the harness allocates
    between them (:meth:`excluded`): judging a training step's accuracy takes float32 differences of
    every gradient against the reference (896 MiB for ``dense-llama8b-shape``), which would
    otherwise stack on whatever the contender holds between steps and become its peak."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocated = 0
        self.reserved = 0

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """The peak so far is kept; the counter restarts when the block ends."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        self.allocated = max(self.allocated, torch.cuda.max_memory_allocated(self.device))
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))
        try:
            yield
        finally:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self) -> tuple[int, int]:
        """(allocated, reserved): the highest of the windows kept and the one still open."""
        return (max(self.allocated, int(torch.cuda.max_memory_allocated(self.device))),
                max(self.reserved, int(torch.cuda.max_memory_reserved(self.device))))


def sanitize(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return sanitize(value.item())
    return str(value)
