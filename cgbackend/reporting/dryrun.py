"""Option ``dryrun``: the partition report of each graph, shown once when Dynamo hands the graph
to the backend (inside the model's first call that reaches it), while the model runs as compiled.

``dryrun=True`` logs the text report of that graph at WARNING on the ``cgbackend.dryrun`` logger:
without any logging set up Python's last-resort handler prints it to stderr, and an application
that configures logging routes or silences it as any other warning. ``dryrun="path.json"`` writes
the JSON report of every graph this backend instance compiled so far to that file (rewritten at
each new graph) and logs one line naming it. Torch-TensorRT's ``dryrun`` shows its partition the
same way; unlike it, cgbackend runs the model afterwards (``capture=False`` runs it all eagerly).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from .hints import build_hints
from .report import Report, graph_report, summarize

__all__ = ["DryRun"]

log = logging.getLogger("cgbackend.dryrun")  # the name the option's docs give


class DryRun:
    """The graphs one backend instance showed (its ``dryrun`` option)."""

    def __init__(self, target: Any) -> None:
        self.target = target
        self.graphs: list = []
        self.breaks: list[dict[str, str]] = []
        self.analyses: list = []

    def show(self, analysis: Any, index: int, break_info: Optional[dict[str, str]], config: Any) -> Report:
        """Show graph ``index`` (once: each graph is handed over once); returns the report shown."""
        self.graphs.append(graph_report(analysis, index, break_info))
        self.analyses.append(analysis)
        if break_info:
            self.breaks.append(break_info)
        if isinstance(self.target, str):
            report = self._report(self.graphs, self.breaks, self.analyses, config)
            with open(self.target, "w", encoding="utf-8") as f:
                f.write(report.to_json())
            log.warning("cgbackend dry run: graph %d's partition report written to %s (%d graph(s) so far); "
                        "the model runs as compiled", index, self.target, len(self.graphs))
            return report
        report = self._report(self.graphs[-1:], [break_info] if break_info else [], [analysis], config)
        log.warning("cgbackend dry run: graph %d, at its first call (the model runs as compiled)\n%s",
                    index, report.to_text())
        return report

    @staticmethod
    def _report(graphs: list, breaks: list, analyses: list, config: Any) -> Report:
        report = Report(graphs=list(graphs), graph_breaks=list(breaks), summary=summarize(graphs, breaks),
                        config=config.to_dict())
        report.hints = build_hints(report, analyses, config)
        return report
