"""The memory layouts a region's compiled code reads its copied inputs in, and the copies that bring
any call's tensors into them.

Inductor's code depends on its inputs' strides: it asserts them on entry and indexes with them.
Dynamo guards the strides of a graph's inputs, but not always by value: a graph traced again after a
stride change has symbolic strides, and Inductor may specialize them while it compiles a region
(lazily, after Dynamo's guards are set, so nothing guards the specialization); and inputs made by
eager code carry whatever strides eager gave them. So each copied input of a region (kinds COPY and
EAGER: parameters and other graphs' outputs are read in place, their strides guarded by Dynamo or set by their
producer) gets one compiled :class:`Layout`, chosen from the example Dynamo recorded:

* the example's strides where they are numbers (Dynamo guards them), a stride-0 (expanded) dim
  included: the compiled code reads the broadcast as the example did, and a static buffer in that
  layout holds the distinct elements only (as cudagraph trees' static inputs do);
* otherwise dense in the example's dim order, 0 where the example's stride is 0, each stride a
  product of sizes: the compiled code then asserts nothing the sizes do not fix.

Where the example's strides differ from the chosen layout, Inductor compiles the region for the
layout instead (its placeholder's fake value is replaced). :class:`AdaptedCall` wraps the compiled
code: a call's tensor in another layout is copied into the compiled one first (and copied back after
if the region writes it). Static buffers are allocated in the compiled layout
(:func:`input_buffer`), so a replay's staging copy converts for free. A tensor a stride-0 layout
cannot hold (its elements differ along the broadcast dim) runs that call eagerly
(``EagerReason.INPUT_LAYOUT``, the runner's check), or eager's kernels where the compiled code is
called with it anyway.

Memory: a buffer with a stride-0 dim holds one slice along it (an attention mask expanded over the
batch costs one mask); a sliced or transposed example keeps its strides (the buffer spans what the
example spans); only examples with symbolic strides are made dense.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx

from ..common.fx_utils import copy_module, fake_value

__all__ = ["Layout", "InputLayouts", "AdaptedCall", "input_buffer", "compact_view", "copy_into",
           "describe_inputs"]


def _hint(value: Any) -> Optional[int]:
    """A number for a size or stride (a SymInt's hint, adding no guard); None if it has none."""
    if isinstance(value, int):
        return value
    hint = getattr(torch.fx.experimental.symbolic_shapes, "optimization_hint", None)
    try:
        if hint is not None:
            return int(hint(value))
        return int(value.node.hint)
    except Exception:  # an unbacked symbol: no hint to order by
        return None


def _non_overlapping(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """No two elements share memory once the stride-0 dims are left out."""
    span = 1
    for st, sz in sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1 and st != 0):
        if st < span:
            return False
        span = st * sz
    return True


def compact_view(t: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
    """``t`` with one element along each of ``dims`` (its stride-0 dims): the part a copy writes."""
    for d in dims:
        t = t.narrow(d, 0, 1)
    return t


def copy_into(buf: torch.Tensor, value: torch.Tensor, dims: Sequence[int] = ()) -> None:
    """Copy ``value`` into a static buffer whose ``dims`` have stride 0 (along which ``value``'s
    elements are equal: it has stride 0 there too)."""
    if dims:
        compact_view(buf, dims).copy_(compact_view(value, dims))
    else:
        buf.copy_(value)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One input's compiled layout: ``fixed`` strides, or dense in ``order`` (dims outermost first)
    with stride 0 on ``zero``, its strides computed from each call's sizes."""

    order: tuple[int, ...]
    zero: tuple[int, ...] = ()
    fixed: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, example: torch.Tensor) -> Optional["Layout"]:
        """The layout to compile for, from Dynamo's example (a fake tensor); None without hints."""
        sizes = [_hint(s) for s in example.shape]
        strides = [_hint(s) for s in example.stride()]
        if None in sizes or None in strides:
            return None
        zero = tuple(d for d, (sz, st) in enumerate(zip(sizes, strides)) if st == 0 and sz > 1)
        order = tuple(sorted((d for d in range(len(sizes)) if d not in zero), key=lambda d: (-strides[d], d)))
        fixed = tuple(example.stride())
        if all(isinstance(s, int) for s in fixed) and _non_overlapping(sizes, fixed):
            return cls(order, zero, fixed)
        return cls(order, zero)  # symbolic strides, or windows that overlap (unfold): dense

    def strides(self, sizes: Sequence[Any]) -> tuple:
        """The strides of a tensor of ``sizes`` in this layout (ints, or SymInts for fake sizes)."""
        if self.fixed is not None:
            return self.fixed
        out: list[Any] = [0] * len(sizes)
        span: Any = 1
        for d in reversed(self.order):
            out[d] = span
            span = span * sizes[d]
        return tuple(out)

    def matches(self, t: torch.Tensor, strides: Sequence[int]) -> bool:
        """Does ``t`` already lie in this layout (``strides``: the layout's for its sizes)? Strides
        of size-1 dims and of empty tensors do not count (Inductor checks neither)."""
        if t.numel() == 0:
            return True
        return all(a == b or sz == 1 for a, b, sz in zip(t.stride(), strides, t.shape))

    @staticmethod
    def broadcast(sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
        """The dims of ``sizes`` read with stride 0 (more than one element along them)."""
        return tuple(d for d, (sz, st) in enumerate(zip(sizes, strides)) if st == 0 and sz > 1)

    def holds(self, t: torch.Tensor) -> bool:
        """Can ``t`` be copied into this layout (equal along each of its stride-0 dims)?"""
        if t.numel() == 0:
            return True
        stride = t.stride()
        return all(stride[d] == 0 for d in self.broadcast(t.shape, self.strides(t.shape)))

    def copy_of(self, t: torch.Tensor, strides: Sequence[int]) -> Optional[torch.Tensor]:
        """A copy of ``t`` in this layout (differentiable), or None if it cannot hold ``t``."""
        dims = self.broadcast(t.shape, strides) if t.numel() else ()
        if any(t.stride(d) != 0 for d in dims):
            return None
        src = compact_view(t, dims)
        out = torch.empty_strided(src.shape, strides, dtype=t.dtype, device=t.device)
        out.copy_(src)
        return out.expand(t.shape) if dims else out


def _placeholders(module: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in module.graph.nodes if n.op == "placeholder"]


def _same_strides(example: torch.Tensor, strides: Sequence[Any]) -> bool:
    """Are the example's strides those of the layout, whatever its symbols are (no guard added)?"""
    from torch.fx.experimental.symbolic_shapes import statically_known_true
    return all(sz == 1 or statically_known_true(a == b)
               for a, b, sz in zip(example.stride(), strides, example.shape))


class InputLayouts:
    """The compiled layouts of one region's copied inputs, by input position."""

    __slots__ = ("layouts", "items", "written", "broadcasting")

    def __init__(self, layouts: dict[int, Layout], written: Sequence[int] = ()) -> None:
        self.layouts = layouts
        self.items = tuple(sorted(layouts.items()))
        self.written = frozenset(written)
        self.broadcasting = tuple((p, lay) for p, lay in self.items
                                  if lay.zero or (lay.fixed is not None and 0 in lay.fixed))
        """Layouts with a stride-0 dim: the only ones a tensor can fail to fit."""

    @classmethod
    def plan(cls, module: torch.fx.GraphModule, positions: Sequence[int],
             written: Sequence[int] = ()) -> tuple["InputLayouts", torch.fx.GraphModule]:
        """The layouts of the inputs at ``positions``, and the module to compile: ``module``, or a
        copy whose placeholders' fake values have the layout where the example's strides differ."""
        placeholders = _placeholders(module)
        layouts: dict[int, Layout] = {}
        replace: dict[int, torch.Tensor] = {}
        for pos in positions:
            example = fake_value(placeholders[pos]) if pos < len(placeholders) else None
            if not isinstance(example, torch.Tensor) or example.layout != torch.strided:
                continue
            layout = Layout.of(example)
            if layout is None:
                continue
            layouts[pos] = layout
            strides = layout.strides(example.shape)
            if not _same_strides(example, strides):
                replace[pos] = _fake_like(example, strides)
        plan = cls(layouts, written)
        if not replace:
            return plan, module
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        copied = copy_module(module, env)
        for pos, fake in replace.items():
            node = env[placeholders[pos]]
            node.meta = dict(node.meta)
            node.meta["val"] = fake
            if "example_value" in node.meta:
                node.meta["example_value"] = fake
        return plan, copied

    def layout(self, pos: int) -> Optional[Layout]:
        return self.layouts.get(pos)

    def hold(self, ins: Sequence[Any]) -> bool:
        """Can every copied input of this call be copied into its compiled layout?"""
        return all(lay.holds(ins[p]) for p, lay in self.broadcasting if isinstance(ins[p], torch.Tensor))

    def adapt(self, args: Sequence[Any]) -> Optional[tuple[Sequence[Any], list, int]]:
        """(``args`` with each copied input in its compiled layout, (caller's tensor, copy) pairs to
        copy back after the call, how many were copied), or None if a layout cannot hold one."""
        changed: Optional[list] = None
        back: list = []
        for pos, layout in self.items:
            t = args[pos]
            if not isinstance(t, torch.Tensor):
                continue
            strides = layout.strides(t.shape)
            if layout.matches(t, strides):
                continue
            new = layout.copy_of(t, strides)
            if new is None:
                return None
            if changed is None:
                changed = list(args)
            changed[pos] = new
            if pos in self.written:
                back.append((t, new))
        if changed is None:
            return args, back, 0
        return changed, back, sum(1 for a, b in zip(args, changed) if a is not b)


def _fake_like(example: torch.Tensor, strides: Sequence[Any]) -> torch.Tensor:
    """A fake tensor like ``example`` (same fake mode, sizes, dtype) with ``strides``."""
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode([example])
    with mode:
        fake = torch.empty_strided(example.shape, strides, dtype=example.dtype, device=example.device)
    return fake.requires_grad_(example.requires_grad)


class AdaptedCall:
    """A region's compiled code, callable with its copied inputs in any layout (RegionCode.fn).

    Each input is copied into its compiled layout where it lies in another (counted in
    ``layout_copies``: warm-up and eager calls; a capture reads static buffers already in it) and
    copied back after the call if the region writes it. A tensor the layout cannot hold runs the call
    on ``module`` (eager's kernels), which reads any layout."""

    __slots__ = ("fn", "module", "layouts", "counters", "needs_backward_prewarm")

    def __init__(self, fn: Callable[..., Any], module: torch.fx.GraphModule, layouts: InputLayouts,
                 counters: Any) -> None:
        self.fn = fn
        self.module = module
        self.layouts = layouts
        self.counters = counters
        self.needs_backward_prewarm = getattr(fn, "needs_backward_prewarm", False)

    @property
    def backward_seen(self) -> bool:
        """The compiled code's (inner.py): has its backward run outside a capture?"""
        return getattr(self.fn, "backward_seen", False)

    def __call__(self, *args: Any) -> Any:
        adapted = self.layouts.adapt(args)
        if adapted is None:
            return self.module(*args)
        new, back, copies = adapted
        if not copies:
            return self.fn(*args)
        self.counters.layout_copies += copies
        out = self.fn(*new)
        for caller, copy in back:
            caller.copy_(copy)  # the region wrote its copy
        return out


def input_buffer(value: torch.Tensor, layout: Optional[Layout]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A static buffer for ``value`` (not filled) and its stride-0 dims: in ``layout`` where it holds
    ``value`` (the compiled code's), else in ``value``'s own strides where they can be written
    after leaving out the stride-0 dims; dense otherwise (overlapping windows)."""
    sizes = value.shape
    strides = layout.strides(sizes) if layout is not None and layout.holds(value) else value.stride()
    if _non_overlapping(sizes, strides):
        buf = torch.empty_strided(sizes, strides, dtype=value.dtype, device=value.device)
        return buf, Layout.broadcast(sizes, strides)
    return torch.empty(sizes, dtype=value.dtype, device=value.device), ()


def describe_inputs(module: Optional[torch.fx.GraphModule], kinds: Sequence[str], ins: Sequence[Any],
                    layouts: Optional[InputLayouts], skip: str) -> str:
    """The region's tensor inputs other than those of kind ``skip`` (parameters), each with its
    placeholder name, kind, sizes and strides, and the strides the compiled code reads it in."""
    names = [n.name for n in _placeholders(module)] if module is not None else []
    parts = []
    for pos, (kind, value) in enumerate(zip(kinds, ins)):
        if kind == skip or not isinstance(value, torch.Tensor):
            continue
        name = names[pos] if pos < len(names) else f"input {pos}"
        text = f"{name} ({kind}) size {tuple(value.shape)} stride {value.stride()}"
        layout = layouts.layout(pos) if layouts is not None else None
        if layout is not None:
            compiled = tuple(layout.strides(value.shape))
            if compiled != value.stride():
                text += f", compiled for stride {compiled}"
        parts.append(text)
    return "; ".join(parts)
