"""cgbackend: a torch.compile backend that brings CUDA graphs to models that are not fully static.

    torch.compile(model, backend="cgbackend", options={"warmup": 3})  # by name (after import, or entry point)
    cgbackend.compile(model, warmup=3)               # traces data-dependent ops into the graph
    cgbackend.explain(model, *inputs)                # ahead-of-time partition report
    cgbackend.stats(compiled_model)                  # counters
    print(cgbackend.summary(compiled_model))         # the counters as a short table, per region
    cgbackend.warm_up(compiled_model, make_inputs, sizes=[1, 2, 4])  # capture sizes before serving
    help(cgbackend.Config), help(cgbackend.Report)   # every option; the report's fields
"""

import sys as _sys

from ._version import __version__


def _main_arguments() -> "list[str] | None":
    """The arguments of ``python -m cgbackend ...`` while runpy imports this package before it runs
    ``__main__`` (``sys.argv[0]`` is still "-m" then); None for every other import."""
    argv, orig = _sys.argv, list(getattr(_sys, "orig_argv", ()))
    if argv[:1] != ["-m"] or "-m" not in orig or orig[orig.index("-m") + 1:orig.index("-m") + 2] != [__name__]:
        return None
    return argv[1:]


def _only_version_or_help() -> bool:
    """``python -m cgbackend --version``, ``--help`` or ``explain --help`` and nothing else: those
    commands print a few lines and exit, and need neither torch (seconds to import) nor the rest of
    the package. A benchmark command on a machine without CUDA is refused here, after importing
    torch alone (common/machine.py). Every other command, and every
    ``import cgbackend``, loads everything."""
    args = _main_arguments()
    if args is None:
        return False
    from .common.machine import refuse_benchmark_without_cuda  # imports torch only when it refuses
    refuse_benchmark_without_cuda(args)
    return args in (["--version"], ["--help"], ["-h"], ["explain", "--help"], ["explain", "-h"])


if _only_version_or_help():  # __main__.py parses the arguments (cli.py imports no torch) and exits
    __all__ = ["__version__"]
else:
    from .api import backend, compile, find_backend, prepare, report, reset, stats
    from .backend import CGBackend
    from .by_name import register as _register_backend
    from .common.logs import register as _register_logs
    from .common.notices import (CGBackendWarning, MoELoopOutsideGraphWarning, NothingCapturedWarning,
                                 UncompiledCallsWarning)
    from .common.reasons import Reason, Rule
    from .config import Config, ConfigError
    from .frontend.marks import mark_dynamic
    from .frontend.warm_up import WarmUp, warm_up
    from .reporting.explain import ExplainError, explain
    from .reporting.report import Report
    from .reporting.stats_table import summary
    from . import distributed  # the documented public path cgbackend.distributed (track_fsdp, release)

    _register_logs()  # TORCH_LOGS="+cgbackend", torch._logging.set_logs(cgbackend=...) (common/logs.py)
    _register_backend()  # torch.compile(backend="cgbackend") without installed metadata (by_name.py)

    __all__ = ["CGBackend", "CGBackendWarning", "Config", "ConfigError", "ExplainError", "MoELoopOutsideGraphWarning",
               "NothingCapturedWarning",
               "Reason", "Report", "Rule", "backend", "compile", "explain", "find_backend", "mark_dynamic", "prepare",
               "report", "reset", "stats", "summary", "UncompiledCallsWarning", "warm_up", "WarmUp", "__version__"]
