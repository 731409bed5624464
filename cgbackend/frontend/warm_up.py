"""Serving: capture the graphs of a list of batch sizes before the first request.

A server that compiles on its first requests pays each size's warm-up calls and capture while a
user waits, and finds out only then how much memory its graphs take. ``warm_up`` runs a compiled
model at each size of a list (as many calls as the ``warmup`` option asks for, then the one that
captures), inference only, largest size first, and says what each size cost: seconds, graphs
captured, pool memory added. The sizes share one pool: a smaller size's graph takes the memory the
larger ones' temporaries and released outputs left, so it adds little (docs/dynamic-shapes.md).
With bucketing (option ``capture_sizes``), a size stands for every request size padded to it: warm
the capture sizes themselves. Sizes above ``max_capture_size`` are run but not captured (by design:
see that option).

    compiled = cgbackend.compile(model)
    done = cgbackend.warm_up(compiled, lambda n: (torch.randint(0, vocab, (n, 1), device="cuda"),),
                             sizes=[1, 2, 4, 8, 16, 32])
    print(done)   # one line per size, and the totals
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Sequence

import torch

from ..common.wording import count

__all__ = ["WarmUp", "warm_up"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmUp:
    """What :func:`warm_up` did: one row per size (``size``, ``seconds``, ``graphs`` captured,
    ``pool_bytes`` the captures reserved) and the totals. ``pool_bytes`` is the growth of the CUDA
    caching allocator's reserved memory across the captures (0 with simulated graphs)."""

    sizes: list[dict[str, Any]]
    seconds: float
    graphs: int
    pool_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"size {r['size']:>6}: {r['graphs']} graph(s), {r['pool_bytes'] / 2**20:.1f} MiB, "
                 f"{r['seconds']:.2f} s" for r in self.sizes]
        lines.append(f"warm-up: {count(len(self.sizes), 'size')}, {count(self.graphs, 'graph')}, "
                     f"{self.pool_bytes / 2**20:.1f} MiB of graph memory, {self.seconds:.2f} s")
        return "\n".join(lines)


def warm_up(compiled: Any, make_inputs: Callable[[int], Any], sizes: Sequence[int]) -> WarmUp:
    """Run ``compiled`` (from ``cgbackend.compile`` or ``torch.compile(backend="cgbackend")``) at
    every size of ``sizes``, largest first, until its graphs for that size are captured, under
    ``torch.no_grad()``.
    ``make_inputs(size)`` returns the call's positional arguments as a tuple, or ``(args, kwargs)``
    as a tuple of a tuple and a dict. Logs one INFO line per size (``cgbackend.frontend.warm_up``); returns
    a :class:`WarmUp`."""
    from ..by_name import find_backend
    instance = find_backend(compiled)
    checked = []
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"cgbackend.warm_up: sizes must be positive integers, got {size!r}")
        checked.append(size)
    if not checked:
        raise ValueError("cgbackend.warm_up: no sizes given")
    # Largest first: the last region's outputs are released after each capture
    # (runtime/loose_outputs.py), so each smaller size's graph fits in the memory the larger ones
    # left in the pool.
    checked = sorted(set(checked), reverse=True)
    calls = instance.config.warmup + 1
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for i, size in enumerate(checked):
        made = make_inputs(size)
        args, kwargs = _split(made)
        before = instance.stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(calls):
                compiled(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        after = instance.stats()
        row = {"size": size, "seconds": time.perf_counter() - t0,
               "graphs": after["graphs_captured"] - before["graphs_captured"],
               "pool_bytes": after["pool_bytes"] - before["pool_bytes"]}
        rows.append(row)
        log.info("cgbackend: warm-up: size %d (%d of %d): %d graph(s), %.1f MiB, %.2f s",
                 size, i + 1, len(checked), row["graphs"], row["pool_bytes"] / 2**20, row["seconds"])
    done = WarmUp(rows, time.perf_counter() - start, sum(r["graphs"] for r in rows),
                  sum(r["pool_bytes"] for r in rows))
    log.info("cgbackend: warm-up done: %s, %s, %.1f MiB of graph memory, %.2f s",
             count(len(rows), "size"), count(done.graphs, "graph"), done.pool_bytes / 2**20, done.seconds)
    return done


def _split(made: Any) -> tuple[tuple, dict]:
    if (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], tuple)
            and isinstance(made[1], dict)):
        return made[0], made[1]
    if isinstance(made, tuple):
        return made, {}
    raise TypeError(f"cgbackend.warm_up: make_inputs must return a tuple of arguments (or "
                    f"(args, kwargs)), got {type(made).__name__}")
