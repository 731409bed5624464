"""passes.partition: region sequences given as data, the ordering invariants, code motion into
earlier static regions, in-place / RNG ordering, folding of small regions, autocast blocks."""

from __future__ import annotations


import pytest
import torch

import cgbackend
from cgbackend import Config, Rule
from cgbackend.passes.pipeline import analyze
from cgbackend.common.fx_utils import compute_nodes, op_name
from cgbackend.models import build_model, make_inputs
from fx_helpers import trace

S, D = "static", "dynamic"


def run(fn, *args, config=None, **compile_kwargs):
    gm = trace(fn, *args, **compile_kwargs)
    analysis = analyze(gm, config or Config(min_region_ops=1, static_dispatch="off"))
    check_invariants(analysis)
    return analysis


def kinds(analysis) -> list[str]:
    return [r.kind for r in analysis.partition.regions]


def nodes_named(analysis, op: str) -> list[torch.fx.Node]:
    found = [n for n in compute_nodes(analysis.gm) if op_name(n) == op]
    assert found, f"no {op} node"
    return found


def region_index(analysis, node) -> int:
    return analysis.partition.region_of[node].index


def check_invariants(analysis) -> None:
    """What every partition must satisfy, whatever the graph."""
    part = analysis.partition
    # Constants made from Python values are hoisted out of every region (passes/constants.py).
    nodes = [n for n in compute_nodes(analysis.gm) if n not in analysis.constants]
    order = {n: i for i, n in enumerate(nodes)}
    # Every other compute node in exactly one region; regions numbered in execution order.
    seen = [n for r in part.regions for n in r.nodes]
    assert sorted(seen, key=order.__getitem__) == nodes
    assert len(seen) == len(set(seen))
    for i, region in enumerate(part.regions):
        assert region.index == i
        assert region.nodes, "empty region"
        for n in region.nodes:
            assert part.region_of[n] is region
        # Graph order inside a region.
        positions = [order[n] for n in region.nodes]
        assert positions == sorted(positions), region.name
    # Static regions hold only static verdicts; everything in a dynamic region has a reason.
    for region in part.regions:
        for n in region.nodes:
            if region.is_static:
                assert analysis.classification.verdicts[n].static, n.name
                assert n not in part.extra_reasons
            else:
                assert analysis.reason_of(n) is not None, n.name
    # Maximal: no two neighbouring regions of one kind.
    for a, b in zip(part.regions, part.regions[1:]):
        assert a.kind != b.kind, (a.name, b.name)
    # Data and ordering edges point forward in execution order.
    position = {n: (part.region_of[n].index, order[n]) for n in nodes}
    for n in nodes:
        for pred in list(n.all_input_nodes) + list(analysis.effects.preds(n)):
            if pred in position:
                assert position[pred] < position[n], f"{pred.name} must run before {n.name}"
    # The brief's form of acyclicity: no static region needs its own output back through eager code.
    for s in part.static_regions():
        for inp in s.inputs:
            producer = part.region_of.get(inp)
            if producer is not None and not producer.is_static:
                assert not any(part.region_of.get(x) is s for x in producer.inputs), (s.name, producer.name)
    # Boundaries: inputs are exactly the outside values read, outputs the values read outside.
    users_outside = {n for n in nodes for u in n.users if part.region_of.get(u) is not part.region_of[n]}
    for region in part.regions:
        inside = set(region.nodes)
        expected_inputs = {i for n in region.nodes for i in n.all_input_nodes if i not in inside}
        assert set(region.inputs) == expected_inputs
        assert len(region.inputs) == len(expected_inputs)
        assert set(region.outputs) == inside & users_outside


# ----------------------------------------------------------------------------- region sequences as data

def _two_dispatches(x):
    a = torch.nonzero(x > 0).float().sum()
    b = (x * a).relu()
    c = torch.nonzero(b > 0.5).float().sum()
    return (b * c).exp()


def _item_in_middle(x):
    h = x.sin()
    n = h.sum().item()
    return (h * n).cos()


def _cpu_in_middle(x):
    h = x.sin()
    s = h.cpu() * 2
    return (h + s.to(h.device)).cos()


SEQUENCES = [
    ("all_static", lambda x: torch.softmax(x @ x.t(), -1).sum(0), [S]),
    ("static_dynamic", lambda x: torch.nonzero(x.sin() > 0) * 2, [S, D]),
    ("static_dynamic_static", lambda x: torch.nonzero(x.sin() > 0).float().sum() + 1, [S, D, S]),
    ("dynamic_static", lambda x: torch.nonzero(x).float().sum().exp(), [D, S]),
    ("item_in_middle", _item_in_middle, [S, D, S]),
    ("cpu_in_middle", _cpu_in_middle, [S, D, S]),
    ("two_dispatches", _two_dispatches, [S, D, S, D, S]),
]


