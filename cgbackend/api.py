"""Public entry points: backend(), compile(), stats(), report(), reset()."""

from __future__ import annotations

from typing import Any, Optional

import torch

from .backend import CGBackend
from .by_name import by_name_backends, find_backend, reset_default_backend
from .config import Config
from .config.suggest import check_callable
from .frontend.compile_model import compile_model
from .frontend.tracing import dynamic_ops_config
from .integrations import opaque
from .reporting.report import Report

__all__ = ["backend", "compile", "prepare", "stats", "report", "find_backend", "dynamic_ops_config", "reset"]


def backend(**options: Any) -> CGBackend:
    """A configured backend instance: ``torch.compile(model, backend=cgbackend.backend(warmup=2))``.

    Unknown options raise ConfigError listing the valid ones (see cgbackend.Config)."""
    return CGBackend(**options)


def prepare(model: torch.nn.Module) -> opaque.InstallResult:
    """Make the modules of ``model`` that Dynamo cannot trace but cgbackend knows (Transformer
    Engine's) one opaque graph call each, for ``torch.compile(model, backend="cgbackend")``;
    ``cgbackend.compile`` does this itself. Returns what was wrapped and what was left alone (with
    why). ``cgbackend.integrations.opaque.uninstall(model)`` undoes it; eager calls behave the same either way."""
    return opaque.install(model)


def compile(model: Any, *, dynamic: Optional[bool] = None, fullgraph: bool = False,
            **options: Any) -> Any:
    """``torch.compile`` with a fresh cgbackend instance, tracing data-dependent ops into the graph.

    Dynamo's ``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` are switched on
    while Dynamo compiles a frame of a call of the returned model (never globally; see
    ``CompileScope``), so a dropless MoE arrives as one graph
    and cgbackend decides what runs eagerly. Returns what torch.compile returns; cgbackend.stats()
    and cgbackend.report() accept it. With static dispatch, the dispatch loops it rewrites live on
    the returned wrapper: ``model`` and its modules keep their own methods (moe/loop_forwards.py).
    """
    check_callable(model, "cgbackend.compile")
    compiled, _ = compile_model(model, Config.from_options(options), dynamic=dynamic, fullgraph=fullgraph)
    return compiled


def stats(obj: Any = None) -> dict[str, Any]:
    """Counters of the backend behind ``obj``: regions, graphs captured, replays, eager calls by
    reason, copies made/avoided, output clones, pool bytes, capture time. See runtime.stats.

    Without ``obj``: every model compiled by name (``backend="cgbackend"``) in this process, added
    up. The same numbers, summed over all instances, are in
    ``torch._dynamo.utils.counters["cgbackend"]``."""
    if obj is None:
        return _sum_stats([b.stats() for b in by_name_backends()])
    return find_backend(obj).stats()


def _sum_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    from .runtime.stats import Counters
    total = Counters().to_dict()
    total.update(pending_forwards=0, nothing_captured_reason=None, captured_sizes={}, memory={})
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                _add_dict(total[key], value)
            elif isinstance(value, list):
                total[key] = total[key] + value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] += value
            elif total.get(key) is None:
                total[key] = value
    return total


def _add_dict(into: dict, part: dict) -> None:
    """Add ``part``'s numbers into ``into``, key by key, nested dicts (memory by size) too."""
    for k, v in part.items():
        if isinstance(v, dict):
            _add_dict(into.setdefault(k, {}), v)
        else:
            into[k] = into.get(k, 0) + v


def report(obj: Any = None) -> Report:
    """Partition report of everything the backend behind ``obj`` compiled, with runtime counters
    (a :class:`cgbackend.Report`; its fields: ``help(cgbackend.Report)``, the JSON Schema
    ``cgbackend/reporting/report.schema.json``; the data classes are in
    ``cgbackend.reporting.report``, the text renderer in ``cgbackend.reporting.text``)."""
    return find_backend(obj).report()


def reset() -> None:
    """Forget the backend instances made by name (their graphs stay alive as long as Dynamo's
    caches hold them); ``torch._dynamo.reset()`` drops those and zeroes every instance's counters."""
    for instance in by_name_backends():
        instance.reset()
    reset_default_backend()
