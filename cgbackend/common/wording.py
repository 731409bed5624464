"""Numbers in words for what cgbackend tells people (reports, log lines, warnings): a count and its
noun in the number the count asks for, so no message says "1 graphs"."""

from __future__ import annotations

from typing import Optional

__all__ = ["count"]


def count(n: int, noun: str, nouns: Optional[str] = None) -> str:
    """``"1 graph launch"``, ``"2 graph launches"``: ``n`` and the noun in its number (``nouns``
    where adding "s" or "es" does not make the plural)."""
    if n == 1:
        return f"{n} {noun}"
    if nouns is None:
        nouns = noun + ("es" if noun.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n} {nouns}"
