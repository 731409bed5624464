"""Give each node and each region a role: attention, router, preprocess, moe_dispatch, experts,
mlp, norm, embedding or other.

Reads: ``nn_module_stack`` (module paths and classes), op names, the
partition's static/dynamic split, data and effect edges.
Writes: nothing on the graph; returns :class:`Labels`.

Per node, the first signal wins: the op itself (embedding, norms, attention
kernels), then the module stack from the innermost module outwards (path
component and class name: ``self_attn`` -> attention, ``gate``/``router`` ->
router, ``experts`` -> experts, ``*moe*`` -> preprocess if static else
moe_dispatch, ``mlp``/``ffn`` -> mlp, ``*norm*`` -> norm, ``embed*`` -> embedding; a class name
by its end: ``Qwen3MoeAttention`` is attention). The routing and combining that static dispatch's
forms add (``DISPATCH_FORM``) are moe_dispatch, static as they are.
A region's role is what it mostly does: the role of more than half of its ops, else ``mixed``
(the report then gives each role's share); a dynamic region that dispatches to experts is
``moe_dispatch``. ``region_role_ops`` keeps the whole composition.
Heuristic by design: the role only names things for people, nothing at
runtime depends on it.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Optional

import torch.fx

from ..common.fx_utils import callee_name, class_name, module_stack
from ..integrations.opaque import opaque_info
from .effects import Effects
from .partition import Partition, Region

__all__ = ["DISPATCH_FORM", "MIXED", "ROLES", "Labels", "label", "node_role", "region_role"]

ROLES = ("attention", "router", "preprocess", "moe_dispatch", "experts", "mlp", "norm",
         "embedding", "other")

DISPATCH_FORM = "cgbackend_dispatch_form"
"""Meta key of the nodes static dispatch's forms add to route tokens to experts and combine their
results (moe/graph_builder.py): role ``moe_dispatch``, static as they are."""

MIXED = "mixed"
"""The role of a region in which no role has more than half of the ops."""

_NORM_OPS = {"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm",
             "native_layer_norm", "fused_rms_norm"}
_ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "multi_head_attention_forward", "flash_attn_func"}
_EMBEDDING_OPS = {"embedding", "embedding_bag"}

_COMPONENT_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"(^|_)(router|gate)$|^router|gating$"), "router"),
    (re.compile(r"^(shared_)?experts?(_.*)?$"), "experts"),
    (re.compile(r"moe|sparse_moe|mixture"), "moe"),
    (re.compile(r"attn|attention"), "attention"),
    (re.compile(r"norm|^ln(_|\d|$)|^ln_f$"), "norm"),
    (re.compile(r"embed|^wte$|^wpe$|^tok_emb|^pos_emb"), "embedding"),
    (re.compile(r"mlp|ffn|feed_?forward|^fc\d*$|^dense$"), "mlp"),
)
# A class name says what the module is at its end: "Qwen3MoeAttention" is attention (its family's name
# "Qwen3Moe" says nothing about it), "Qwen3MoeDecoderLayer" is none of these, "MixtralSparseMoeBlock" an MoE.
_CLASS_END = r"(block|layer|module)?$"
_CLASS_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"(router|topkgate|gating)" + _CLASS_END, re.I), "router"),
    (re.compile(r"(experts?|expertmlp)" + _CLASS_END, re.I), "experts"),
    (re.compile(r"(moe|sparsemoe|mixtureofexperts)" + _CLASS_END, re.I), "moe"),
    (re.compile(r"(attention|attn)" + _CLASS_END, re.I), "attention"),
    (re.compile(r"norm" + _CLASS_END, re.I), "norm"),
    (re.compile(r"embeddings?" + _CLASS_END, re.I), "embedding"),
    (re.compile(r"(mlp|feedforward|ffn)" + _CLASS_END, re.I), "mlp"),
)


@dataclasses.dataclass
class Labels:
    node_roles: dict[torch.fx.Node, str]
    region_roles: dict[int, str]
    """Region index -> role."""
    region_role_ops: dict[int, dict[str, int]]
    """Region index -> {role: number of ops with that role}."""


def _last_named_component(path: str) -> str:
    for part in reversed(path.split(".")):
        if part and not part.isdigit():
            return part
    return ""


_PRIORITY = ("router", "experts", "moe", "attention", "norm", "embedding", "mlp")


def _module_signal(path: str, cls) -> Optional[str]:
    """Role named by the module's attribute name or its class, the more specific one winning
    (a MixtralSparseMoeBlock stored as ``ffn`` is an MoE, not an MLP)."""
    found = set()
    component = _last_named_component(path).lower()
    if component:
        found.update(role for pattern, role in _COMPONENT_RULES if pattern.search(component))
    name = class_name(cls)
    found.update(role for pattern, role in _CLASS_RULES if pattern.search(name))
    for role in _PRIORITY:
        if role in found:
            return role
    return None


def _role_and_scope(node: torch.fx.Node, static: bool) -> tuple[str, str]:
    """(role, path of the module that decided it)."""
    if node.meta.get(DISPATCH_FORM):
        return "moe_dispatch", ""
    info = opaque_info(node)
    if info is not None and info.module is not None:
        role = info.family.role(info.module)
        if role is not None:
            return role, info.path
    name = callee_name(node)
    if name in _EMBEDDING_OPS:
        return "embedding", ""
    if name in _NORM_OPS:
        return "norm", ""
    if name in _ATTENTION_OPS:
        return "attention", ""
    for path, cls in reversed(module_stack(node)):
        role = _module_signal(path, cls)
        if role == "moe":
            return ("preprocess" if static else "moe_dispatch"), path
        if role is not None:
            return role, path
    return "other", ""


def node_role(node: torch.fx.Node, static: bool) -> str:
    return _role_and_scope(node, static)[0]


def region_role(region: Region, roles: dict[torch.fx.Node, str]) -> tuple[str, dict[str, int]]:
    """(the region's role, its ops per role), from its nodes' ``roles``."""
    ops: collections.Counter = collections.Counter(roles[node] for node in region.nodes)
    if not region.is_static and (ops["moe_dispatch"] or (ops["experts"] and len(ops) > 1)):
        return "moe_dispatch", dict(ops)
    if not ops:
        return "other", {}
    role, count = max(ops.items(), key=lambda kv: kv[1])
    return (role if 2 * count > sum(ops.values()) else MIXED), dict(ops)


def label(gm: torch.fx.GraphModule, partition: Partition, effects: Optional[Effects] = None) -> Labels:
    """``effects``: its ordering edges count as "consumes" (a combine reads what an eager index_add_
    wrote in place)."""
    roles: dict[torch.fx.Node, str] = {}
    # Static ops of an MoE layer that consume its eager dispatch (directly or through other ops of
    # the same layer) combine the experts' results: they belong to the dispatch, not to the
    # preprocessing before it.
    scope_of: dict[torch.fx.Node, str] = {}
    after_dispatch: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        region = partition.region_of.get(node)
        if region is None:
            continue
        role, scope = _role_and_scope(node, region.is_static)
        scope_of[node] = scope
        if role in ("moe_dispatch", "preprocess"):
            preds = list(node.all_input_nodes) + (list(effects.preds(node)) if effects is not None else [])
            fed = any(scope_of.get(p) == scope and (p in after_dispatch or roles.get(p) == "moe_dispatch")
                      for p in preds)
            if role == "moe_dispatch" or fed:
                after_dispatch.add(node)
            if role == "preprocess" and fed:
                role = "moe_dispatch"
        roles[node] = role
    region_roles: dict[int, str] = {}
    region_role_ops: dict[int, dict[str, int]] = {}
    for region in partition.regions:
        region_roles[region.index], region_role_ops[region.index] = region_role(region, roles)
    return Labels(node_roles=roles, region_roles=region_roles, region_role_ops=region_role_ops)
