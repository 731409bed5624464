"""Rough kernel-launch counts per node, for folding tiny regions and for the report's estimates.

An estimate, not a measurement: views and metadata ops launch nothing, most
tensor ops launch one kernel, a few known ops launch more. The report labels
these numbers as estimates.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..common.fx_utils import callee_name, fake_value, iter_tensors
from ..integrations.opaque import opaque_info

__all__ = ["estimate_kernels"]

_FREE = {
    # views and metadata
    "view", "view_as", "reshape", "reshape_as", "permute", "transpose", "t", "unsqueeze", "squeeze",
    "expand", "expand_as", "narrow", "select", "flatten", "unflatten", "split", "chunk", "unbind",
    "split_with_sizes", "movedim", "as_strided", "detach", "alias", "size", "dim", "stride",
    "numel", "sym_size", "sym_stride", "sym_numel", "unsafe_view", "_unsafe_view", "diagonal",
    "real", "imag", "view_as_real", "view_as_complex", "T", "mT", "contiguous_view",
    "requires_grad_", "_assert_scalar", "_check", "_check_is_size", "sym_constrain_range_for_size",
    "_enter_autocast", "_exit_autocast", "_set_grad_enabled", "set_grad_enabled", "type_as_noop",
}
_SEVERAL = {
    "one_hot": 3, "nonzero": 2, "where_cond": 2, "bincount": 2, "argsort": 2, "sort": 2,
    "unique": 4, "masked_select": 3, "repeat_interleave": 3, "cross_entropy": 3, "topk": 1,
    "scaled_dot_product_attention": 1, "multi_head_attention_forward": 6, "group_norm": 2,
    "batch_norm": 1, "nll_loss": 2, "log_softmax": 1, "gumbel_softmax": 4, "histc": 2,
}


def _is_tensor_index(arg) -> bool:
    items = arg if isinstance(arg, (tuple, list)) else (arg,)
    for item in items:
        if isinstance(item, torch.fx.Node) and any(True for _ in iter_tensors(fake_value(item))):
            return True
    return False


def estimate_kernels(node: torch.fx.Node) -> int:
    """Estimated kernel launches of one node (0 for views, metadata and host-only work)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return 0
    info = opaque_info(node)
    if info is not None:  # a whole module's forward (opaque.py)
        module = info.module
        return info.family.kernels(module) if module is not None else 1
    value = fake_value(node)
    tensors = list(iter_tensors(value))
    name = callee_name(node)
    if node.op == "call_function" and node.target is operator.getitem:
        # x[i] / x[a:b] is a view; x[idx_tensor] gathers. getitem on tuples launches nothing.
        base = node.args[0]
        if isinstance(base, torch.fx.Node) and isinstance(fake_value(base), torch.Tensor):
            return 1 if len(node.args) > 1 and _is_tensor_index(node.args[1]) else 0
        return 0
    if node.op == "call_function" and node.target is operator.setitem:
        return 1
    if not tensors:
        return 0
    if name in _FREE:
        return 0
    if name == "where" and len(node.args) == 1 and not node.kwargs:
        return _SEVERAL["where_cond"]
    if name in ("to", "type", "float", "half", "bfloat16", "double", "int", "long", "bool"):
        # A cast launches a kernel only when it changes dtype or device.
        src = node.args[0] if node.args else None
        src_val = fake_value(src) if isinstance(src, torch.fx.Node) else None
        if isinstance(src_val, torch.Tensor) and isinstance(value, torch.Tensor):
            if src_val.dtype == value.dtype and src_val.device == value.device:
                return 0
        return 1
    if name == "contiguous":
        src = node.args[0] if node.args else None
        src_val = fake_value(src) if isinstance(src, torch.fx.Node) else None
        if isinstance(src_val, torch.Tensor):
            try:
                return 0 if src_val.is_contiguous() else 1
            except Exception:  # unbacked strides: cannot tell, count one
                return 1
        return 1
    return _SEVERAL.get(name, 1)
