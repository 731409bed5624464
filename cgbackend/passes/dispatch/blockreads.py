"""Expert parameters read from their block while gradients are off.

After the layout (layout.py) each laid-out expert parameter is slice ``e`` of one block. Dynamo
still makes every one of them a graph input of its own: for 128 experts of three weights, 384
inputs per layer, each fetched by Dynamo's generated code before every call of the graph (about
0.3 ms of host time per layer on an H200 host, more than the layer's graph launch), where a model
with stacked expert weights passes three.

``BlockReads`` swaps, for the duration of each call of the compiled model with gradients off, each
such experts list in its owner for a stand-in tree: the same module objects' state (every stand-in
shares its original's ``__dict__``: training flags, hooks, buffers, attributes stay live), whose
param-owning modules read each laid-out parameter ``name`` as ``block[e]`` (a class property) and
whose containers hand out the stand-in children (``_modules``, a class property). Dynamo then
passes one input per block and indexes it in the graph (``block[e]``, the form stacked experts
already take). The values are the same memory, so results are bitwise those of the parameters.

Gradients on: the originals stay (autograd must reach each expert's own parameter). Before every
swap the trees are checked against what they were built from, in C loops: each module's
``_modules`` and ``_parameters`` hold the same objects, and every parameter still is its slice of
the block (``data_ptr``). Anything else (a parameter or module replaced, ``p.data`` reassigned)
rebuilds the stand-ins, or leaves the list as it is, with the reason in the report.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import threading
from typing import Any, Optional

import torch
import torch.nn as nn

from .layout import consecutive

__all__ = ["BlockReads"]

log = logging.getLogger(__name__)

_ptrs_equal = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)

_CLASSES: dict[tuple, type] = {}


def _reader(name: str) -> property:
    return property(lambda self: self._cgb_blocks[name][self._cgb_index])


def _standin_class(cls: type, names: tuple[str, ...], container: bool) -> type:
    """``cls`` with properties for the parameters ``names`` (read from the block) and, for a module
    with children, ``_modules`` (the stand-in children); per-instance data in slots."""
    key = (cls, names, container)
    if key not in _CLASSES:
        ns: dict[str, Any] = {"__slots__": ("_cgb_blocks", "_cgb_index", "_cgb_children")}
        for name in names:
            ns[name] = _reader(name)
        if container:
            ns["_modules"] = property(lambda self: self._cgb_children)
        _CLASSES[key] = type(cls.__name__, (cls,), ns)
    return _CLASSES[key]


def _standin(module: nn.Module, blocks: dict[str, torch.Tensor], index: Optional[int],
             prefix: str = "") -> nn.Module:
    """The stand-in of ``module`` (expert ``index``): parameters ``prefix + name`` found in
    ``blocks`` read as ``blocks[...][index]``; children stood in for recursively."""
    own = tuple(n for n in module._parameters if prefix + n in blocks)
    children = module._modules
    obj = object.__new__(_standin_class(type(module), own, bool(children)))
    obj.__dict__ = module.__dict__
    obj._cgb_blocks = {n: blocks[prefix + n] for n in own}
    obj._cgb_index = index
    obj._cgb_children = {name: (None if child is None else _standin(child, blocks, index, f"{prefix}{name}."))
                         for name, child in children.items()}
    return obj


@dataclasses.dataclass
class _List:
    """One experts list: where it lives, its stand-in, and what the stand-in was built from."""
    path: str
    owner: nn.Module
    attr: str
    experts: nn.ModuleList
    names: list[str]
    standin: Optional[nn.Module] = None
    dicts: list = dataclasses.field(default_factory=list)     # the originals' _modules / _parameters
    keys: list = dataclasses.field(default_factory=list)      # their keys and values at build time
    values: list = dataclasses.field(default_factory=list)
    params: list = dataclasses.field(default_factory=list)    # every laid-out parameter
    ptrs: list = dataclasses.field(default_factory=list)      # their addresses at build time
    reason: str = ""


def _flat(dicts: list[dict]) -> tuple[list, list]:
    """Every key and every value of ``dicts``, in order (C loops: compared by identity after)."""
    return (list(itertools.chain.from_iterable(map(dict.keys, dicts))),
            list(itertools.chain.from_iterable(map(dict.values, dicts))))


def _eligible(experts: nn.ModuleList) -> tuple[Optional[dict[str, torch.Tensor]], str]:
    """The blocks of ``experts``' parameters (name -> [E, ...] view of the block), or why not."""
    first = experts[0]
    if any(type(m) is not type(first) for m in experts):
        return None, "experts of different classes"
    names = [n for n, _ in first.named_parameters()]
    if not names:
        return None, "experts without parameters"
    blocks = {}
    for name in names:
        params = [dict(m.named_parameters()).get(name) for m in experts]
        if any(p is None for p in params):
            return None, f"not every expert has {name}"
        if not consecutive([p.data for p in params]):
            return None, f"{name} is not laid out as one block"
        p0 = params[0].detach()
        blocks[name] = p0.as_strided((len(params),) + tuple(p0.shape), (p0.numel(),) + tuple(p0.stride()),
                                     p0.storage_offset())
    return blocks, ""


