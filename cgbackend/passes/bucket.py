"""Which static regions may pad a symbolic size up to a capture size, and how (bucketing).

Reads: each static region's nodes and boundary (fake values with Dynamo's symbolic sizes), the
effects pass (in-place writes), the config (``capture_sizes``). With ``inner="inductor"`` the
region's Inductor code is compiled once for the symbolic sizes, so it runs at the padded ones too.
Writes: nothing on the graph; returns :class:`Buckets`.

A region is *bucketable along a backed symbol s* when padding every s-sized dimension of its
inputs at the end (s -> B >= s) leaves the first s rows of every output unchanged, so the outputs
can be sliced back. The proof (passes/rowdep.py, rows = s) must show that the region is
row-independent along s: each input that depends on s has it in exactly one dimension, as the
outermost factor of that dimension's size (``s``, ``32*s``); every op keeps rows apart; each output
sized by s holds its rows in that dimension. On top of the row proof:

* s may flow into the region as a number only to be used as a size: reshapes, views, expands,
  and constant factories (``zeros``, ``ones``, ``full``, ``empty``) whose result is then a row
  source itself. Any other use (``arange(s)``, ``x / s``, a comparison) would see B, not s.
* the region writes none of its inputs in place (a write would land on the padded copy);
* no value computed from ``arange(s)`` is read as an index or an integer divisor: padding rows
  hold s..B-1 there (passes/padvalues.py; padded inputs get copies of a real row instead);
* every symbol in the sizes that are padded or sliced can be read from the region's inputs.

Only inference calls are padded (training regions save activations of the exact size for their
backward); at most one symbol per region is padded, the others key the graph exactly.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable, Optional, Sequence

import sympy
import torch
import torch.fx

from ..config import Config
from ..common.fx_utils import fake_value, plain_name, size_expr, source_location, storage_ids
from .effects import Effects
from .padvalues import unsafe_padding_use
from .partition import Partition, Region
from .rowdep import NotRowwise, propagate_rows, rows_divide, whole_blocks
from .shapes import Shapes

__all__ = ["Buckets", "BucketPlan", "Monomial", "RegionBuckets", "SymbolBucketing", "buckets",
           "mutated_input_positions", "written_positions"]

_SIZE_ARGS = {"view", "reshape", "unflatten", "_unsafe_view"}
_EXPANDS = {"expand", "broadcast_to"}
_FACTORIES = {"zeros", "ones", "empty", "full", "new_zeros", "new_ones", "new_empty", "new_full"}
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclasses.dataclass(frozen=True)
class Monomial:
    """A size ``coef * prod(symbols)``: how padded and sliced sizes are evaluated at run time."""

    coef: int
    symbols: tuple[str, ...]

    def __call__(self, bindings: dict[str, int]) -> int:
        out = self.coef
        for name in self.symbols:
            out *= bindings[name]
        return out

    def __str__(self) -> str:
        parts = ([str(self.coef)] if self.coef != 1 or not self.symbols else []) + list(self.symbols)
        return "*".join(parts)


@dataclasses.dataclass
class BucketPlan:
    """How the runtime pads one region along ``symbol`` (positions are region input/output indices)."""

    symbol: str
    probes: dict[str, tuple[int, int, Optional[Monomial]]]
    """Symbol -> (input position, dimension, divisor) where its value is read, in an order where
    each divisor's symbols come first: the size there is the symbol times the divisor (``32*s``);
    dimension -1: the input is the number itself."""
    pad_inputs: dict[int, tuple[int, Monomial]]
    """Tensor inputs sized by the symbol: position -> (dimension, its size)."""
    value_inputs: dict[int, Monomial]
    """Numbers (SymInt inputs) that involve the symbol: position -> value."""
    outputs: dict[int, tuple[int, Monomial]]
    """Outputs sized by the symbol: index -> (dimension, size); sliced back after each replay."""

    def bindings(self, ins: list) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, (pos, dim, divisor) in self.probes.items():
            value = ins[pos]
            size = int(value) if dim < 0 else value.shape[dim]
            out[name] = size if divisor is None else size // divisor(out)
        return out


@dataclasses.dataclass
class SymbolBucketing:
    symbol: str
    bucketable: bool
    why: str
    """Why not (empty when bucketable)."""
    op: str = ""
    source: str = ""
    code: str = ""
    padded: bool = False
    """The symbol this region pads (one per region)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RegionBuckets:
    symbols: dict[str, SymbolBucketing]
    plan: Optional[BucketPlan] = None


