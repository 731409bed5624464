"""A failed trace told in one line that names the user's code, not torch's frames.

Dynamo wraps the error of a model that fails under fake tensors (a shape mismatch, a wrong
argument) in its own exceptions and lists the frames in a ``from user code:`` block, outermost
first, torch's own wrappers (``external_utils.py ... in inner``) among them; an error raised in
code Dynamo left to Python carries the frames in its traceback instead. :func:`tracing_failure`
finds the innermost frame outside torch, cgbackend's runtime and the standard library in either
place, and :func:`quiet_meta_failures` keeps the fake-tensor log record that repeats the same
error as a 20-line traceback out of the user's terminal while explain traces.
"""

from __future__ import annotations

import contextlib
import linecache
import logging
import re
from typing import Any, Iterator, Optional

from ..common.fx_utils import user_function
from ..common.user_code import is_user_file
from .breaks import break_text

__all__ = ["eager_failure", "quiet_meta_failures", "tracing_failure", "user_frame"]

_USER_CODE_BLOCK = re.compile(r"(?:from user code|User stack):\s*\n(?P<block>(?:[ \t]+.*\n?)+)")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')


def _frame(path: str, line: int, name: str) -> dict[str, Any]:
    return {"path": path, "line": line, "function": user_function(name),
            "code": linecache.getline(path, line).strip()}


def _chain(exc: BaseException) -> list[BaseException]:
    chain = [exc]
    while True:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or nxt in chain or len(chain) > 16:
            return chain
        chain.append(nxt)


def user_frame(exc: BaseException) -> Optional[dict[str, Any]]:
    """``{"path", "line", "function", "code"}`` of the user's line the error comes from: the last
    user frame of Dynamo's ``from user code:`` block, else the innermost user frame of a
    traceback in the exception chain; None when every frame is torch's or cgbackend's."""
    chain = _chain(exc)
    for e in chain:
        for block in _USER_CODE_BLOCK.finditer(str(e)):
            frames = [m for m in _FRAME.finditer(block.group("block")) if is_user_file(m.group("file"))]
            if frames:
                last = frames[-1]
                return _frame(last.group("file"), int(last.group("line")), last.group("name"))
    for e in reversed(chain):  # the root cause first
        found = None
        tb = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if is_user_file(code.co_filename):
                found = _frame(code.co_filename, tb.tb_lineno, code.co_name)
            tb = tb.tb_next
        if found is not None:
            return found
    return None


def _where(exc: BaseException) -> str:
    """" at file.py:LINE in function (`code`)" of the user's line ``exc`` comes from, or ""."""
    frame = user_frame(exc)
    if frame is None:
        return ""
    base = frame["path"].replace("\\", "/").rsplit("/", 1)[-1]
    return f" at {base}:{frame['line']} in {frame['function']}" + (f" (`{frame['code']}`)" if frame["code"] else "")


def eager_failure(exc: BaseException) -> str:
    """One line for an error the model raised when run eagerly: its type, first line and the user's line."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}{_where(exc)}"


def tracing_failure(exc: BaseException) -> str:
    """One line for a failed trace: the root error (the innermost of the exception chain, where
    Dynamo's own wrapper hides it), the user's line it comes from and what to try."""
    chain = _chain(exc)
    root = chain[-1]
    where = _where(exc)
    message = str(root)
    lines = message.strip().splitlines()
    text = break_text(message) if "Explanation:" in message else (lines[0] if lines else "")
    bullet = next((line.strip()[2:] for line in message.splitlines()[1:] if line.strip().startswith("- ")), "")
    if bullet:
        text = f"{text} {bullet}"
    if type(root).__name__ == "ConstraintViolationError":
        fix = ("mark the dimensions that must stay equal to it dynamic too ("
               "torch._dynamo.mark_dynamic on each; CLI: --dynamic NAME:DIM for each), or leave it static")
    else:
        fix = "check that the model runs eagerly on these inputs"
    wrapped = f" (inside {type(exc).__name__})" if root is not exc else ""
    return f"tracing the model failed{where}: {type(root).__name__}: {text}{wrapped}; {fix}"


class _DropMetaFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """While explain traces: drop the fake-tensor logger's record of a failed meta kernel (a full
    traceback at ERROR level); the same error reaches the caller as one ExplainError line. Other
    records, and every other logger, are left alone."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    dropper = _DropMetaFailures()
    logger.addFilter(dropper)
    try:
        yield
    finally:
        logger.removeFilter(dropper)
