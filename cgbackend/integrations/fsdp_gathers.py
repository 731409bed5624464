"""FSDP2's gathered parameters at the same addresses every step, so graphs read them in place.

FSDP2 allocates each parameter's gathered (unsharded) memory before the forward and before the
backward of its module and frees it after (``storage.resize_(0)``, reshard). In the caching
allocator's shared pool, where it lands depends on everything else allocated in between. In a pool
that holds nothing else, the same sizes are allocated and freed in the same order every step, so
each lands where it did the step before: a layer's forward and backward gathers alike, every layer
at the same addresses (seen on two H200s from the first step on, once the first gather is routed
too). :class:`PinnedGathers` routes those allocations into such a pool, one per device. CUDA graphs
then read FSDP's own memory in place: a replay is keyed on those addresses and on the parameters'
identity (runtime/graph_cache.py), and a backward checks them again (runtime/params.py), so a
gather that lands elsewhere means a new graph or an eager call, never a read of freed memory.
Nothing is copied and nothing stays allocated after FSDP2 reshards: memory as eager FSDP2.

Where the pool cannot be made (no CUDA, a torch without ``torch.cuda.MemPool``, a mesh of one rank,
FSDP2 internals that changed), the parameters are marked *volatile* instead (distributed.FSDPParamSet,
runtime/params.py): graphs read static copies refreshed before every replay, one copy per graph
entry. :func:`fsdp_param_policy` decides.

It wraps two methods of each ``FSDPParam`` (private API, feature-tested by :meth:`PinnedGathers.why_not`),
per instance; FSDP's own allocation sizes, copy-out, reshard and streams are unchanged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from .distributed import FSDPParamSet, fsdp_modules

__all__ = ["PinnedGathers", "FSDPPolicy", "fsdp_param_policy"]

log = logging.getLogger(__name__)

_GATHER_METHODS = ("init_all_gather_outputs", "alloc_all_gather_outputs")
"""The FSDPParam methods that allocate its unsharded parameter's memory (the first gather's
``torch.empty``, and every later gather's ``storage.resize_``)."""


def _fsdp_groups(module: torch.nn.Module) -> list[Any]:
    """FSDPParamGroup objects of one fully_shard'ed module (private API, feature-tested)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        return []
    state = _get_module_fsdp_state(module)
    if state is None:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _mesh_size(group: Any) -> int:
    """Ranks one FSDPParamGroup gathers over (0 where it cannot be told)."""
    try:
        return int(group._all_gather_process_group.size())
    except Exception:  # private API: a torch where it is named otherwise
        return 0


class PinnedGathers:
    """The pools FSDP2's gathers are routed into, one per device (module docstring)."""

    def __init__(self) -> None:
        self._pools: dict[Any, Any] = {}

    @staticmethod
    def why_not(groups: list[Any]) -> Optional[str]:
        """None where every parameter of ``groups`` can be pinned, else why not."""
        if not torch.cuda.is_available() or not hasattr(torch.cuda, "MemPool") \
                or not hasattr(torch.cuda, "use_mem_pool"):
            return "no CUDA device, or a torch without torch.cuda.MemPool"
        if any(_mesh_size(g) <= 1 for g in groups):
            return "a mesh of one rank gathers without init/alloc_all_gather_outputs"
        for fp in (p for g in groups for p in getattr(g, "fsdp_params", ())):
            if not all(callable(getattr(fp, name, None)) for name in _GATHER_METHODS):
                return "FSDP2's parameters no longer allocate through init/alloc_all_gather_outputs"
            device = getattr(fp, "device", None)
            if not isinstance(device, torch.device) or device.type != "cuda":
                return "parameters not on a CUDA device"
        return None

    def pool(self, device: torch.device) -> Any:
        pool = self._pools.get(device)
        if pool is None:
            with torch.cuda.device(device):
                pool = self._pools[device] = torch.cuda.MemPool()
        return pool

    def pin(self, fsdp_param: Any) -> bool:
        """Route ``fsdp_param``'s gathers into the pool of its device; False if already pinned."""
        if getattr(fsdp_param, "_cgbackend_pinned", False):
            return False
        device = fsdp_param.device
        pool = self.pool(device)
        for name in _GATHER_METHODS:
            original = getattr(fsdp_param, name)

            def routed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                # use_mem_pool routes this thread's allocations only: forward gathers run on the
                # caller's thread, backward ones on autograd's, each through this wrapper.
                with torch.cuda.use_mem_pool(pool, device):
                    return _original(*args, **kwargs)

            setattr(fsdp_param, name, routed)
        fsdp_param._cgbackend_pinned = True
        return True


@dataclasses.dataclass
class FSDPPolicy:
    """How a model's FSDP2 parameters are read by the graphs."""

    modules: int = 0
    """fully_shard'ed modules found (0: none, nothing changes)."""
    pinned: Optional[PinnedGathers] = None
    """Their gathers pinned (read in place); kept alive as long as the graphs that read them."""
    volatile: Optional[FSDPParamSet] = None
    """Else the predicate that marks them volatile (copied into the graphs before each replay)."""
    why_copied: str = ""


def fsdp_param_policy(model: Any) -> FSDPPolicy:
    """Pin the gathers of ``model``'s FSDP2 parameters where that can be done, else mark them
    volatile (module docstring)."""
    modules = fsdp_modules(getattr(model, "_orig_mod", model))
    if not modules:
        return FSDPPolicy()
    groups = [g for m in modules for g in _fsdp_groups(m)]
    why = PinnedGathers.why_not(groups)
    if why is None:
        pinned = PinnedGathers()
        count = sum(pinned.pin(p) for g in groups for p in getattr(g, "fsdp_params", ()))
        log.info("cgbackend: %d fully_shard modules: their %d gathered parameters are allocated in a pool of "
                 "their own and read by the graphs in place", len(modules), count)
        return FSDPPolicy(len(modules), pinned=pinned)
    log.info("cgbackend: %d fully_shard modules: their parameters are copied into the graphs (%s)",
             len(modules), why)
    return FSDPPolicy(len(modules), volatile=FSDPParamSet(modules), why_copied=why)
