"""Released gradient buffers (runtime/tangents.py): the owner reaches the compiled backward, which
frees it at its last read; an owner no compiled backward takes goes when the capture is over."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from cgbackend.runtime import tangents
from cgbackend.runtime.loose_outputs import loose_alias, loose_supported
from cgbackend.runtime.tangents import OwnerTransfer, owner_transfer_supported

pytestmark = pytest.mark.skipif(not (loose_supported() and owner_transfer_supported()),
                                reason="no non-owning storages or no AOT runtime call in this torch")


def _body(x, w):
    return torch.nn.functional.gelu(x @ w) * 3


def _backward_through(fn, seed):
    """The gradients of ``fn`` for an incoming gradient held only by a OwnerTransfer, whether its owner
    was gone when the input's gradient was ready (in the backward, before it returned), and the
    OwnerTransfer."""
    torch.manual_seed(seed)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)
    grad = torch.randn(64, 48)
    want = torch.autograd.grad(_body(x, w), [x, w], grad_outputs=[grad])
    out = fn(x, w)
    owner = grad.clone()
    ref = StorageWeakRef(owner.untyped_storage())
    alias = loose_alias(owner)
    transfer = OwnerTransfer()
    transfer.add(7, alias, owner)
    del owner
    gone_in_backward = []
    x.register_hook(lambda g: gone_in_backward.append(ref.expired()))
    with transfer:
        got = torch.autograd.grad([out], [x, w], grad_outputs=[alias])
        assert getattr(tangents._aot_runtime(), tangents._ENTRY) is tangents._call
    assert transfer not in tangents._active
    if not tangents._active:
        assert getattr(tangents._aot_runtime(), tangents._ENTRY) is not tangents._call
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    return gone_in_backward, transfer


def test_compiled_backward_takes_the_owner_and_frees_it_at_its_last_read():
    """Inductor's backward takes the owner in its argument list and clears it: the buffer is gone
    before the backward is over, and the gradients are those of the buffer's values."""
    torch._dynamo.reset()
    compiled = torch.compile(_body, backend="inductor")
    compiled(torch.randn(64, 32, requires_grad=True), torch.randn(32, 48, requires_grad=True))  # compile
    for seed in (1, 2):
        gone, transfer = _backward_through(compiled, seed)
        assert gone == [True] and transfer.given == 1
        assert transfer.released() == {7: 64 * 48 * 4}


def test_an_owner_no_compiled_backward_takes_goes_at_exit():
    """Eager kernels: no AOT call takes the owner; the buffer lives through the backward and goes
    when the transfer closes."""
    gone, transfer = _backward_through(_body, 3)
    assert gone == [False] and transfer.given == 0
    assert transfer.released() == {7: 64 * 48 * 4}


def test_an_owner_still_held_elsewhere_is_not_counted_released():
    owner = torch.randn(16)
    keep = owner.view(4, 4)  # another tensor on the same storage
    transfer = OwnerTransfer()
    transfer.add(0, loose_alias(owner), owner)
    del owner
    with transfer:
        pass
    assert transfer.released() == {} and keep.sum().isfinite()


def test_only_a_stolen_list_receives_an_owner():
    """A call that copies its arguments (steal_args=False) keeps the alias: the owner stays with the
    transfer rather than in a list its caller may keep."""
    owner = torch.randn(8)
    alias = loose_alias(owner)
    transfer = OwnerTransfer()
    transfer.add(0, alias, owner)
    seen = []

    def boxed(args):
        seen.append(list(args))
        return []
    boxed._boxed_call = True
    with transfer:
        tangents._call(boxed, [alias], steal_args=False)
        assert seen[0][0] is alias and transfer.given == 0
        args = [alias]
        tangents._call(boxed, args, steal_args=True)
        assert args[0] is owner and seen[1][0] is owner and transfer.given == 1


def _relayed_backward(fn, seed, retain=False):
    """Gradients of ``fn`` through GradRelay for an incoming gradient autograd makes (a product's
    backward), whether that gradient was gone when the input's gradient was ready, and the
    counters."""
    from cgbackend.runtime.stats import Counters
    torch.manual_seed(seed)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)
    scale = torch.randn(64, 48)
    want = torch.autograd.grad((_body(x, w) * scale).sum(), [x, w])
    counters = Counters()
    (y,) = tangents.GradRelay.apply(False, counters, fn(x, w))
    refs = []
    y.register_hook(lambda g: refs.append(StorageWeakRef(g.untyped_storage())))
    gone_in_backward = []
    x.register_hook(lambda g: gone_in_backward.append(refs[0].expired()))
    got = torch.autograd.grad((y * scale).sum(), [x, w], retain_graph=retain)
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert not any(h.counters is counters for h in tangents._active), "a relay outlived its backward pass"
    return gone_in_backward, refs[0].expired(), counters


