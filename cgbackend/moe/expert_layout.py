"""Expert weights laid out for the grouped form without a copy per call.

The grouped form multiplies every expert's rows with one ``[E, out, in]`` weight. Experts kept as
separate modules (``nn.ModuleList`` of identical experts, Mixtral style) hold E separate
parameters, and ``torch.stack`` would copy all of them on every call (for 64 experts of a 2048 x
1408 SwiGLU, 1.1 GB per layer). ``stack_expert_params(model)``, run by ``cgbackend.compile`` when
static dispatch is on, moves each such group of parameters into one contiguous block: the same
Parameter objects (optimizers and state dicts keep working), the same values, now consecutive
slices ``block[e]`` of one storage. In the graph, ``stacked_view(w_0, ..., w_{E-1})`` then returns
a view of that block (no kernel, no copy; its backward hands each expert its slice of the
gradient), after checking on every run that the parameters still are consecutive slices of one
storage; where they are not (a parameter replaced since), it stacks them, a copy, as before. A
captured graph holds the view, and the runtime keys graphs on parameter addresses, so replacing a
parameter means a new capture, which runs the check again.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["stack_expert_params", "stacked_view", "block_view", "relayout", "consecutive", "LayoutCheck"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Relayout:
    module: str
    experts: int
    params: list[str]
    bytes: int
    left: str = ""
    """Why the parameters were left as they are (empty: laid out)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        where = self.module or "model"
        if self.left:
            return f"{where}: the {self.experts} experts' {', '.join(self.params)} left as they are: {self.left}"
        return (f"{where}: the {self.experts} experts' {', '.join(self.params)} laid out as one block each "
                f"({self.bytes / 2 ** 20:.1f} MiB), read by the grouped form without a copy")


SHARDED = ("sharded by a distributed engine (DTensor parameters, FSDP2's fully_shard): the engine gathers "
           "each expert's parameter into memory of its own before each forward and backward, so the grouped "
           "form stacks the gathered parameters on each call (a copy) instead of reading one block")
"""Why the experts' parameters of a sharded model are not laid out."""


def _sharded(t: torch.Tensor) -> bool:
    """A DTensor (a distributed engine's sharded parameter; feature-tested)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without torch.distributed
        return False
    return isinstance(t, DTensor)


def _is_fake(t: torch.Tensor) -> bool:
    return t.device.type == "meta" or type(t).__name__ == "FakeTensor" or hasattr(t, "fake_mode")


def consecutive(ws: Sequence[torch.Tensor]) -> bool:
    """``ws[e]`` is slice ``e`` of one contiguous block: same storage, same shape and dtype,
    contiguous, storage offsets one slice apart. Fake tensors keep storage identity and offsets,
    so the pass can ask the same question of Dynamo's fake parameters."""
    w0 = ws[0]
    if not w0.is_contiguous():
        return False
    try:
        s0 = w0.untyped_storage()
    except Exception:
        return False
    step = w0.numel()
    for e, w in enumerate(ws):
        if w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device or not w.is_contiguous():
            return False
        try:
            same = w.untyped_storage()._cdata == s0._cdata
        except Exception:
            return False
        if not same or w.storage_offset() != w0.storage_offset() + e * step:
            return False
    return s0.nbytes() >= (w0.storage_offset() + len(ws) * step) * w0.element_size()