@pytest.mark.parametrize("fn, expected", [c[1:] for c in SEQUENCES], ids=[c[0] for c in SEQUENCES])
def test_region_sequence(fn, expected):
    analysis = run(fn, torch.randn(8, 4))
    assert kinds(analysis) == expected


@pytest.mark.parametrize("name, expected", [
    ("dense", [S]),
    ("moe", [S, D, S, D, S]),
    ("moe_sort", [S, D, S, D, S]),
    ("item", [S, D, S]),
    ("cpu_op", [S, D, S]),
    ("dropout", [S]),
])
def test_reference_model_sequences(name, expected):
    model = build_model(name, size="tiny").eval()
    (x,) = make_inputs(name, model, n=1)
    analysis = run(model, x, config=Config(static_dispatch="off"))
    assert kinds(analysis) == expected


def test_regions_keep_graph_order_and_names():
    analysis = run(_two_dispatches, torch.randn(8, 4))
    assert [r.name for r in analysis.partition.regions] == ["S0", "D1", "S2", "D3", "S4"]
    assert [r.name for r in analysis.partition.static_regions()] == ["S0", "S2", "S4"]
    assert [r.name for r in analysis.partition.dynamic_regions()] == ["D1", "D3"]


# ----------------------------------------------------------------------------- code motion

def test_independent_static_work_moves_into_the_earlier_static_region():
    def fn(x, y):
        a = x.sin()
        i = torch.nonzero(a)
        b = y.cos() * 2 + 1
        return i, b

    analysis = run(fn, torch.randn(8, 4), torch.randn(3))
    assert kinds(analysis) == [S, D]
    first = analysis.partition.regions[0]
    for op in ("Tensor.sin", "Tensor.cos", "operator.mul", "operator.add"):
        (node,) = nodes_named(analysis, op)
        assert analysis.partition.region_of[node] is first, op
    (nz,) = nodes_named(analysis, "nonzero")
    assert region_index(analysis, nz) == 1


def test_static_work_that_needs_the_dynamic_result_stays_after_it():
    def fn(x, y):
        n = torch.nonzero(x > 0).float().sum()
        return y.cos() * n, y.sin() * 3

    analysis = run(fn, torch.randn(8, 4), torch.randn(3))
    (cos,) = nodes_named(analysis, "Tensor.cos")
    (sin,) = nodes_named(analysis, "Tensor.sin")
    mul_n, mul_3 = nodes_named(analysis, "operator.mul")
    assert region_index(analysis, cos) == 0 and region_index(analysis, sin) == 0
    assert region_index(analysis, mul_3) == 0
    assert region_index(analysis, mul_n) == 2
    assert kinds(analysis) == [S, D, S]


# ----------------------------------------------------------------------------- in-place and RNG order

def _write_then_read(x):
    a = x.sin() * 2
    k = x.sum().item()
    a.add_(k)  # eager write on a static output
    return a.cos()


def _write_then_read_alias(x):
    a = x.sin() * 2
    v = a.view(-1)  # the later read goes through this alias, not through the write
    k = x.sum().item()
    a.add_(k)
    return v.cos()


def _read_then_write(x):
    a = x.sin() * 2
    r = a * 3  # must read the value before the write
    k = x.sum().item()
    a.add_(k)
    return r, a.cos()


@pytest.mark.parametrize("fn", [_write_then_read, _write_then_read_alias, _read_then_write],
                         ids=["write_read", "write_read_alias", "read_write"])
def test_inplace_write_by_eager_code_orders_static_reads(fn):
    analysis = run(fn, torch.randn(8, 4))
    (write,) = nodes_named(analysis, "Tensor.add_")
    (read,) = nodes_named(analysis, "Tensor.cos")
    assert not analysis.partition.region_of[write].is_static
    assert analysis.partition.region_of[read].is_static
    assert region_index(analysis, read) > region_index(analysis, write)
    if fn is _read_then_write:
        r = [n for n in nodes_named(analysis, "operator.mul") if n.args[1] == 3][0]
        assert region_index(analysis, r) < region_index(analysis, write)


@pytest.mark.parametrize("fn", [_write_then_read, _write_then_read_alias, _read_then_write],
                         ids=["write_read", "write_read_alias", "read_write"])
def test_inplace_ordering_runs_like_eager(fn):
    compiled = cgbackend.compile(fn, min_region_ops=1)
    for seed in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
        expected, got = fn(x.clone()), compiled(x.clone())
        for e, g in zip(expected if isinstance(expected, tuple) else (expected,),
                        got if isinstance(got, tuple) else (got,)):
            assert torch.equal(e, g)


