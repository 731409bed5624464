"""``torch.compile(model, backend="cgbackend", options={...})``: the entry point and the backend
instances it makes, one per torch.compile call (docs/design.md, "Behaving like a torch.compile
backend")."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx

from .backend import CGBackend
from .config import ConfigError
from .config.suggest import torch_compile_argument

__all__ = ["backend_of_wrapper", "by_name_backends", "default_backend", "dynamo_entry",
           "is_compile_wrapper", "register", "reset_default_backend"]


class _ByName:
    """The instances made for ``torch.compile(..., backend="cgbackend")``: one per torch.compile
    call (found through torch's compile wrapper, which calls the entry point), or, where that
    wrapper cannot be found (another torch version), one per distinct ``options``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instances: list[weakref.ReferenceType[CGBackend]] = []
        self.by_options: dict[str, CGBackend] = {}

    def make(self, options: dict[str, Any]) -> CGBackend:
        instance = CGBackend(by_name=True, **options)
        with self.lock:
            self.instances = [r for r in self.instances if r() is not None]
            self.instances.append(weakref.ref(instance))
        return instance

    def for_options(self, options: dict[str, Any]) -> CGBackend:
        key = repr(sorted(options.items()))
        with self.lock:
            found = self.by_options.get(key)
        if found is None:
            found = self.make(options)
            with self.lock:
                found = self.by_options.setdefault(key, found)
        return found

    def live(self) -> list[CGBackend]:
        with self.lock:
            return [i for i in (r() for r in self.instances) if i is not None]

    def clear(self) -> None:
        with self.lock:
            self.instances.clear()
            self.by_options.clear()


_by_name = _ByName()


def by_name_backends() -> list[CGBackend]:
    """Live instances made for ``torch.compile(..., backend="cgbackend")``, oldest first."""
    return _by_name.live()


def default_backend() -> CGBackend:
    """The instance for ``backend="cgbackend"`` without options where torch's compile wrapper
    cannot be found; created on first use with CGBACKEND_* options."""
    return _by_name.for_options({})


def reset_default_backend() -> None:
    """Forget every by-name instance (their graphs live on while Dynamo's caches hold them)."""
    _by_name.clear()


def _compile_wrapper() -> Any:
    """torch.compile's wrapper object that called the entry point (``torch._TorchCompileWrapper``,
    one per torch.compile call), or None. Private API: feature-tested by name and by the attribute
    that must point back at the entry point."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if is_compile_wrapper(owner):
            return owner
        frame = frame.f_back
    return None


def dynamo_entry(gm: torch.fx.GraphModule, example_inputs: list, *, options: Optional[dict] = None,
                 mode: Optional[str] = None) -> Callable[..., Any]:
    """What ``torch.compile(model, backend="cgbackend", options={...})`` calls (the
    torch_dynamo_backends entry point). ``options`` are cgbackend's (see cgbackend.Config; unknown
    ones raise ConfigError listing the valid ones); ``mode`` is rejected. torch.compile is lazy, so
    both errors surface at the first call, where Dynamo compiles."""
    if mode is not None:
        raise ConfigError(torch_compile_argument("mode", mode))
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"cgbackend options must be a dict of option names to values, got {options!r}")
    options = dict(options or {})
    wrapper = _compile_wrapper()
    if wrapper is None:
        return _by_name.for_options(options)(gm, example_inputs)
    return backend_of_wrapper(wrapper, options)(gm, example_inputs)


class _OwnKwargs(dict):
    """torch.compile's kwargs for the backend (options=), equal only to themselves."""

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    __hash__ = None  # type: ignore[assignment]


def is_compile_wrapper(obj: Any) -> bool:
    """Is ``obj`` torch.compile's wrapper around this entry point (backend="cgbackend")?"""
    return type(obj).__name__ == "_TorchCompileWrapper" and getattr(obj, "compiler_fn", None) is dynamo_entry