class _StackedView(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, *ws: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        w0 = ws[0]
        return w0.as_strided((len(ws),) + tuple(w0.shape), (w0.numel(),) + tuple(w0.stride()),
                             w0.storage_offset())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        return tuple(grad.unbind(0))


def stacked_view(*ws: torch.Tensor) -> torch.Tensor:
    """``torch.stack(ws)`` without the copy when ``ws`` are consecutive slices of one block."""
    if not _is_fake(ws[0]) and consecutive(ws):
        return _StackedView.apply(*ws)
    return torch.stack(ws)


def block_view(w0: torch.Tensor, n: int) -> torch.Tensor:
    """The ``[n, *w0.shape]`` block whose slice 0 is ``w0``: ``n`` consecutive slices of ``w0``'s
    storage from ``w0`` on (a view, no copy). For inference graphs of folded loops, which take expert
    0's parameter only; that the other experts' parameters are the other slices is checked when the
    graph is made and on every call (:class:`LayoutCheck`). Only graphs that run without
    gradients use it (autograd cannot take a view past ``w0``'s own elements back to ``w0``)."""
    return w0.as_strided((n,) + tuple(w0.shape), (w0.numel(),) + tuple(w0.stride()), w0.storage_offset())


def relayout(params: Sequence[torch.Tensor]) -> int:
    """Move ``params`` (one shape, dtype and device) into one new contiguous block, values kept:
    ``p.data = block[e]``. Returns the block's bytes."""
    p0 = params[0]
    with torch.no_grad():
        block = torch.empty((len(params),) + tuple(p0.shape), dtype=p0.dtype, device=p0.device)
        for e, p in enumerate(params):
            block[e].copy_(p.data)
            p.data = block[e]
    return block.numel() * block.element_size()


def stack_expert_params(model: torch.nn.Module) -> list[Relayout]:
    """Lay out the parameters of each ModuleList of identical experts as slices of one block: lists
    whose name contains "expert" (``experts``, ``local_experts``) and that hold no list themselves.
    One parameter name at a time, so the transient extra memory is one block."""
    done: list[Relayout] = []
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < 2:
            continue
        if "expert" not in path.rsplit(".", 1)[-1].lower():
            continue  # a model's stack of layers is a ModuleList too: only experts are moved
        if any(isinstance(sub, torch.nn.ModuleList) for m in module for sub in m.modules()):
            continue
        first = module[0]
        if any(type(m) is not type(first) for m in module):
            continue
        names = [n for n, _ in first.named_parameters()]
        groups = []
        for name in names:
            params = [dict(m.named_parameters()).get(name) for m in module]
            if any(p is None for p in params):
                groups = []
                break
            p0 = params[0]
            if any(p.shape != p0.shape or p.dtype != p0.dtype or p.device != p0.device for p in params):
                groups = []
                break
            groups.append((name, params))
        if not groups:
            continue
        if any(_sharded(p) for _, params in groups for p in params):
            # Its local shards are not what a graph reads: the engine's gathered (unsharded) copies
            # are, in allocations the engine makes per parameter (cgbackend.distributed).
            done.append(Relayout(path, len(module), [name for name, _ in groups], 0, left=SHARDED))
            log.info("cgbackend: %s: %s", path or "model", done[-1].describe())
            continue
        moved, nbytes = [], 0
        for name, params in groups:
            if not consecutive([p.data for p in params]):
                nbytes += relayout(params)
                moved.append(name)
        if moved:
            done.append(Relayout(path, len(module), moved, nbytes))
            log.info("cgbackend: %s: the %d experts' %s laid out as one block each (%.1f MiB), so the grouped "
                     "form reads them without a copy", path or "model", len(module), ", ".join(moved),
                     nbytes / 2 ** 20)
    return done


_ptrs_equal: Optional[Callable[[list, list, list], bool]] = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal",
                                                                    None)
"""PyTorch's C++ comparison of tensors' addresses with a list (CUDA builds; feature-tested)."""


_REGISTRATIONS = [0]
"""Parameters registered on any module since import (``setattr`` of a Parameter, ``register_parameter``,
``load_state_dict(assign=True)``), counted by a global registration hook installed with the first
LayoutCheck: a replaced parameter object is seen at the next call."""


def _count_registration(module: torch.nn.Module, name: str, param: Any) -> None:
    _REGISTRATIONS[0] += 1


def _watch_registrations() -> None:
    if not getattr(_watch_registrations, "done", False):
        torch.nn.modules.module.register_module_parameter_registration_hook(_count_registration)
        _watch_registrations.done = True  # type: ignore[attr-defined]


class _Block:
    """One expert list's parameters of one name, as the last call saw them."""

    __slots__ = ("owner", "params", "idx", "ptrs", "seen")

    def __init__(self, owner: torch.nn.Module, params: list) -> None:
        self.owner = weakref.ref(owner)
        self.params = params
        self.idx = list(range(len(params)))
        self.ptrs = [p.data_ptr() for p in params]
        self.seen = _REGISTRATIONS[0]
        weakref.finalize(owner, params.clear)


