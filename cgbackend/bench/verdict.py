"""Telling a tie from a win or a loss.

Two contenders with the same device work can come out several percent apart from one run to the
next, so a ratio of medians alone cannot say "faster". Three figures help (benchmarks/README.md):

* per-block paired ratios: a case's contenders are timed in alternating blocks, so the ratio of two
  contenders' medians within one block cancels slow drifts of the machine; a row's
  ``ratio_to_<ref>_blocks`` lists them, one per block both ran in;
* a twin (``--twin NAME``): a second, independent instance of one contender, timed in the same
  blocks; how far it lands from its original (``harness_spread``) is the harness's own resolution
  for that case;
* ``verdict_<ref>``: ``tie`` where the per-block ratios span 1.0 or the ratio is within the twin's
  spread of 1.0, else ``faster`` or ``slower``.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Optional, Sequence

from .contenders import CONTENDERS, Contender

TWIN_SUFFIX = ":twin"
"""A twin's contender name is its original's with this suffix (``cgbackend:twin``)."""


def twin_name(name: str) -> str:
    return name + TWIN_SUFFIX


def original_name(name: str) -> str:
    """The contender a (twin's) name stands for: ``cgbackend:twin`` -> ``cgbackend``."""
    return name[:-len(TWIN_SUFFIX)] if name.endswith(TWIN_SUFFIX) else name


def contender_named(name: str) -> Contender:
    """The contender of a row name: a twin (``NAME:twin``, ``--twin``) is a second, independent
    instance of NAME under its own name."""
    original = CONTENDERS[original_name(name)]
    return original if name == original.name else dataclasses.replace(original, name=name)


def block_medians(times: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """The median of each block of ``times``, the blocks being consecutive runs of ``sizes`` entries
    (empty blocks left out)."""
    out, start = [], 0
    for n in sizes:
        if n > 0:
            out.append(statistics.median(times[start:start + n]))
        start += n
    return out


def block_ratios(row: dict[str, Any], ref: dict[str, Any]) -> Optional[list[float]]:
    """``row``'s median over ``ref``'s in each alternating block both were timed in (same
    ``block_ids``), in block order; None where either has no blocks (sequential timing, decode
    rows, rows of older runs) or they share none."""
    ids, meds = row.get("block_ids"), row.get("block_medians_ms")
    ref_ids, ref_meds = ref.get("block_ids"), ref.get("block_medians_ms")
    if not (ids and meds and ref_ids and ref_meds):
        return None
    theirs = dict(zip(ref_ids, ref_meds))
    ratios = [m / theirs[i] for i, m in zip(ids, meds) if i in theirs and theirs[i] > 0]
    return ratios or None


def verdict(ratio: Optional[float], blocks: Optional[Sequence[float]] = None,
            spread: Optional[float] = None) -> Optional[str]:
    """``tie``, ``faster`` or ``slower`` for a ratio of medians (below 1: faster than the reference).

    Tie when the interval the per-block ratios span contains 1.0, or when ``|ratio - 1|`` is at most
    the harness's spread (a twin ran); otherwise the side of 1.0 the blocks (else the ratio) fall on.
    None without a ratio, or with neither blocks nor a spread to judge by."""
    if ratio is None or (not blocks and spread is None):
        return None
    if blocks and min(blocks) <= 1.0 <= max(blocks):
        return "tie"
    if spread is not None and abs(ratio - 1.0) <= spread:
        return "tie"
    side = max(blocks) if blocks else ratio
    return "faster" if side < 1.0 else "slower"


def twin_spread(group: Sequence[dict[str, Any]]) -> Optional[float]:
    """The harness's resolution for one case: over every twin that ran beside its original, the
    largest ``|twin / original - 1|`` of their per-block ratios (of their medians where they share no
    block, as under ``--timing sequential``); None without a twin."""
    ok = {r["contender"]: r for r in group if r.get("error") is None and r.get("median_ms")}
    spread = None
    for name, twin in ok.items():
        original = ok.get(original_name(name)) if name != original_name(name) else None
        if original is None:
            continue
        ratios = block_ratios(twin, original) or [twin["median_ms"] / original["median_ms"]]
        worst = max(abs(r - 1.0) for r in ratios)
        spread = worst if spread is None else max(spread, worst)
    return spread


def put_verdicts(group: Sequence[dict[str, Any]], refs: dict[str, Optional[dict[str, Any]]]) -> None:
    """For each reference ``key`` -> its row in ``refs`` (None where it did not run), each row of the
    case with a ``ratio_to_<key>`` gets ``ratio_to_<key>_blocks`` and ``verdict_<key>``; every row
    gets the case's ``harness_spread``."""
    spread = twin_spread(group)
    for r in group:
        r["harness_spread"] = spread
        for key, ref in refs.items():
            ratio = r.get(f"ratio_to_{key}")
            blocks = block_ratios(r, ref) if ratio is not None and ref is not None else None
            r[f"ratio_to_{key}_blocks"] = blocks
            r[f"verdict_{key}"] = verdict(ratio, blocks, spread)


def verdict_cell(ratio_text: str, row: dict[str, Any], key: str) -> str:
    """A rendered ratio with its verdict, ``1.02 (tie)``; the ratio alone where the row has none
    (rows of older runs)."""
    v = row.get(f"verdict_{key}")
    return f"{ratio_text} ({v})" if v and ratio_text != "-" else ratio_text
