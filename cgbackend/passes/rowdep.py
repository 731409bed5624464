"""Row-independence proof: which dimension of each tensor carries "rows", op by op.

Reads: an FX graph with fake example values (Dynamo's ``example_value``).
Returns: for every node that depends on the given sources, the dimension that
holds the rows (or ``ROWS_IN_TUPLE`` for tuples whose elements all keep them),
or raises :class:`NotRowwise` naming the first op that mixes rows.

"Row-independent along dimension d" means: row i of every output depends only on
row i of the row inputs (and on tensors that do not depend on the rows at all,
such as parameters). It is what makes two rewrites safe: computing a per-row
function on *all* rows and masking (the static MoE dispatch, moe/),
and padding rows up to a bucket and slicing the result.

The rules are a whitelist. An op not listed, or listed but applied across the row
dimension (a softmax, sum or cumsum over it, a matmul that contracts it, a reshape
that merges it with another dimension, attention over it), fails the proof with
the op and the reason; nothing unknown is assumed safe.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, Optional

import sympy
import torch
import torch.fx

from ..common.fx_utils import fake_value, op_name, plain_name, size_expr, sizes_equal
from .call_args import Call, call_of, implicit_softmax_dim
from .effects import is_random_node

__all__ = ["NotRowwise", "propagate_rows", "rows_divide", "whole_blocks", "ROWS_IN_TUPLE", "ROW_BLOCK"]

ROWS_IN_TUPLE = "tuple"

ROW_BLOCK = "cgbackend_row_block"
"""``node.meta`` key of the nodes the static MoE dispatch inserts (moe/):
``(key, is_result)``. The grouped and small-batch forms sort a layer's (token, slot) pairs by
expert; the masked-dense form has each expert compute, for a token it does not receive, on the
first row it does receive (an argmax over rows), and masks that product out. No op-by-op rule can
show either to keep rows apart, but both are built so that row t of each result is a function of
row t of their inputs alone (the accumulator, the gathered rows, the routing ids and weights; the
expert body is proven row-wise before a form is built, moe/match.py), for any number of rows.
:func:`propagate_rows` takes such a block whole: each result keeps the rows of the inputs it is
computed from, which must all hold them along their one dimension of the result's row count, and
no node outside the block may read a node inside it but its results (else the block is not taken
whole and its ops meet the rules one by one)."""

# Element-wise in the first argument; the other arguments must not depend on the rows.
_UNARY = {
    "relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "tanh", "exp", "log", "log2", "neg", "abs",
    "sqrt", "rsqrt", "square", "sin", "cos", "erf", "softplus", "mish", "hardswish", "hardsigmoid",
    "leaky_relu", "elu", "selu", "celu", "relu6", "hardtanh", "log1p", "expm1", "reciprocal", "sign",
    "float", "half", "bfloat16", "double", "to", "type", "type_as", "contiguous", "clone", "detach",
    "clamp", "clamp_min", "clamp_max", "nan_to_num", "logical_not", "bitwise_not", "softsign",
    "logsigmoid", "invert", "pos", "neg_", "abs_", "round", "floor", "ceil", "trunc",
    "isnan", "isinf", "isfinite", "sigmoid_", "tanh_", "exp_",
    "zeros_like", "ones_like", "full_like",  # the same value in every element (not empty_like: garbage)
}
# Element-wise with broadcasting over all tensor arguments.
_BINARY = {
    "add", "sub", "mul", "truediv", "div", "floordiv", "pow", "maximum", "minimum", "eq", "ne", "lt",
    "gt", "le", "ge", "and_", "or_", "xor", "logical_and", "logical_or", "iadd", "imul", "isub",
    "itruediv", "rsub", "atan2", "true_divide", "fmod", "remainder", "add_", "mul_", "sub_", "div_",
    "masked_fill", "masked_fill_", "where", "lerp", "addcmul", "addcdiv", "bitwise_and", "bitwise_or",
    "mod", "copysign", "hypot", "xlogy", "fmax", "fmin",
}
_REDUCE = {"sum", "mean", "amax", "amin", "prod", "logsumexp", "var", "std", "norm", "any", "all",
           "max", "min", "argmax", "argmin", "count_nonzero"}
_ALONG = {"softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp",
          "argsort", "sort", "topk", "glu", "normalize"}


_METADATA = {"size", "sym_size", "stride", "dim", "numel", "sym_numel", "sym_stride", "ndimension"}


class NotRowwise(Exception):
    """An op that (as far as the rules can tell) mixes rows; ``node`` and ``why`` say which and how."""

    def __init__(self, node: torch.fx.Node, why: str) -> None:
        super().__init__(f"{op_name(node)} ({node.name}): {why}")
        self.node = node
        self.why = why


def _shape(node: Any) -> Optional[tuple]:
    value = fake_value(node) if isinstance(node, torch.fx.Node) else node
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _ndim(node: Any) -> int:
    shape = _shape(node)
    return len(shape) if shape is not None else 0


def _norm_dim(dim: Any, ndim: int) -> int:
    if not isinstance(dim, int):
        raise TypeError
    return dim + ndim if dim < 0 else dim


def _prod_is_one(dims: Iterable[Any]) -> bool:
    return all(sizes_equal(d, 1) for d in dims)


def _row_args(node: torch.fx.Node, dims: dict) -> list[tuple[Any, Any]]:
    out = []
    for a in list(node.args) + list(node.kwargs.values()):
        items = a if isinstance(a, (list, tuple)) else [a]
        for item in items:
            if isinstance(item, torch.fx.Node) and item in dims:
                out.append((item, dims[item]))
    return out


def _broadcast_dim(node: torch.fx.Node, dims: dict) -> int:
    """Element-wise op over broadcast tensors: all row tensors must line their rows up, and no
    other tensor may have a size above one at that position."""
    out_nd = _ndim(node)
    tensors = [a for a in list(node.args) + list(node.kwargs.values())
               if isinstance(a, torch.fx.Node) and isinstance(fake_value(a), torch.Tensor)]
    from_right = None
    for t in tensors:
        if t in dims:
            r = dims[t]
            if not isinstance(r, int):
                raise NotRowwise(node, "a tuple operand")
            k = _ndim(t) - r
            if from_right is not None and k != from_right:
                raise NotRowwise(node, "its operands hold rows in different dimensions")
            from_right = k
    assert from_right is not None
    for t in tensors:
        if t in dims:
            continue
        shape = _shape(t)
        if len(shape) >= from_right and not sizes_equal(shape[len(shape) - from_right], 1):
            raise NotRowwise(node, f"operand {t.name} is not row-wise but spans the row dimension")
    return out_nd - from_right


def rows_divide(size: Any, rows: Any) -> bool:
    """Is ``size`` a whole multiple of ``rows`` (ints, SymInts or sympy expressions), with ``rows`` its
    outermost factor: ``32*s0`` for ``rows=s0``, ``1024`` for ``rows=512``?"""
    try:
        size, rows = size_expr(size), size_expr(rows)
    except (TypeError, ValueError):
        return False
    if size.is_Integer and rows.is_Integer:
        return int(rows) > 0 and int(size) % int(rows) == 0
    quotient = sympy.simplify(size / rows)
    if quotient.free_symbols & rows.free_symbols:
        return False
    return not (quotient.is_number and not quotient.is_integer)


def _reshape_dim(node: torch.fx.Node, src: torch.fx.Node, r: int, rows: Any) -> int:
    """A reshape keeps rows apart when the rows are the outermost factor of both shapes: everything
    before the row dimension has size one, and the first larger dimension of the result is a whole
    multiple of the row count. Row-major order then keeps each row one contiguous block, whether
    the reshape merges the rows with the dimensions after them ([b, t, c] -> [b*t, c]) or splits
    them back ([b*t, c] -> [b, t, c])."""
    ins, outs = _shape(src), _shape(node)
    if len(outs) > r and all(sizes_equal(a, b) for a, b in zip(ins[:r + 1], outs[:r + 1])):
        return r  # the dimensions up to the rows are kept; only later ones are split or merged
    if not _prod_is_one(ins[:r]):
        raise NotRowwise(node, "reshape of a tensor with non-unit dimensions before the rows")
    for j, size in enumerate(outs):
        if sizes_equal(size, 1):
            continue
        if rows_divide(size, rows):
            return j
        break
    raise NotRowwise(node, "reshape splits the rows or moves them inside another dimension")


def _getitem_dim(node: torch.fx.Node, r: int) -> int:
    key = node.args[1]
    key = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, torch.fx.Node) or isinstance(k, (list, torch.Tensor)) for k in key):
        raise NotRowwise(node, "advanced indexing of row-wise values")
    ndim_in = _ndim(node.args[0])
    n_consuming = sum(1 for k in key if k is not None and k is not Ellipsis)
    expanded: list[Any] = []
    for k in key:
        if k is Ellipsis:
            expanded.extend([slice(None)] * (ndim_in - n_consuming))
        else:
            expanded.append(k)
    in_dim, out_dim = 0, 0
    for k in expanded:
        if k is None:
            out_dim += 1
            continue
        if in_dim == r:
            if not (isinstance(k, slice) and k == slice(None)):
                raise NotRowwise(node, "indexing slices or picks rows")
            return out_dim
        in_dim += 1
        if not isinstance(k, int):
            out_dim += 1
    return out_dim + (r - in_dim)


def _rule(node: torch.fx.Node, dims: dict, rows: Any) -> Any:
    name = plain_name(node)
    row_args = _row_args(node, dims)
    src, r = row_args[0]
    first = node.args[0] if node.args else None
    nd = _ndim(src)

    if node.op == "call_function" and node.target is operator.getitem:
        if r == ROWS_IN_TUPLE:
            return _tuple_elem(node, src, dims)
        return _getitem_dim(node, r)
    if not isinstance(r, int) and name not in ("cat", "stack"):
        raise NotRowwise(node, "a tuple of row-wise values passed whole")
    if name in _UNARY:
        if src is not first or len(row_args) > 1:
            raise NotRowwise(node, "a row-wise value in a non-element-wise argument")
        return r
    if name in _BINARY:
        return _broadcast_dim(node, dims)
    if name == "dropout":
        if not is_random_node(node):  # p == 0 or training=False
            return r
        raise NotRowwise(node, "dropout draws random numbers by position, not by row")
    if name in ("linear", "matmul", "mm", "bmm"):
        if src is not first or len(row_args) > 1:
            raise NotRowwise(node, "the rows are contracted (row-wise value as the right operand)")
        if r >= nd - 1 or (name == "bmm" and r != 0):
            raise NotRowwise(node, "the row dimension is contracted")
        return r
    call = _call(node)
    if name in ("layer_norm", "rms_norm", "group_norm"):
        if name == "group_norm":
            raise NotRowwise(node, "group_norm normalizes over channels and positions")
        shape = call.get("normalized_shape")
        n = len(shape) if isinstance(shape, (list, tuple)) else 1
        if r >= nd - n or len(row_args) > 1:
            raise NotRowwise(node, "normalized over the row dimension")
        return r
    if name in _ALONG:
        dim = call.get("dim")
        if dim is None and name in ("softmax", "log_softmax"):
            dim = implicit_softmax_dim(nd)
        if _norm_dim(dim, nd) == r:
            raise NotRowwise(node, f"{name} runs along the row dimension")
        return ROWS_IN_TUPLE if isinstance(fake_value(node), (tuple, list)) else r
    if name in _REDUCE:
        if isinstance(call.get("other"), torch.fx.Node):  # torch.max(a, b): element-wise
            return _broadcast_dim(node, dims)
        dim = call.get("dim")
        if dim is None:
            raise NotRowwise(node, f"{name} over all elements mixes rows")
        reduced = [_norm_dim(d, nd) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        if r in reduced:
            raise NotRowwise(node, f"{name} reduces the row dimension")
        keep = call.get("keepdim", False)
        out = r if keep else r - sum(1 for d in reduced if d < r)
        return ROWS_IN_TUPLE if isinstance(fake_value(node), (tuple, list)) else out
    if name in ("chunk", "split", "tensor_split", "split_with_sizes", "unbind"):
        if _norm_dim(call.get("dim"), nd) == r:
            raise NotRowwise(node, f"{name} cuts the row dimension")
        if name == "unbind":
            raise NotRowwise(node, "unbind")  # elements lose a dimension; not needed so far
        return ROWS_IN_TUPLE
    if name in ("reshape", "view", "flatten", "view_as", "reshape_as", "unflatten"):
        return _reshape_dim(node, src, r, rows)
    if name == "unsqueeze":
        d = _norm_dim(call.get("dim"), nd + 1)
        return r + 1 if d <= r else r
    if name == "squeeze":
        d = call.get("dim")
        if d is None:
            raise NotRowwise(node, "squeeze without a dimension may drop the rows")
        squeezed = [_norm_dim(x, nd) for x in (d if isinstance(d, (list, tuple)) else [d])]
        if r in squeezed:
            raise NotRowwise(node, "squeeze of the row dimension")
        return r - sum(1 for x in squeezed if x < r and sizes_equal(_shape(src)[x], 1))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (_norm_dim(d, nd) for d in list(call.args.values())[1:3])  # dim0/dim1, axis0/axis1
        return b if r == a else a if r == b else r
    if name == "t":
        return 1 - r if nd == 2 else r
    if name == "permute":
        return [_norm_dim(p, nd) for p in call.get("dims")].index(r)
    if name in ("expand", "expand_as"):
        out = _shape(node)
        k = nd - r
        if not sizes_equal(out[len(out) - k], _shape(src)[r]):
            raise NotRowwise(node, "expand of the row dimension")
        return len(out) - k
    if name == "addmm":  # input + mat1 @ mat2 (GPT-2's Conv1D)
        bias, mat1 = call.get("input"), call.get("mat1")
        if mat1 not in dims or dims[mat1] != 0 or call.get("mat2") in dims:
            raise NotRowwise(node, "the rows are contracted (not the rows of the first matrix)")
        if bias in dims:
            if dims[bias] != 0 or _ndim(bias) != 2:
                raise NotRowwise(node, "a row-wise bias with rows in another dimension")
        elif _ndim(bias) == 2 and not sizes_equal(_shape(bias)[0], 1):
            raise NotRowwise(node, f"operand {bias.name} is not row-wise but spans the row dimension")
        return 0
    if name in ("cat", "concat", "stack"):
        # torch.cat skips 1-d empty tensors (a cache before its first update).
        tensors = [t for t in call.get("tensors") if not (name != "stack" and _shape(t) == (0,))]
        dim = _norm_dim(call.get("dim"), _ndim(tensors[0]) + (name == "stack"))
        rs = {dims.get(t) for t in tensors}
        if len(rs) != 1 or None in rs:
            raise NotRowwise(node, f"{name} of row-wise and other tensors")
        (r,) = rs
        if name == "stack":
            return r + 1 if dim <= r else r
        if dim == r:
            raise NotRowwise(node, f"{name} along the row dimension")
        return r
    if name == "one_hot":  # a new last dimension: each row's classes
        if src is not first:
            raise NotRowwise(node, "a row-wise value as the class count")
        return r
    if name == "embedding":
        if src is not first:
            raise NotRowwise(node, "row-wise embedding table")
        return r
    if name == "scaled_dot_product_attention":
        qkv = [call.get("query"), call.get("key"), call.get("value")]
        if any(dims.get(a) != r for a in qkv) or r >= nd - 2:
            raise NotRowwise(node, "attention mixes positions along the row dimension")
        mask = call.get("attn_mask")
        if isinstance(mask, torch.fx.Node):
            mshape, k = _shape(mask), nd - r  # the rows' position counted from the right
            if mask in dims:
                if not isinstance(dims[mask], int) or len(mshape) - dims[mask] != k:
                    raise NotRowwise(node, "the attention mask holds rows in another dimension")
            elif mshape is not None and len(mshape) >= k and not sizes_equal(mshape[len(mshape) - k], 1):
                raise NotRowwise(node, "the attention mask spans the row dimension but is not row-wise")
        return r
    raise NotRowwise(node, "not known to be row-wise")


def _call(node: torch.fx.Node) -> Call:
    """``node``'s arguments by its op's schema; an op whose signature is not known is not proven."""
    call = call_of(node)
    if call is None:
        raise NotRowwise(node, "arguments not understood (no known signature)")
    return call


def _tuple_elem(node: torch.fx.Node, src: torch.fx.Node, dims: dict) -> int:
    """Element of a tuple made by a row-keeping op: the same row dimension as that op's input
    (values and indices of topk/sort/max keep the shape; chunk/split pieces too)."""
    producer_rows = _row_args(src, dims)
    r = producer_rows[0][1]
    name = plain_name(src)
    if name in _REDUCE:
        nd = _ndim(producer_rows[0][0])
        call = _call(src)
        dim, keep = call.get("dim"), call.get("keepdim", False)
        d = _norm_dim(dim, nd)
        return r if keep or d > r else r - 1
    return r


def propagate_rows(nodes: Iterable[torch.fx.Node], sources: dict[torch.fx.Node, int],
                   rows: Any = None) -> dict[torch.fx.Node, Any]:
    """Row dimension of every node (in ``nodes``, topological order) that depends on ``sources``.

    ``rows`` is the number of rows (an int, SymInt or sympy expression): the size of each source's
    row dimension is a whole multiple of it, rows outermost. Default: the first source's size.
    Raises NotRowwise at the first node that cannot be shown to keep rows apart."""
    dims: dict[torch.fx.Node, Any] = dict(sources)
    if rows is None and sources:
        first, dim = next(iter(sources.items()))
        rows = _shape(first)[dim]
    nodes = list(nodes)
    blocks = whole_blocks(nodes)
    for node in nodes:
        if node in dims or node.op not in ("call_function", "call_method"):
            continue
        block = blocks.get(node.meta.get(ROW_BLOCK, (None,))[0])
        if block is not None:
            if node.meta[ROW_BLOCK][1]:
                d = _block_rows(node, block, dims)
                if d is not None:
                    dims[node] = d
            continue  # inside the block: its result answers for it
        if not _row_args(node, dims) or plain_name(node) in _METADATA:
            continue  # size queries give numbers, not row data (passes/bucket.py checks their use)
        try:
            dims[node] = _rule(node, dims, rows)
        except (TypeError, ValueError, IndexError) as exc:
            raise NotRowwise(node, f"arguments not understood ({type(exc).__name__})") from None
    return dims


def whole_blocks(nodes: list) -> dict[Any, set]:
    """The blocks (ROW_BLOCK) that ``nodes`` hold whole: each result, and every block node a result
    is computed from, is among them, and nothing but block nodes reads a block node that is not a
    result."""
    members: dict[Any, set] = {}
    has_result: set = set()
    for node in nodes:
        tag = node.meta.get(ROW_BLOCK)
        if tag is not None:
            members.setdefault(tag[0], set()).add(node)
            if tag[1]:
                has_result.add(tag[0])
    whole = {}
    for key, block in members.items():
        if key not in has_result:
            continue
        ok = True
        for node in block:
            inside = [a for a in node.all_input_nodes if a.meta.get(ROW_BLOCK, (None,))[0] == key]
            if any(a not in block and not _made_from_nothing(a) for a in inside):
                ok = False  # part of the block lies outside these nodes (constants may: the
                # partition hoists them, passes/constants.py)
            if not node.meta[ROW_BLOCK][1] and any(
                    u not in block and not _dead_in_block(u, key) for u in node.users):
                ok = False  # a value of the block's inside is read outside it
        if ok:
            whole[key] = block
    return whole


def _every(node: torch.fx.Node, step: Any, ok: Any) -> bool:
    """``ok`` holds for ``node`` and for every node reached from it through ``step``."""
    stack, seen = [node], {node}
    while stack:
        n = stack.pop()
        if not ok(n):
            return False
        for m in step(n):
            if m not in seen:
                seen.add(m)
                stack.append(m)
    return True


def _dead_in_block(node: torch.fx.Node, key: Any) -> bool:
    """``node`` and everything that reads it are nodes of block ``key`` other than its results: a
    part of the block nothing needs (the region's live nodes leave it out)."""
    def inside(n: torch.fx.Node) -> bool:
        tag = n.meta.get(ROW_BLOCK)
        return tag is not None and tag[0] == key and not tag[1]
    return _every(node, lambda n: n.users, inside)


def _made_from_nothing(node: torch.fx.Node) -> bool:
    """No graph input is among ``node``'s ancestors (``arange(E).view(E, 1, 1)``): a constant."""
    return _every(node, lambda n: n.all_input_nodes, lambda n: n.op not in ("placeholder", "get_attr"))


def _block_rows(out: torch.fx.Node, block: set, dims: dict) -> Any:
    """Row dimension of a block's result (ROW_BLOCK): 0, when every input that holds rows of the
    block nodes ``out`` is computed from holds them along its one dimension of ``out``'s row count;
    None when no such input holds rows."""
    part, stack = {out}, [out]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a in block and a not in part:
                part.add(a)
                stack.append(a)
    inputs = {a for n in part for a in n.all_input_nodes if a not in block}
    carrying = [a for a in inputs if a in dims]
    if not carrying:
        return None
    shape = _shape(out)
    if not shape:
        raise NotRowwise(out, "the rewritten dispatch gives no tensor")
    for a in carrying:
        # The block reads each input's tokens along the dimension of the token count's size (the
        # dispatch matched them so); the proof's rows must be that dimension, and the only one.
        # (Compared as expressions: a SymInt comparison would guard on the example's sizes, and
        # a token count equal to a fixed width in the example would then be specialized.)
        a_shape, d, rows_expr = _shape(a), dims[a], size_expr(shape[0])
        same = [i for i, size in enumerate(a_shape or ()) if size_expr(size) == rows_expr]
        if not isinstance(d, int) or same != [d]:
            raise NotRowwise(out, f"the rewritten dispatch reads {a.name} with rows along dimension "
                                  f"{d}, not along its one dimension of {shape[0]} tokens")
    return 0
