"""Small readers of FX node metadata shared by the passes.

Dynamo stores fake values under ``meta["example_value"]``, AOT graphs under
``meta["val"]``; :func:`fake_value` is the one place that knows both. Our own
per-node results live under ``meta["cgbackend"]`` (:data:`META_KEY`).
"""

from __future__ import annotations

import operator
import re
from typing import Any, Iterator, Optional

import sympy
import torch
import torch.fx

META_KEY = "cgbackend"

_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def copy_module(module: torch.fx.GraphModule, env: Optional[dict] = None) -> torch.fx.GraphModule:
    """``module``'s graph copied node by node (meta shallow-copied, the output node's too), over the
    same root module; ``env`` (if given) receives each old node's copy. A caller that changes the
    copy's graph recompiles it."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(module.graph, {} if env is None else env)
    graph.output(out).meta = dict(next(iter(reversed(module.graph.nodes))).meta)
    return torch.fx.GraphModule(module, graph)


def fake_value(node: torch.fx.Node) -> Any:
    """The fake (meta) value Dynamo or AOT recorded for ``node``; None if it has none."""
    meta = node.meta
    if "val" in meta:
        return meta["val"]
    return meta.get("example_value")


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a value (tensors, tuples, lists, dicts, named tuples)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


def storage_ids(value: Any) -> set[int]:
    """Identities of the storages that the tensors in ``value`` view (fake tensors keep them)."""
    ids = set()
    for t in iter_tensors(value):
        try:
            ids.add(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            # Sparse or other layouts without a storage: no aliasing information.
            continue
    return ids


def attr_module(node: torch.fx.Node) -> Optional[torch.nn.Module]:
    """The module a ``get_attr`` node reads (a higher-order op's body: ``autograd_function_apply``'s
    forward and backward, a cond's branches), or None (another node, a tensor attribute)."""
    if node.op != "get_attr":
        return None
    root = node.graph.owning_module
    if root is None:
        return None
    try:
        value = operator.attrgetter(node.target)(root)
    except AttributeError:
        return None
    return value if isinstance(value, torch.nn.Module) else None


def is_subgraph_attr(node: torch.fx.Node) -> bool:
    """A ``get_attr`` of a module. Not a value a region can take or return: each region whose ops
    call it reads it from the root itself (runtime/split.py)."""
    return attr_module(node) is not None


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes that run something: everything except placeholders and the output node."""
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


_OWN_FRAMES = ("cgbackend/integrations/opaque.py",)
"""Frames of cgbackend's own code Dynamo traces (an opaque call's wrapper): the user's line is above."""


_RESUME_RE = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")


def user_function(name: str) -> str:
    """The user's function behind Dynamo's resume function after a graph break
    (``torch_dynamo_resume_in_forward_at_70`` -> ``forward``); other names as they are."""
    match = _RESUME_RE.match(name)
    return match.group("name") if match else name


def source_frame(node: torch.fx.Node) -> dict[str, Any] | None:
    """The innermost user frame of ``node``: ``{"path", "line", "function", "code"}`` (the full
    path as Dynamo recorded it), or None."""
    trace = node.meta.get("stack_trace") or ""
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME_RE.search(lines[i])
        path = m.group("file").replace("\\", "/") if m else ""
        if m and not path.endswith(_OWN_FRAMES):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if code and set(code) <= set("^~ "):
                code = ""
            return {"path": m.group("file"), "line": int(m.group("line")),
                    "function": user_function(m.group("func")), "code": code}
    return None


def source_location(node: torch.fx.Node) -> tuple[str, str]:
    """("file.py:LINE in func", "the code line") of the innermost user frame, or ("", "")."""
    frame = source_frame(node)
    if frame is None:
        return "", ""
    file = frame["path"].replace("\\", "/").rsplit("/", 1)[-1]
    return f"{file}:{frame['line']} in {frame['function']}", frame["code"]


_PATH_ROOT_RE = re.compile(r"^L\['[^']*'\]\.?")
_INDEX_RE = re.compile(r"\[(\d+)\]")
_MODULES_RE = re.compile(r"_modules\['([^']+)'\]")


def normalize_module_path(path: str) -> str:
    """``L['self'].layers[0]._modules['attn']`` -> ``layers.0.attn``."""
    path = _PATH_ROOT_RE.sub("", path)
    path = _MODULES_RE.sub(r"\1", path)
    path = _INDEX_RE.sub(r".\1", path)
    path = path.replace("..", ".").strip(".")
    return path