@dataclasses.dataclass
class Buckets:
    regions: dict[int, RegionBuckets]


class _NoBucket(Exception):
    def __init__(self, why: str, node: Optional[torch.fx.Node] = None) -> None:
        super().__init__(why)
        self.why = why
        self.node = node


def _monomial(expr: Any) -> Optional[Monomial]:
    """``expr`` as coef * product of distinct symbols, or None (sums, powers, divisions)."""
    coef, rest = sympy.sympify(expr).as_coeff_Mul()
    if not coef.is_Integer or int(coef) <= 0:
        return None
    factors = [] if rest == 1 else list(sympy.Mul.make_args(rest))
    if not all(isinstance(f, sympy.Symbol) for f in factors) or len(set(factors)) != len(factors):
        return None
    return Monomial(int(coef), tuple(sorted(str(f) for f in factors)))


def _has(value: Any, sym: sympy.Symbol) -> bool:
    if isinstance(value, torch.Tensor):
        return any(sym in size_expr(d).free_symbols for d in value.shape)
    if isinstance(value, _SYM_TYPES):
        return sym in value.node.expr.free_symbols
    return False


def _sized_dim(value: torch.Tensor, sym: sympy.Symbol, what: str) -> tuple[int, Monomial]:
    """The one dimension of ``value`` sized by ``sym``, with ``sym`` its outermost factor."""
    dims = [d for d, size in enumerate(value.shape) if sym in size_expr(size).free_symbols]
    if len(dims) != 1:
        raise _NoBucket(f"{what} has {sym} in {len(dims)} dimensions")
    size = size_expr(value.shape[dims[0]])
    mono = _monomial(size)
    if mono is None or not rows_divide(size, sym):
        raise _NoBucket(f"{what} has size {size} along dimension {dims[0]}, not a multiple of {sym}")
    return dims[0], mono


def written_positions(effects: Effects, nodes: Iterable[torch.fx.Node], inputs: Sequence[torch.fx.Node]) -> set[int]:
    """``inputs`` (by position) whose data one of ``nodes`` writes in place."""
    written: set[int] = set()
    for node in nodes:
        written |= effects.writes.get(node, set())
    if not written:
        return set()
    return {pos for pos, inp in enumerate(inputs) if storage_ids(fake_value(inp)) & written}


def mutated_input_positions(effects: Effects, region: Region) -> set[int]:
    """Region inputs (by position) whose data some node of the region writes in place."""
    return written_positions(effects, region.nodes, region.inputs)


def _live(region: Region, effects: Effects) -> set[torch.fx.Node]:
    """The region's nodes that its outputs, its in-place writes, its random ops or its global-state
    ops need. The others compute values nothing reads (``expert_mask.sum(...) > 0`` left behind by
    a static dispatch rewrite of transformers' loop over the hit experts): the row proof skips
    them, as no row of any output depends on them. (The other checks still see every node.)"""
    members = set(region.nodes)
    random_nodes, barriers = set(effects.random_nodes), set(effects.barriers)
    stack = [n for n in region.outputs if n in members]
    stack += [n for n in region.nodes if n in effects.writes or n in random_nodes or n in barriers
              or n.op not in ("call_function", "call_method")]
    live = set(stack)
    while stack:
        node = stack.pop()
        for a in list(node.all_input_nodes) + list(effects.preds(node)):
            if a in members and a not in live:
                live.add(a)
                stack.append(a)
    return live


