"""The row-independence proof (passes/rowdep.py) on tiny Dynamo graphs: positive and negative cases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cgbackend.passes.rowdep import NotRowwise, propagate_rows
from fx_helpers import trace


def _out_dim(fn, *args):
    """Row dimension of the graph's output when the first input's dimension 0 holds rows."""
    gm = trace(fn, *args)
    nodes = list(gm.graph.nodes)
    x = next(n for n in nodes if n.op == "placeholder")
    dims = propagate_rows(nodes, {x: 0})
    out = next(n for n in nodes if n.op == "output").args[0][0]
    return dims.get(out)


W = torch.randn(8, 8)
X = torch.randn(5, 8)


@pytest.mark.parametrize("fn", [
    lambda x: F.linear(x, W),
    lambda x: F.gelu(F.linear(x, W)) * 2 + 1,
    lambda x: F.layer_norm(x, (8,)),
    lambda x: F.rms_norm(x, (8,)),
    lambda x: F.softmax(x, dim=-1),
    lambda x: x.sum(-1, keepdim=True) * x,
    lambda x: F.silu(x @ W).chunk(2, dim=-1)[0],
    lambda x: x.reshape(5, 2, 4).transpose(1, 2).reshape(5, 8),
    lambda x: torch.cumsum(x, dim=1),
    lambda x: x[:, :4].to(torch.float64).unsqueeze(1).squeeze(1),
], ids=["linear", "gelu_affine", "layer_norm", "rms_norm", "softmax_last", "sum_last", "chunk",
        "reshape_within_row", "cumsum_last", "slice_cast"])
def test_row_independent_along_dim0(fn):
    assert _out_dim(fn, X) == 0


def test_rows_merged_with_later_dims_stay_blocks():
    """Flattening [5, 8] to [40] keeps row i as the block 8i..8i+7; splitting it back restores it."""
    assert _out_dim(lambda x: x.reshape(-1), X) == 0
    assert _out_dim(lambda x: (x.reshape(-1) * 2).reshape(5, 2, 4).sum(-1), X) == 0
    assert _out_dim(lambda x: F.one_hot(x.argmax(-1), 8).permute(1, 0), X) == 1


def test_rows_move_with_transpose():
    assert _out_dim(lambda x: x.unsqueeze(0).transpose(0, 1).reshape(5, 8), X) == 0
    assert _out_dim(lambda x: x.t(), X) == 1


@pytest.mark.parametrize("fn,why", [
    (lambda x: F.softmax(x, dim=0), "softmax runs along the row dimension"),
    (lambda x: x.sum(0), "reduces the row dimension"),
    (lambda x: x.sum(), "over all elements"),
    (lambda x: torch.cumsum(x, dim=0), "cumsum runs along the row dimension"),
    (lambda x: x.t() @ x, "contracted"),
    (lambda x: x.reshape(8, 5), "splits the rows or moves them inside"),
    (lambda x: x.t().reshape(-1), "non-unit dimensions before the rows"),
    (lambda x: x[1:], "slices or picks rows"),
    (lambda x: x + torch.randn(5, 8), "spans the row dimension"),
    (lambda x: torch.sort(x, dim=0).values, "sort runs along the row dimension"),
    (lambda x: F.dropout(x, 0.5, training=True), "random numbers"),
], ids=["softmax_dim0", "sum_dim0", "sum_all", "cumsum_dim0", "contract", "reshape_across_rows", "flatten_transposed", "slice",
        "other_rows", "sort_dim0", "dropout"])
def test_not_row_independent(fn, why):
    with pytest.raises(NotRowwise, match=why):
        _out_dim(fn, X)


def test_attention_over_the_sequence_is_not_row_independent_but_over_the_batch_is():
    q = torch.randn(2, 4, 6, 8)  # batch, heads, sequence, head dim

    def attn(x):
        return F.scaled_dot_product_attention(x, x, x)

    gm = trace(attn, q)
    nodes = list(gm.graph.nodes)
    x = nodes[0]
    out = next(n for n in nodes if n.op == "output").args[0][0]
    assert propagate_rows(nodes, {x: 0})[out] == 0  # batch rows: each its own attention
    with pytest.raises(NotRowwise, match="attention"):
        propagate_rows(nodes, {x: 2})  # sequence positions attend to each other


def test_unknown_op_is_not_assumed_row_independent():
    with pytest.raises(NotRowwise, match="not known"):
        _out_dim(lambda x: torch.fft.fft(x).real, X)


def test_addmm_rows_of_the_first_matrix():
    def rows_of(fn):
        gm = trace(fn, X)
        nodes = list(gm.graph.nodes)
        x = next(n for n in nodes if n.op == "placeholder" and n.name == "l_x_")
        out = next(n for n in nodes if n.op == "output").args[0][0]
        return propagate_rows(nodes, {x: 0})[out]

    b = torch.randn(8)
    assert rows_of(lambda x: torch.addmm(b, x, W)) == 0
    with pytest.raises(NotRowwise, match="contracted"):
        rows_of(lambda x: torch.addmm(b, W[:5].t(), x))


def test_cat_skips_an_empty_cache():
    assert _out_dim(lambda x: torch.cat([torch.tensor([]), x], dim=-1), X) == 0


def test_attention_mask_must_line_up_with_the_rows():
    q = torch.randn(2, 4, 6, 8)

    def with_mask(x, mask):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)

    gm = trace(with_mask, q, torch.zeros(1, 1, 6, 6, dtype=torch.bool))  # shared by every row
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output").args[0][0]
    assert propagate_rows(nodes, {nodes[0]: 0})[out] == 0
    gm = trace(with_mask, q, torch.zeros(2, 1, 6, 6, dtype=torch.bool))  # per row, not a row source
    nodes = list(gm.graph.nodes)
    with pytest.raises(NotRowwise, match="mask spans the row dimension"):
        propagate_rows(nodes, {nodes[0]: 0})
    assert propagate_rows(nodes, {nodes[0]: 0, nodes[1]: 0})[  # per row and a row source: fine
        next(n for n in nodes if n.op == "output").args[0][0]] == 0


def test_reshape_after_the_rows_keeps_them():
    """[2, 5, 8] with rows in dim 1 (a sequence): splitting the last dimension keeps them."""
    gm = trace(lambda x: x.view(2, 5, 2, 4).relu(), torch.randn(2, 5, 8))
    nodes = list(gm.graph.nodes)
    out = next(n for n in nodes if n.op == "output").args[0][0]
    assert propagate_rows(nodes, {nodes[0]: 1})[out] == 1


def _tagged(fn, *args, block=None, result=None):
    """The graph of ``fn`` with the nodes named in ``block`` tagged as one ROW_BLOCK whose result
    is the node named ``result`` (what the static dispatch does with the nodes it inserts)."""
    from cgbackend.passes.rowdep import ROW_BLOCK
    gm = trace(fn, *args)
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op in ("call_function", "call_method")]
    for i, n in enumerate(calls):
        if i in block:
            n.meta[ROW_BLOCK] = ("b", i == result)
    return nodes, calls


def _sorted_mix(x):
    order = torch.sort(x[:, 0], stable=True)[1]  # rows visited in another order
    y = torch.empty_like(x).index_copy(0, order, x[order] * 2)  # and written back to their places
    return y + x


def test_a_row_block_is_taken_whole():
    """A tagged block's result keeps the rows of its inputs, however its ops mix them inside; the
    same ops untagged fail the proof."""
    nodes, calls = _tagged(_sorted_mix, X, block=range(7), result=6)
    x = next(n for n in nodes if n.op == "placeholder")
    assert propagate_rows(nodes, {x: 0})[calls[6]] == 0
    plain = list(trace(_sorted_mix, X).graph.nodes)
    with pytest.raises(NotRowwise, match="sort"):
        propagate_rows(plain, {next(n for n in plain if n.op == "placeholder"): 0})


def test_a_row_block_read_from_outside_or_along_other_rows_is_not_taken_whole():
    """A value inside the block read by an op outside it: the block's ops meet the rules one by
    one (and the sort fails). An input whose rows lie in another dimension: the block fails."""
    def leaked(x):
        order = torch.sort(x[:, 0], stable=True)[1]
        y = torch.empty_like(x).index_copy(0, order, x[order] * 2) + x
        return y, order.float().sum()  # the order read outside the block

    nodes, calls = _tagged(leaked, X, block=range(7), result=6)
    x = next(n for n in nodes if n.op == "placeholder")
    with pytest.raises(NotRowwise, match="sort"):
        propagate_rows(nodes, {x: 0})

    def rows_in_dim1(x):
        xt = x.t()  # outside the block: rows now in dimension 1
        return torch.empty_like(xt).copy_(xt) + 1

    nodes, calls = _tagged(rows_in_dim1, X, block=(1, 2, 3), result=3)
    x = next(n for n in nodes if n.op == "placeholder")
    with pytest.raises(NotRowwise, match="dimension 1"):
        propagate_rows(nodes, {x: 0})


def test_a_row_block_node_nothing_needs_may_lie_outside_the_nodes():
    """A block node nothing reads (left out of a region's live nodes) does not break the block; a
    block node read by an op outside the block does (the leak case above)."""
    def with_dead(x):
        order = torch.sort(x[:, 0], stable=True)[1]
        y = torch.empty_like(x).index_copy(0, order, x[order] * 2)
        _ = order.float() + 1  # tagged with the block, read by nothing
        return y + x

    nodes, calls = _tagged(with_dead, X, block=range(9), result=6)
    dead = calls[7:9]  # order.float() + 1
    assert all(not n.users or set(n.users) <= set(dead) for n in dead)
    live = [n for n in nodes if n not in dead]
    x = next(n for n in nodes if n.op == "placeholder")
    assert propagate_rows(live, {x: 0})[calls[6]] == 0
