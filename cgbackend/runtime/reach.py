"""Which inputs of a training region each of its outputs reaches in the backward.

A region's backward graph computes gradients for every input that requires grad; an output the
loss does not use gets a zero gradient there, so its inputs would come back as zeros where eager
autograd never reaches them and leaves ``.grad`` None. The runner returns None for an input when
every output that reaches it received no gradient, as eager does, on every call from the first.

Reachability is read once per training entry from the autograd graph its forward built (the same
graph eager autograd would walk): from each output's ``grad_fn`` through ``next_functions`` to the
``AccumulateGrad`` nodes of the region's leaf inputs. A region compiled by Inductor builds one
autograd node for its whole forward, which reaches every input; there the region's FX module is run
once more on fake tensors (no kernel, no memory) to build the graph eager autograd would have built
(:func:`fake_output_reach`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)

__all__ = ["fake_output_reach", "reached_inputs", "unreached"]


def reached_inputs(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> tuple[frozenset, ...]:
    """For each output, the positions in ``inputs`` (leaf tensors) its backward reaches."""
    position = {id(t): i for i, t in enumerate(inputs)}
    result = []
    for out in outputs:
        reached: set[int] = set()
        start = out.grad_fn
        if start is None:  # the output is itself one of the leaves
            if id(out) in position:
                reached.add(position[id(out)])
            result.append(frozenset(reached))
            continue
        seen = {start}
        stack = [start]
        while stack:
            fn = stack.pop()
            variable = getattr(fn, "variable", None)  # AccumulateGrad
            if variable is not None and id(variable) in position:
                reached.add(position[id(variable)])
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        result.append(frozenset(reached))
    return tuple(result)


def fake_output_reach(module: Callable[..., Any], ins: Sequence[Any], diff_in: Sequence[int],
                      diff_out: Optional[Sequence[int]] = None
                      ) -> Optional[tuple[tuple[int, ...], tuple[frozenset, ...]]]:
    """:func:`reached_inputs` for the outputs ``diff_out`` of ``module(*ins)`` (None: every output
    that requires grad) and its inputs ``diff_in``, from a run on fake copies of ``ins``:
    (those outputs, what each reaches). None where the module cannot run on fake tensors (the
    caller then keeps the runtime graph's answer, which only errs towards zeros)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        wanted = set(diff_in)
        fakes = []
        for p, t in enumerate(ins):
            if isinstance(t, torch.Tensor):
                f = mode.from_tensor(t.detach())
                t = f.requires_grad_(True) if p in wanted else f
            fakes.append(t)
        with mode, torch.enable_grad():
            outs = module(*fakes)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        if diff_out is None:
            diff_out = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
        return tuple(diff_out), reached_inputs([outs[k] for k in diff_out], [fakes[p] for p in diff_in])
    except Exception as exc:  # an op without a fake implementation, an opaque call
        log.debug("cgbackend: reachability from a fake run failed (%s); the runtime graph's is kept", exc)
        return None


def unreached(reach: tuple[frozenset, ...], grads: Sequence[Optional[torch.Tensor]]) -> set[int]:
    """Input positions that no output with a gradient reaches (``grads`` per output, None: unused)."""
    live: set[int] = set()
    for reached, grad in zip(reach, grads):
        if grad is not None:
            live |= reached
    every: set[int] = set()
    for reached in reach:
        every |= reached
    return every - live
