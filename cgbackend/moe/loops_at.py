"""The MoE dispatch loops of the function that holds a source line: for a graph break or a skipped
frame Dynamo names by file and line, which dispatch loops (those static dispatch's loop rewrite
recognizes: source_rewrite.py) it leaves outside the graphs. Read from the file's source, with no
function object at hand (the backend used by name never sees the model)."""

from __future__ import annotations

import ast
import copy
import functools
import linecache
from typing import Optional

from .source_rewrite import LoopRewrite, loop_records

__all__ = ["dispatch_loops_at"]


@functools.lru_cache(maxsize=64)
def _tree(filename: str) -> Optional[ast.Module]:
    text = "".join(linecache.getlines(filename))
    if "for " not in text:
        return None
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):
        return None


def _innermost_function(tree: ast.Module, line: int) -> Optional[ast.FunctionDef]:
    found = None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if found is None or node.lineno >= found.lineno:
                found = node
    return found


def dispatch_loops_at(filename: str, line: int) -> list[LoopRewrite]:
    """The loops of the function holding ``filename:line`` that static dispatch's loop rewrite
    would turn into fixed-length loops (``form`` set), in source order; [] where there is none or
    the source cannot be read."""
    tree = _tree(filename)
    if tree is None:
        return []
    fdef = _innermost_function(tree, line)
    if fdef is None:
        return []
    records = loop_records(copy.deepcopy(fdef), filename, fdef.name)  # it rewrites what it reads
    return [r for r in records if r.form]
