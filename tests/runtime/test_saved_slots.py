"""Saved-tensor slots (runtime/saved.py): what a Loosening frees, when, and what it leaves alone."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from cgbackend.runtime.saved import Loosening, SavedTensors, loosening_supported

pytestmark = pytest.mark.skipif(not loosening_supported(), reason="no non-owning storages in this torch")

EVERYWHERE = [(0, 2 ** 64)]


def _forward(saved, a, b):
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        e = (a * b).exp()       # ExpBackward saves e; MulBackward saves b (a's gradient reads it)
        out = e.sin().sum()     # SinBackward saves e
    return out, e


def _loosening(saved, ranges, own):
    """A Loosening as the backward builds it: ``saved.alone`` as the recorder sets it (the saved
    storages that are none of ``own``, the region's static inputs and outputs)."""
    saved.alone = frozenset(r().ptr for r in saved.slots if r() is not None and r().ptr not in own)
    return Loosening(saved, ranges)


def test_each_saved_tensor_goes_once_the_last_node_reading_it_ran():
    torch.manual_seed(0)
    a = torch.randn(4096, requires_grad=True)
    b = torch.randn(4096)
    saved = SavedTensors()
    out, e = _forward(saved, a, b)
    modified, storages = saved.finish()
    assert modified is None and e.untyped_storage().data_ptr() in storages
    ref = StorageWeakRef(e.untyped_storage())
    want = torch.autograd.grad(out, a, retain_graph=True)[0]
    del e
    loosening = _loosening(saved, EVERYWHERE, own={a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()})
    exp_node = out.grad_fn.next_functions[0][0].next_functions[0][0]
    assert type(exp_node).__name__.startswith("ExpBackward")
    alive_at_exp = []
    exp_node.register_prehook(lambda grads: alive_at_exp.append(not ref.expired()))
    with loosening.during([out]):
        got = torch.autograd.grad(out, a, retain_graph=True)[0]
    # SinBackward read e first and its slot went after it ran; ExpBackward's own slot of e kept the
    # storage alive until ExpBackward ran too.
    assert alive_at_exp == [True] and ref.expired()
    assert loosening.freed_bytes() == 4096 * 4  # e alone: a and b are the region's own
    torch.testing.assert_close(got, want)
    slots = [r() for r in saved.slots]
    loose = [s for s in slots if s is not None and s.tensor is None]
    kept = [s for s in slots if s is not None and s.tensor is not None]
    assert len(loose) == 2 and all(s.loose is not None and s.loose.numel() == 4096 for s in loose)
    assert [s.ptr for s in kept] == [b.untyped_storage().data_ptr()]
    # The graph is kept: its nodes read the loose tensors at the same addresses.
    assert all(s.get().data_ptr() == s.ptr for s in loose)


def _small():
    """A forward whose b lives only in its slot: (a, hooks, output, weak reference to e's storage)."""
    a = torch.randn(256, requires_grad=True)
    saved = SavedTensors()
    out, e = _forward(saved, a, torch.randn(256))
    saved.finish()
    return a, saved, out, StorageWeakRef(e.untyped_storage())


def test_nothing_outside_the_pool_ranges_is_loosened():
    a, saved, out, ref = _small()
    loosening = _loosening(saved, [], own=())
    with loosening.during([out]):
        torch.autograd.grad(out, a, retain_graph=True)
    loosening.rest()
    assert not ref.expired() and loosening.freed_bytes() == 0
    assert all(r() is None or r().tensor is not None for r in saved.slots)
    torch.autograd.grad(out, a)  # the graph still has its saved tensors


def test_rest_loosens_the_slots_no_node_read():
    a, saved, out, ref = _small()
    loosening = _loosening(saved, EVERYWHERE, own={a.untyped_storage().data_ptr()})
    loosening.rest()  # as for an entry whose backward graph was captured before (release_ready)
    assert ref.expired() and loosening.freed_bytes() == 2 * 256 * 4  # e and b
    assert sum(r() is not None and r().tensor is None for r in saved.slots) == 3  # e twice and b
