"""The Dynamo backend: (GraphModule, example_inputs) -> callable.

``CGBackend(**options)`` is one backend instance: it owns the memory pools, the
counters and the compiled graphs it made. ``torch.compile(model,
backend="cgbackend", options={...})`` (the ``torch_dynamo_backends`` entry point)
makes one instance per ``torch.compile`` call, configured by ``options``;
``cgbackend.backend(...)`` and ``cgbackend.compile(...)`` make separate instances
too. ``torch._dynamo.reset()`` (``torch.compiler.reset()``) resets every instance's
counters along with Dynamo's caches.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx

from .analysis import Analysis, analyze
from .breaks import break_text, source_of_stack
from .config import Config, ConfigError
from .opaque import InstallResult
from .report import Report, build_report, graph_report, summarize
from .runtime.executor import CompiledGraph
from .runtime.mirror import CounterMirror
from .runtime.region import RuntimeShared
from .runtime.stats import EagerReason
from . import structured

__all__ = ["CGBackend", "by_name_backends", "default_backend", "dynamo_entry", "reset_default_backend"]

log = logging.getLogger(__name__)


def graph_break_info(gm: torch.fx.GraphModule) -> Optional[dict[str, str]]:
    """Dynamo's reason for ending this graph, when it ended at a graph break."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    source = source_of_stack(getattr(reason, "user_stack", None))
    return {"reason": break_text(str(getattr(reason, "reason", ""))), "source": source}


