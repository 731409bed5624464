"""Graph memory before anything runs: what one captured graph of a static region would take from
the shared pool, from the fake values Dynamo traced (explain's report; ``cgbackend.report`` too).

A captured graph keeps, in the pool, every block its kernels allocated while it was captured: the
peak of the region's values live at once (its outputs included, which stay allocated for the
caller or the next region), plus the static copies the runtime makes of the inputs it copies
(user inputs and values of eager regions; parameters, constants and hand-offs from a static region
are read in place). A value's bytes are its storage's (views add none); a value dies after the last
node of the region that reads it, unless it is an output. Training regions: the forward graph only
(saved activations and the backward graph come on top; ``stats()["memory"]`` measures them).

A bucketed region (passes/bucket.py) captures one graph per capture size it meets: each is
estimated with the padded size set to that capture size (other sizes at their traced values).
Those graphs share the pool's blocks for what is not held between calls, so the pool is about the
largest graph's; ``max_capture_size`` below the largest size bounds it (hints.py says so).

An estimate: Inductor fuses (fewer intermediate values) and the allocator rounds blocks up, so the
measured figure (``stats()["memory"]["reserved"]``, per region in the runtime report) differs;
values whose size cannot be evaluated (unbacked sizes) are counted in ``unknown_values``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from ..common.fx_utils import fake_value, iter_tensors

__all__ = ["GraphMemory", "analysis_memory", "memory_text", "region_memory"]


@dataclasses.dataclass
class GraphMemory:
    """One captured graph of a region, estimated. ``size``: the capture size of the padded symbol,
    None for a graph at the traced sizes."""

    size: Optional[int]
    peak_bytes: int
    """The region's values live at once, at most (outputs included)."""
    output_bytes: int
    copied_input_bytes: int
    """Static copies of the inputs the runtime copies into the graph's buffers."""
    unknown_values: int = 0
    traced: bool = False
    """The graph a call at the traced sizes would use (the capture size its padded size rounds up to)."""

    @property
    def bytes(self) -> int:
        return self.peak_bytes + self.copied_input_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "bytes": self.bytes, "peak_bytes": self.peak_bytes,
                "output_bytes": self.output_bytes, "copied_input_bytes": self.copied_input_bytes,
                "unknown_values": self.unknown_values, "traced": self.traced}


def _storages(node: torch.fx.Node) -> list[tuple[int, Any]]:
    """(storage identity, storage bytes) of each tensor in the node's fake value."""
    out = []
    for t in iter_tensors(fake_value(node)):
        try:
            storage = t.untyped_storage()
            out.append((storage._cdata, storage.nbytes()))
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): not counted
            continue
    return out


def _traced_values(values: Sequence[Any]) -> dict:
    """Symbol -> traced value of the backed sizes of the fake values' shape environment
    (``backed_var_to_val`` where torch has it, which renamed ``var_to_val``)."""
    for v in values:
        mode = getattr(v, "fake_mode", None)
        env = getattr(mode, "shape_env", None)
        if env is not None:
            table = getattr(env, "backed_var_to_val", None)
            return dict(table if table is not None else env.var_to_val)
    return {}


def _evaluator(known: dict, padded: Optional[str]) -> Callable[[Any, Optional[int]], Optional[int]]:
    """A function (bytes as an int or SymInt, capture size) -> int, or None where a size has no
    value (unbacked): the padded symbol set to the capture size, the others to their traced
    values (``known``: :func:`_traced_values`)."""

    def value(n: Any, size: Optional[int]) -> Optional[int]:
        if isinstance(n, int):
            return n
        if not isinstance(n, torch.SymInt):
            return None
        expr = n.node.expr
        subs = {}
        for sym in expr.free_symbols:
            if padded is not None and size is not None and str(sym) == padded:
                subs[sym] = size
            elif sym in known:
                subs[sym] = known[sym]
            else:
                return None
        try:
            return int(expr.xreplace(subs))
        except (TypeError, ValueError):
            return None

    return value


