"""Shared test setup: the ``cuda`` and ``slow`` markers, a Dynamo/cgbackend reset around every test."""

from __future__ import annotations

import gc
import os
import sys

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1) > 1:
    # Inductor compiles kernels in a pool of worker processes (one per core: each a fresh interpreter
    # importing torch) in every process that compiles; with every core taken by a test worker that
    # pool only adds interpreters. Set before torch's Inductor config is first imported (it reads
    # the variable then); processes the tests start inherit it. A value set by the caller is kept.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

# Inductor's CPU kernels without explicit vector code: the tests that run Inductor on a CPU (the
# stand-in for its GPU kernels: region compiles, bf16 rounding, the bench's Inductor contenders)
# check what cgbackend does around the compiled code, not the C++ vectorizer, and scalar loops
# compile faster (with an empty Inductor cache the bf16 routing-flips test took 26 s instead of
# 36 s on a 2-core machine). It changes no GPU kernel. A value set by the caller is kept.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

# glibc's malloc hands every block of 128 KiB or more (a threshold it raises up to 32 MiB as it
# goes) to the kernel and back with mmap/munmap, and gives the top of its heap back past 128 KiB:
# each later allocation then page-faults fresh zeroed pages. Tracing and compiling allocate and free
# such blocks all the time (a tenth of a test worker's CPU time was system time). The processes
# this one starts (the xdist workers, started after this file is loaded, the fresh interpreters and
# gloo ranks of the tests) keep those blocks in the heap: on two files of the runtime and dispatch
# tests, system time went from 9 to 6 s and the run from 64-68 to 56-60 s. glibc reads the
# variable when a process starts; other C libraries ignore it. A value set by the caller is kept.
os.environ.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:"
                      "glibc.malloc.trim_threshold=1073741824:glibc.malloc.top_pad=67108864")

import pytest

# torch (and cgbackend) are imported where a hook or fixture first needs them: under pytest-xdist
# the controlling process loads this file too and runs no test, and importing torch there cost
# about 3 s of CPU while the workers started on the same cores.

# The shared helpers (fx_helpers.py, cuda_utils.py, log_helpers.py) live here; the tests live in folders that
# mirror the package (tests/passes/, tests/runtime/, ...).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _one_core_per_worker() -> None:
    """Under pytest-xdist, each worker's torch (and every process a test starts: fresh interpreters,
    spawned gloo ranks, which inherit the environment) uses the cores left to it, not all of them.
    torch's default is one OpenMP thread per core in every process: two workers on two cores ran
    four threads, and an OpenMP parallel region waits for all of its threads, so each op that
    splits its work waited for a thread the other worker's process held (a scheduler time slice).
    The tests' tiny models gain nothing from a second thread; the runtime tests took 4x longer
    that way, and the gloo ranks' steps 50x (1-3 s per step of a one-layer model). A thread count
    set by the caller (OMP_NUM_THREADS) is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" in sys.modules:  # else torch reads the variable when it is imported
        sys.modules["torch"].set_num_threads(threads)


_one_core_per_worker()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu: needs 2 CUDA GPUs (skipped without them)")
    config.addinivalue_line("markers", "slow: long CPU runs, deselected unless -m selects them (-m slow)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    import torch
    if "slow" not in (config.getoption("markexpr", "") or ""):  # slow tests run only when -m names them
        slow = [item for item in items if "slow" in item.keywords]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if "slow" not in item.keywords]
    if torch.cuda.device_count() < 2:
        two = pytest.mark.skip(reason="needs 2 CUDA GPUs")
        for item in items:
            if "multigpu" in item.keywords:
                item.add_marker(two)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Python's full (generation 2) garbage collections walk every tracked object: after torch,
# transformers, Dynamo and Inductor are imported that is several hundred thousand objects, about 0.2 s
# per collection, and Dynamo's tracing triggers such collections a few hundred times per worker (a
# third of the bench tests' time went there). Objects alive between tests (imported modules, their
# functions and classes) are moved to the permanent generation, which collections skip: after
# collection, and again after a test that imported many modules. Objects a test makes are never
# frozen during that test, so what a test checks about collection (gc.collect(), gc.get_objects(),
# weak references) is unchanged.
_FROZEN_WITH_MODULES = [0]
_REFREEZE_AFTER_MODULES = 30


def _freeze_long_lived() -> None:
    gc.collect()
    gc.freeze()
    _FROZEN_WITH_MODULES[0] = len(sys.modules)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Young collections less often too (700 allocations by default): Dynamo makes objects by the
    # million, most of them short-lived; 10000 and 20 take about a tenth off the bench tests' CPU time.
    gc.set_threshold(10000, 20, 10)
    # Inductor and transformers double the objects alive after import (200k -> 400k); tests load them
    # on each worker anyway, and the first test that does would pay for full collections of them.
    import torch._inductor.compile_fx  # noqa: F401
    try:
        import transformers  # noqa: F401
    except ImportError:
        pass
    _freeze_long_lived()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Every test starts with empty Dynamo caches and no default backend instance."""
    import torch

    import cgbackend
    torch._dynamo.reset()
    cgbackend.reset()
    yield
    torch._dynamo.reset()
    cgbackend.reset()
    if len(sys.modules) > _FROZEN_WITH_MODULES[0] + _REFREEZE_AFTER_MODULES:
        _freeze_long_lived()
