"""The cost model: which static form a dispatch unit or layer takes.

Four ways to run a MoE layer, each estimated as ``max(FLOPs / rate, bytes / bandwidth) + fixed``:

* ``masked_dense``: every expert on every token: ``E * T`` rows of expert FLOPs; reads all E
  experts' weights; a few kernels.
* ``grouped``: ``T * k`` rows (the routed ones) through grouped products; reads the weights of the
  experts that got rows (expected under uniform routing); a sort, gathers and a scatter (a fixed
  cost for their launches and ``routing_row_ns`` per routed row); plus, for experts kept as
  separate modules, the stacking copy of every expert weight (read and written) on every call.
* ``dynamic``: the loop left as written: ``T * k`` rows, the hit experts' weights, and per expert a
  host sync and its launches, eagerly (``loop_expert_us``).
* ``small_batch``: the grouped form's routing, each of the ``T * k`` rows multiplied by its own
  expert's weights without grouping (a per-row reduction kernel): it reads one expert's weights per
  row (``T * k * per-expert bytes`` at the rate ``small_gbs`` measured for that kernel), plus its
  fixed cost (``small_fixed_us``) and the routing's per-row cost. For decode's few rows per
  expert. Weighed for inference only: its backward would scatter a weight gradient per row, so a
  layer that needs gradients never takes it under "auto".

The rates come from ``costs.json`` beside this file, measured on a GPU by
``benchmarks/dispatch_costs.py`` (which also times the forms directly, for the crossover table
in docs/static-dispatch.md); without that file the defaults below stand, and the report says
which were used. On a device other than CUDA nothing is captured, so "auto" keeps the old rule
there: masked dense up to ``_AUTO_MAX_ROWS`` rows per expert (the CPU tests exercise the forms
through the explicit modes).
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Optional

from ..config.dispatch_mode import GROUPED_FORMS, DispatchMode

__all__ = ["FORMS", "GROUPED_FORMS", "choose_form", "choose_layer_form", "constants", "estimate"]

FORMS = ("masked_dense",) + GROUPED_FORMS
"""The static forms (GROUPED_FORMS: those built from the grouped routing, grouped.py: where-loop
layers, folded loops)."""

# Off CUDA, "auto" rewrites into masked dense while each expert computes on at most this many rows.
_AUTO_MAX_ROWS = 1 << 16

_DEFAULTS = {
    "source": "defaults (no costs.json measured for this package)",
    "dense_tflops": 500.0,       # bf16 matrix products of MoE-expert shapes
    "grouped_tflops": 350.0,     # torch._grouped_mm over the routed rows
    "bandwidth_gbs": 2500.0,     # device memory, read + write counted
    "masked_fixed_us": 15.0,     # per expert: its few kernels in the graph
    "grouped_fixed_us": 60.0,    # sort, bincount, cumsum, gathers, scatter: their launches
    "routing_row_ns": 5.0,       # the routing's work per routed row (sort, gathers, scatter)
    "rate_by_rows": {},          # {"dense"|"grouped": {rows per product: TFLOP/s}}, measured
    "loop_expert_us": 70.0,      # per expert: where + host sync + gather + launches + index_add
    "small_fixed_us": 40.0,      # small batch: sort, gathers, scatter, its three kernels
    "small_gbs": 2500.0,         # small batch: expert weights read per routed row
}


_measured_override: Optional[dict] = None
"""Set by benchmarks/dispatch_costs.py to estimate with the constants it just measured."""


@functools.lru_cache(maxsize=1)
def constants() -> dict[str, Any]:
    path = os.path.join(os.path.dirname(__file__), "costs.json")
    values = dict(_DEFAULTS)
    try:
        if _measured_override is not None:
            measured = dict(_measured_override)
        else:
            with open(path, encoding="utf-8") as f:
                measured = json.load(f)
    except (OSError, ValueError):
        return values
    values.update({k: v for k, v in measured.items() if k in _DEFAULTS or k in ("device", "date", "torch")})
    values["rate_by_rows"] = {kind: {int(m): float(r) for m, r in table.items()}
                              for kind, table in values.get("rate_by_rows", {}).items()}
    values["source"] = f"measured ({measured.get('device', '?')}, {measured.get('date', '?')}; costs.json)"
    return values


def _hint(size: Any) -> Optional[int]:
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if isinstance(hint, int) else None


def _rate(c: dict, kind: str, rows: float) -> float:
    """TFLOP/s of a product of ``rows`` rows: the measured table, interpolated in log(rows) and held
    flat outside it; the flat default where nothing was measured."""
    table = sorted(c.get("rate_by_rows", {}).get(kind, {}).items())
    if not table:
        return c["dense_tflops" if kind == "dense" else "grouped_tflops"]
    if rows <= table[0][0]:
        return table[0][1]
    for (m0, r0), (m1, r1) in zip(table, table[1:]):
        if rows <= m1:
            f = (math.log(rows) - math.log(m0)) / (math.log(m1) - math.log(m0))
            return r0 + f * (r1 - r0)
    return table[-1][1]


def estimate(tokens: int, experts: int, k: int, flops_per_row: int, weight_bytes: int,
             stack_bytes: int, small_batch: bool = False) -> dict[str, float]:
    """Estimated microseconds of each way to run one layer (see the module docstring); the
    small-batch form's only with ``small_batch`` (a layer that needs no gradient)."""
    c = constants()
    per_group = max(tokens * k / max(experts, 1), 1.0)
    bw = c["bandwidth_gbs"] * 1e3          # bytes per microsecond
    # experts that get a row, expected under uniform routing (each token picks k distinct experts)
    hit = experts * (1.0 - (1.0 - min(k, experts) / experts) ** tokens) if experts else 0.0
    routing = tokens * k * c["routing_row_ns"] / 1e3
    per_expert_bytes = weight_bytes / max(experts, 1)

    def t(flops: float, tflops: float, nbytes: float) -> float:
        return max(flops / (tflops * 1e6), nbytes / bw)

    routed = tokens * k * flops_per_row
    forms = {
        "masked_dense": (t(experts * tokens * flops_per_row, _rate(c, "dense", tokens), weight_bytes)
                         + experts * c["masked_fixed_us"]),
        "grouped": (t(routed, _rate(c, "grouped", per_group), hit * per_expert_bytes) + 2 * stack_bytes / bw
                    + c["grouped_fixed_us"] + routing),
        "dynamic": (t(routed, _rate(c, "dense", per_group), hit * per_expert_bytes)
                    + experts * c["loop_expert_us"]),
    }
    if small_batch:
        forms["small_batch"] = (tokens * k * per_expert_bytes / (c["small_gbs"] * 1e3) + 2 * stack_bytes / bw
                                + c["small_fixed_us"] + routing)
    return forms


