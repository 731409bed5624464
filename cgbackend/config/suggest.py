""""Did you mean" for a mistyped option name or value: the closest valid one, by difflib."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = ["did_you_mean"]


def did_you_mean(word: Any, choices: Iterable[Any]) -> str:
    """``" (did you mean 'auto'?)"`` for the choice closest to ``word``, or "" when none is close."""
    if not isinstance(word, str):
        return ""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if not close:  # a case slip ("Auto") or a prefix ("induct")
        close = [n for n in names if n.lower() == word.lower() or (len(word) >= 3 and n.startswith(word))][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""
