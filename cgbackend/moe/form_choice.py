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

The rates come from ``costs.json`` beside this file: one set per GPU, by the name
``torch.cuda.get_device_name`` gives, measured on that GPU by ``benchmarks/dispatch_costs.py
--constants-only`` (which adds or replaces its own device's set; without ``--constants-only`` it
also times the forms directly, for the crossover table in docs/static-dispatch.md). A GPU with no
set of its own takes the reference device's (``REFERENCE_DEVICE``, the H100 the crossover table
was measured on); the report's ``source`` names the set used and the device it stands in for. The
H100 and the H200 have sets of their own (the H200's measured on 2026-11-28, 41 s). Without the file the defaults below stand, and the report
says so. On a device other than CUDA nothing is captured, so "auto" keeps the old rule
there: masked dense up to ``_AUTO_MAX_ROWS`` rows per expert (the CPU tests exercise the forms
through the explicit modes).
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Optional

import torch

from ..config.dispatch_mode import GROUPED_FORMS, DispatchMode

__all__ = ["FORMS", "GROUPED_FORMS", "REFERENCE_DEVICE", "choose_form", "choose_layer_form", "constants",
           "current_device_name", "estimate", "measured_sets", "use_measured"]

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

REFERENCE_DEVICE = "NVIDIA H100 80GB HBM3"
"""The GPU whose constants stand in for a GPU that has none of its own in costs.json."""

COSTS_PATH = os.path.join(os.path.dirname(__file__), "costs.json")


def measured_sets(path: Optional[str] = None) -> dict[str, dict]:
    """costs.json's constants by device name: ``{"devices": {name: {...}}}`` (a file holding one
    device's constants at the top level, as written before there were several, counts as that
    device's). Empty when there is no readable file."""
    try:
        with open(path or COSTS_PATH, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    if isinstance(doc.get("devices"), dict):
        return dict(doc["devices"])
    return {doc.get("device", REFERENCE_DEVICE): doc} if doc else {}


def current_device_name(device: Any = None) -> Optional[str]:
    """``torch.cuda.get_device_name`` of ``device`` (the current CUDA device by default), or None
    off CUDA."""
    if device is not None and torch.device(device).type != "cuda":
        return None
    if device is None and not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


def constants(device_name: Optional[str] = None) -> dict[str, Any]:
    """The cost model's constants for the GPU named ``device_name`` (default: the current CUDA
    device; off CUDA, the reference device's), with ``source`` saying which set they are."""
    return _constants(device_name if device_name is not None else current_device_name())


@functools.lru_cache(maxsize=8)
def _constants(device_name: Optional[str]) -> dict[str, Any]:
    values = dict(_DEFAULTS)
    if _measured_override is not None:
        measured, note = dict(_measured_override), ""
    else:
        sets = measured_sets()
        if not sets:
            return values
        if device_name in sets:
            measured, note = sets[device_name], ""
        else:
            stand_in = REFERENCE_DEVICE if REFERENCE_DEVICE in sets else next(iter(sets))
            measured = sets[stand_in]
            note = f"; standing in for {device_name}, not measured" if device_name else ""
    values.update({k: v for k, v in measured.items() if k in _DEFAULTS or k in ("device", "date", "torch")})
    values["rate_by_rows"] = {kind: {int(m): float(r) for m, r in table.items()}
                              for kind, table in values.get("rate_by_rows", {}).items()}
    values["source"] = f"measured ({measured.get('device', '?')}, {measured.get('date', '?')}; costs.json{note})"
    return values


def use_measured(measured: Optional[dict]) -> None:
    """Estimate with ``measured`` (constants just measured: benchmarks/dispatch_costs.py) on every
    device, or (None) with costs.json's sets again."""
    global _measured_override
    _measured_override = measured
    _constants.cache_clear()


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
             stack_bytes: int, small_batch: bool = False, device_name: Optional[str] = None) -> dict[str, float]:
    """Estimated microseconds of each way to run one layer (see the module docstring) on the GPU
    named ``device_name`` (default: the current one); the small-batch form's only with
    ``small_batch`` (a layer that needs no gradient)."""
    c = constants(device_name)
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
                      device_name: Optional[str] = None,
                      native_on_cuda: Optional[bool] = None) -> tuple[Optional[str], str, dict]:
    """Form for a layer of where-loop units that can take the grouped form (grouped.Layer).
    ``native``: torch._grouped_mm applies (else "auto" does not pick grouped: its stand-in gathers a
    weight matrix per row, fine for tests, not for speed). ``needs_grad``: the layer's output needs
    a gradient (then "auto" does not weigh the small-batch form). ``device_name``: the GPU whose
    constants apply (default: the current CUDA device's).

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
                   small_batch=not needs_grad, device_name=device_name)
    if not native:
        est.pop("grouped")
    figures["estimate_us"] = {f: round(v, 1) for f, v in est.items()}
    figures["constants"] = constants(device_name)["source"]
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