class LayoutCheck:
    """Before each call of a graph that reads E experts' parameters from expert 0's block
    (:func:`block_view`; expert 0's parameter is graph input ``position``): are the other experts'
    parameters still that block's slices? The expert list is the one whose expert 0 holds that
    input (``find``; a graph compiled once for a stack of layers serves each layer's list), and its
    parameters are ``resolve(experts)``. One C++ comparison of the E addresses with those of the
    list's last call; where one changed (a parameter's ``.data`` replaced, the model moved), the
    parameters are checked again and, when they no longer are one block, laid out as one again
    (:func:`relayout`, a copy, logged as a warning) before the graph runs, so it
    never reads a replaced parameter's old values. A parameter object replaced on its module (any
    registration since the list's last call) is looked up again first. Not seen: writes straight
    into a module's private ``_parameters`` dict. Parameters are held until their expert list is
    garbage collected.

    A call returns whether any address changed since the list's last call. The runtime makes the
    check after launching a graph that can run twice alike (it writes no input, draws no random
    number), while the GPU runs it, and runs the graph again when an address had changed
    (runtime/executor.py): where :meth:`settled` holds, so that what the launch read was valid
    memory (expert 0's parameter where the list's last call found it: its view of the block reads
    the block's own storage) and no parameter was registered since."""

    def __init__(self, position: int, find: Callable[[torch.Tensor], Optional[torch.nn.Module]],
                 resolve: Callable[[torch.nn.Module], list], where: str) -> None:
        _watch_registrations()
        self.position = position
        self.find = find
        self.resolve = resolve
        self.where = where
        self.blocks: dict[int, tuple[Any, _Block]] = {}
        """id(expert 0's parameter) -> (a weak reference to it, its list's block)."""

    def _known(self, w0: torch.Tensor) -> Optional[tuple[Any, _Block]]:
        """The entry of the list ``w0`` (this call's expert-0 parameter) belongs to, if seen before."""
        entry = self.blocks.get(id(w0))
        return entry if entry is not None and entry[0]() is w0 else None

    def settled(self, args: Sequence[Any]) -> bool:
        w0 = args[self.position]
        entry = self._known(w0)
        if entry is None:
            return False
        block = entry[1]
        return block.seen == _REGISTRATIONS[0] and bool(block.ptrs) and block.ptrs[0] == w0.data_ptr()

    def __call__(self, args: Sequence[Any]) -> bool:
        w0 = args[self.position]
        entry = self._known(w0) or self._add(w0)
        block = entry[1]
        ps = block.params
        if block.seen != _REGISTRATIONS[0]:
            block.seen = _REGISTRATIONS[0]
            owner = block.owner()
            if owner is not None:
                now = self.resolve(owner)
                if len(now) != len(ps) or any(a is not b for a, b in zip(now, ps)):
                    ps[:] = now
                    block.ptrs = []
        if not ps:
            return False
        if _ptrs_equal is not None and len(block.ptrs) == len(ps):
            if _ptrs_equal(ps, block.ptrs, block.idx):
                return False
        elif [p.data_ptr() for p in ps] == block.ptrs:
            return False
        if not consecutive([p.data for p in ps]):
            p0 = ps[0]
            if any(p.shape != p0.shape or p.dtype != p0.dtype or p.device != p0.device for p in ps):
                raise RuntimeError(
                    f"cgbackend: {self.where}: the experts' parameters no longer share one shape, dtype and "
                    "device, which the compiled graph reads them as; compile the model again "
                    "(torch.compiler.reset(), then cgbackend.compile)")
            nbytes = relayout(ps)
            log.warning("cgbackend: %s: the experts' parameters were no longer one block (one was replaced); "
                        "laid out as one again (%.1f MiB copied) before the call", self.where, nbytes / 2 ** 20)
        block.ptrs = [p.data_ptr() for p in ps]
        return True

    def _add(self, w0: torch.Tensor) -> tuple[Any, _Block]:
        owner = self.find(w0)
        if owner is None:
            raise RuntimeError(f"cgbackend: {self.where}: the parameter the graph reads the experts' block from "
                               "belongs to no expert list it was compiled for; compile the model again "
                               "(torch.compiler.reset(), then cgbackend.compile)")
        entry = (weakref.ref(w0), _Block(owner, self.resolve(owner)))
        self.blocks[id(w0)] = entry
        return entry
