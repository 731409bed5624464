"""Static outputs the runtime stops holding once they are captured: the last static region's
inference outputs.

Why. Every captured size of a bucketed region is a graph of its own, and each graph's static
outputs stayed allocated in the pool between calls: a later capture (the next size) could not use
that memory, so N sizes cost the sum of their outputs on top of the largest one's temporaries. The
dense model's 16 serving sizes grew the reserved memory by 286 MiB against 156 MiB for the largest
alone (H100); with the outputs released, by 164 MiB.

What is released. The outputs of an inference graph of the *terminal* region (no static region
reads them: executor.mark_terminal) are copied for the caller right after the graph's replay, in
the same call, before any other graph of the pool runs (outputs.OutputBuilder; a dynamic region
after it may read them, in the same call, before the copy). Between calls nothing needs their
values. The runtime keeps, in place of each output, a tensor on a storage that does not own its
memory (``torch._C._construct_storage_from_data_pointer``, feature-tested; cudagraph trees builds its
outputs the same way), so the allocator sees the blocks freed: they stay in the graph's pool, and
only a later capture into that pool can receive them.

Why that is safe (the rule of runtime/pool.py, extended). A graph captured later may now place
anything in those blocks: temporaries, static inputs, static outputs. Its static inputs are
written right before its own replay; its outputs and saved activations, while still needed, mark
it live, and :meth:`PoolState.hazard` keeps the released graph (captured earlier) from replaying
then. The released graph's own replay writes its outputs there, and they are copied before the
next replay of any graph. Outputs that are an input's memory (a view of a parameter or of a static
buffer), entries with outputs rebuilt on a caller's tensor, regions with opaque module calls and
training entries keep their outputs as before.

Simulated graphs (CPU tests) keep their tensors but model the hazard: a released graph's outputs
are scribbled over at every replay of any other graph of its pool (capture.SimulatedGraph), so
code that read them after another replay would fail a test.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..common.fx_utils import iter_tensors
from .capture import SimulatedGraph

__all__ = ["StorageWeakRef", "loose_alias", "loose_aliases", "loose_supported", "releases_outputs", "release_outputs"]

try:  # cudagraph trees checks its storages with it
    from torch.multiprocessing.reductions import StorageWeakRef
except ImportError:  # pragma: no cover - present in torch 2.11 and 2.13
    StorageWeakRef = None  # type: ignore[assignment,misc]

_from_pointer: Optional[Callable[..., Any]] = getattr(torch._C, "_construct_storage_from_data_pointer", None)
"""Feature-tested private API (torch 2.11 and 2.13): a storage on memory it does not own."""


def loose_supported() -> bool:
    return _from_pointer is not None


def _on(storage: Any, value: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``storage`` as ``value`` views its own."""
    alias = torch.empty(0, dtype=value.dtype, device=value.device)
    alias.set_(storage, value.storage_offset(), value.size(), value.stride())
    return alias


def loose_alias(value: torch.Tensor) -> torch.Tensor:
    """``value`` on a storage that does not own its memory (the caller drops ``value`` next)."""
    storage = value.untyped_storage()
    return _on(_from_pointer(storage.data_ptr(), value.device, storage.nbytes()), value)


def loose_aliases(values: Any) -> tuple:
    """Each tensor of ``values`` (None kept) on a storage that does not own its memory, one such
    storage per storage of theirs, so tensors that shared memory still share it (the caller drops
    ``values`` next)."""
    loose: dict[int, Any] = {}
    out = []
    for value in values:
        if not isinstance(value, torch.Tensor) or not value.numel():
            out.append(value)
            continue
        storage = value.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in loose:
            loose[ptr] = _from_pointer(ptr, value.device, storage.nbytes())
        out.append(_on(loose[ptr], value))
    return tuple(out)


def releases_outputs(entry: Any, terminal: bool, hooks: Any) -> bool:
    """Are ``entry``'s static outputs released after its capture (module docstring)? ``terminal``:
    its region is the graph's last static one; ``hooks``: its opaque module calls' (or None)."""
    return (terminal and not entry.training and hooks is None
            and entry.input_views is None and entry.outputs is not None
            and (isinstance(entry.graph, SimulatedGraph) or _from_pointer is not None))


def release_outputs(entry: Any) -> None:
    """Release ``entry``'s static outputs (module docstring); ``entry.out_released`` says how many
    bytes."""
    inputs = {t.untyped_storage().data_ptr() for t in iter_tensors(entry.static_ins) if t.numel()}
    simulated = isinstance(entry.graph, SimulatedGraph)
    loose: dict[int, Any] = {}
    released = 0
    outs = []
    for value in entry.outputs:
        if (not isinstance(value, torch.Tensor) or not value.numel() or value.layout != torch.strided
                or value.untyped_storage().data_ptr() in inputs):
            outs.append(value)
            continue
        storage = value.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in loose:
            loose[ptr] = None if simulated else _from_pointer(ptr, value.device, storage.nbytes())
            released += storage.nbytes()
        if simulated:
            outs.append(value)
            continue
        outs.append(_on(loose[ptr], value))
    if not released:
        return
    if simulated:
        entry.graph.released = True
    else:
        entry.outputs = type(entry.outputs)(outs) if isinstance(entry.outputs, (list, tuple)) else outs
    entry.out_released = released
