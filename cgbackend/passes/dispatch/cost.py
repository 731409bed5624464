"""The cost model: which static form a dispatch unit takes."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["FORMS", "MODES", "choose_form"]

FORMS = ("masked_dense",)
MODES = ("off", "auto") + FORMS

# "auto" rewrites into masked dense while each expert computes on at most this many rows.
_AUTO_MAX_ROWS = 1 << 16


def choose_form(plan: Any, mode: str) -> tuple[Optional[str], str]:
    """The cost model: masked dense makes every expert compute on every token. "auto" takes it while
    that stays small (launch-bound layers, where the loop's syncs and per-expert gathers cost more
    than the extra FLOPs) and leaves the loop dynamic above the row limit. The limit is a rough
    guess, not a measured crossover."""
    tokens = plan.tokens
    if mode in FORMS:
        return mode, f"{mode} requested (static_dispatch={mode!r})"
    if not isinstance(tokens, int):
        return "masked_dense", "masked dense: token count symbolic, rewritten (no host sync, fixed shapes)"
    if tokens > _AUTO_MAX_ROWS:
        return None, (f"{tokens} rows per expert exceed the masked-dense limit of {_AUTO_MAX_ROWS} "
                      "(every expert would compute on every row); left dynamic")
    return "masked_dense", (f"masked dense: {tokens} rows per expert (limit {_AUTO_MAX_ROWS}); "
                            "no host sync and fixed shapes")


