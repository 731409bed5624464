"""Parameter storage a graph may rely on: addresses in the key, checks before backward, and
parameters whose storage an engine moves on purpose (FSDP2's unsharded parameters).

A CUDA graph bakes in the address of every tensor it reads. Parameters are read in place, so a
graph is only valid while each parameter's storage is where it was at capture, with the bytes it
had. Three cases:

* An ordinary parameter: its ``(data_ptr, storage nbytes)`` is part of the forward key (a
  replaced or resized storage means another graph), and a training entry records it at capture;
  before a backward replay :meth:`ParamPolicy.moved` compares again, because an engine may free
  and re-allocate the storage between forward and backward (FSDP2 with
  ``reshard_after_forward=True`` resizes it to 0 after the forward and all-gathers it again,
  often elsewhere, before the backward). A moved parameter makes that backward run through the
  captured forward's autograd graph (its saved aliases share the parameter's storage object, so
  they read the current bytes), counted as ``param_moved``.
* A *volatile* parameter (``ParamPolicy.volatile`` says so; cgbackend.distributed registers
  FSDP2's unsharded parameters): its address is not part of the key at all. The graph reads a
  static copy, refreshed from the parameter before every forward replay and again before every
  backward replay (the engine has gathered it again by then). Graph counts then do not depend on
  where the allocator puts the storage; the price is one copy of the parameter per graph entry.
* A parameter whose storage has no bytes (FSDP2 resharded it): never replayed on; the key differs
  from every captured one.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["ParamAddresses", "ParamPolicy", "ptrs_equal", "storage_key"]

ptrs_equal: Optional[Callable[[list, list, Sequence[int]], bool]] = getattr(
    torch._C, "_tensors_data_ptrs_at_indices_equal", None)
"""PyTorch's C++ check that tensors[i].data_ptr() == ptrs[i] at the given positions, all three
arguments lists (CUDA builds; feature-tested: absent on CPU-only builds, where the callers read
each address in Python)."""


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's bytes are and how many its storage holds (0 after ``resize_(0)``)."""
    return t.data_ptr(), t.untyped_storage().nbytes()


class ParamPolicy:
    """How one backend instance treats parameter inputs of its graphs (see the module docstring)."""

    __slots__ = ("volatile",)

    def __init__(self) -> None:
        self.volatile: Optional[Callable[[torch.Tensor], bool]] = None
        """Predicate: parameters whose storage an engine frees and re-allocates between calls
        (cgbackend.distributed.track_fsdp sets it). None: no such parameters."""

    def is_volatile(self, t: torch.Tensor) -> bool:
        return self.volatile is not None and self.volatile(t)

    def key(self, t: torch.Tensor) -> Any:
        """A parameter's part of a graph key: its address (a storage freed with ``resize_(0)`` has
        none, 0, and one gathered again lives at a new address or at the same bytes)."""
        if self.volatile is not None and self.volatile(t):
            return "copied"
        return t.data_ptr()

    @staticmethod
    def record(static_ins: Sequence[Any], positions: Sequence[int]) -> tuple:
        """At capture: ``(pos, data_ptr, nbytes)`` of the parameters read in place."""
        return tuple((p,) + storage_key(static_ins[p]) for p in positions
                     if isinstance(static_ins[p], torch.Tensor) and static_ins[p].numel() > 0)

    @staticmethod
    def check_of(static_ins: Sequence[Any], recorded: tuple) -> Optional[tuple[list, list]]:
        """What :meth:`unmoved` compares: the recorded addresses aligned with the static inputs, and
        their positions; None without PyTorch's C++ comparison."""
        if ptrs_equal is None or not isinstance(static_ins, list) or not recorded:
            return None
        aligned: list = [None] * len(static_ins)
        for pos, ptr, _ in recorded:
            aligned[pos] = ptr
        return aligned, [pos for pos, _, _ in recorded]

    @staticmethod
    def unmoved(static_ins: Sequence[Any], check: Optional[tuple[list, list]]) -> bool:
        """Every parameter still at the address :meth:`record` saw, in one C++ comparison (a
        training entry reads hundreds of expert parameters: the per-parameter storage lookups of
        :meth:`moved` were host time in every backward). A storage's bytes change only by a
        re-allocation (a new address) or a resize to none (address 0), so the same address is the
        same storage. False: ask :meth:`moved`, which says which and how."""
        return check is not None and ptrs_equal(static_ins, check[0], check[1])

    @staticmethod
    def moved(static_ins: Sequence[Any], recorded: tuple) -> Optional[str]:
        """Before a backward replay: the first parameter (read in place) whose storage is no longer
        where it was at capture, or None. The static inputs of a training entry are aliases that
        share the parameters' storage objects, so they see a resize or re-allocation."""
        for pos, ptr, nbytes in recorded:
            now = storage_key(static_ins[pos])
            if now != (ptr, nbytes):
                return (f"input {pos}: storage at {now[0]:#x} with {now[1]} bytes, captured at "
                        f"{ptr:#x} with {nbytes} bytes")
        return None

    @staticmethod
    def refresh(static_ins: Sequence[Any], sources: Sequence[tuple[int, torch.Tensor]]) -> int:
        """Copy volatile parameters into the entry's static copies; returns how many were copied.
        Raises if a source holds no bytes (the engine has not gathered it for this pass)."""
        with torch.no_grad():
            for pos, src in sources:
                if src.untyped_storage().nbytes() == 0:
                    raise RuntimeError(
                        f"cgbackend: parameter input {pos} has no storage (size 0) when a graph needs "
                        "it: the distributed engine freed it (FSDP2 reshard) and did not gather it "
                        "again before this forward or backward")
                static_ins[pos].detach().copy_(src)
        return len(sources)


class ParamAddresses:
    """The addresses of one region's parameter inputs as the latest call had them, and the key part
    they make: where PyTorch's C++ comparison exists (CUDA builds, the one cudagraph trees uses), an
    unchanged set is one call instead of one data_ptr() each (a MoE region has hundreds). The graph
    cache keys with it, and the fast path compares with it."""

    __slots__ = ("positions", "_idx", "_ptrs", "key")

    def __init__(self, positions: tuple[int, ...]) -> None:
        self.positions = positions
        """The parameter inputs' positions."""
        self._idx = list(positions)
        self._ptrs: Optional[list] = None
        self.key: tuple = ()
        """The latest call's parameters' part of the key (their addresses)."""

    def addresses(self, ins: list) -> tuple:
        """The parameters' part of the key (ParamPolicy.key without volatile parameters: the address)."""
        last, is_list = self._ptrs, isinstance(ins, list)  # the C++ check takes lists only
        if (last is not None and is_list and len(last) == len(ins)
                and ptrs_equal(ins, last, self._idx)):
            return self.key
        ptrs = [ins[p].data_ptr() for p in self.positions]
        if ptrs_equal is not None and is_list:
            aligned: list = [None] * len(ins)
            for p, ptr in zip(self.positions, ptrs):
                aligned[p] = ptr
            self._ptrs = aligned
        self.key = tuple(ptrs)
        return self.key

    def aligned(self) -> Optional[list]:
        """The latest call's parameter addresses aligned with its inputs, for the C++ comparison
        (None where PyTorch lacks it)."""
        return self._ptrs

    def same(self, ins: list, params: tuple, ptrs: Optional[list]) -> bool:
        """Are ``ins``' parameters at the addresses ``params`` (``ptrs``: the same, aligned)?"""
        if ptrs is not None and isinstance(ins, list) and len(ptrs) == len(ins):
            return ptrs_equal(ins, ptrs, self._idx)
        found = self.addresses(ins)
        return found is params or found == params