def module_stack(node: torch.fx.Node) -> list[tuple[str, type | str]]:
    """Outermost-first list of (normalized path, module class) the node was traced under."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for entry in stack.values():
        path, cls = entry[0], entry[1]
        out.append((normalize_module_path(str(path)), cls))
    return out


def module_path(node: torch.fx.Node) -> str:
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def class_name(cls: type | str) -> str:
    if isinstance(cls, str):
        return cls.rsplit(".", 1)[-1]
    return getattr(cls, "__name__", str(cls))


def op_name(node: torch.fx.Node) -> str:
    """A short human name for what the node runs: ``linear``, ``Tensor.index_add_``, ``aten.nonzero``."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return f"module {target}"
    if node.op == "get_attr":
        return f"get_attr {target}"
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return str(target.overloadpacket).replace("::", ".")
        if isinstance(target, torch._ops.OpOverloadPacket):
            return str(target).replace("::", ".")
        if isinstance(target, torch._ops.HigherOrderOperator):
            return f"higher_order.{target.name()}"
        name = getattr(target, "__name__", None) or str(target)
        module = getattr(target, "__module__", None) or ""
        if module == "_operator" or target in _OPERATOR_FUNCS:
            return f"operator.{name}"
        if module.startswith("torch.nn.functional") or name in _FUNCTIONAL_NAMES:
            return name
        return name
    return str(target)


def op_key(node: torch.fx.Node) -> str:
    """The name users pass in ``dynamic_ops``: ``torch.nonzero``, ``Tensor.item``, ``ns::op``."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_function":
        if isinstance(target, torch._ops.OpOverload):
            return target.overloadpacket._qualified_op_name
        if isinstance(target, torch._ops.OpOverloadPacket):
            return target._qualified_op_name
        module = getattr(target, "__module__", None) or ""
        name = getattr(target, "__name__", None) or str(target)
        if module.startswith("torch.nn.functional") or module == "torch._C._nn":
            return f"torch.nn.functional.{name}"
        if module in ("torch", "torch._C._VariableFunctions") or module.startswith("torch._C"):
            return f"torch.{name}"
        return f"{module}.{name}" if module else name
    return str(target)


_OPERATOR_FUNCS = {getattr(operator, n) for n in dir(operator) if not n.startswith("_")}
_FUNCTIONAL_NAMES = {"linear", "embedding", "layer_norm", "softmax", "dropout"}


def callee_name(node: torch.fx.Node) -> str:
    """The bare name of what a call node calls: ``index_add_``, ``nonzero``, ``linear``."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return target._opname
        if isinstance(target, torch._ops.OpOverloadPacket):
            return target._qualified_op_name.split("::")[-1]
        return getattr(target, "__name__", "") or ""
    return ""


def plain_name(node: torch.fx.Node) -> str:
    """callee_name without dunder wrapping: Dynamo of torch 2.11 records ``a == b`` as the method
    ``__eq__`` (and ``x * y`` as ``__mul__``), torch 2.13 as ``operator.eq``."""
    name = callee_name(node)
    return name[2:-2] if name.startswith("__") and name.endswith("__") and len(name) > 4 else name


def size_expr(size: Any) -> sympy.Expr:
    """A size (int, SymInt or sympy expression) as a sympy expression."""
    node = getattr(size, "node", None)
    if node is not None and hasattr(node, "expr"):
        return node.expr
    return size if isinstance(size, sympy.Basic) else sympy.Integer(int(size))


def sizes_equal(a: Any, b: Any) -> bool:
    """Sizes (ints or SymInts) known to be equal; False when the comparison cannot be decided."""
    try:
        return bool(a == b)
    except Exception:  # an unbacked comparison that cannot be decided
        return False


def shape_str(t: torch.Tensor) -> str:
    dims = ", ".join(str(d) for d in t.shape)
    dtype = str(t.dtype).replace("torch.", "")
    return f"[{dims}]@{dtype}"


def value_spec(value: Any) -> str:
    """``[4, 128, 512]@bfloat16`` for tensors, the type for other values."""
    if isinstance(value, torch.Tensor):
        return shape_str(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(value_spec(v) for v in value) + ")"
    if isinstance(value, torch.SymInt):
        return f"SymInt({value.node.expr})"
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        return f"{type(value).__name__}({value.node.expr})"
    if value is None:
        return "None"
    return type(value).__name__


def dynamo_compile_id() -> Optional[tuple[int, int, int]]:
    """(frame id, compile of that frame in this process, attempt) of the Dynamo compile in
    progress; None where torch has none (private API, feature-tested)."""
    context = getattr(getattr(torch, "_guards", None), "CompileContext", None)
    current = getattr(context, "current_compile_id", None)
    compile_id = current() if current is not None else None
    frame, count = getattr(compile_id, "frame_id", None), getattr(compile_id, "frame_compile_id", None)
    if not (isinstance(frame, int) and isinstance(count, int)):
        return None
    return frame, count, getattr(compile_id, "attempt", 0) or 0