class BlockReads:
    """The experts lists of a model whose parameters are read from their blocks in no-grad calls
    (see the module docstring). Use as a context manager around each call of the compiled model."""

    def __init__(self, model: nn.Module) -> None:
        self.lists: list[_List] = []
        self.calls = 0
        """Calls that ran with the stand-ins in place."""
        self._local = threading.local()
        modules = dict(model.named_modules())
        for path, module in modules.items():
            if not isinstance(module, nn.ModuleList) or len(module) < 2 or not path:
                continue
            if "expert" not in path.rsplit(".", 1)[-1].lower():
                continue
            if any(isinstance(sub, nn.ModuleList) for m in module for sub in m.modules()):
                continue
            owner_path, _, attr = path.rpartition(".")
            entry = _List(path, modules[owner_path], attr, module, [])
            self._build(entry)
            self.lists.append(entry)

    def _build(self, entry: _List) -> None:
        blocks, why = _eligible(entry.experts)
        entry.standin = None
        if blocks is None:
            entry.reason = why
            return
        entry.names = list(blocks)
        children = {str(e): _standin(m, blocks, e) for e, m in enumerate(entry.experts)}
        top = object.__new__(_standin_class(type(entry.experts), (), True))
        top.__dict__ = entry.experts.__dict__
        top._cgb_blocks, top._cgb_index, top._cgb_children = {}, None, children
        entry.standin = top
        entry.dicts, entry.params = [], []
        for m in [entry.experts, *entry.experts.modules()]:
            entry.dicts += [m._modules, m._parameters]
        entry.keys, entry.values = _flat(entry.dicts)
        for m in entry.experts:
            entry.params += [p for _, p in m.named_parameters()]
        entry.ptrs = [p.data_ptr() for p in entry.params]
        entry.reason = ""

    def _current(self, entry: _List) -> bool:
        """The stand-in still mirrors the list: same modules and parameters, each at its address."""
        if entry.owner._modules.get(entry.attr) is not entry.experts:
            return False
        keys, values = _flat(entry.dicts)
        if keys != entry.keys or not all(map(operator.is_, values, entry.values)):
            return False
        if _ptrs_equal is not None:
            return _ptrs_equal(entry.params, entry.ptrs, list(range(len(entry.params))))
        return all(p.data_ptr() == q for p, q in zip(entry.params, entry.ptrs))

    def __bool__(self) -> bool:
        return any(e.standin is not None for e in self.lists)

    def __enter__(self) -> None:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return
        swapped = []
        if not torch.is_grad_enabled():
            for entry in self.lists:
                if entry.standin is None:
                    continue
                if not self._current(entry):
                    self._build(entry)
                    if entry.standin is None:
                        log.info("cgbackend: %s: parameters read one by one from now on (%s)", entry.path,
                                 entry.reason)
                        continue
                entry.owner._modules[entry.attr] = entry.standin
                swapped.append(entry)
        if swapped:
            self.calls += 1
        self._local.swapped = swapped

    def __exit__(self, *exc: Any) -> None:
        self._local.depth -= 1
        if self._local.depth:
            return
        for entry in self._local.swapped:
            entry.owner._modules[entry.attr] = entry.experts
        self._local.swapped = []

    def notes(self) -> list[str]:
        """One line per experts list, for the report."""
        out = []
        for e in self.lists:
            if e.standin is not None:
                out.append(f"{e.path}: with gradients off the {len(e.experts)} experts read "
                           f"{', '.join(e.names)} from their blocks ({len(e.names)} graph inputs instead of "
                           f"{len(e.params)}); {self.calls} call(s) so far")
            elif e.reason:
                out.append(f"{e.path}: expert parameters passed one by one ({e.reason})")
        return out
