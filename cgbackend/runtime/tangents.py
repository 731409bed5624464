"""Incoming gradients and their buffers, freed at their last read rather than held to the end.

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
too (``.data``). The owning tensor goes to the capture in an :class:`OwnerTransfer`: while the
capture runs, AOT autograd's runtime call (``call_func_at_runtime_with_args``, private:
feature-tested) is wrapped, and an argument that is a buffer's alias is replaced by its owner in the list that the
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

The incoming gradients themselves. Autograd's engine, and AOT autograd's backward frame, hold the
gradient a node receives until that node returns; for a region compiled whole, that is the whole
backward, where an eager model frees it after its last layer's backward. So the outputs only the
caller reads reach the caller through :class:`GradRelay` (its copies of a replay's outputs, or a
warm-up call's outputs themselves), whose backward hands each incoming gradient on as a tensor on
a storage that does not own its memory, the owner held by a transfer: the region's backward then
holds the last reference. Inductor's code (a warm-up call) takes the owner through the same wrap
and frees it after its last read; a training entry's backward drops it once it is copied into the
backward graph's buffer, before the graph replays or is captured (a backward that then runs
without the graph reads that buffer); and the end of the backward pass (the engine's callback)
drops any owner left, so nothing outlives the pass. Counted in ``grads_relayed`` and
``grads_relayed_freed_early``.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import Any, Optional

import torch

from .loose_outputs import StorageWeakRef, loose_alias, loose_supported

__all__ = ["GradRelay", "OwnerTransfer", "QUEUE_CALLBACK", "owner_transfer_supported", "relay_copies",
           "relay_outputs", "release_incoming"]

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


def owner_transfer_supported() -> bool:
    """Can a released buffer's owner reach the compiled backward's arguments?"""
    return StorageWeakRef is not None and _aot_runtime() is not None


# The wrap is process-wide (AOT autograd's module attribute), so the transfers it serves are too:
# the backward of a capture runs on autograd's device thread, not the thread that entered.
_lock = threading.RLock()
_active: list["OwnerTransfer"] = []
_original: Optional[Any] = None
_relayed: dict[int, "OwnerTransfer"] = {}
"""id of a relayed gradient's alias -> the transfer holding its owner (release_incoming)."""


