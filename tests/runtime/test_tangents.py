"""Released gradient buffers (runtime/tangents.py): the owner reaches the compiled backward, which
frees it at its last read; an owner no compiled backward takes goes when the capture is over."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from cgbackend.runtime import tangents
from cgbackend.runtime.loose_outputs import loose_alias, loose_supported
from cgbackend.runtime.tangents import Handover, handover_supported

pytestmark = pytest.mark.skipif(not (loose_supported() and handover_supported()),
                                reason="no non-owning storages or no AOT runtime call in this torch")


def _body(x, w):
    return torch.nn.functional.gelu(x @ w) * 3


def _backward_through(fn, seed):
    """The gradients of ``fn`` for an incoming gradient held only by a Handover, whether its owner
    was gone when the input's gradient was ready (in the backward, before it returned), and the
    Handover."""
    torch.manual_seed(seed)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)
    grad = torch.randn(64, 48)
    want = torch.autograd.grad(_body(x, w), [x, w], grad_outputs=[grad])
    out = fn(x, w)
    owner = grad.clone()
    ref = StorageWeakRef(owner.untyped_storage())
    alias = loose_alias(owner)
    handover = Handover()
    handover.add(7, alias, owner)
    del owner
    gone_in_backward = []
    x.register_hook(lambda g: gone_in_backward.append(ref.expired()))
    with handover:
        got = torch.autograd.grad([out], [x, w], grad_outputs=[alias])
        assert getattr(tangents._aot_runtime(), tangents._ENTRY) is tangents._call
    assert getattr(tangents._aot_runtime(), tangents._ENTRY) is not tangents._call
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    return gone_in_backward, handover


def test_compiled_backward_takes_the_owner_and_frees_it_at_its_last_read():
    """Inductor's backward takes the owner in its argument list and clears it: the buffer is gone
    before the backward is over, and the gradients are those of the buffer's values."""
    torch._dynamo.reset()
    compiled = torch.compile(_body, backend="inductor")
    compiled(torch.randn(64, 32, requires_grad=True), torch.randn(32, 48, requires_grad=True))  # compile
    for seed in (1, 2):
        gone, handover = _backward_through(compiled, seed)
        assert gone == [True] and handover.given == 1
        assert handover.released() == {7: 64 * 48 * 4}


def test_an_owner_no_compiled_backward_takes_goes_at_exit():
    """Eager kernels: no AOT call takes the owner; the buffer lives through the backward and goes
    when the handover closes."""
    gone, handover = _backward_through(_body, 3)
    assert gone == [False] and handover.given == 0
    assert handover.released() == {7: 64 * 48 * 4}


def test_an_owner_still_held_elsewhere_is_not_counted_released():
    owner = torch.randn(16)
    keep = owner.view(4, 4)  # another tensor on the same storage
    handover = Handover()
    handover.add(0, loose_alias(owner), owner)
    del owner
    with handover:
        pass
    assert handover.released() == {} and keep.sum().isfinite()


def test_only_a_stolen_list_receives_an_owner():
    """A call that copies its arguments (steal_args=False) keeps the alias: the owner stays with the
    handover rather than in a list its caller may keep."""
    owner = torch.randn(8)
    alias = loose_alias(owner)
    handover = Handover()
    handover.add(0, alias, owner)
    seen = []

    def boxed(args):
        seen.append(list(args))
        return []
    boxed._boxed_call = True
    with handover:
        tangents._call(boxed, [alias], steal_args=False)
        assert seen[0][0] is alias and handover.given == 0
        args = [alias]
        tangents._call(boxed, args, steal_args=True)
        assert args[0] is owner and seen[1][0] is owner and handover.given == 1
