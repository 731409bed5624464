"""``cgbackend.distributed``: what a distributed script calls (docs/distributed.md).

``track_fsdp(instance, model)`` keeps FSDP2's parameters graphed for a backend that
``torch.compile`` was given directly (``cgbackend.compile`` does it itself); ``release(model)``
drops a model's graphs before ``torch.distributed.destroy_process_group()``; ``NVLS_ENV`` /
``set_nvls_env`` turn NVLink multicast off for spawned ranks. How cgbackend lives with DDP, FSDP2
and expert parallelism is in ``cgbackend/integrations/distributed.py``; this module is the public
path to those names and holds nothing else.
"""

from .integrations.distributed import NVLS_ENV, FSDPParamSet, fsdp_modules, release, set_nvls_env, track_fsdp

__all__ = ["FSDPParamSet", "NVLS_ENV", "fsdp_modules", "release", "set_nvls_env", "track_fsdp"]