class CGBackend:
    """A cgbackend instance; pass it as ``torch.compile(model, backend=instance)``."""

    def __init__(self, config: Optional[Config] = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("CGBackend takes either a Config or keyword options, not both")
        self.config = config if config is not None else Config.from_options(options)
        self.shared = RuntimeShared(self.config)
        self.shared.mirror = CounterMirror()
        """Pushes this instance's counters into torch._dynamo.utils.counters["cgbackend"]."""
        self._graphs: list[weakref.ReferenceType[CompiledGraph]] = []
        self._analyses: list[tuple[Analysis, Optional[dict[str, str]]]] = []
        self._keep_analyses = False
        self._lock = threading.Lock()
        self._no_cuda_logged = False
        self.opaque: Optional[InstallResult] = None
        """What cgbackend.compile / explain made opaque in the model (opaque.py), for the report."""
        self.__name__ = "cgbackend"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        with self._lock:
            index = len(self._graphs)
            analysis = analyze(gm, self.config)
            break_info = graph_break_info(gm)
            if self._keep_analyses:
                self._analyses.append((analysis, break_info))
            inner = None
            if self.config.inner == "inductor":
                from .inner import inductor_inner  # imports Inductor only when asked for
                inner = inductor_inner(self.config)
            compiled = CompiledGraph(analysis, list(example_inputs), self.shared, index, inner=inner)
            self._graphs.append(weakref.ref(compiled))
            self.shared.mirror.push(self.shared.counters)
        part = analysis.partition
        ops = sum(1 for r in part.regions for n in r.nodes if n.op.startswith("call_"))
        static_ops = sum(1 for r in part.static_regions() for n in r.nodes if n.op.startswith("call_"))
        log.info("cgbackend: graph %d: %d ops, %d static regions (%.0f%% of ops), %d dynamic regions%s",
                 index, ops, len(part.static_regions()), 100.0 * static_ops / max(ops, 1),
                 len(part.dynamic_regions()),
                 f" [{compiled.blocked}]" if compiled.blocked else "")
        if structured.structured_tracing_on():
            gr = graph_report(analysis, index, break_info)
            structured.emit_report(Report(graphs=[gr], graph_breaks=[break_info] if break_info else [],
                               summary=summarize([gr], [break_info] if break_info else []),
                               config=self.config.to_dict()), "cgbackend_partition_report")
        if compiled.blocked == EagerReason.NO_CUDA and self.config.strict:
            raise RuntimeError(
                f"cgbackend: strict=True but graph {index} computes on "
                f"{analysis.classification.compute_device}"
                f"{'' if torch.cuda.is_available() else ' and this machine has no CUDA device'}: nothing "
                "can be captured and strict forbids running it eagerly; run on CUDA tensors, or set "
                "strict=False (or simulate_graphs=True to test the runtime on CPU)")
        if compiled.blocked == "no_cuda" and not self._no_cuda_logged:
            self._no_cuda_logged = True
            log.info("cgbackend: nothing is captured: the model computes on %s and CUDA graphs need "
                     "CUDA tensors; the split graph runs eagerly", analysis.classification.compute_device)
        return compiled

    # ------------------------------------------------------------------ introspection

    def compiled_graphs(self) -> list[CompiledGraph]:
        return [g for g in (ref() for ref in self._graphs) if g is not None]

    def reset(self) -> None:
        """Forget the graphs compiled so far and zero the counters; ``torch._dynamo.reset()`` calls
        this (Dynamo drops the compiled graphs at the same time). Memory pools stay, for reuse."""
        with self._lock:
            self._graphs.clear()
            self._analyses.clear()
            self.shared.counters.clear()
            self.shared.mirror.reset()
            self._no_cuda_logged = False

    def stats(self) -> dict[str, Any]:
        self.shared.mirror.push(self.shared.counters)
        out = self.shared.counters.to_dict()
        out["pending_forwards"] = sum(g.slots.pending() for g in self.compiled_graphs())
        out["nothing_captured_reason"] = next(
            (g.blocked for g in self.compiled_graphs() if g.blocked is not None), None)
        return out

    def report(self) -> Report:
        """The partition report of every graph this instance compiled, with runtime counters."""
        graphs = []
        for i, g in enumerate(self.compiled_graphs()):
            gr = graph_report(g.analysis, i, graph_break_info(g.analysis.gm))
            gr.runtime = g.runtime_summary()
            if g.blocked is not None:
                gr.notes.append(f"nothing captured: {g.blocked}")
            graphs.append(gr)
        breaks = [b for b in (graph_break_info(g.analysis.gm) for g in self.compiled_graphs()) if b]
        return Report(graphs=graphs, graph_breaks=breaks, summary=summarize(graphs, breaks),
                      config=self.config.to_dict(), opaque_modules=self._opaque_dict())

    def _opaque_dict(self) -> dict[str, Any]:
        return self.opaque.to_dict() if self.opaque is not None else {}

    def build_report(self, extra_breaks: list[dict[str, str]], notes: list[str],
                     analyses: Optional[list] = None, calls: Optional[dict[int, int]] = None) -> Report:
        """The ahead-of-time report of ``analyses`` (default: those kept); ``calls``: graph index ->
        how often it ran in the traced model call (per-call figures count those runs)."""
        report = build_report(self._analyses if analyses is None else analyses, extra_breaks,
                              self.config.to_dict(), notes, runs=calls)
        report.opaque_modules = self._opaque_dict()
        return report


class _ByName:
    """The instances made for ``torch.compile(..., backend="cgbackend")``: one per torch.compile
    call (found through torch's compile wrapper, which calls the entry point), or, where that
    wrapper cannot be found (another torch version), one per distinct ``options``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.instances: list[weakref.ReferenceType[CGBackend]] = []
        self.by_options: dict[str, CGBackend] = {}

    def make(self, options: dict[str, Any]) -> CGBackend:
        instance = CGBackend(**options)
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


_MODE_MESSAGE = ("cgbackend takes no mode= (mode={mode!r} selects Inductor's presets); pass cgbackend "
                 "options instead, e.g. torch.compile(model, backend=\"cgbackend\", "
                 "options={{\"warmup\": 3}}), or use cgbackend.compile(model, warmup=3)")


def dynamo_entry(gm: torch.fx.GraphModule, example_inputs: list, *, options: Optional[dict] = None,
                 mode: Optional[str] = None) -> Callable[..., Any]:
    """What ``torch.compile(model, backend="cgbackend", options={...})`` calls (the
    torch_dynamo_backends entry point). ``options`` are cgbackend's (see cgbackend.Config; unknown
    ones raise ConfigError listing the valid ones); ``mode`` is rejected. torch.compile is lazy, so
    both errors surface at the first call, where Dynamo compiles."""
    if mode is not None:
        raise ConfigError(_MODE_MESSAGE.format(mode=mode))
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
