"""``python -m cgbackend ARGS`` for several ARGS in one fresh interpreter (an interpreter start and the
torch import cost about 3 s of CPU each; the suite's time limit counts them).

Each run is what ``-m`` does: runpy runs the package's ``__main__`` afresh with ``sys.argv`` set.
Output is captured at the file-descriptor level (stdout and stderr redirected to files around each
run), so whatever reaches the process's streams is seen, not only what Python code writes to
``sys.stdout``: a logging handler bound to the original stream, C++ log lines. The first run starts
in a fresh interpreter; later ones share what the earlier ones imported or configured, so a check
that needs a fresh interpreter of its own (warnings logged once per process) runs alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from typing import Optional, Sequence

_DRIVER = """
import json, os, runpy, sys, tempfile
results = []
for args in json.loads(sys.argv[1]):
    sys.argv = [sys.argv[0]] + args
    code = 0
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            runpy.run_module("cgbackend", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = exc.code or 0
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results.append({"returncode": code, "stdout": out.read(), "stderr": err.read()})
sys.stdout.write(json.dumps(results))
"""


def run_programs(arg_lists: Sequence[Sequence[str]], cwd: Optional[str] = None,
                 env: Optional[dict] = None, timeout: float = 300) -> list[types.SimpleNamespace]:
    """One namespace (``returncode``, ``stdout``, ``stderr``) per entry of ``arg_lists``, in order.
    ``env`` replaces the environment (default: this one without ``CGBACKEND_*`` settings)."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CGBACKEND_")}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([list(a) for a in arg_lists])],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [types.SimpleNamespace(**run) for run in json.loads(proc.stdout)]
