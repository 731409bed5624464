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
from typing import Any, Sequence

import torch

__all__ = ["stack_expert_params", "stacked_view", "consecutive"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Relayout:
    module: str
    experts: int
    params: list[str]
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
        moved, nbytes = [], 0
        with torch.no_grad():
            for name, params in groups:
                if consecutive([p.data for p in params]):
                    continue
                block = torch.empty((len(params),) + tuple(params[0].shape), dtype=params[0].dtype,
                                    device=params[0].device)
                for e, p in enumerate(params):
                    block[e].copy_(p.data)
                    p.data = block[e]
                moved.append(name)
                nbytes += block.numel() * block.element_size()
        if moved:
            done.append(Relayout(path, len(module), moved, nbytes))
            log.info("cgbackend: %s: the %d experts' %s laid out as one block each (%.1f MiB), so the grouped "
                     "form reads them without a copy", path or "model", len(module), ", ".join(moved),
                     nbytes / 2 ** 20)
    return done
