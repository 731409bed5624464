"""What ``explain`` leaves behind in Dynamo's caches: nothing that another compiled model uses.

``explain`` compiles the model with a backend instance of its own, which captures nothing. Dynamo
keeps each compiled frame on the traced code object (a cache entry, with the backend that made it),
and the layers of two models of one class share their code objects. A ``torch._dynamo.reset()``
would drop every model's entries (their graphs, their counters); instead, once the report is built,
only the entries explain's instance made are invalidated, as Dynamo does itself when an object a
guard holds dies. Other backends' entries never match a call under explain's instance anyway
(Dynamo checks an entry's backend), so models compiled before or after keep their graphs.

Dynamo also marks a code object to be run as it is from then on, for every later compile in the
process, when it gives up a frame (a graph break inside a loop, as by name at a MoE's dispatch
loop). A code object Dynamo converted during explain was not so marked before (a marked one is not
converted), so :class:`Isolated` records the code objects Dynamo converts while explain traces and
gives them their default treatment back afterwards. And Dynamo remembers per code object the sizes
it saw (automatic dynamic shapes: a size that changed is traced dynamic at the next compile of that
code): explain's traces would make another model's next compile dynamic where it would not be, so
that record is put back as it was.

Private API of Dynamo (``_debug_get_cache_entry_list``, ``input_codes``, the extra state's
``invalidate``, ``set_code_exec_strategy``), feature-tested: where it is missing, explain's
entries or marks stay and the report's notes say so.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Optional

__all__ = ["Isolated", "forget_entries"]


def _owner(backend: Any) -> Any:
    """The backend behind Dynamo's wrappers of it (torch.compile's, the callback's)."""
    for _ in range(8):
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(backend, "compiler_fn", None)
        if inner is None or inner is backend:
            return backend
        backend = inner
    return backend


def forget_entries(instance: Any) -> Optional[str]:
    """Invalidate every Dynamo cache entry made with ``instance``; returns why it could not, or None."""
    try:
        from torch._dynamo import convert_frame
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        from torch._dynamo.guards import DeletedGuardManagerWrapper
        seen = list(convert_frame.input_codes.seen)
    except (ImportError, AttributeError) as exc:
        return f"explain's compiled frames were left in Dynamo's caches, unused ({type(exc).__name__}: {exc})"
    for ref in seen:
        code = ref() if isinstance(ref, weakref.ref) else ref
        if code is None:
            continue
        for entry in _debug_get_cache_entry_list(code):
            if _owner(getattr(entry, "backend", None)) is not instance:
                continue
            manager = entry.guard_manager
            extra = getattr(manager, "extra_state", None)
            if extra is None or getattr(manager, "cache_entry", None) is None:
                continue  # invalidated already
            extra.invalidate(entry, DeletedGuardManagerWrapper("cgbackend.explain is done with this frame"))
    return None


class Isolated:
    """While explain traces: record the code objects Dynamo converts; afterwards, invalidate the
    entries ``instances`` made (:func:`forget_entries`) and undo Dynamo's marks on those codes.
    ``notes``: what could not be undone."""

    def __init__(self) -> None:
        self.instances: list[Any] = []
        self.codes: list[Any] = []
        self.notes: list[str] = []
        self._tracker: Any = None
        self._saved_sizes: Any = None

    def __enter__(self) -> "Isolated":
        try:
            from torch._dynamo import convert_frame
            tracker = convert_frame.input_codes
            add = tracker.add
        except (ImportError, AttributeError):
            return self
        codes = self.codes

        def recording_add(code: Any) -> None:
            codes.append(code)
            add(code)

        tracker.add = recording_add  # this Tracker instance only, until __exit__
        self._tracker = tracker
        self._saved_sizes = _code_state()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._tracker is not None:
            vars(self._tracker).pop("add", None)
        for instance in self.instances:
            note = forget_entries(instance)
            if note and note not in self.notes:
                self.notes.append(note)
        self._unmark()
        if self._saved_sizes is not None:
            state, saved = self._saved_sizes
            state.clear()
            state.update(saved)

    def _unmark(self) -> None:
        if not self.codes:
            return
        try:
            from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
        except ImportError as exc:
            self.notes.append("code objects Dynamo gave up while explain traced stay skipped by later compiles in "
                              f"this process ({type(exc).__name__}: {exc})")
            return
        default = _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT)
        for code in {id(c): c for c in self.codes}.values():
            set_code_exec_strategy(code, default)
        self.codes.clear()


def _code_state() -> Any:
    """Dynamo's record of the sizes each code object was traced with, and a copy of it (None where
    this torch keeps it elsewhere)."""
    try:
        from torch._dynamo.pgo import get_code_state
        state = get_code_state()
        return state, copy.deepcopy(dict(state))
    except (ImportError, AttributeError, TypeError):
        return None
