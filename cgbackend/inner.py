"""Inner compilers: what a static region's FX module becomes before it is captured.

``inner="eager"`` keeps the module as is. ``inner="inductor"`` compiles it with Inductor (Inductor's
own CUDA graphs off: cgbackend captures) using the fake values Dynamo recorded for the region's
inputs. Training works through Inductor's AOT autograd; its backward is compiled lazily at the first
backward, which the eager warm-up call provides, so nothing compiles during a capture.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.fx

from .config import Config
from .fx_utils import fake_value
from .runtime.region import no_donated_buffers

__all__ = ["inductor_inner"]

log = logging.getLogger(__name__)


def _example_inputs(module: torch.fx.GraphModule) -> list[Any]:
    return [fake_value(n) for n in module.graph.nodes if n.op == "placeholder"]


def inductor_inner(config: Config) -> Callable[[torch.fx.GraphModule, Any], Callable[..., Any]]:
    from torch._inductor.compile_fx import compile_fx

    def compile_region(module: torch.fx.GraphModule, region: Any) -> Callable[..., Any]:
        example_inputs = _example_inputs(module)
        with no_donated_buffers():
            compiled = compile_fx(module, example_inputs,
                                  config_patches={"triton.cudagraphs": False, "triton.cudagraph_trees": False})

        def call(*args: Any) -> Any:  # Dynamo's calling convention: compiled(*args)
            with no_donated_buffers():  # parts of AOT compile on first call
                return compiled(*args)

        call.needs_backward_prewarm = True
        return call

    return compile_region

