"""Parameter gradients a pool's backward graphs stop owning once whoever received them let go.

A backward graph writes the gradients of its region's inputs into buffers it owns for as long as
its entry lives; autograd receives aliases of them (static_grads.py). A training loop keeps the
parameters' as ``.grad`` until the optimizer step, which eager holds as much of: owning them costs
nothing. FSDP2 does not keep them: it copies each layer's gradients into its reduce-scatter buffer
right after that layer's backward and drops them, where eager frees them. Owned, every layer's
stayed allocated: the unsharded model's size (a 16-layer 128-expert MoE: 19 GiB a rank).

So before a backward graph is captured in a pool, each earlier backward graph of that pool whose
given gradients nobody holds any more (use counts: held.HeldStorages) keeps its parameters'
gradients only as tensors on storages that do not own their memory (loose_outputs.loose_aliases),
and the blocks go back to the pool, where this capture, and later ones, may receive them. A graph
qualifies once all its gradients are free: the activations' are consumed by the next backward of
the pass, so one capture later. A training loop that holds ``.grad`` keeps them owned; nothing
changes for it. The activations' gradients stay owned: the next backward node reads them while the
autograd engine still refers to them, which the checks below would take for a holder.

Why it is safe: the rule of pool.py, both ways. The loosened graph's own replay writes its
gradients into blocks that graphs captured later may use; while those graphs' data are live, the
rule keeps the loosened graph (captured earlier) from replaying. Conversely, a graph captured after
the loosening may write over the parameters' gradients while someone still holds them: the pool
keeps the loosened entries whose gradients are given out (``PoolState.given_loose``), and before
such a graph replays each is checked: nobody holds them, or a ``.grad`` aliasing them gets its own
copy (as ``static_grads.reclaim_grads`` does before an entry's own replay); if anything else still
holds them, that replay waits (eager, ``replay_order_hazard``). FSDP2 reads them on the compute
stream before dropping them, so what a later graph writes is ordered after the read.

Simulated graphs (CPU tests) keep their tensors and model the hazard: a loosened graph's outputs
are scribbled over at every replay of another graph of its pool (capture.SimulatedGraph).
"""

from __future__ import annotations

from .capture import SimulatedGraph
from .entries import TrainEntry
from .held import HeldStorages
from .loose_outputs import loose_aliases, loose_supported
from .pool import PoolState
from .spec import PARAM
from .stats import Counters

__all__ = ["loosen_dropped", "watch_given", "owns_grads", "weight_grads", "weights_held"]


def owns_grads(entry: TrainEntry) -> bool:
    """May ``entry``'s parameter gradients be loosened once dropped: a backward graph exists, it
    writes some, they are still owned, and whether they are held can be told (use counts)."""
    return (entry.bwd_graph is not None and entry.loose_from < 0 and entry.held is not None
            and entry.weights_held is not None
            and (loose_supported() or isinstance(entry.bwd_graph, SimulatedGraph)))


def weight_grads(diff_in: tuple, kinds: tuple, grads: tuple) -> tuple:
    """Which of a backward graph's gradients (``grads``, in ``diff_in`` order) are its parameters'."""
    return tuple(k for k, pos in enumerate(diff_in) if kinds[pos] is PARAM and grads[k] is not None)


def loosen_dropped(pool: PoolState, counters: Counters) -> int:
    """Before a backward capture in ``pool``: loosen the gradients of its backward graphs that
    nobody holds any more (module docstring). Returns how many entries were loosened."""
    loosened = 0
    keep = []
    for entry in pool.grad_owners:
        if not owns_grads(entry):
            continue
        if not entry.held.free():
            keep.append(entry)
            continue
        graph = entry.bwd_graph
        grads = list(entry.static_grad_ins)
        weights = [grads[k] for k in entry.weight_grads]
        nbytes = sum({g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                      for g in weights if g.numel()}.values())
        if loose_supported():
            # Nothing outside holds any of them (held.free()): the new counts' baselines are clean.
            for k, alias in zip(entry.weight_grads, loose_aliases(weights)):
                grads[k] = alias
            entry.static_grad_ins = tuple(grads)
            # Both made before either is marked: each holds the storages' Python objects, which
            # the other's counts include.
            entry.held = HeldStorages(entry.static_grad_ins)
            entry.weights_held = HeldStorages([grads[k] for k in entry.weight_grads])
            entry.held.mark()
            entry.weights_held.mark()
        if isinstance(graph, SimulatedGraph):
            # A simulated graph keeps its own outputs (the aliases read the same memory); the
            # replays of the graphs captured from now on scribble them (capture.py).
            graph.loose = (pool.next_index, [grads[k] for k in entry.weight_grads])
        del weights, grads
        entry.loose_from = pool.next_index
        counters.grads_loosened += 1
        counters.grads_loosened_bytes += nbytes
        loosened += 1
    pool.grad_owners = keep
    return loosened


def watch_given(entry: TrainEntry, counters: Counters) -> None:
    """``entry``'s loosened gradients were just given to autograd: until nobody holds its
    parameters' any more, graphs of its pool captured after the loosening may not replay."""
    entry.pool.given_loose[id(entry)] = (entry.loose_from, lambda: weights_held(entry, counters))


def weights_held(entry: TrainEntry, counters: Counters) -> bool:
    """Does anyone still hold ``entry``'s loosened parameter gradients? A ``.grad`` of one of its
    leaves aliasing them gets its own copy first (counted), as before the entry's own replay."""
    held = entry.weights_held
    if held.free():
        return False
    ptrs = {entry.static_grad_ins[k].data_ptr() for k in entry.weight_grads}
    for leaf in entry.leaves:
        grad = leaf.grad
        if grad is not None and grad.data_ptr() in ptrs:
            leaf.grad = grad.clone()
            counters.copies_made += 1
            counters.copied_by_kind["grad_reclaimed"] += 1
        del grad
    return not held.free()