@pytest.mark.skipif(not tangents.RELAY, reason="no end-of-backward hook in this torch")
def test_a_relayed_gradient_goes_at_its_last_read_in_compiled_code():
    """The incoming gradient reaches Inductor's backward as an alias whose owner the compiled code
    takes and frees: gone before the region's backward is over, gradients as eager's."""
    torch._dynamo.reset()
    compiled = torch.compile(_body, backend="inductor")
    compiled(torch.randn(64, 32, requires_grad=True), torch.randn(32, 48, requires_grad=True))  # compile
    gone, after, counters = _relayed_backward(compiled, 4)
    assert gone == [True] and after
    assert counters.grads_relayed == 1 and counters.grads_relayed_freed_early == 1


@pytest.mark.skipif(not tangents.RELAY, reason="no end-of-backward hook in this torch")
@pytest.mark.parametrize("retain", [False, True])
def test_a_relayed_gradient_nothing_takes_goes_when_the_pass_ends(retain):
    """Eager kernels: nothing takes the owner; it lives through the region's backward (the kernels
    read the alias) and goes with the backward pass, which keeps or drops its graph."""
    gone, after, counters = _relayed_backward(_body, 5, retain)
    assert gone == [False] and after
    assert counters.grads_relayed == 1 and counters.grads_relayed_freed_early == 0


@pytest.mark.skipif(not tangents.RELAY, reason="no end-of-backward hook in this torch")
def test_a_relay_of_a_backward_that_raised_goes_with_its_graph():
    """A backward pass that raises runs no end-of-pass callback: the relay's owners go when the
    relaying node does (the graph is dropped), not never."""
    from cgbackend.runtime.stats import Counters
    x = torch.randn(16, requires_grad=True)
    counters = Counters()
    (y,) = tangents.GradRelay.apply(False, counters, x * 2)
    refs = []
    y.register_hook(lambda g: refs.append(StorageWeakRef(g.untyped_storage())))

    def fail(g):
        raise RuntimeError("raised in backward")
    x.register_hook(fail)
    with pytest.raises(RuntimeError, match="raised in backward"):
        (y * 3).sum().backward()
    del y
    import gc
    gc.collect()
    assert refs[0].expired() and not any(h.counters is counters for h in tangents._active)


def test_release_incoming_drops_only_relayed_owners():
    from cgbackend.runtime.stats import Counters
    owner = torch.randn(8)
    counters = Counters()
    transfer = OwnerTransfer(counters)
    alias = loose_alias(owner)
    transfer.add(0, alias, owner)
    tangents._relayed[id(alias)] = transfer
    ref = StorageWeakRef(owner.untyped_storage())
    del owner
    try:
        assert tangents.release_incoming([None, torch.randn(8), alias.clone()]) == 0 and not ref.expired()
        assert tangents.release_incoming([alias]) == 1 and ref.expired()
        assert counters.grads_relayed_freed_early == 1 and id(alias) not in tangents._relayed
    finally:
        tangents._relayed.pop(id(alias), None)


@pytest.mark.skipif(not tangents.RELAY, reason="no end-of-backward hook in this torch")
def test_one_gradient_relayed_to_two_compiled_regions():
    """An add hands the same gradient tensor to two relays: each region's compiled backward takes
    only its own alias, whose owner the other relay also holds, so neither frees what the other
    still reads; both gradients are eager's."""
    from cgbackend.runtime.stats import Counters
    torch._dynamo.reset()
    first = torch.compile(_body, backend="inductor")
    second = torch.compile(lambda x, w: _body(x, w) * 0.5, backend="inductor")
    torch.manual_seed(6)
    x = torch.randn(64, 32, requires_grad=True)
    w = torch.randn(32, 48, requires_grad=True)
    scale = torch.randn(64, 48)
    want = torch.autograd.grad(((_body(x, w) + _body(x, w) * 0.5) * scale).sum(), [x, w])
    for _ in range(2):  # the first call compiles
        counters = Counters()
        (a,) = tangents.GradRelay.apply(False, counters, first(x, w))
        (b,) = tangents.GradRelay.apply(False, counters, second(x, w))
        got = torch.autograd.grad(((a + b) * scale).sum(), [x, w])
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    assert counters.grads_relayed == 2 and counters.grads_relayed_freed_early == 2
