"""Run the passes in order on one Dynamo graph; the result feeds both the runtime and the report.
The runtime consumes it as it is: every analysis and rewrite decision it acts on is here."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch.fx

from ..config import Config
from . import (Classification, Effects, Labels, Partition, Schedule, Shapes, analyze_effects, classify, label,
               partition, schedule, shapes)
from .bucket import Buckets, buckets
from .constants import Constants, find_constants
from ..moe.graph_rewrite import DispatchResult, rewrite_static_dispatch
from .gather import GatherPlan, plan_gathers
from .region_facts import GraphFacts, graph_facts
from ..common.reasons import Reason
from .scalars import DeviceScalars, device_scalars

__all__ = ["Analysis", "analyze"]


@dataclasses.dataclass
class Analysis:
    gm: torch.fx.GraphModule
    config: Config
    effects: Effects
    classification: Classification
    partition: Partition
    labels: Labels
    shapes: Shapes
    schedule: Schedule
    dispatch: DispatchResult = dataclasses.field(default_factory=DispatchResult)
    buckets: Buckets = dataclasses.field(default_factory=lambda: Buckets(regions={}))
    constants: Constants = dataclasses.field(default_factory=Constants)
    facts: GraphFacts = dataclasses.field(default_factory=GraphFacts)
    """What the runtime needs of each static region (written inputs, ...): passes/region_facts.py."""
    gathers: GatherPlan = dataclasses.field(default_factory=GatherPlan)
    """Row gathers of dynamic regions rewritten for a cheap backward (training): passes/gather.py."""
    scalars: DeviceScalars = dataclasses.field(default_factory=DeviceScalars)

    def reason_of(self, node: torch.fx.Node) -> Optional[Reason]:
        return self.partition.reason_of(node, self.classification)


def analyze(gm: torch.fx.GraphModule, config: Config, *, training: Optional[bool] = None,
            compute_device: Optional[str] = None, loops: Sequence = ()) -> Analysis:
    dispatch = rewrite_static_dispatch(gm, config.static_dispatch, loops)
    scalars = device_scalars(gm)
    effects = analyze_effects(gm)
    classification = classify(gm, config, training=training, compute_device=compute_device)
    constants = find_constants(gm, effects)
    part = partition(gm, classification, effects, config, set(constants.nodes))
    region_shapes = shapes(gm, part)
    return Analysis(gm=gm, config=config, effects=effects, classification=classification,
                    partition=part, labels=label(gm, part, effects), shapes=region_shapes,
                    schedule=schedule(part, classification, effects), dispatch=dispatch,
                    buckets=buckets(part, region_shapes, effects, config), constants=constants,
                    facts=graph_facts(gm, part, effects),
                    gathers=plan_gathers(part, classification.training), scalars=scalars)
