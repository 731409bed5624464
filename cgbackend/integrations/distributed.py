"""cgbackend under PyTorch's distributed engines: DDP, FSDP2 (``fully_shard``), expert parallelism.

* DDP needs nothing: parameters keep their storage, DDP's all-reduce runs in its autograd hooks,
  outside the graphs, and Dynamo's DDP optimizer splits the graph at bucket boundaries.
* FSDP2 frees each unsharded parameter's storage after use (``storage.resize_(0)``) and
  all-gathers it again before the next forward or backward. integrations/fsdp_gathers.py routes
  those allocations into a pool of their own, where each lands at the same addresses every step,
  and graphs read them in place; where it cannot, :class:`FSDPParamSet` marks those parameters
  *volatile* for a backend (runtime/params.py): graphs read static copies refreshed before every
  replay. With neither, graphs are keyed on parameter addresses and a backward whose parameter
  moved runs eagerly (``param_moved``): correct, never a replay on freed storage, but slower.
* Collectives whose sizes are fixed by shapes (a functional all-to-all with equal or constant
  splits, an all-reduce: an expert-parallel exchange of fixed capacity, models/ep_capacity.py) are
  captured with their static region; the others (``all_to_all_single`` with host-read splits,
  all-gathers, reduce-scatters) are dynamic regions that run eagerly between graphs
  (passes/collectives.py, option ``capture_collectives``).
* Exit: a CUDA graph that captured NCCL work keeps its communicator alive, and
  ``destroy_process_group`` (or the process group's destructor at interpreter exit) then waits for
  the graph to be destroyed. Every backend releases its graphs when the process exits (a
  ``weakref.finalize``, run at exit), on ``torch._dynamo.reset()`` and when
  ``cgbackend.distributed.release`` is called. Call ``release(model)`` and then
  ``torch.distributed.destroy_process_group()`` at the end of a distributed script.

The functions a script calls with a model or a backend (``track_fsdp``, ``release``) are in
``cgbackend/distributed.py``; this module holds the mechanisms and knows no backend.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Iterable, Optional

import torch

__all__ = ["fsdp_modules", "FSDPParamSet", "NVLS_ENV", "set_nvls_env", "is_ddp",
           "WholeGraphUnderDDP"]

log = logging.getLogger(__name__)

NVLS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast off (the GPU machines this project runs on require it)."""


def set_nvls_env(env: Optional[dict] = None) -> dict:
    """Set NVLS_ENV's variables in ``env`` (default os.environ) where they are absent."""
    env = os.environ if env is None else env
    for key, value in NVLS_ENV.items():
        env.setdefault(key, value)
    return env


def _fsdp_module_class() -> Optional[type]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    return FSDPModule


def fsdp_modules(model: Any) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to."""
    cls = _fsdp_module_class()
    if cls is None or not isinstance(model, torch.nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


def _fsdp_params(module: torch.nn.Module) -> Iterable[Any]:
    """FSDPParam objects of one fully_shard'ed module (private API, feature-tested)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        return ()
    state = _get_module_fsdp_state(module)
    if state is None:
        return ()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return [p for g in groups for p in getattr(g, "fsdp_params", ())]


class FSDPParamSet:
    """Predicate: is this tensor one of FSDP2's unsharded parameters (in the tracked modules)?

    FSDP2 makes each unsharded parameter once, at its first all-gather, and keeps the object
    (only its storage comes and goes), so the set of ids is refreshed only until every tracked
    parameter has one."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self._modules = [weakref.ref(m) for m in modules]
        self._ids: set[int] = set()
        self._keep: list[Any] = []  # the unsharded parameters themselves: their ids stay unique
        self._complete = False

    def _refresh(self) -> None:
        ids, keep, complete = set(), [], True
        for ref in self._modules:
            module = ref()
            if module is None:
                continue
            for fsdp_param in _fsdp_params(module):
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is None:
                    complete = False
                    continue
                ids.add(id(unsharded))
                keep.append(unsharded)
        self._ids, self._keep, self._complete = ids, keep, complete

    def __call__(self, t: torch.Tensor) -> bool:
        if id(t) in self._ids:
            return True
        if self._complete:
            return False
        self._refresh()
        return id(t) in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def module_count(self) -> int:
        """How many fully_shard'ed modules are tracked."""
        return len(self._modules)


def is_ddp(model: Any) -> bool:
    from torch.nn.parallel import DistributedDataParallel
    return isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel)


class WholeGraphUnderDDP:
    """Dynamo's ``optimize_ddp`` off around a call of a DDP model compiled by cgbackend.compile
    (scoped, restored after the call; nothing is written when it is already off).

    Dynamo's DDP optimizer splits the graph at gradient-bucket boundaries so that a compiled
    backward (AOT autograd) can let buckets all-reduce early. cgbackend's backward is already one
    autograd node per static region, so DDP's hooks fire region by region anyway; the split only
    cuts regions in two. It also gave wrong gradients with ``static_dispatch`` (a MoE whose
    dispatch was cut by the split, tests/test_distributed.py), so cgbackend.compile keeps the graph
    whole. ``torch.compile(ddp_model, backend="cgbackend")`` keeps Dynamo's setting."""

    __slots__ = ("_saved",)

    def __enter__(self) -> None:
        cfg = torch._dynamo.config
        self._saved = cfg.optimize_ddp
        if self._saved:
            cfg.optimize_ddp = False

    def __exit__(self, *exc: Any) -> None:
        if self._saved:
            torch._dynamo.config.optimize_ddp = self._saved
