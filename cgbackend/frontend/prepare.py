"""What cgbackend does to a model before Dynamo traces it, in one place for every door.

``cgbackend.compile`` and ``cgbackend.explain`` both prepare the model with
:func:`prepare_for_compile` (through compile_model.py), so the report shows the graphs the run
gets; by name (``torch.compile(model, backend="cgbackend")``, and ``explain(..., by_name=True)``)
the model is traced as it is.

* Opaque modules (option ``opaque_modules``, integrations/opaque.py): modules Dynamo cannot trace
  but cgbackend knows (Transformer Engine's) become one graph call each.
* Static dispatch's part (option ``static_dispatch``, moe/prepare.py): dispatch loops rewritten in
  the model's source, expert weights laid out as one block (compile only: explain leaves the
  model's parameters where they are).
* Compile only: stacks of identical layers compiled once each (option ``regional_min_layers``,
  regional.py; none under ``fullgraph=True``, DDP or FSDP2, whose hooks wrap the whole model),
  and FSDP2's gathers pinned where they land every step, or its parameters copied into the graphs
  (integrations/fsdp_gathers.py). A model compiled
  without static dispatch is remembered (weakly) so the report's hints can survey its loops.

The result, :class:`Prepared`, is handed to the backend's constructor (``CGBackend(config,
prepared=...)``), which reports it and gives the runtime what it needs.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Optional

import torch

from ..config import Config
from ..integrations import opaque
from ..integrations.distributed import fsdp_modules, is_ddp
from ..integrations.fsdp_gathers import FSDPPolicy, fsdp_param_policy
from ..moe.loop_forwards import LoopForwards
from ..moe.prepare import prepare_dispatch
from .regional import LayerStack, find_layer_stacks

__all__ = ["Prepared", "prepare_for_compile"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    """What an entry point did to a model before Dynamo traced it."""

    opaque: Optional[opaque.InstallResult] = None
    """The modules made opaque graph calls (and those left alone, with why), for the report."""
    forwards: Optional[LoopForwards] = None
    """The rewritten dispatch loops' forwards, on the modules only while a compiled call runs."""
    relayouts: list = dataclasses.field(default_factory=list)
    """Expert parameters laid out as one block each (moe/expert_layout.py), for the report."""
    stacks: list[LayerStack] = dataclasses.field(default_factory=list)
    """Stacks of identical layers compiled once each (regional.py)."""
    survey_target: Optional[Callable[[], Any]] = None
    """A weak reference to a model compiled without static dispatch: its loops are surveyed (what
    the loop rewrite would do, moe/loop_forwards.survey) when a report is built, for the hints."""
    fsdp: FSDPPolicy = dataclasses.field(default_factory=FSDPPolicy)
    """How FSDP2's parameters are read: their gathers pinned (read in place; the pools live as long
    as this), or copied into the graphs before each replay (integrations/fsdp_gathers.py)."""

    @property
    def volatile_params(self) -> Optional[Callable[[torch.Tensor], bool]]:
        """Which parameters are copied into the graphs before each replay (runtime/params.py)."""
        return self.fsdp.volatile

    @property
    def loops(self) -> list:
        """Every dispatch loop the source rewrite looked at (moe/source_rewrite.LoopRewrite)."""
        return self.forwards.records if self.forwards is not None else []


def prepare_for_compile(model: Any, config: Config, *, fullgraph: bool = False) -> Prepared:
    """``cgbackend.compile``'s preparation of ``model`` (a module; anything else is traced as it is)."""
    if not isinstance(model, torch.nn.Module):
        return Prepared()
    prepared = Prepared(stacks=_layer_stacks(model, config, fullgraph))
    if config.opaque_modules:
        prepared.opaque = opaque.install(model)
    prepared.forwards, prepared.relayouts = prepare_dispatch(model, config.static_dispatch, lay_out_experts=True)
    if prepared.forwards is None:
        prepared.survey_target = weakref.ref(model)  # surveyed for the report's hints, when one is asked for
    prepared.fsdp = fsdp_param_policy(model)  # FSDP2's parameters: read in place, or copied
    return prepared


def _layer_stacks(model: torch.nn.Module, config: Config, fullgraph: bool) -> list[LayerStack]:
    """The model's stacks of identical layers to compile once each (regional.py); none under
    fullgraph=True (each layer is a graph break), DDP or FSDP2 (their hooks wrap the whole model)."""
    if fullgraph or is_ddp(model) or fsdp_modules(model):
        return []
    stacks = find_layer_stacks(model, config.regional_min_layers)
    for stack in stacks:
        log.info("cgbackend: %s", stack.describe())
    return stacks