def choose_layer_form(layer: Any, mode: DispatchMode, device_type: str, itemsize: int,
                      native: bool = True, needs_grad: bool = True,
                      native_on_cuda: Optional[bool] = None) -> tuple[Optional[str], str, dict]:
    """Form for a layer of where-loop units that can take the grouped form (grouped.Layer).
    ``native``: torch._grouped_mm applies (else "auto" does not pick grouped: its stand-in gathers a
    weight matrix per row, fine for tests, not for speed). ``needs_grad``: the layer's output needs
    a gradient (then "auto" does not weigh the small-batch form).

    Off CUDA, "auto" leaves the layer to the per-unit rule, and ``figures["on_cuda"]`` says what a
    CUDA run of the same layer would choose (``native_on_cuda``: whether torch._grouped_mm would
    apply there; default ``native``), so a report traced on the CPU shows where a GPU run differs."""
    n, k = layer.experts, layer.k
    weight_bytes = n * (layer.flops_per_row // 2) * itemsize
    tokens = _hint(layer.tokens)
    figures: dict[str, Any] = {"experts": n, "k": k, "tokens": tokens, "flops_per_row": layer.flops_per_row,
                               "stack_bytes_per_call": layer.stack_bytes}
    copy = (f"; stacks the {n} experts' weights on every call ({layer.stack_bytes / 2**20:.1f} MiB copied)"
            if layer.stack_bytes else "")
    requested = mode.requested_form
    if requested in GROUPED_FORMS:
        return requested, f"{requested} requested (static_dispatch={requested!r}){copy}", figures
    if mode is DispatchMode.MASKED_DENSE:
        return requested, f"{requested} requested (static_dispatch={requested!r})", figures
    if device_type != "cuda" or tokens is None:
        if device_type != "cuda" and tokens is not None:
            on_cuda = native if native_on_cuda is None else native_on_cuda
            form, why, cuda_figures = choose_layer_form(layer, mode, "cuda", itemsize, on_cuda, needs_grad)
            figures["on_cuda"] = {"form": form, "why": why, "estimate_us": cuda_figures.get("estimate_us")}
        return None, "", figures  # the per-unit rule decides (choose_form)
    est = estimate(tokens, n, k, layer.flops_per_row, weight_bytes, layer.stack_bytes,
                   small_batch=not needs_grad)
    if not native:
        est.pop("grouped")
    figures["estimate_us"] = {f: round(v, 1) for f, v in est.items()}
    figures["constants"] = constants()["source"]
    best = min(est, key=est.get)
    text = ", ".join(f"{f} {v:.0f} us" for f, v in est.items())
    if best == "dynamic":
        return "dynamic", f"left dynamic by the cost model ({tokens} tokens: {text})", figures
    return best, f"{best.replace('_', ' ')} by the cost model ({tokens} tokens, {n} experts top-{k}: {text}){copy}", figures


def choose_form(plan: Any, mode: DispatchMode) -> tuple[Optional[str], str]:
    """Form of a unit outside a grouped layer (sorted_split, grouped_mm_fallback, a where loop the
    grouped form cannot take): masked dense or left dynamic. Off CUDA, "auto" takes masked dense
    while it stays under the row limit, a rule of thumb rather than a measured crossover."""
    tokens = plan.tokens
    requested = mode.requested_form
    if mode is DispatchMode.MASKED_DENSE:
        return requested, f"{requested} requested (static_dispatch={requested!r})"
    if requested in GROUPED_FORMS:
        return "masked_dense", (f"masked dense: the {requested.replace('_', '-')} form takes layers of "
                                f"where-loop units only (this unit is {plan.pattern})")
    if not isinstance(tokens, int):
        return "masked_dense", "masked dense: token count symbolic, rewritten (no host sync, fixed shapes)"
    if tokens > _AUTO_MAX_ROWS:
        return None, (f"{tokens} rows per expert exceed the masked-dense limit of {_AUTO_MAX_ROWS} "
                      "(every expert would compute on every row); left dynamic")
    return "masked_dense", (f"masked dense: {tokens} rows per expert (limit {_AUTO_MAX_ROWS}); "
                            "no host sync and fixed shapes")