def test_random_ops_keep_their_order_across_regions():
    def fn(x, y):
        i = torch.nonzero(x > 0)
        r1 = torch.randn(i.shape[0])  # eager (sized from data)
        r2 = torch.rand_like(y)  # static, but must draw after r1
        return r1, r2 * 2

    analysis = run(fn, torch.randn(8, 4), torch.randn(3))
    (r1,) = nodes_named(analysis, "randn")
    (r2,) = nodes_named(analysis, "rand_like")
    assert not analysis.partition.region_of[r1].is_static
    assert analysis.partition.region_of[r2].is_static
    assert region_index(analysis, r2) > region_index(analysis, r1)


# ----------------------------------------------------------------------------- folding small regions

def test_small_static_region_is_folded_with_a_reason():
    fn = lambda x: torch.nonzero(x.sin() > 0).float().sum() + 1  # noqa: E731
    unfolded = run(fn, torch.randn(8, 4), config=Config(min_region_ops=1))
    assert kinds(unfolded) == [S, D, S]
    folded = run(fn, torch.randn(8, 4), config=Config())  # default min_region_ops=2
    assert kinds(folded) == [S, D]
    (add,) = nodes_named(folded, "operator.add")
    assert folded.classification.verdicts[add].static  # the classifier still says static ...
    assert not folded.partition.region_of[add].is_static  # ... but it runs eagerly
    reason = folded.partition.extra_reasons[add]
    assert reason.rule == Rule.SMALL_REGION
    assert reason.op == "operator.add"
    assert reason.source.startswith("test_partition.py:")
    assert folded.reason_of(add) == reason
    # The region that stays (sin + gt, 2 launches) is not folded.
    (sin,) = nodes_named(folded, "Tensor.sin")
    assert sin not in folded.partition.extra_reasons


def test_folded_region_merges_with_its_dynamic_neighbours():
    def fn(x):
        a = torch.nonzero(x.sin().cos() > 0).float().sum()  # S0: 3 launches
        b = x * a  # S2: mul + gt, 2 launches, between two dynamic parts
        return torch.nonzero(b > 0).float().sum()

    assert kinds(run(fn, torch.randn(8, 4), config=Config(min_region_ops=2))) == [S, D, S, D]
    folded = run(fn, torch.randn(8, 4), config=Config(min_region_ops=3))
    assert kinds(folded) == [S, D]  # the middle region folds; the eager parts around it become one step
    folded_nodes = [n for n, r in folded.partition.extra_reasons.items()]
    assert sorted(op_name(n) for n in folded_nodes) == ["operator.gt", "operator.mul"]
    assert {r.rule for r in folded.partition.extra_reasons.values()} == {Rule.SMALL_REGION}
    (gt0, gt1) = nodes_named(folded, "operator.gt")
    assert folded.partition.region_of[gt0].is_static and not folded.partition.region_of[gt1].is_static


def test_views_only_region_is_folded_even_at_min_region_ops_1():
    fn = lambda x: torch.nonzero(x.sin() > 0).float().sum().reshape(1, 1)  # noqa: E731
    analysis = run(fn, torch.randn(8, 4), config=Config(min_region_ops=1))
    (reshape,) = nodes_named(analysis, "Tensor.reshape")
    assert kinds(analysis) == [S, D]
    assert analysis.partition.extra_reasons[reshape].rule == Rule.SMALL_REGION


def test_whole_graph_below_threshold_runs_eagerly():
    analysis = run(lambda x: (x @ x.t()).softmax(-1), torch.randn(8, 4), config=Config(min_region_ops=50))
    assert kinds(analysis) == [D]
    assert all(analysis.reason_of(n).rule == Rule.SMALL_REGION for n in analysis.partition.regions[0].nodes)


# ----------------------------------------------------------------------------- autocast and grad-mode blocks

def _autocast_static(x):
    h = x.sin()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.mm(h, h.t())
        h = h.relu()
    return h.float().cos()


def _autocast_cut(x):
    h = x.sin()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.mm(h, h.t())
        i = torch.nonzero(h > 0)
        h = h.relu()
    return h.float().cos(), i


