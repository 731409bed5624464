"""FX passes. Each is pure: a graph (and earlier results) in, a result dataclass out."""

from .classify import Classification, classify
from .effects import Effects, analyze_effects
from .label import Labels, label
from .partition import Partition, Region, partition
from .schedule import Schedule, schedule
from .shapes import Shapes, shapes

__all__ = ["Classification", "Effects", "Labels", "Partition", "Region", "Schedule", "Shapes",
           "analyze_effects", "classify", "label", "partition", "schedule", "shapes"]
