"""The torch build in words, for messages that say why CUDA work cannot run on this machine, and
the benchmarks' refusal to run without CUDA."""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["torch_build", "no_cuda_line", "refuse_benchmark_without_cuda"]


def torch_build() -> str:
    """``"torch 2.13.0+cpu, a CPU-only build"`` or ``"torch 2.13.0, built for CUDA 12.8"``."""
    import torch  # the benchmarks' early refusal (cli.py) imports this module before torch
    build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
    return f"torch {torch.__version__}, {build}"


def no_cuda_line(command: str, smoke: bool) -> str:
    """The one line a benchmark command prints on a machine without CUDA (``smoke``: the command
    has ``--smoke``)."""
    hint = "--smoke runs a short CPU check of every contender, " if smoke else ""
    return (f"cgbackend {command}: no CUDA device ({torch_build()}), and the benchmark "
            f"times CUDA graphs; {hint}--device cpu times on the CPU")


def refuse_benchmark_without_cuda(args: Sequence[str]) -> None:
    """``bench`` and ``serve-bench`` without ``--smoke``, ``--device`` or ``--help`` on a machine
    without CUDA: print :func:`no_cuda_line` and exit 2, having imported torch and nothing else of
    cgbackend (the package imports torch's compiler stack: seconds more). The benchmarks check the
    same again after parsing their flags (bench/settings.py); the package's ``__init__`` calls this
    for ``python -m cgbackend``."""
    if not args or args[0] not in ("bench", "serve-bench"):
        return
    flags = [a.split("=", 1)[0] for a in args[1:] if a.startswith("-")]
    asks = ("--smoke", "--device", "--help")
    if "-h" in flags or any(len(f) > 2 and ask.startswith(f) for f in flags for ask in asks):
        return  # argparse takes a flag's unambiguous prefix too (--dev cpu)
    import torch
    if torch.cuda.is_available():
        return
    print(no_cuda_line(args[0], smoke=args[0] == "bench"), file=sys.stderr)
    raise SystemExit(2)
