"""Dynamic-output-shape ops found through torch.Tag.dynamic_output_shape (passes/op_tags.py), not only
through classify.py's hand-written list: ops the list never named are classified as host syncs with
their reason, even where a torch._check fixed the traced size (then no unbacked symbol shows them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cgbackend import Config, Rule
import importlib

classify = importlib.import_module("cgbackend.passes.classify")
from cgbackend.passes.op_tags import STATIC_WHEN, tagged_dynamic_output_shape
from fx_helpers import trace

FILE = "test_op_tags.py"


@torch.library.custom_op("cgtest_tags::compact", mutates_args=(), tags=(torch.Tag.dynamic_output_shape,))
def compact(x: torch.Tensor) -> torch.Tensor:
    """The positive entries, packed: its size comes from the data."""
    return x[x > 0]


@compact.register_fake
def _(x):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size())


def _verdict(gm, op_substring):
    result = classify.classify(gm, Config())
    found = [(n, v) for n, v in result.verdicts.items() if op_substring in str(n.target)]
    assert found, [str(n.target) for n in result.verdicts]
    return found[0]


def test_aten_unique_the_old_list_lacked_is_a_host_sync_with_its_reason():
    def make(fix: bool):
        def fn(x):
            idx = torch.arange(4).repeat(2) + (x.sum() * 0).long()
            u = torch.ops.aten._unique(idx)[0]
            if fix:
                torch._check(u.shape[0] == 4)  # the traced size is fixed: no unbacked symbol left to see
            return u * 2
        return fn

    # torch 2.13 traces _unique's size as an unbacked symbol, which the check then fixes; torch 2.11's
    # fake _unique has a static size already (and the check would contradict it).
    gm = trace(make(False), torch.randn(8, 4))
    node, _ = _verdict(gm, "_unique")
    if any(isinstance(s, torch.SymInt) for s in node.meta["example_value"][0].shape):
        gm = trace(make(True), torch.randn(8, 4))
    node, verdict = _verdict(gm, "_unique")
    assert not verdict.static
    assert verdict.reason.rule == Rule.HOST_SYNC
    assert "dynamic_output_shape" in verdict.reason.detail and "aten::_unique" in verdict.reason.detail
    assert verdict.reason.source.startswith(FILE + ":")


def test_tagged_custom_op_with_checked_size_is_a_host_sync():
    def fn(x):
        y = compact(x.abs() + 1)
        torch._check(y.shape[0] == 32)
        return y.sin()

    gm = trace(fn, torch.randn(8, 4))
    node, verdict = _verdict(gm, "compact")
    assert not verdict.static and verdict.reason.rule == Rule.HOST_SYNC
    assert "cgtest_tags::compact" in verdict.reason.detail


@pytest.mark.parametrize("fn, tagged", [
    (lambda x: torch.nonzero(x), True),
    (lambda x: x.nonzero(), True),
    (lambda x: torch.bincount(x.flatten().long().abs()), True),
    (lambda x: torch.masked_select(x, x > 0), True),
    (lambda x: torch.unique_consecutive(x), True),
    (lambda x: F.one_hot(x.long().abs().flatten()), True),
    (lambda x: F.one_hot(x.long().abs().flatten() % 3, num_classes=3), False),  # STATIC_WHEN
    (lambda x: x.repeat_interleave(2), False),  # a mixed packet: classify.py decides by its arguments
    (lambda x: x.sin(), False),
    (lambda x: torch.where(x > 0, x, 0), False),
])
def test_tag_lookup_of_torch_level_calls(fn, tagged):
    gm = torch.fx.symbolic_trace(fn)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    found = [tagged_dynamic_output_shape(n) for n in calls]
    assert (found[-1] is not None) == tagged, found


def test_every_exemption_says_why():
    for name, (predicate, why) in STATIC_WHEN.items():
        assert callable(predicate) and len(why) > 40, name


def test_hand_written_entries_are_only_what_tags_miss():
    for name, why in classify._SYNCING_OPS.items():
        assert why, name
        tagged = [torch.Tag.dynamic_output_shape in getattr(packet, o).tags
                  for packet in [getattr(torch.ops.aten, name, None)] if packet is not None
                  for o in packet.overloads() if o != "out"]
        assert not (tagged and all(tagged)), name


def test_ops_a_supported_release_leaves_untagged_count_as_tagged(monkeypatch):
    """torch 2.11 lacks the tag on aten._unique and one_hot (and fakes _unique with a static size):
    LATE_TAGGED names them. Here the tag looked for is one no operator of the test has, so only that
    list can find them, on any release."""
    from cgbackend.passes import op_tags
    monkeypatch.setattr(op_tags, "_TAG", torch.Tag.nondeterministic_seeded)
    op_tags._packet_tagged.cache_clear()
    try:
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        calls = {
            "_unique": graph.call_function(torch.ops.aten._unique.default, (x,)),
            "one_hot": graph.call_function(F.one_hot, (x,)),
            "one_hot with classes": graph.call_function(F.one_hot, (x,), {"num_classes": 3}),
            "nonzero": graph.call_function(torch.ops.aten.nonzero.default, (x,)),
        }
        found = {k: tagged_dynamic_output_shape(n) for k, n in calls.items()}
    finally:
        op_tags._packet_tagged.cache_clear()
    assert found == {"_unique": "aten::_unique", "one_hot": "aten::one_hot", "one_hot with classes": None,
                     "nonzero": None}, found
    assert set(op_tags.LATE_TAGGED) == {"_unique", "one_hot"} and all(op_tags.LATE_TAGGED.values())
