"""MoE dispatch loops that graph breaks leave outside the graphs, said once.

Used by name (``torch.compile(model, backend="cgbackend")``), Dynamo traces with its default
settings: a data-dependent op (``nonzero``, ``torch.where(mask)``, ``.tolist()``) breaks the graph,
and a break inside a ``for`` loop makes Dynamo skip the whole frame, so an MoE layer's per-expert
loop runs eagerly, one host synchronization per expert, and what follows it sees a new shape every
call. ``cgbackend.compile(model)`` rewrites such loops into fixed-length ones before tracing
(moe/source_rewrite.py) and the dispatch into static code.

A backend instance made by name looks at the graph break that ended each graph it compiles and at
the frames Dynamo skipped since its last compile (``counters["unimplemented"]``); where one is
data-dependent and its function holds a loop static dispatch's rewrite recognizes
(moe/loops_at.py), the loop is recorded: warned once per instance
(:class:`~cgbackend.common.notices.MoELoopOutsideGraphWarning`), logged, and named in the report's
notes (``explain --by-name`` too).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import torch

from ..common.notices import MoELoopOutsideGraphWarning
from ..common.user_code import warn
from ..moe.loops_at import dispatch_loops_at

__all__ = ["LeftOutLoops", "MEASURED"]

log = logging.getLogger(__name__)

MEASURED = ("on an H200, a 48-layer Qwen3-30B-A3B-shaped transformers model with eager experts ran a "
            "2048-token call in 552 ms by name (eager: 530 ms) and in 53 ms with cgbackend.compile(model)")
"""The measurement the warning quotes (benchmarks/results/latest.json: model hf-qwen3-moe-48l, H200,
2026-11-28; contenders cgbackend-by-name and eager in one run, cgbackend in the next)."""

_DATA_DEPENDENT = re.compile(r"data.dependent|unbacked|nonzero|dynamic shape operator|\.tolist|\.item",
                             re.I)
_SKIPPED = re.compile(r"frame skipped: [\w<>.]+ \((?P<file>.+) line (?P<line>\d+)\)")


class LeftOutLoops:
    """One by-name instance's dispatch loops left outside its graphs."""

    def __init__(self, warn: bool = True) -> None:
        self.warn = warn
        self.loops: dict[tuple[str, int], Any] = {}
        """(file, first line) -> the loop's record (moe/source_rewrite.LoopRewrite)."""
        self._warned = False
        self._unsupported: dict[str, int] = dict(torch._dynamo.utils.counters["unimplemented"])

    def on_compile(self, gm: torch.fx.GraphModule) -> None:
        """A graph this instance compiles: its ending break, and the frames skipped since the last."""
        sites = []
        reason = getattr(gm, "compile_subgraph_reason", None)
        if reason is not None and getattr(reason, "graph_break", False) \
                and _DATA_DEPENDENT.search(str(getattr(reason, "reason", ""))):
            stack = getattr(reason, "user_stack", None) or []
            sites.extend((str(f.filename), int(f.lineno)) for f in stack[-1:])
        unsupported = dict(torch._dynamo.utils.counters["unimplemented"])
        for message, count in unsupported.items():
            if count > self._unsupported.get(message, 0) and _DATA_DEPENDENT.search(message):
                match = _SKIPPED.search(message)
                if match is not None:
                    sites.append((match.group("file"), int(match.group("line"))))
        self._unsupported = unsupported
        for filename, line in sites:
            for loop in dispatch_loops_at(filename, line):
                self.loops.setdefault((loop.filename, loop.lines[0]), loop)
        if self.loops and not self._warned:
            self._warned = True
            log.info("cgbackend: %s", self.message())
            if self.warn:  # at the user's call, else at the first loop left out
                first = next(iter(self.loops.values()))
                warn(self.message(), MoELoopOutsideGraphWarning, fallback=(first.filename, first.lines[0]))

    def sources(self) -> list[str]:
        """``file.py:LINE in function`` of each loop, in the order found."""
        return [loop.source for loop in self.loops.values()]

    def message(self) -> Optional[str]:
        if not self.loops:
            return None
        where = ", ".join(self.sources())
        return (f"by name, Dynamo breaks the graph at data-dependent ops of the MoE dispatch loop(s) at {where}: "
                "each such loop runs outside the graphs, eagerly, with a host synchronization per expert, and "
                "what it computes per expert sees a new shape at nearly every call. cgbackend.compile(model) "
                f"rewrites these loops statically before tracing and graphs the whole layer ({MEASURED})")

    def notes(self) -> list[str]:
        message = self.message()
        return [message] if message else []

    def to_list(self) -> list[dict[str, Any]]:
        return [{"source": loop.source, "form": loop.form} for loop in self.loops.values()]
