"""Which shape symbols each region's inputs and outputs depend on (sympy), backed or unbacked.

Reads: fake values of each region's boundary nodes (``Region.inputs`` and
``Region.outputs``) and of its inner nodes, and the shape environment's symbols in them.
Writes: nothing on the graph; returns :class:`Shapes`.

A *backed* symbol (``s0``) is a size Dynamo made symbolic but knows at every
call from the inputs (dynamic batch, sequence). An *unbacked* symbol (``u0``)
is read from device data (``nonzero``). A static region never has unbacked
symbols (the classifier keeps those nodes eager); its backed symbols are what
its captured graphs are keyed on.
"""

from __future__ import annotations

import dataclasses

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

from ..common.fx_utils import fake_value, value_spec
from .partition import Partition

__all__ = ["RegionShapes", "Shapes", "shapes"]


@dataclasses.dataclass
class RegionShapes:
    inputs: list[tuple[str, str]]
    """(node name, "[s0, 128, 512]@bfloat16") per input."""
    outputs: list[tuple[str, str]]
    input_symbols: dict[str, str]
    """Symbol name -> "backed" | "unbacked", for symbols in the inputs' shapes and values."""
    output_symbols: dict[str, str]
    inner_symbols: dict[str, str] = dataclasses.field(default_factory=dict)
    """Symbols of values made and used inside the region (a dispatch's u0..u7)."""

    @property
    def symbols(self) -> dict[str, str]:
        return {**self.input_symbols, **self.output_symbols, **self.inner_symbols}

    @property
    def is_symbolic(self) -> bool:
        return bool(self.input_symbols or self.output_symbols)


@dataclasses.dataclass
class Shapes:
    regions: dict[int, RegionShapes]


def _symbols(value) -> dict[str, str]:
    try:
        syms = free_symbols(value)
        unbacked = free_unbacked_symbols(value)
    except Exception:  # opaque values
        return {}
    out = {}
    for sym in sorted(syms, key=str):
        if isinstance(sym, sympy.Symbol):
            out[str(sym)] = "unbacked" if sym in unbacked else "backed"
    return out


def _specs(nodes: list[torch.fx.Node]) -> tuple[list[tuple[str, str]], dict[str, str]]:
    specs, syms = [], {}
    for node in nodes:
        value = fake_value(node)
        specs.append((node.name, value_spec(value)))
        syms.update(_symbols(value))
    return specs, syms


def shapes(gm: torch.fx.GraphModule, partition: Partition) -> Shapes:
    out = {}
    for region in partition.regions:
        ins, in_syms = _specs(region.inputs)
        outs, out_syms = _specs(region.outputs)
        inner: dict[str, str] = {}
        for node in region.nodes:
            inner.update(_symbols(fake_value(node)))
        for name in list(inner):
            if name in in_syms or name in out_syms:
                del inner[name]
        out[region.index] = RegionShapes(inputs=ins, outputs=outs, input_symbols=in_syms,
                                         output_symbols=out_syms, inner_symbols=inner)
    return Shapes(regions=out)
