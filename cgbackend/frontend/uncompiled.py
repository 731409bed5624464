"""Calls Dynamo ran without the backend: counted, with where and why, said once.

Dynamo runs a frame as plain Python, without a word, in a few cases: its function was compiled
``recompile_limit`` times (8) and a later call matches none of those graphs (from then on that
function runs uncompiled for the rest of the process, for every call that misses), or its compile
failed and Dynamo ran the frame as it is. Nothing of the model's results changes (they are
eager's), but nothing of those calls is graphed, and ``cgbackend.stats()`` would count nothing.

Where cgbackend calls the compiled function itself it sees such a call directly: no compiled
graph of the instance ran during it (a regional layer's call, regional_calls.py; a call of the
model compiled by ``cgbackend.compile``, whose wrapper then counts ``model``). Where it does not
(``torch.compile(model, backend="cgbackend")``, or a frame inside a layer) it sees the compiles:
a function compiled ``recompile_limit`` times has reached the limit, and is named in the report.

Counted in ``stats()["uncompiled_calls"]`` (``uncompiled_by``: where), explained in the report's
notes, logged and warned once per instance (:class:`~cgbackend.notices.UncompiledCallsWarning`,
of the ``NothingCapturedWarning`` family).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ..common.notices import UncompiledCallsWarning
from ..common.user_code import warn
from ..common.wording import count

__all__ = ["UncompiledCalls", "recompile_limit"]

log = logging.getLogger(__name__)


def recompile_limit() -> int:
    """Dynamo's limit on the graphs of one function (``recompile_limit``, ``cache_size_limit`` in
    older torch)."""
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit", 8))


def _graphs_of_compiling_frame() -> Optional[int]:
    """The graphs Dynamo holds for the code it is compiling now, this one included; None where this
    torch cannot tell (private API, feature-tested)."""
    translator = getattr(getattr(torch._dynamo, "symbolic_convert", None), "InstructionTranslator", None)
    entries = getattr(getattr(torch._dynamo, "eval_frame", None), "_debug_get_cache_entry_list", None)
    try:
        tx = translator.current_tx() if translator is not None else None
        code = getattr(tx, "f_code", None)
        return len(entries(code)) + 1 if code is not None and entries is not None else None
    except Exception:  # no frame is being compiled (a graph compiled outside Dynamo)
        return None


class UncompiledCalls:
    """One backend instance's record (its counters)."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters
        self.reasons: dict[str, str] = {}
        """where -> why, the first reason seen there."""
        self.limits: dict[str, str] = {}
        """Functions that reached Dynamo's recompile limit -> their source location."""
        self.warned = False

    def note(self, where: str, why: str, calls: int = 1) -> None:
        """``calls`` calls ran at ``where`` without the backend, because of ``why``."""
        self.counters.uncompiled_calls += calls
        self.counters.uncompiled_by[where] += calls
        if where not in self.reasons:
            self.reasons[where] = why
            log.warning("cgbackend: %s ran without cgbackend (as plain Python, uncompiled): %s", where, why)
        self._warn(f"{where} ran without cgbackend (as plain Python, uncompiled): {why}")

    def on_compile(self, name: str) -> None:
        """A graph of the function Dynamo is compiling (``name``) was compiled: with it, the function
        holds ``recompile_limit`` graphs, and a later call that matches none of them runs uncompiled."""
        graphs = _graphs_of_compiling_frame()
        if graphs is None or graphs < recompile_limit() or name in self.limits:
            return
        self.limits[name] = f"{graphs} graphs"
        self._warn(f"Dynamo compiled {name} {graphs} times, its recompile limit "
                   f"(torch._dynamo.config.recompile_limit={recompile_limit()}): a later call that matches none "
                   "of its graphs runs without cgbackend (TORCH_LOGS=recompiles names what changes)")

    def _warn(self, message: str) -> None:
        if self.warned:
            return
        self.warned = True
        warn(f"cgbackend: {message}", UncompiledCallsWarning)  # at the user's call, not cgbackend's frame

    def notes(self) -> list[str]:
        """The report's lines: each place calls ran uncompiled, how many, and why."""
        out = [f"{count(self.counters.uncompiled_by.get(where, 0), 'call')} of {where} ran without cgbackend "
               f"(uncompiled): {why}" for where, why in self.reasons.items()]
        out += [f"{name} reached Dynamo's recompile limit ({what}): later calls that match none of its graphs "
                "run without cgbackend" for name, what in self.limits.items()]
        return out

    def reset(self) -> None:
        self.reasons.clear()
        self.limits.clear()
        self.warned = False
