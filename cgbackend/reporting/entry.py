"""The report's first line: whose partition it shows, ``cgbackend.compile(model)`` or
``torch.compile(model, backend="cgbackend")`` (by name), and how the other differs (from
``Report.traced_via``, filled by explain)."""

from __future__ import annotations

from typing import Any

__all__ = ["ENTRIES", "entry_text"]

ENTRIES = {
    "compile": ("cgbackend.compile(model)", "data-dependent ops traced into the graph",
                "explain without --by-name (Python: by_name=False)"),
    "by_name": ('torch.compile(model, backend="cgbackend")',
                "by name: Dynamo's settings as they are, a graph break at each data-dependent op",
                "explain --by-name (Python: by_name=True)"),
}


def _counts(graphs: int, breaks: int) -> str:
    return f"{graphs} graph{'s' if graphs != 1 else ''}, {breaks} graph break{'s' if breaks != 1 else ''}"


def entry_text(traced_via: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    if not traced_via:
        return []
    entry = traced_via["entry"]
    call, how, _ = ENTRIES[entry]
    if entry == "compile" and not traced_via.get("trace_dynamic_ops", True):
        how = "data-dependent ops left to Dynamo's settings (trace_dynamic_ops=False)"
    line = f"  shows: {call} ({how}): {_counts(summary['graphs'], summary['graph_breaks'])}; "
    other_entry = "by_name" if entry == "compile" else "compile"
    other_call, _, see = ENTRIES[other_entry]
    other = traced_via.get("other")
    if other is not None:
        same = (other["graphs"], other["graph_breaks"]) == (summary["graphs"], summary["graph_breaks"])
        line += (f"{other_call} gives {_counts(other['graphs'], other['graph_breaks'])}"
                 f"{' too' if same else ''}: {see} shows its partition")
    elif traced_via.get("other_may_differ", True):
        why = "data-dependent ops or opaque modules here" if entry == "compile" else "graph breaks here"
        line += (f"{other_call} may differ ({why}): {see} shows its partition, --compare (Python: "
                 "compare=True) counts it here")
    else:
        line += f"{other_call} gives the same partition (no data-dependent op, no graph break)"
    return [line]
