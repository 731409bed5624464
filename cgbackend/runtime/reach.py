"""Which inputs of a training region each of its outputs reaches in the backward (issue 22).

A region's backward graph computes gradients for every input that requires grad; an output the
loss does not use gets a zero gradient there, so its inputs would come back as zeros where eager
autograd never reaches them and leaves ``.grad`` None. The runner returns None for an input when
every output that reaches it received no gradient, as eager does, on every call from the first.

Reachability is read once per training entry from the autograd graph its forward built (the same
graph eager autograd would walk): from each output's ``grad_fn`` through ``next_functions`` to the
``AccumulateGrad`` nodes of the region's leaf inputs.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["reached_inputs", "unreached"]


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