def _plan(region: Region, sym: sympy.Symbol, live: Optional[set] = None) -> BucketPlan:
    sources: dict[torch.fx.Node, int] = {}
    pad_inputs: dict[int, tuple[int, Monomial]] = {}
    value_inputs: dict[int, Monomial] = {}
    sym_nodes: set[torch.fx.Node] = set()
    aranges: list[torch.fx.Node] = []
    for pos, inp in enumerate(region.inputs):
        value = fake_value(inp)
        if not _has(value, sym):
            continue
        if isinstance(value, torch.Tensor):
            dim, mono = _sized_dim(value, sym, f"input {inp.name}")
            sources[inp] = dim
            pad_inputs[pos] = (dim, mono)
        elif isinstance(value, torch.SymInt) and (mono := _monomial(value.node.expr)) is not None:
            value_inputs[pos] = mono
            sym_nodes.add(inp)
        else:
            raise _NoBucket(f"input {inp.name} is the number {value}, not a product of sizes")
    # The symbol as a number: only as a size.
    for node in region.nodes:
        value = fake_value(node)
        uses = [a for a in node.all_input_nodes if a in sym_nodes]
        if isinstance(value, _SYM_TYPES) or (isinstance(value, (tuple, list)) and value
                                               and all(isinstance(v, (int, *_SYM_TYPES)) for v in value)):
            if any(_has(v, sym) for v in (value if isinstance(value, (tuple, list)) else [value])):
                sym_nodes.add(node)  # a size, or a shape tuple (x.size())
            continue
        if not uses:
            continue
        name = plain_name(node)
        if name in _SIZE_ARGS:
            continue
        if name in _EXPANDS:
            base = fake_value(node.args[0]) if node.args else None
            if isinstance(base, torch.Tensor) and not _has(base, sym) and isinstance(value, torch.Tensor):
                # The same values in every row (an attention mask broadcast over the batch).
                sources[node] = _sized_dim(value, sym, f"{name} ({node.name})")[0]
            continue  # else: expanding rows the proof tracks, which it checks
        if isinstance(value, torch.Tensor) and (
                name in _FACTORIES or (name == "arange" and len(node.args) == 1 and not node.kwargs.keys()
                                       & {"start", "end", "step"})):
            # Constants, or arange(s): row i holds i whatever the padding, so the first s rows of
            # arange(B) are arange(s).
            sources[node] = _sized_dim(value, sym, f"{name} ({node.name})")[0]
            if name == "arange":
                aranges.append(node)
            continue
        raise _NoBucket(f"uses {sym} as a number, not a size", node)
    try:
        dims = propagate_rows([n for n in region.nodes if live is None or n in live], sources, rows=sym)
    except NotRowwise as exc:
        raise _NoBucket(exc.why, exc.node) from None
    # Inside a block the proof takes whole (rowdep.ROW_BLOCK), indices from arange over the padded
    # size index tensors of the padded size, and its results in padding rows are those of the real
    # rows they copy: no taint goes in or out there.
    inside = set().union(*whole_blocks(list(region.nodes)).values())
    unsafe = unsafe_padding_use([n for n in region.nodes if n not in inside], aranges)
    if unsafe is not None:
        raise _NoBucket(unsafe[1], unsafe[0])
    outputs: dict[int, tuple[int, Monomial]] = {}
    for i, out in enumerate(region.outputs):
        value = fake_value(out)
        if not _has(value, sym):
            continue
        if not isinstance(value, torch.Tensor):
            raise _NoBucket(f"returns {out.name} = {value}, a number computed from {sym}", out)
        dim, mono = _sized_dim(value, sym, f"output {out.name}")
        if dims.get(out) != dim:
            raise _NoBucket(f"output {out.name} is sized by {sym} but not computed row by row", out)
        outputs[i] = (dim, mono)
    needed = {s for _, m in list(pad_inputs.values()) + list(outputs.values()) for s in m.symbols}
    needed |= {s for m in value_inputs.values() for s in m.symbols}
    probes = _probes(region, needed)
    missing = sorted(needed - set(probes))
    if missing:
        raise _NoBucket(f"the size {', '.join(missing)} cannot be read from the region's inputs")
    return BucketPlan(symbol=str(sym), probes=probes, pad_inputs=pad_inputs, value_inputs=value_inputs,
                      outputs=outputs)


