"""cgbackend under PyTorch's distributed engines: DDP, FSDP2 (``fully_shard``), expert parallelism.

* DDP needs nothing: parameters keep their storage, DDP's all-reduce runs in its autograd hooks,
  outside the graphs, and Dynamo's DDP optimizer splits the graph at bucket boundaries.
* FSDP2 frees each unsharded parameter's storage after use (``storage.resize_(0)``) and
  all-gathers it again before the next forward or backward, wherever the caching allocator puts
  it. :func:`track_fsdp` gives those allocations a memory pool of their own (:class:`PinnedGathers`):
  the same sequence of the same sizes is allocated and freed there every step, so a layer's
  unsharded parameters land at the same addresses at every all-gather, forward and backward
  alike, and graphs read them in place (keyed on their addresses, checked before every replay
  like any parameter's). Nothing is copied and nothing stays allocated after FSDP2 reshards:
  memory as eager FSDP2. Where that pool cannot be made (no CUDA, a torch without
  ``torch.cuda.MemPool``, a mesh of one rank, FSDP2 internals that changed), the parameters are
  marked *volatile* instead (runtime/params.py): graphs read static copies refreshed before every
  replay (one copy per graph entry). Without either, a backward whose parameter moved runs
  eagerly (``param_moved``): correct, never a replay on freed storage, but slower.
* Collectives (``all_to_all_single`` with host-read splits, all-gathers, reduce-scatters) are
  dynamic regions (passes/collectives.py): they run eagerly between graphs.
* Exit: a CUDA graph that captured NCCL work keeps its communicator alive, and
  ``destroy_process_group`` (or the process group's destructor at interpreter exit) then waits for
  the graph to be destroyed. cgbackend captures no collectives, and every backend releases its
  graphs when the process exits (a ``weakref.finalize``, run at exit) or when :func:`release` is
  called. Call ``release(model)`` and then ``torch.distributed.destroy_process_group()`` at the
  end of a distributed script.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Iterable, Optional

import torch

from .by_name import find_backend

__all__ = ["track_fsdp", "release", "fsdp_modules", "FSDPParamSet", "PinnedGathers", "NVLS_ENV",
           "set_nvls_env"]

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


_GATHER_METHODS = ("init_all_gather_outputs", "alloc_all_gather_outputs")
"""The FSDPParam methods that allocate its unsharded parameter's memory (the first all-gather's
``torch.empty``, and every later all-gather's ``storage.resize_``)."""


class PinnedGathers:
    """FSDP2's unsharded parameters allocated in a memory pool of their own, one per device.

    FSDP2 allocates each parameter's gathered memory before the forward and before the backward
    of its module and frees it after (reshard). In the caching allocator's shared pool, where it
    lands depends on everything else allocated in between; in a pool that holds nothing else, the
    same sizes are allocated and freed in the same order every step, so each lands where it did
    the step before (a layer's forward and backward gathers alike, seen on two H200s: from the
    first step on with the first gather routed too). CUDA graphs then read FSDP's own memory in
    place: a replay is keyed on those addresses (runtime/graph_cache.py) and a backward checks
    them again (runtime/params.py), so a gather that lands elsewhere means a new graph or an eager
    call, never a read of freed memory. Wraps two methods of each ``FSDPParam`` (private API,
    feature-tested: :meth:`supported`), per instance; FSDP's own allocation, copy-out, reshard and
    streams are unchanged."""

    def __init__(self) -> None:
        self._pools: dict[Any, Any] = {}

    @staticmethod
    def supported(fsdp_params: list[Any]) -> Optional[str]:
        """None where every parameter can be pinned, else why not."""
        if not torch.cuda.is_available() or not hasattr(torch.cuda, "MemPool") \
                or not hasattr(torch.cuda, "use_mem_pool"):
            return "no CUDA device, or a torch without torch.cuda.MemPool"
        for fp in fsdp_params:
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
        pool = self.pool(fsdp_param.device)
        device = fsdp_param.device
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


def _mesh_size(group: Any) -> int:
    """Ranks one FSDPParamGroup gathers over (0 where it cannot be told)."""
    try:
        return int(group._all_gather_process_group.size())
    except Exception:  # private API: a torch where it is named otherwise
        return 0


def track_fsdp(backend_or_model: Any, model: Optional[torch.nn.Module] = None) -> int:
    """Make graphs read FSDP2's unsharded parameters of ``model`` safely: their gathers pinned in a
    pool of their own (:class:`PinnedGathers`: read in place), or, where that cannot be done, the
    parameters marked volatile (copied into static buffers before each replay). ``cgbackend.compile``
    does this itself; call it after ``torch.compile(model, backend=instance)`` as
    ``track_fsdp(instance, model)``. Returns how many fully_shard'ed modules were found (0: nothing
    changes)."""
    backend = find_backend(backend_or_model)
    target = model if model is not None else backend_or_model
    target = getattr(target, "_orig_mod", target)
    modules = fsdp_modules(target)
    if not modules:
        return 0
    groups = [g for m in modules for g in _fsdp_groups(m)]
    params = [p for g in groups for p in getattr(g, "fsdp_params", ())]
    why = PinnedGathers.supported(params)
    if why is None and any(_mesh_size(g) <= 1 for g in groups):
        why = "a mesh of one rank gathers without init/alloc_all_gather_outputs"
    if why is None:
        pinned = backend.fsdp_gathers = backend.fsdp_gathers or PinnedGathers()
        count = sum(pinned.pin(p) for p in params)
        log.info("cgbackend: %d fully_shard modules: their %d gathered parameters are allocated in a pool of "
                 "their own and read by the graphs in place", len(modules), count)
        return len(modules)
    backend.shared.params.volatile = FSDPParamSet(modules)
    log.info("cgbackend: %d fully_shard modules: their parameters are copied into the graphs (%s)",
             len(modules), why)
    return len(modules)


def release(obj: Any = None) -> int:
    """Release the graphs of the backend behind ``obj`` now (before destroy_process_group)."""
    return find_backend(obj).release()


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