def backend_of_wrapper(wrapper: Any, options: Optional[dict] = None) -> CGBackend:
    """The instance of one torch.compile call, made on first use from its ``options``."""
    instance = vars(wrapper).get("_cgbackend")
    if instance is None:
        if options is None:
            options = dict(getattr(wrapper, "kwargs", {}).get("options") or {})
        instance = _by_name.make(options)
        wrapper._cgbackend = instance  # one instance per torch.compile call: its model's own counters
        # Dynamo reuses a compiled frame for another torch.compile call whose backend compares
        # equal (torch's wrapper compares its compiler function and kwargs): two models of one class
        # compiled with the same options would share graphs, and one would count the other's calls.
        # kwargs that equal only themselves keep each torch.compile call's graphs (and counters) its
        # own, as with cgbackend.backend() instances.
        wrapper.kwargs = _OwnKwargs(getattr(wrapper, "kwargs", {}))
    return instance


def _reset_by_name() -> None:
    for instance in _by_name.live():
        instance.reset()


# torch._dynamo.reset() calls reset() on each backend it cached; by name that is torch's compile
# wrapper, which forwards to its compiler function's reset.
dynamo_entry.reset = _reset_by_name


def register() -> None:
    """Register ``dynamo_entry`` under the name "cgbackend" with Dynamo where the package's
    ``torch_dynamo_backends`` entry point is not installed (a source tree, a vendored copy), so
    ``import cgbackend`` is enough for ``torch.compile(model, backend="cgbackend")``. Where the entry
    point is installed, Dynamo loads this same function through it on first use (registering it
    here too would make that load fail as a duplicate name).

    Dynamo's registry lives in ``torch._dynamo``, a second of imports that ``import cgbackend`` does
    not otherwise need (the command line's --help and the benchmarks' refusal on a machine without
    CUDA stay quick): where it is not imported yet, the name is registered right after it is
    (:class:`_AfterDynamoImport`), which torch.compile does before it looks a name up."""
    import importlib.metadata
    if any(ep.name == "cgbackend" and ep.value == f"{__name__}:dynamo_entry"
           for ep in importlib.metadata.entry_points(group="torch_dynamo_backends")):
        return
    if "torch._dynamo" in sys.modules:
        _register_now()
    elif not any(isinstance(finder, _AfterDynamoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


def _register_now() -> None:
    from torch._dynamo import lookup_backend, register_backend
    try:
        register_backend(compiler_fn=dynamo_entry, name="cgbackend")
    except AssertionError:  # Dynamo's "duplicate name"
        found = lookup_backend("cgbackend")
        if found is not dynamo_entry:
            raise RuntimeError(f"another backend is registered with Dynamo as 'cgbackend': {found!r}") from None


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Registers the name once ``torch._dynamo`` has been imported (a post-import hook: it finds the
    module's spec through the other finders and runs the registration after the module's code)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)  # once; the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _register_now()

        loader.exec_module = exec_module  # this spec's loader object only
        return spec


def find_backend(obj: Any = None) -> CGBackend:
    """The CGBackend behind a compiled model or function. A model compiled by name
    (``torch.compile(model, backend="cgbackend")``) has its own instance, one per torch.compile
    call; None gives the instance used by name where torch's compile wrapper cannot be found."""
    if obj is None:
        return default_backend()
    if isinstance(obj, CGBackend):
        return obj
    # Only the object's own attribute: an OptimizedModule's getattr falls through to the module.
    found = getattr(obj, "__dict__", {}).get("_cgbackend")
    if isinstance(found, CGBackend):
        return found
    # torch.compile(model, backend=...): the backend sits behind the OptimizeContext's callback; a
    # compiled function keeps that context (or its callback) in its closure.
    starts = [getattr(getattr(obj, "dynamo_ctx", None), "callback", None)]
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            content = cell.cell_contents
        except ValueError:  # empty cell
            continue
        starts.append(getattr(content, "callback", None) or content)
    for candidate in starts:
        for _ in range(8):
            if candidate is None:
                break
            if isinstance(candidate, CGBackend):
                return candidate
            if is_compile_wrapper(candidate):
                return backend_of_wrapper(candidate)
            if candidate is dynamo_entry:
                return default_backend()
            candidate = (getattr(candidate, "_torchdynamo_orig_backend", None)
                         or getattr(candidate, "compiler_fn", None))
    raise TypeError(
        "cgbackend could not find the backend behind this object; pass the backend instance "
        "(cgbackend.backend(...)), a model from cgbackend.compile(...), or a module compiled "
        "with torch.compile(..., backend=...)")
