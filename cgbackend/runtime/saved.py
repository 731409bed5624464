"""What a training capture's forward saves for its backward, as the capture's autograd graph holds
it: autograd's version check restored, and the saved activations of regions that cannot compute
their forward again given to their backward graph without losing that autograd graph.

Version check. A training capture saves static buffers for backward through saved-tensor hooks
that skip autograd's version check (the buffers are rewritten between replays on purpose).
:class:`SavedTensors` restores it: a saved tensor the region itself writes in place after saving
it, or a caller's tensor written between forward and backward, raises in backward as eager does,
on every call.

Slots. Each saved tensor is held in a :class:`SavedSlot`, the hooks' packed object: the autograd
graph holds the slot, the slot holds an alias of the tensor. A region that can compute its forward
again lets the last backward capture of its pool consume that graph (backward.py): autograd frees
each slot after its node ran, and the backward graph reuses the blocks.

Loosening. A region that cannot compute its forward again (random ops, global state, an input
written in place, an opaque module call such as Transformer Engine's) needs that graph for a
backward that cannot replay its graph (retain_graph, a moved parameter, a held gradient): it ran
through autograd on the captured forward's saved tensors, which every forward replay rewrites in
place. Kept allocated, they would sit next to the backward graph's temporaries for good, at the
capture's peak and between steps. Here the capture keeps its autograd graph, and :class:`Loosening`
makes each slot's tensor one on a storage that does not own its memory (``loose_alias``) right
after the node that reads it ran in the consuming capture, as the engine frees saved tensors in an
eager backward: the backward graph reuses those blocks in the same order, and the graph still finds
this call's values at the same addresses between a forward replay and the backward graph's replay
(the only graph that may lie in them, the pool being sealed). Only storages made in the entry's
pool during its forward capture are loosened (not its static inputs or outputs, not a parameter,
not a module's buffer), read from the allocator's segments.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional

import torch

from .loose_outputs import StorageWeakRef, loose_alias, loose_supported

__all__ = ["SavedSlot", "SavedTensors", "Loosening", "pool_ranges"]


class SavedSlot:
    """One saved tensor: ``tensor`` (an alias owning its memory) until loosened, then ``loose``
    (the same view on a storage that does not own it)."""

    __slots__ = ("tensor", "loose", "ptr", "__weakref__")

    def __init__(self, tensor: torch.Tensor, ptr: int) -> None:
        self.tensor: Optional[torch.Tensor] = tensor
        self.loose: Optional[torch.Tensor] = None
        self.ptr = ptr

    def get(self) -> torch.Tensor:
        return self.tensor if self.tensor is not None else self.loose

    def loosen(self) -> int:
        """Drop the owning alias; returns 1 if this call did."""
        t = self.tensor
        if t is None:
            return 0
        self.loose = loose_alias(t)
        self.tensor = None
        return 1


class SavedTensors:
    """The saved-tensor hooks (``pack``/``unpack``) around a training capture's forward (module
    docstring). ``finish()`` after the forward returns what the forward itself wrote in place after
    saving it (each replay runs the same code, so such a region raises in every backward, as eager
    does), and the storages that were saved, so that the runtime can check the caller's tensors of
    those inputs between forward and backward; ``slots`` keeps weak references to the slots the
    autograd graph still holds then."""

    def __init__(self) -> None:
        self._packed: list[tuple[weakref.ref, int, str]] = []
        self.slots: list[weakref.ref] = []
        self.unpacked: Optional[list[SavedSlot]] = None
        """While a Loosening runs: the slots unpacked since the last node finished."""
        self.alone: frozenset[int] = frozenset()
        """Storages of the saved tensors that are neither a static input nor an output of the
        region (set by the recorder, which counts both): the only ones a Loosening may free."""

    def pack(self, t: torch.Tensor) -> SavedSlot:
        # An alias without autograd history (not the tensor itself: a node saving its own output
        # would then hold that output, whose grad_fn is the node, a cycle Python cannot see).
        alias = t.detach()
        storage = alias.untyped_storage() if alias.layout == torch.strided else None
        ptr = storage.data_ptr() if storage is not None else 0
        slot = SavedSlot(alias, ptr)
        self._packed.append((weakref.ref(slot), alias._version, f"{tuple(alias.shape)}@{alias.dtype}"))
        return slot

    def unpack(self, slot: SavedSlot) -> torch.Tensor:
        if self.unpacked is not None:
            self.unpacked.append(slot)
        return slot.get()

    def finish(self) -> tuple[Optional[str], dict[int, int]]:
        """(description of a saved tensor written in place after it was saved, or None; storage
        pointer -> size in bytes of every saved tensor's storage)."""
        modified = None
        storages: dict[int, int] = {}
        for ref, version, what in self._packed:
            slot = ref()
            if slot is None or slot.tensor is None:
                continue
            alias = slot.tensor
            if slot.ptr:
                storages[slot.ptr] = alias.untyped_storage().nbytes()
            if modified is None and alias._version != version:
                modified = (f"a saved tensor of shape {what} is at version {alias._version}; "
                            f"expected version {version}")
            self.slots.append(ref)
        self._packed.clear()
        return modified, storages


def pool_ranges(handle: Any, device: torch.device) -> Optional[list[tuple[int, int]]]:
    """The address ranges of the allocator's segments that belong to the graph pool ``handle`` on
    ``device`` (torch.cuda.memory_snapshot), or None where the snapshot does not say (then nothing
    is loosened)."""
    ranges = []
    index = device.index if device.index is not None else torch.cuda.current_device()
    for seg in torch.cuda.memory_snapshot():
        if "segment_pool_id" not in seg:
            return None
        if seg.get("device") == index and tuple(seg["segment_pool_id"]) == tuple(handle):
            ranges.append((seg["address"], seg["address"] + seg["total_size"]))
    return ranges


def loosening_supported() -> bool:
    return loose_supported() and hasattr(torch.autograd.graph.Node, "register_hook")


class Loosening:
    """Loosen the slots of a retained autograd graph (module docstring): ``during(roots)`` around
    the consuming capture's backward (each node's slots right after it ran); ``rest()`` then, or
    on its own for an entry whose backward graph was captured earlier, the slots left. Only slots
    whose storage lies in ``ranges`` and is in ``saved.alone`` (none of the entry's static inputs
    and outputs)."""

    def __init__(self, saved: SavedTensors, ranges: list[tuple[int, int]]) -> None:
        self.saved = saved
        self._ok: dict[int, Any] = {}
        """Storage pointer -> (weak reference, bytes) if its slots are loosened, else None."""
        for ref in saved.slots:
            slot = ref()
            if slot is None or slot.tensor is None or slot.ptr not in saved.alone or slot.ptr in self._ok:
                continue
            storage = slot.tensor.untyped_storage()
            inside = StorageWeakRef is not None and any(lo <= slot.ptr < hi for lo, hi in ranges)
            self._ok[slot.ptr] = (StorageWeakRef(storage), storage.nbytes()) if inside else None

    def freed_bytes(self) -> int:
        """Bytes of the loosened storages whose memory went back to the pool (a module's buffer a
        slot also held stays allocated: its owner holds it)."""
        total = 0
        for ok in self._ok.values():
            if ok is not None and ok[0].expired():
                total += ok[1]
        return total

    def _loosen(self, slots: Iterable[SavedSlot]) -> None:
        for slot in slots:
            if self._ok.get(slot.ptr) is not None:
                slot.loosen()

    def during(self, roots: list) -> "_During":
        return _During(self, roots)

    def rest(self) -> None:
        self._loosen(s for s in (ref() for ref in self.saved.slots) if s is not None)


class _During:
    """Post-hooks on every node of the graph from ``roots``: the slots a node unpacked are loosened
    once it ran (its own references to them are gone by then, as eager frees them there)."""

    def __init__(self, loosening: Loosening, roots: list) -> None:
        self.loosening = loosening
        self.roots = roots
        self.handles: list = []

    def _after_node(self, grad_inputs: Any, grad_outputs: Any) -> None:
        saved = self.loosening.saved
        done, saved.unpacked = saved.unpacked, []
        self.loosening._loosen(done)

    def __enter__(self) -> "_During":
        seen: dict[int, Any] = {}  # keeps the node objects alive: their ids stay unique
        stack = [t.grad_fn for t in self.roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            self.handles.append(node.register_hook(self._after_node))
            stack.extend(n for n, _ in node.next_functions if n is not None)
        self.loosening.saved.unpacked = []
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.loosening.saved.unpacked = None
