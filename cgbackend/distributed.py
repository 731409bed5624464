"""``cgbackend.distributed``: what a distributed script calls (docs/distributed.md).

``track_fsdp(instance, model)`` keeps FSDP2's parameters graphed for a backend that
``torch.compile`` was given directly (``cgbackend.compile`` does it itself); ``release(model)``
drops a model's graphs before ``torch.distributed.destroy_process_group()``; ``NVLS_ENV`` /
``set_nvls_env`` turn NVLink multicast off for spawned ranks. How cgbackend lives with DDP, FSDP2
and expert parallelism is in ``cgbackend/integrations/distributed.py``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .by_name import find_backend
from .integrations.distributed import NVLS_ENV, FSDPParamSet, fsdp_modules, set_nvls_env
from .integrations.fsdp_gathers import fsdp_param_policy

__all__ = ["FSDPParamSet", "NVLS_ENV", "fsdp_modules", "release", "set_nvls_env", "track_fsdp"]


def track_fsdp(backend_or_model: Any, model: Optional[torch.nn.Module] = None) -> int:
    """Make the graphs of a backend read FSDP2's unsharded parameters of ``model`` safely: their
    gathers pinned where they land every step (read in place), or the parameters copied into
    static buffers before each replay (integrations/fsdp_gathers.py). ``cgbackend.compile`` does
    this itself; call it after ``torch.compile(model, backend=instance)`` as
    ``track_fsdp(instance, model)``. Returns how many fully_shard'ed modules were found (0: nothing
    changes)."""
    backend = find_backend(backend_or_model)
    policy = fsdp_param_policy(model if model is not None else backend_or_model)
    if policy.modules:
        backend.use_fsdp_policy(policy)
    return policy.modules


def release(obj: Any = None) -> int:
    """Release the graphs of the backend behind ``obj`` now (before destroy_process_group)."""
    return find_backend(obj).release()
