"""What static dispatch did to the model before Dynamo traced it, added to a report: the loops the
source rewrite looked at (``loop_rewrites``, with the units each rewritten loop kept a skip for),
the zero gradient of experts that receive no token, and the expert weights laid out as one block."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["annotate_report", "on_cuda_differs"]


def annotate_report(report: Any, loops: Sequence, relayouts: Sequence) -> None:
    """Fill ``report`` (a reporting.report.Report) from ``loops`` (source_rewrite.LoopRewrite
    records) and ``relayouts`` (expert_layout.Relayout records)."""
    kept: dict[str, int] = {}
    for g in report.graphs:
        for s in g.dispatch.get("skipped", ()):
            if s.get("loop"):
                kept[s["loop"]] = kept.get(s["loop"], 0) + 1
    report.loop_rewrites = [dict(r.to_dict(), kept_skips=kept.get(r.source, 0)) if r.form else r.to_dict()
                            for r in loops]
    if any(r.form and r.traced is not False and r.own_expert_params for r in loops) \
            and report.summary.get("dispatch_rewrites"):
        report.summary["unrouted_expert_grads"] = "zero"
        report.notes.append("experts that receive no token get a zero gradient where eager leaves .grad None: "
                            "static dispatch runs the experts of a rewritten dispatch loop also on no rows "
                            "(as grouped-GEMM MoE layers do); warned once at the first backward")
    for r in relayouts:
        report.notes.append(r.describe())
    differ = on_cuda_differs(report)
    if differ:
        shown = ", ".join(f"{n} x {here} -> {there}" for (here, there), n in sorted(differ.items()))
        report.notes.append(f"traced off CUDA: on a CUDA device the cost model would choose other forms for "
                            f"{sum(differ.values())} dispatch unit(s) ({shown}), and the partition there may "
                            "differ; explain --device cuda (Python: inputs and model on a CUDA device) traces "
                            "as the GPU run will")


def on_cuda_differs(report: Any) -> dict[tuple[str, str], int]:
    """(form here, form on CUDA) -> how many rewritten dispatch units of ``report`` would take another
    form on a CUDA device (form_choice.choose_layer_form's ``on_cuda`` figure)."""
    differ: dict[tuple[str, str], int] = {}
    for g in report.graphs:
        for r in g.dispatch.get("rewrites", ()):
            cuda = (r.get("figures") or {}).get("on_cuda")
            if cuda and (cuda["form"] or "dynamic") != r["form"]:
                key = (r["form"], cuda["form"] or "dynamic")
                differ[key] = differ.get(key, 0) + 1
    return differ
