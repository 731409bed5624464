"""Dynamo's graph breaks as cgbackend reports them: the full reason (each break's first line and
explanation, the nested one of a skipped frame included) and the user's source line.

Three places hold them, and each misses some: the graph Dynamo hands over
(``compile_subgraph_reason``: breaks that end a graph), ``counters["graph_break"]`` (breaks that
resume in a new graph) and ``counters["unimplemented"]`` (every unsupported construct, including
a break inside a loop, after which Dynamo skips the whole frame and compiles nothing of it; on
torch 2.13 that one is in no other place).
"""

from __future__ import annotations

import linecache
import re
from typing import Any, Optional

from ..common.fx_utils import user_function

__all__ = ["break_text", "code_of_stack", "frame_skipped", "skipped_frame_source", "source_of_stack"]

_NESTED = "*** While handling this graph break, another graph break occurred: ***"
_SKIP_MARKERS = ("frame skipped:", "Skipping the frame", "Skipping frame")
_FRAME_RE = re.compile(r"frame skipped: (?P<name>[\w<>.]+) \((?P<file>.+) line (?P<line>\d+)\)")


_TERSE = {
    "generic_jump": ("a Python branch on a tensor's value (an `if` or `while` whose condition is a tensor): "
                     "Dynamo cannot trace control flow that depends on tensor data, so the graph ends here and "
                     "the branch runs in Python after a host sync; to keep one graph, compute both sides and "
                     "pick with torch.where, or use torch.cond"),
}
"""Dynamo's graph-ending reasons that come without an explanation (its internal instruction names),
by their first word, told in words."""


def break_text(message: str) -> str:
    """One line: each break's headline and its ``Explanation:``, nested breaks joined by "; then ";
    a terse internal reason (``generic_jump TensorVariable()``) explained, with Dynamo's own words
    kept in brackets."""
    words = str(message).strip().split(" ", 1)
    if words and words[0] in _TERSE:
        return f"{_TERSE[words[0]]} [Dynamo: {str(message).strip()}]"
    parts = []
    for section in str(message).split(_NESTED):
        lines = [line.strip() for line in section.strip().splitlines() if line.strip()]
        if not lines:
            continue
        text = lines[0]
        explanation = next((line[len("Explanation:"):].strip() for line in lines[1:]
                            if line.startswith("Explanation:")), "")
        if explanation:
            text = f"{text}: {explanation}"
        parts.append(text)
    return "; then ".join(parts)


def frame_skipped(message: str) -> bool:
    """Did this unsupported construct make Dynamo skip the whole frame (run it eagerly)?"""
    return any(marker in message for marker in _SKIP_MARKERS)


def skipped_frame_source(message: str) -> str:
    """"file.py:LINE in function" of the skipped frame named in Dynamo's message, or ""."""
    match = _FRAME_RE.search(message)
    if match is None:
        return ""
    filename = match.group("file").replace("\\", "/").rsplit("/", 1)[-1]
    return f"{filename}:{match.group('line')} in {match.group('name')}"


def source_of_stack(stack: Optional[list[Any]]) -> str:
    """"file.py:LINE in function" of the innermost user frame of a Dynamo user stack."""
    if not stack:
        return ""
    frame = stack[-1]
    filename = str(frame.filename).replace("\\", "/").rsplit("/", 1)[-1]
    return f"{filename}:{frame.lineno} in {user_function(frame.name)}"


def code_of_stack(stack: Optional[list[Any]]) -> str:
    """The line of code of the innermost frame of a Dynamo user stack, or ""."""
    if not stack:
        return ""
    frame = stack[-1]
    return (getattr(frame, "line", None) or linecache.getline(str(frame.filename), frame.lineno) or "").strip()
