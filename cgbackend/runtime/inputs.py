"""What a region's inputs must keep of eager semantics when they are copied into static buffers.

A static region reads each caller's tensor through a copy of its own (region.py). Eager code
reads the caller's memory itself, so four things the copy would lose are restored here:

* **Overlap.** Two inputs that share memory (``base[:8]`` and ``base[2:]``) become two buffers. If
  the region writes one of them in place, the other's copy is stale inside the region and its
  copy-back would erase the write. :func:`overlap` finds such calls; they run eagerly, counted as
  ``aliased_inputs``. Regions that write no input in place read overlapping copies correctly and
  pay nothing.
* **Views.** An output that is a view of a copied input (``x.view(-1)``) would be a view of the
  static buffer: an eager write to ``x`` between regions would not reach it, and a later replay
  would overwrite it. :class:`InputViews` (found at capture) makes it the same view of the
  caller's tensor on every call; an output that is the input itself (``self.acc += v`` on a
  buffer) is the caller's object.
* **Saved tensors.** Training captures save static buffers for backward with hooks that skip
  autograd's version check (the buffers are rewritten between replays on purpose).
  ``saved.SavedTensors`` restores the check: a saved tensor the region itself writes in place
  after saving it, or a caller's tensor written between forward and backward, raises in backward
  as eager does (:func:`saved_modified_error`), on every call.
* **Padding.** A padded (bucketed) input gets copies of its last real row in its padding rows,
  not zeros: the region is row-independent (passes/bucket.py), so each padding row computes what
  that real row computed, and no value an eager call would not see (index -1 from a zero row
  minus an offset) reaches the graph. :func:`fill_padding`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["overlap", "overlap_candidates", "InputViews", "fill_padding", "saved_modified_error"]


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage pointer, first byte, one past the last byte) that ``t`` may touch."""
    size = t.element_size()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    start = t.storage_offset() * size
    return t.untyped_storage().data_ptr(), start, start + (last + 1) * size


def overlap_candidates(kinds: Sequence[str], written: Sequence[int], in_place: str,
                       value: str) -> tuple[int, ...]:
    """Positions to compare with the written ones: every copied input, and parameters (read in
    place, kind ``in_place``) only when a copied input is written. Two inputs that are both read
    in place (a written buffer and a parameter viewing the same base) behave as eagerly already."""
    copied = [p for p, k in enumerate(kinds) if k not in (value, in_place)]
    if any(kinds[w] not in (value, in_place) for w in written):
        return tuple(p for p, k in enumerate(kinds) if k != value)
    return tuple(copied)


def overlap(ins: Sequence[Any], written: Sequence[int], others: Sequence[int]) -> Optional[tuple[int, int]]:
    """A written position and another (``others``) whose tensors share memory, or None.
    Conservative: ranges that interleave without sharing an element (``x[::2]``, ``x[1::2]``)
    count as overlapping. Cost: one storage lookup per position, spans only on a shared storage."""
    spans: dict[int, list] = {}
    for w in written:
        t = ins[w]
        if isinstance(t, torch.Tensor) and t.numel() and t.layout == torch.strided:
            spans.setdefault(t.untyped_storage().data_ptr(), []).append((w, t))
    if not spans:
        return None
    for pos in others:
        t = ins[pos]
        if not isinstance(t, torch.Tensor) or not t.numel() or t.layout != torch.strided:
            continue
        same = spans.get(t.untyped_storage().data_ptr())
        if not same:
            continue
        _, lo, hi = _span(t)
        for w, tw in same:
            if w == pos:
                continue
            _, lo2, hi2 = _span(tw)
            if lo < hi2 and lo2 < hi:
                return w, pos
    return None


class InputViews:
    """Outputs of one captured entry that alias a static input (a copied input's buffer, or a
    parameter or buffer read in place), rebuilt on the caller's tensors after each replay.

    ``views``: output index -> input position. Valid when the static input has the caller's strides
    (so an element's offset from the start is the same in both); :meth:`rebase` returns None when
    a call's strides differ (a padded entry keyed on sizes only), and the call then runs eagerly."""

    __slots__ = ("views", "static")

    def __init__(self, views: dict[int, int], static: Sequence[Any]) -> None:
        self.views = views
        self.static = static

    @classmethod
    def find(cls, outputs: Sequence[Any], static_ins: Sequence[Any], positions: Sequence[int],
             skip: Sequence[int] = ()) -> Optional["InputViews"]:
        """Outputs (not in ``skip``) whose storage is that of a static input at ``positions``."""
        by_storage: dict[int, int] = {}
        for pos in positions:
            t = static_ins[pos]
            if isinstance(t, torch.Tensor) and t.numel() and t.layout == torch.strided:
                by_storage.setdefault(t.untyped_storage().data_ptr(), pos)
        if not by_storage:
            return None
        views: dict[int, int] = {}
        for i, out in enumerate(outputs):
            if i in skip or not isinstance(out, torch.Tensor) or not out.numel() or out.layout != torch.strided:
                continue
            pos = by_storage.get(out.untyped_storage().data_ptr())
            if pos is not None:
                views[i] = pos
        return cls(views, static_ins) if views else None

    def storages(self, outputs: Sequence[Any]) -> set[int]:
        return {outputs[i].untyped_storage().data_ptr() for i in self.views}

    def usable(self, ins: Sequence[Any]) -> bool:
        static = self.static
        return all(ins[p].stride() == static[p].stride() for p in self.views.values())

    def rebase(self, outputs: Sequence[Any], ins: Sequence[Any]) -> list:
        """``outputs`` with each aliasing one the same view of the caller's tensor."""
        outs = list(outputs)
        static = self.static
        for i, pos in self.views.items():
            out, src, caller = outs[i], static[pos], ins[pos]
            offset = caller.storage_offset() + out.storage_offset() - src.storage_offset()
            if out.shape == caller.shape and out.stride() == caller.stride() \
                    and offset == caller.storage_offset() and out.dtype == caller.dtype:
                outs[i] = caller  # the input itself (an in-place update returns it)
            else:
                outs[i] = caller.detach().as_strided(out.shape, out.stride(), offset) \
                    if caller.requires_grad else caller.as_strided(out.shape, out.stride(), offset)
        return outs


def saved_modified_error(what: str, region: str) -> RuntimeError:
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: {what} (cgbackend region {region}, which replays a graph; the same code "
        "raises this eagerly). Hint: clone the tensor before writing it in place, or write it "
        "after the backward pass.")


def fill_padding(buf: torch.Tensor, value: torch.Tensor, dim: int, block: int) -> None:
    """``value`` as the prefix of ``buf`` along ``dim``, and its last row (``block`` entries of
    ``dim``: the rows of ``32*s``-sized dimensions are blocks of 32) in every padding row."""
    n = value.shape[dim]
    buf.narrow(dim, 0, n).copy_(value)
    extra = buf.shape[dim] - n
    if extra <= 0 or n < block or block <= 0:
        return
    rows = extra // block
    last = value.narrow(dim, n - block, block).unsqueeze(dim)
    pad = buf.narrow(dim, n, extra).unflatten(dim, (rows, block))
    pad.copy_(last.expand(pad.shape))