def _probes(region: Region, needed: set[str]) -> dict[str, tuple[int, int, Optional[Monomial]]]:
    """Where each needed symbol is read: a number input or a dimension equal to it first, then a
    dimension ``c * s * (symbols already read)`` (divided back at run time)."""
    sized: list[tuple[int, int, Optional[Monomial]]] = []
    for pos, inp in enumerate(region.inputs):
        value = fake_value(inp)
        if isinstance(value, torch.SymInt):
            sized.append((pos, -1, _monomial(value.node.expr)))
        elif isinstance(value, torch.Tensor):
            sized.extend((pos, d, _monomial(size_expr(size))) for d, size in enumerate(value.shape))
    probes: dict[str, tuple[int, int, Optional[Monomial]]] = {}
    for pos, dim, mono in sized:
        if mono is not None and mono.coef == 1 and len(mono.symbols) == 1:
            name = mono.symbols[0]
            if name in needed and name not in probes:
                probes[name] = (pos, dim, None)
    progress = True
    while progress:
        progress = False
        for pos, dim, mono in sized:
            if mono is None or dim < 0:
                continue
            unknown = [n for n in mono.symbols if n not in probes]
            if len(unknown) == 1 and unknown[0] in needed:
                rest = tuple(n for n in mono.symbols if n != unknown[0])
                probes[unknown[0]] = (pos, dim, Monomial(mono.coef, rest))
                progress = True
    return probes


def buckets(partition: Partition, shapes: Shapes, effects: Effects, config: Config) -> Buckets:
    out: dict[int, RegionBuckets] = {}
    plans: dict[int, dict[str, BucketPlan]] = {}
    for region in partition.static_regions():
        rs = shapes.regions.get(region.index)
        backed = {n for n, kind in (rs.input_symbols.items() if rs else ()) if kind == "backed"}
        # Sizes only: the shape environment's own symbol objects (with their assumptions).
        syms = sorted((s for s in _size_symbols(region) if str(s) in backed), key=str)
        if not syms:
            continue
        entry = out[region.index] = RegionBuckets(symbols={})
        plans[region.index] = {}
        off = ("bucketing is off (capture_sizes=())" if not config.capture_sizes
               else "the region writes one of its inputs in place" if mutated_input_positions(effects, region)
               else None)
        live = _live(region, effects) if off is None else None
        for sym in syms:
            name = str(sym)
            if off is not None:
                entry.symbols[name] = SymbolBucketing(name, False, off)
                continue
            try:
                plans[region.index][name] = _plan(region, sym, live)
            except _NoBucket as exc:
                where, code = source_location(exc.node) if exc.node is not None else ("", "")
                op = plain_name(exc.node) if exc.node is not None else ""
                entry.symbols[name] = SymbolBucketing(name, False, exc.why, op=op, source=where, code=code)
    # One symbol padded per region: the one most regions can pad, so that a chain of regions pads
    # the same size and hands its padded outputs on in place.
    votes = collections.Counter(name for by_name in plans.values() for name in by_name)
    for index, by_name in plans.items():
        entry = out[index]
        if by_name:
            chosen = max(sorted(by_name), key=lambda n: votes[n])
            entry.plan = by_name[chosen]
        for name in by_name:
            padded = name == entry.plan.symbol
            entry.symbols[name] = SymbolBucketing(
                name, True, "" if padded else f"row-independent, but {entry.plan.symbol} is the one padded",
                padded=padded)
        entry.symbols = dict(sorted(entry.symbols.items()))
    return Buckets(regions=out)


def _size_symbols(region: Region) -> set:
    """Symbols in the tensor shapes at the region's boundary."""
    syms: set = set()
    for node in region.inputs + region.outputs:
        value = fake_value(node)
        if isinstance(value, torch.Tensor):
            for d in value.shape:
                syms |= size_expr(d).free_symbols
    return syms