def _call(f: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
    """AOT autograd's runtime call, with the owners of the active transfers put into a stolen
    argument list (``steal_args``: the callee takes the list, and compiled code clears it)."""
    steal = kwargs.get("steal_args", rest[0] if rest else False)
    if steal and isinstance(args, list) and _active:
        for transfer in list(_active):
            transfer.give(args)
    return _original(f, args, *rest, **kwargs)  # type: ignore[misc]


class OwnerTransfer:
    """Passes the ownership of buffers read through non-owning aliases to the compiled backward
    that reads them (a context manager): released gradient buffers during one backward capture, or
    a relay's incoming gradients during one backward pass. It holds each owner until the compiled
    backward takes it as its argument (which frees it after its last read), it is dropped once read
    (:meth:`drop`), or the transfer ends."""

    def __init__(self, counters: Any = None) -> None:
        self._owners: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._refs: list[tuple[int, Any, int]] = []
        self.given = 0
        """Owners a compiled backward took as its argument (freed at their last read)."""
        self._module: Optional[Any] = None
        self.counters = counters
        """A relay's: the backend's counters, told at close how many owners went early."""
        self.closed = False

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
        """Replace each alias in ``args`` by its owner, which then lives only in ``args``. The
        very alias only: a tensor merely on the same memory may be another relay's, whose owner
        must outlive this call (the same gradient relayed to two regions)."""
        with _lock:
            if not self._owners:
                return
            for j, arg in enumerate(args):
                pair = self._owners.get(id(arg))
                if pair is not None and pair[0] is arg:
                    self._take(j, args, pair)
                    if not self._owners:
                        return

    def _take(self, j: int, args: list, pair: tuple) -> None:
        del self._owners[id(pair[0])]
        _relayed.pop(id(pair[0]), None)
        args[j] = pair[1]
        self.given += 1

    def drop(self, alias: torch.Tensor) -> bool:
        """The owner of ``alias`` goes now (nothing reads it any more); False if not held here."""
        with _lock:
            pair = self._owners.get(id(alias))
            if pair is None or pair[0] is not alias:
                return False
            del self._owners[id(alias)]
            _relayed.pop(id(alias), None)
        del pair
        return True

    def released(self) -> dict[int, int]:
        """Key -> bytes of the buffers whose memory went back to the pool (nothing else held
        them); read after the capture."""
        return {key: nbytes for key, ref, nbytes in self._refs if ref.expired()}

    def __enter__(self) -> "OwnerTransfer":
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
        with _lock:
            for key in self._owners:
                _relayed.pop(key, None)
            owners, self._owners = self._owners, {}
            module, self._module = self._module, None
            if module is not None:
                _active.remove(self)
                if not _active and getattr(module, _ENTRY) is _call:
                    setattr(module, _ENTRY, _original)
        del owners  # the owners left go now (outside the lock: freeing may run other code)

    def close(self) -> None:
        """End of the backward pass a relay's transfer served (an autograd engine callback, or the
        relaying node going after a pass that raised); once."""
        with _lock:
            if self.closed:
                return
            self.closed = True
        if self.counters is not None:
            self.counters.grads_relayed_freed_early += self.given
        self.__exit__(None, None, None)


def _queue_callback() -> Optional[Any]:
    """The autograd engine's end-of-backward-pass hook (semi-private; feature-tested)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    return getattr(engine, "queue_callback", None)


QUEUE_CALLBACK = _queue_callback()
RELAY = QUEUE_CALLBACK is not None and loose_supported() and StorageWeakRef is not None
"""Can incoming gradients be relayed (GradRelay): non-owning storages and the end-of-pass hook."""


def _relayable(grad: Any) -> bool:
    return (type(grad) is torch.Tensor and grad.layout == torch.strided and not grad.requires_grad
            and grad.numel() > 0)


def relay(grads: tuple, counters: Any = None, node: Any = None) -> tuple:
    """``grads`` with each plain tensor replaced by a tensor on a storage that does not own its
    memory; the owners are held by a transfer until a compiled backward takes them (its stolen
    arguments), ``release_incoming`` drops them, or the backward pass ends (or, for a pass that
    raised, which runs no end-of-pass callback, ``node``, the relaying node, goes)."""
    if not RELAY or torch.is_grad_enabled():  # grad mode in backward: create_graph, left as is
        return grads
    transfer = None
    out = list(grads)
    for i, grad in enumerate(grads):
        if not _relayable(grad):
            continue
        if transfer is None:
            transfer = OwnerTransfer(counters).__enter__()
        alias = loose_alias(grad)
        transfer.add(i, alias, grad)
        with _lock:
            _relayed[id(alias)] = transfer
        out[i] = alias
        if counters is not None:
            counters.grads_relayed += 1
    if transfer is not None:
        QUEUE_CALLBACK(transfer.close)  # type: ignore[misc]
        if node is not None:
            weakref.finalize(node, transfer.close)
    return tuple(out)


def release_incoming(grads: Any) -> int:
    """Drop the owners of the relayed gradients among ``grads`` (their values were copied where
    they are read); returns how many went."""
    if not _relayed:
        return 0
    dropped = 0
    for grad in grads:
        transfer = _relayed.get(id(grad)) if grad is not None else None
        if transfer is not None and transfer.drop(grad):
            dropped += 1
            if transfer.counters is not None:
                transfer.counters.grads_relayed_freed_early += 1
    return dropped


class GradRelay(torch.autograd.Function):
    """The caller's view of outputs only the caller reads: copies of them (``copy``, training
    replays, whose outputs lie in graph memory) or new tensors on their memory (warm-up calls).
    Its backward passes each incoming gradient on through :func:`relay`, so the region's
    backward, not autograd's buffers, holds the last reference to it."""

    @staticmethod
    def forward(ctx: Any, copy: bool, counters: Any, *tensors: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.counters = counters
        return tuple(t.clone() if copy else t.detach() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        return (None, None) + relay(grads, ctx.counters, ctx)


def relay_copies(tensors: list, counters: Any = None) -> list:
    """Copies of ``tensors`` for the caller, each differentiable back to its source (clone())."""
    if not RELAY:
        return [t.clone() for t in tensors]
    return list(GradRelay.apply(True, counters, *tensors))


def relay_outputs(outputs: Any, positions: Any, counters: Any = None) -> Any:
    """A warm-up call's outputs with those at ``positions`` that require grad passed through
    GradRelay (the caller alone reads them)."""
    if not RELAY or not isinstance(outputs, (list, tuple)) or not torch.is_grad_enabled():
        return outputs
    picked = [i for i in sorted(positions) if i < len(outputs) and isinstance(outputs[i], torch.Tensor)
              and outputs[i].requires_grad]
    if not picked:
        return outputs
    out = list(outputs)
    for i, value in zip(picked, GradRelay.apply(False, counters, *(outputs[i] for i in picked))):
        out[i] = value
    return tuple(out) if isinstance(outputs, tuple) else out