def _autocast_after_dynamic(x):
    i = torch.nonzero(x > 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = (x @ x.t()).relu()
    return g.float().sum() * 2, i


def _two_autocast_blocks(x):
    h = x.sin()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g = h @ h.t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        k = h @ h.t()
    return g.float() + k.float()


@pytest.mark.parametrize("fn", [_autocast_static, _two_autocast_blocks, _autocast_after_dynamic],
                         ids=["one_block", "two_blocks", "block_after_dynamic"])
def test_uncut_autocast_block_stays_in_one_static_region(fn):
    analysis = run(fn, torch.randn(8, 4))
    enters = nodes_named(analysis, "_enter_autocast")
    exits = nodes_named(analysis, "_exit_autocast")
    assert len(enters) == len(exits) >= 1
    for enter, exit_ in zip(enters, exits):
        region = analysis.partition.region_of[enter]
        assert region.is_static
        assert analysis.partition.region_of[exit_] is region
        assert enter not in analysis.partition.extra_reasons and exit_ not in analysis.partition.extra_reasons
        # The block's compute sits between them, in the same region.
        nodes = compute_nodes(analysis.gm)
        inside = nodes[nodes.index(enter) + 1:nodes.index(exit_)]
        assert inside
        for n in inside:
            assert analysis.partition.region_of[n] is region, n.name
        assert region.nodes.index(enter) < min(region.nodes.index(n) for n in inside)
        assert region.nodes.index(exit_) > max(region.nodes.index(n) for n in inside)
    if fn is not _autocast_after_dynamic:
        assert kinds(analysis) == [S]


def test_autocast_block_cut_by_dynamic_op_switches_eagerly():
    analysis = run(_autocast_cut, torch.randn(8, 4))
    (enter,) = nodes_named(analysis, "_enter_autocast")
    (exit_,) = nodes_named(analysis, "_exit_autocast")
    for node in (enter, exit_):
        assert analysis.classification.verdicts[node].static  # the classifier has no objection ...
        assert not analysis.partition.region_of[node].is_static  # ... the partition cuts the block
        assert analysis.partition.extra_reasons[node].rule == Rule.GLOBAL_STATE
        assert analysis.reason_of(node).rule == Rule.GLOBAL_STATE
    (mm,) = nodes_named(analysis, "mm")
    (cos,) = nodes_named(analysis, "Tensor.cos")
    # The switch runs before the block's compute, the exit after, the code after the block later still.
    assert region_index(analysis, enter) < region_index(analysis, mm) < region_index(analysis, exit_)
    assert region_index(analysis, exit_) < region_index(analysis, cos)


@pytest.mark.parametrize("fn", [_autocast_static, _autocast_cut], ids=["static", "cut"])
def test_autocast_partitions_run_like_eager(fn):
    compiled = cgbackend.compile(fn, min_region_ops=1)
    for seed in range(2):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))
        expected, got = fn(x), compiled(x)
        for e, g in zip(expected if isinstance(expected, tuple) else (expected,),
                        got if isinstance(got, tuple) else (got,)):
            assert e.dtype == g.dtype
            assert torch.equal(e, g)


def test_uncut_no_grad_block_stays_in_one_static_region():
    """A grad-mode switch is global state like autocast: cut only when eager code cuts its block."""
    def fn(x):
        h = x.sin() * 2
        with torch.no_grad():
            g = h.cos() * 3
        return h + g

    analysis = run(fn, torch.randn(8, 4, requires_grad=True))
    assert not [r for r in analysis.partition.extra_reasons.values() if r.rule == Rule.GLOBAL_STATE]
    assert kinds(analysis) == [S]


# ----------------------------------------------------------------------------- tuples

def test_tuple_elements_stay_with_the_op_that_made_them():
    def fn(x):
        idx, cols = torch.where(x > 0)
        vals, ind = torch.topk(x, 2, dim=-1)
        return idx * 2, vals * ind

    analysis = run(fn, torch.randn(8, 4))
    (where,) = nodes_named(analysis, "where")
    (topk,) = nodes_named(analysis, "topk")
    for user in where.users:
        assert analysis.partition.region_of[user] is analysis.partition.region_of[where]
    for user in topk.users:
        assert analysis.partition.region_of[user] is analysis.partition.region_of[topk]
    assert analysis.partition.region_of[topk].is_static


def test_grad_mode_block_runs_like_eager_with_grads():
    def fn(x, w):
        h = (x @ w).sin() * 2
        with torch.no_grad():
            g = h.cos() * 3
        return (h + g).sum()

    compiled = cgbackend.compile(fn, min_region_ops=1)
    x = torch.randn(8, 4)
    w = torch.randn(4, 4, requires_grad=True)
    for _ in range(2):
        got = compiled(x, w)
        (grad_got,) = torch.autograd.grad(got, w)
        expected = fn(x, w)
        (grad_expected,) = torch.autograd.grad(expected, w)
        assert torch.equal(got, expected)
        assert torch.equal(grad_got, grad_expected)
