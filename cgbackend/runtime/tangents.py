"""Incoming-gradient buffers that the backward graph frees at their last read, in its capture.

Why. A training entry's backward graph reads each incoming gradient from a static buffer, which
the runtime fills before every replay; for an output only the caller reads, that buffer is the
output's own memory (recorder.py, ``grad_out_shared``). Held by the runtime, the buffer stayed
allocated through the whole backward capture, next to every temporary of the backward graph, and
between steps. Cudagraph trees copies the gradient into a recording input that only the compiled
backward's boxed arguments own, and Inductor's code frees it after its last read (``del
tangents_1``): dense-llama8b-shape's capture step peaked one such block (32 MiB) above
reduce-overhead's, and held it between steps above eager.

What. At the pool's last backward capture (the pool is sealed: no capture follows into it, the
point where static inputs go to the backward graph, backward.py ``release_inputs``), the runtime
keeps each such buffer only as a tensor on a storage that does not own its memory
(loose_outputs.loose_alias); the captured forward's outputs, the autograd roots, get that storage
too (``.data``). The owning tensor goes to the capture in a :class:`Handover`: while the capture
runs, AOT autograd's runtime call (``call_func_at_runtime_with_args``, private: feature-tested) is
wrapped, and an argument that is a buffer's alias is replaced by its owner in the list that the
compiled backward takes and clears. The compiled code frees the buffer after its last read, and
the backward graph's later temporaries may take the block. An owner no compiled backward took
(eager kernels, an opaque module call, a torch whose AOT autograd calls its backward otherwise) is
dropped when the capture is over: its block is the pool's again from then on, as after a release.

Why that is safe. The graphs read and write the block at its address, which no allocation outside
a capture into this pool receives, and no capture into it follows. Each forward replay writes the
output there and the caller's copy is made right after; the backward replay's staging copy writes
the incoming gradient before the graph reads it. Between a forward replay and its backward, no
graph that may use the block replays but this entry's backward graph (pool.py, the replay-order
rule). That backward graph may put its own outputs there (parameter gradients): before the next
call replays anything, a ``.grad`` still aliasing them gets its own memory, and anything else still
holding them keeps the forward from replaying (backward.py ``reclaim_grads``).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Optional

import torch

from .loose_outputs import StorageWeakRef

__all__ = ["Handover", "handover_supported"]

_ENTRY = "call_func_at_runtime_with_args"


def _aot_runtime() -> Optional[Any]:
    """AOT autograd's runtime module where its compiled backward is called, or None where torch
    has no such call. Imported on use: it imports Dynamo, which must come first."""
    try:
        importlib.import_module("torch._dynamo")  # AOT autograd's runtime imports it: first
        from torch._functorch._aot_autograd import runtime_wrappers
    except ImportError:  # pragma: no cover - present in torch 2.11 and 2.13
        return None
    return runtime_wrappers if callable(getattr(runtime_wrappers, _ENTRY, None)) else None


def handover_supported() -> bool:
    """Can a released buffer's owner reach the compiled backward's arguments?"""
    return StorageWeakRef is not None and _aot_runtime() is not None


# The wrap is process-wide (AOT autograd's module attribute), so the handovers it serves are too:
# the backward of a capture runs on autograd's device thread, not the thread that entered.
_lock = threading.Lock()
_active: list["Handover"] = []
_original: Optional[Any] = None


def _call(f: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    """AOT autograd's runtime call, with the owners of the active handovers put into a stolen
    argument list (``steal_args``: the callee takes the list, and compiled code clears it)."""
    steal = kwargs.get("steal_args", rest[0] if rest else False)
    if steal and isinstance(args, list) and _active:
        for handover in list(_active):
            handover.give(args)
    return _original(f, args, *rest, **kwargs)  # type: ignore[misc]


class Handover:
    """The owning tensors of released gradient buffers during one backward capture (a context
    manager): given to the compiled backward that reads their aliases, or dropped at exit."""

    def __init__(self) -> None:
        self._owners: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._refs: list[tuple[int, Any, int]] = []
        self.given = 0
        """Owners a compiled backward took as its argument (freed at their last read)."""
        self._module: Optional[Any] = None

    def add(self, key: int, alias: torch.Tensor, owner: torch.Tensor, keep: bool = True) -> None:
        """``owner``'s memory is read through ``alias`` from now on; ``key`` names it in
        :meth:`released`. The caller drops its own references to ``owner`` next. ``keep``: an
        incoming-gradient buffer, held for the compiled backward that reads it; otherwise only
        watched (freed once the caller's references go)."""
        storage = owner.untyped_storage()
        self._refs.append((key, StorageWeakRef(storage), storage.nbytes()))
        if keep:
            self._owners[id(alias)] = (alias, owner)

    def give(self, args: list) -> None:
        """Replace each alias in ``args`` (the very tensor, or one with its address and view) by
        its owner, which then lives only in ``args``."""
        for j, arg in enumerate(args):
            if not self._owners:
                return
            if not isinstance(arg, torch.Tensor):
                continue
            pair = self._owners.get(id(arg))
            if pair is None or pair[0] is not arg:
                pair = next((p for p in self._owners.values() if _same_view(p[0], arg)), None)
                if pair is None:
                    continue
            del self._owners[id(pair[0])]
            args[j] = pair[1]
            self.given += 1
            del pair

    def released(self) -> dict[int, int]:
        """Key -> bytes of the buffers whose memory went back to the pool (nothing else held
        them); read after the capture."""
        return {key: nbytes for key, ref, nbytes in self._refs if ref.expired()}

    def __enter__(self) -> "Handover":
        global _original
        module = _aot_runtime()
        if module is None:
            return self
        with _lock:
            if not _active:
                _original = getattr(module, _ENTRY)
                setattr(module, _ENTRY, _call)
            _active.append(self)
        self._module = module
        return self

    def __exit__(self, *exc: Any) -> None:
        self._owners.clear()  # the owners left go now: their blocks are the pool's
        module, self._module = self._module, None
        if module is None:
            return
        with _lock:
            _active.remove(self)
            if not _active and getattr(module, _ENTRY) is _call:
                setattr(module, _ENTRY, _original)


def _same_view(alias: torch.Tensor, arg: torch.Tensor) -> bool:
    if arg.layout != torch.strided or arg.dtype != alias.dtype or arg.device != alias.device:
        return False
    try:
        return arg.data_ptr() == alias.data_ptr() and arg.shape == alias.shape and arg.stride() == alias.stride()
    except RuntimeError:  # a tensor without storage (a subclass)
        return False