def region_memory(region: Any, copied: Callable[[torch.fx.Node], bool], padded: Optional[str] = None,
                  sizes: Sequence[int] = ()) -> list[GraphMemory]:
    """The graphs of one static region (passes/partition.Region), estimated: one per capture size
    in ``sizes`` where ``padded`` names the bucketed symbol, else one at the traced sizes.
    ``copied(input node)``: whether the runtime copies that input into a static buffer."""
    nodes = list(region.nodes)
    found: dict[torch.fx.Node, list] = {}

    def storages(node: torch.fx.Node) -> list[tuple[int, Any]]:  # each node's looked up once
        if node not in found:
            found[node] = _storages(node)
        return found[node]

    inside_inputs = {sid for inp in region.inputs for sid, _ in storages(inp)}
    produced: dict[int, tuple[int, Any]] = {}  # storage -> (index of the node making it, bytes)
    last: dict[int, int] = {}
    for i, node in enumerate(nodes):
        for inp in node.all_input_nodes:
            for sid, _ in storages(inp):
                if sid in produced:
                    last[sid] = i
        for sid, nbytes in storages(node):
            if sid in inside_inputs:
                continue  # written in place into an input: no new block
            if sid not in produced:
                produced[sid] = (i, nbytes)
            last[sid] = max(last.get(sid, i), i)
    end = len(nodes)
    out_sids = {sid for out in region.outputs for sid, _ in storages(out) if sid in produced}
    for sid in out_sids:
        last[sid] = end
    copies = [t.numel() * t.element_size() for inp in region.inputs if copied(inp)
              for t in iter_tensors(fake_value(inp))]
    known = _traced_values([t for n in nodes[:1] + list(region.inputs) for t in iter_tensors(fake_value(n))])
    evaluate = _evaluator(known, padded)

    def one(size: Optional[int]) -> GraphMemory:
        unknown = 0
        delta = [0] * (end + 2)
        for sid, (start, nbytes) in produced.items():
            b = evaluate(nbytes, size)
            if b is None:
                unknown += 1
                continue
            delta[start] += b
            delta[last[sid] + 1] -= b
        live = peak = 0
        for d in delta:
            live += d
            peak = max(peak, live)
        outputs = 0
        for sid in out_sids:
            b = evaluate(produced[sid][1], size)
            outputs += b or 0
        copied_bytes = 0
        for c in copies:
            b = evaluate(c, size)
            if b is None:
                unknown += 1
            else:
                copied_bytes += b
        return GraphMemory(size=size, peak_bytes=peak, output_bytes=outputs, copied_input_bytes=copied_bytes,
                           unknown_values=unknown)

    if padded is None or not sizes:
        graph = one(None)
        graph.traced = True
        return [graph]
    graphs = [one(s) for s in sizes]
    traced = next((int(v) for sym, v in known.items() if str(sym) == padded), None)
    rounded = [g for g in graphs if traced is not None and g.size >= traced]
    if rounded:
        rounded[0].traced = True
    return graphs


def _is_param(node: torch.fx.Node) -> bool:
    """A parameter or module buffer Dynamo lifted (read in place by every graph)."""
    return "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {})


def analysis_memory(analysis: Any, region: Any) -> list[GraphMemory]:
    """:func:`region_memory` of a static region of ``analysis`` (passes/pipeline.Analysis), its
    inputs' kinds decided as the runtime decides them (runtime/executor.py): placeholders that are
    not parameters and values of dynamic regions are copied; constants, parameters and outputs of
    static regions are read in place. A bucketed region (inference) gets one graph per capture
    size (those above ``max_capture_size`` run without a graph)."""
    constants = set(analysis.constants.nodes)
    region_of = analysis.partition.region_of

    def copied(inp: torch.fx.Node) -> bool:
        if not isinstance(fake_value(inp), torch.Tensor) or inp in constants:
            return False
        if inp.op == "placeholder":
            return not _is_param(inp)
        producer = region_of.get(inp)
        return producer is None or not producer.is_static

    padded = None
    entry = analysis.buckets.regions.get(region.index)
    if entry is not None and not analysis.classification.training:
        padded = next((name for name, b in entry.symbols.items() if b.padded), None)
    config = analysis.config
    sizes = sorted(s for s in config.capture_sizes if not config.max_capture_size or s <= config.max_capture_size)
    return region_memory(region, copied, padded, sizes)


def memory_text(memory: list[dict[str, Any]], training: bool) -> list[str]:
    """The report's line for a static region's estimated graph memory."""
    if not memory:
        return []
    mib = [f"{m['bytes'] / 2**20:.1f}" for m in memory]
    if memory[0]["size"] is None:
        text = f"{mib[0]} MiB at the traced sizes"
    else:
        shown = list(zip((m["size"] for m in memory), mib))
        if len(shown) > 6:
            shown = shown[:2] + [("...", "")] + shown[-3:]
        text = "by capture size " + ", ".join(f"{s}: {v}" if v else s for s, v in shown) + " MiB"
    extra = " (forward graph; saved activations and the backward come on top)" if training else ""
    unknown = sum(m["unknown_values"] for m in memory)
    if unknown:
        extra += f"; {unknown} value(s) of unknown size left out"
    return [f"{'':<10}graph memory (estimate): {text}{extra}"]
