"""The Dynamo backend: (GraphModule, example_inputs) -> callable.

``CGBackend(**options)`` (or ``CGBackend(config)``) is one backend instance: it owns the memory
pools, the counters and the compiled graphs it made; everything it is told (options, what
``cgbackend.compile`` / ``explain`` did to the model) comes through its constructor. ``torch.compile(model,
backend="cgbackend", options={...})`` (the ``torch_dynamo_backends`` entry point)
makes one instance per ``torch.compile`` call, configured by ``options``;
``cgbackend.backend(...)`` and ``cgbackend.compile(...)`` make separate instances
too. ``torch._dynamo.reset()`` (``torch.compiler.reset()``) resets every instance's
counters along with Dynamo's caches.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx

from .passes.pipeline import Analysis, analyze
from .reporting.breaks import break_text, code_of_stack, source_of_stack
from .common import progress
from .config import Config
from .reporting.dryrun import DryRun
from .frontend.tracing import is_data_dependent, trace_scope_missed
from .reporting.coverage import runtime_launches
from .reporting.hints import build_hints
from .frontend.prepare import Prepared
from .moe.loop_forwards import mark_traced
from .moe.report_notes import annotate_report
from .runtime.region_timer import RegionTimer
from .reporting.report import Report, build_report, graph_report, summarize
from .runtime.executor import CompiledGraph
from .runtime.memory import memory_of
from .runtime.capture_watch import CaptureWatch
from .runtime.mirror import CounterMirror
from .runtime.release import finalizer, release_graphs
from .runtime.shared import RuntimeShared
from .runtime.stats import Counters
from .common.reasons import EagerReason
from .common.wording import count
from .frontend.as_written import AsWritten
from .frontend.uncompiled import UncompiledCalls
from .reporting import structured
from .reporting.left_out import LeftOutLoops

__all__ = ["CGBackend"]

log = logging.getLogger(__name__)


def graph_break_info(gm: torch.fx.GraphModule) -> Optional[dict[str, str]]:
    """Dynamo's reason for ending this graph, when it ended at a graph break."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    stack = getattr(reason, "user_stack", None)
    return {"reason": break_text(str(getattr(reason, "reason", ""))), "source": source_of_stack(stack),
            "code": code_of_stack(stack)}


def _function_of(gm: torch.fx.GraphModule) -> str:
    """``file.py:LINE in func`` of the user function a Dynamo graph was traced from (its first
    node's outermost user frame), for messages."""
    for node in gm.graph.nodes:
        match = _FRAME.search(node.meta.get("stack_trace") or "")
        if match:
            return f"{match['file'].replace(chr(92), '/').rsplit('/', 1)[-1]}:{match['line']} in {match['func']}"
    return "a compiled function"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


class CGBackend:
    """A cgbackend instance; pass it as ``torch.compile(model, backend=instance)``."""

    def __init__(self, config: Optional[Config] = None, *, prepared: Optional[Prepared] = None,
                 keep_analyses: bool = False, warn_nothing_captured: bool = True, by_name: bool = False,
                 **options: Any) -> None:
        """``config`` or keyword ``options`` (not both). ``prepared``: what ``cgbackend.compile`` or
        ``explain`` did to the model before Dynamo traced it (frontend/prepare.py). ``keep_analyses``:
        keep every graph's analysis for :meth:`build_report` (explain). ``warn_nothing_captured``:
        False leaves out the warning that the model ran with nothing captured (explain captures
        nothing by design), and the warning that MoE loops stay outside the graphs. ``by_name``: made
        for ``torch.compile(model, backend="cgbackend")`` (or explain's trace of it): graph breaks
        that leave MoE dispatch loops outside the graphs are recorded (reporting/left_out.py)."""
        if config is not None and options:
            raise TypeError("CGBackend takes either a Config or keyword options, not both")
        self.config = config if config is not None else Config.from_options(options)
        self.prepared = prepared if prepared is not None else Prepared()
        """What was done to the model before tracing: opaque modules, rewritten loops, expert
        layout, layer stacks (frontend/prepare.py); read by the report."""
        counters = Counters()
        self.timer: Optional[RegionTimer] = RegionTimer() if self.config.profile else None
        """Per-region timing (option profile)."""
        capture_watch = CaptureWatch(counters)
        """Warns once when the model runs with nothing captured (runtime/capture_watch.py)."""
        capture_watch.enabled = warn_nothing_captured
        # The mirror brings this instance's counters into torch._dynamo.utils.counters["cgbackend"]
        # (read there). Each layer of a stack holds its own graphs of the shared code.
        self.shared = RuntimeShared(self.config, counters=counters, mirror=CounterMirror(counters),
                                    watch=self.timer, capture_watch=capture_watch,
                                    layer_copies=max((len(s.layers) for s in self.prepared.stacks), default=1),
                                    watch_churn=by_name)
        if self.prepared.volatile_params is not None:
            self.set_volatile_params(self.prepared.volatile_params)
        self._graphs: list[weakref.ReferenceType[CompiledGraph]] = []
        self._analyses: list[tuple[Analysis, Optional[dict[str, str]]]] = []
        self._keep_analyses = keep_analyses
        self._lock = threading.Lock()
        self._no_cuda_logged = False
        self._loop_survey: Optional[list] = None
        self.trace_fallback: Optional[str] = None
        """Why cgbackend.compile stopped tracing data-dependent ops into the graph, if it did."""
        self.switch_per_call = False
        """cgbackend.compile switches Dynamo's data-dependent settings around each call rather than
        around each compile (tracing.CompileScope), after a compile ran without them."""
        self.uncompiled = UncompiledCalls(self.shared.counters)
        """Calls Dynamo ran without this instance: counted, explained, warned once (frontend/uncompiled.py)."""
        self.left_out = LeftOutLoops(warn=warn_nothing_captured) if by_name else None
        """By name: MoE dispatch loops graph breaks leave outside the graphs (reporting/left_out.py)."""
        self.as_written = AsWritten(counters) if by_name else None
        """By name: functions with nothing to graph that Dynamo recompiles run as written (frontend/as_written.py)."""
        self.dry_run = DryRun(self.config.dryrun)
        """Option dryrun: each graph's partition report, shown once (dryrun.py)."""
        self.__name__ = "cgbackend"
        # Graphs go before the process group at exit: a CUDA graph holding NCCL resources would
        # make the communicator's destruction wait (cgbackend.distributed).
        self._release_at_exit = finalizer(self, self._graphs, self.config.simulate_graphs)

    @property
    def loops(self) -> list:
        """Every dispatch loop the source rewrite looked at (moe/source_rewrite.py)."""
        return self.prepared.loops

    def use_fsdp_policy(self, policy: Any) -> None:
        """Read FSDP2's parameters as ``policy`` says (integrations/fsdp_gathers.FSDPPolicy): kept
        with this instance, whose graphs read the pinned gathers' memory."""
        self.prepared.fsdp = policy
        if policy.volatile is not None:
            self.set_volatile_params(policy.volatile)

    def set_volatile_params(self, predicate: Callable[[torch.Tensor], bool]) -> None:
        """Parameters for which ``predicate`` holds are copied into static buffers before each
        replay instead of being read at their address (FSDP2's, which move; runtime/params.py)."""
        self.shared.params.volatile = predicate

    def kept_analyses(self) -> list[tuple[Analysis, Optional[dict[str, str]]]]:
        """The analyses kept so far (``keep_analyses=True``), with each graph's break, in order."""
        return list(self._analyses)

    def forget_analyses(self, keep: int = 0) -> None:
        """Drop the kept analyses after the first ``keep``."""
        del self._analyses[keep:]

    def note_trace_fallback(self, cause: BaseException) -> None:
        first = str(cause).strip().splitlines()
        caused_by = next((line.strip() for line in first if line.strip().startswith("Caused by:")), "")
        self.trace_fallback = (f"Dynamo could not trace a data-dependent value ({type(cause).__name__}: "
                               f"{first[0] if first else ''}{'; ' + caused_by if caused_by else ''}); "
                               "traced as plain torch.compile does, with a graph break there")
        self.shared.mirror.begin(self.shared.counters)
        self.shared.counters.trace_fallbacks += 1
        log.warning("cgbackend: %s", self.trace_fallback)

    def note_frame_failure(self, kind: str, message: str) -> None:
        """A frame of a cgbackend.compile call failed to compile after a graph of the call had run,
        and Dynamo ran it as it is (tracing.CompileScope), and skips it from then on. A
        data-dependent value (``.tolist()`` of a data-dependent length after a graph break) makes
        the instance trace as plain torch.compile from the next call on. Counted and reported."""
        self.shared.mirror.begin(self.shared.counters)
        first = message.strip().splitlines()[0] if message.strip() else "no message"
        if is_data_dependent(kind):
            self.note_trace_fallback(RuntimeError(f"{kind}: {message}"))
        self.uncompiled.note("frame", f"Dynamo failed to compile a frame after a graph of the call had run "
                                      f"({kind}: {first}): it ran that frame as it is, and skips it from then on")

    def note_trace_scope_missed(self) -> None:
        """This graph of a cgbackend.compile call was traced without the data-dependent settings
        (tracing.CompileScope: Dynamo ran no start callback for its compile): data-dependent ops in it
        broke the graph, as in plain torch.compile. Counted; this instance switches the settings
        around each call from now on."""
        self.shared.counters.trace_scope_missed += 1
        if not self.switch_per_call:
            self.switch_per_call = True
            log.warning("cgbackend: a graph was traced without capture_scalar_outputs / "
                        "capture_dynamic_output_shape_ops (Dynamo ran no compile callback for it: "
                        "another compile was in progress); data-dependent ops in it break the graph. "
                        "The settings are switched around every call of this model from now on")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        self.shared.mirror.begin(self.shared.counters)  # before this compile counts anything
        if trace_scope_missed():
            self.note_trace_scope_missed()
        traced_s = progress.seconds_since_compile_start()
        with self._lock:
            index = len(self._graphs)
            started = time.perf_counter()
            mark_traced(gm, self.loops)  # which rewritten loops the model ran (the report, the gradient notice)
            analysis = analyze(gm, self.config, loops=self.loops)
            analysed_s = time.perf_counter() - started
            break_info = graph_break_info(gm)
            if self.as_written is not None:
                self.as_written.check(analysis, break_info is not None, _function_of(gm))
            if self._keep_analyses:
                self._analyses.append((analysis, break_info))
            # Static regions are compiled by the inner compiler lazily, at their first warm-up call
            # (inner.py): only regions that are called are compiled.
            compiled = CompiledGraph(analysis, list(example_inputs), self.shared, index)
            self._graphs.append(weakref.ref(compiled))
            self.shared.mirror.push(self.shared.counters)
        part = analysis.partition
        ops = sum(1 for r in part.regions for n in r.nodes if n.op.startswith("call_"))
        static_ops = sum(1 for r in part.static_regions() for n in r.nodes if n.op.startswith("call_"))
        log.info("cgbackend: graph %d: %s, %s (%.0f%% of ops), %s%s",
                 index, count(ops, "op"), count(len(part.static_regions()), "static region"),
                 100.0 * static_ops / max(ops, 1), count(len(part.dynamic_regions()), "dynamic region"),
                 f" [{compiled.blocked}]" if compiled.blocked else "")
        progress.log.log(progress.level(analysed_s + (traced_s or 0.0)),
                         "cgbackend: graph %d: %sanalysed by cgbackend in %.1f s; its static regions compile and "
                         "capture at their first calls", index,
                         "" if traced_s is None else f"traced by Dynamo in {traced_s:.1f} s, ", analysed_s)
        if structured.structured_tracing_on():
            gr = graph_report(analysis, index, break_info)
            structured.emit_report(Report(graphs=[gr], graph_breaks=[break_info] if break_info else [],
                               summary=summarize([gr], [break_info] if break_info else []),
                               config=self.config.to_dict()), "cgbackend_partition_report")
        self.shared.capture_watch.on_compile(compiled)
        self.uncompiled.on_compile(_function_of(gm))
        if self.left_out is not None:
            self.left_out.on_compile(gm)
        if self.config.dryrun:
            self.dry_run.show(analysis, index, break_info, self.config)  # dryrun.py
        if compiled.blocked == EagerReason.NO_CUDA and self.config.strict:
            raise RuntimeError(
                f"cgbackend: strict=True but graph {index} computes on "
                f"{analysis.classification.compute_device}"
                f"{'' if torch.cuda.is_available() else ' and this machine has no CUDA device'}: nothing "
                "can be captured and strict forbids running it eagerly; run on CUDA tensors, or set "
                "strict=False (or simulate_graphs=True to test the runtime on CPU)")
        if compiled.blocked == EagerReason.NO_CUDA and not self._no_cuda_logged:
            self._no_cuda_logged = True
            log.info("cgbackend: nothing is captured: the model computes on %s and CUDA graphs need "
                     "CUDA tensors; the split graph runs eagerly", analysis.classification.compute_device)
        return compiled

    def release(self) -> int:
        """Drop every graph this instance holds (later calls capture again); returns how many
        entries were dropped. Done at process exit too."""
        return release_graphs(self._graphs, self.config.simulate_graphs)

    # ------------------------------------------------------------------ introspection

    def compiled_graphs(self) -> list[CompiledGraph]:
        return [g for g in (ref() for ref in self._graphs) if g is not None]

    def reset(self) -> None:
        """Forget the graphs compiled so far and zero the counters; ``torch._dynamo.reset()`` calls
        this (Dynamo drops the compiled graphs at the same time). Memory pools stay, for reuse.

        Their CUDA graphs are released first: Dynamo's compiled functions stay reachable from the
        traced code's module globals (``__compiled_fn_*``) after a reset, and with them the graphs,
        which would otherwise hold their memory, and any NCCL work captured in them (which makes
        ``destroy_process_group`` wait), until the interpreter exits."""
        with self._lock:
            release_graphs(self._graphs, self.config.simulate_graphs)
            self._graphs.clear()
            self._analyses.clear()
            self.shared.mirror.reset()  # adds what was counted so far, then starts from zero
            self.shared.counters.clear()
            self.shared.capture_watch.reset()
            self.uncompiled.reset()
            self._no_cuda_logged = False

    def stats(self) -> dict[str, Any]:
        self.shared.mirror.push(self.shared.counters)
        out = self.shared.counters.to_dict()
        out["pending_forwards"] = sum(g.slots.pending() for g in self.compiled_graphs())
        # Only while nothing was captured: a GPU run with one graph on CPU tensors captured the rest
        # (a 48-layer model by name showed no_cuda next to 123 captured graphs).
        out["nothing_captured_reason"] = None if out["graphs_captured"] else next(
            (g.blocked for g in self.compiled_graphs() if g.blocked is not None), None)
        out["memory"] = memory_of([e for g in self.compiled_graphs() for r in g.runners
                                   for e in r.cache.entries.values()])
        # Capture size -> pool bytes its held graphs added (0 where nothing was reserved, as with
        # simulated graphs).
        out["captured_sizes"] = {size: part["reserved"] for size, part in out["memory"]["by_size"].items()}
        return out

    def report(self) -> Report:
        """The partition report of every graph this instance compiled, with runtime counters."""
        graphs = []
        compiled = self.compiled_graphs()
        for g in compiled:  # region ids as in the logs and profiler ranges: g<index>.<region>
            gr = graph_report(g.analysis, g.index, graph_break_info(g.analysis.gm))
            gr.runtime = g.runtime_summary()
            if self.timer is not None:
                gr.runtime["timing"] = self.timer.graph_timing(g.index)
            if g.blocked is not None:
                gr.notes.append(f"nothing captured: {g.blocked}")
            graphs.append(gr)
        breaks = [b for b in (graph_break_info(g.analysis.gm) for g in compiled) if b]
        report = Report(graphs=graphs, graph_breaks=breaks, summary=summarize(graphs, breaks),
                        config=self.config.to_dict(), opaque_modules=self._opaque_dict())
        report.summary.update(runtime_launches(graphs, compiled, bool(breaks)))
        report.hints = build_hints(report, [g.analysis for g in compiled], self.config,
                                   self.loops or self._surveyed_loops())
        self._annotate(report)
        return report

    def _surveyed_loops(self) -> list:
        if self._loop_survey is None:
            target = self.prepared.survey_target
            model = target() if target is not None else None
            if model is None:
                return []
            from .moe.loop_forwards import survey
            self._loop_survey = survey(model)
        return self._loop_survey

    def _annotate(self, report: Report) -> None:
        """What happened before Dynamo's graphs: the model's preparation (static dispatch's loop
        rewrites and expert layout, layer stacks) and a trace fallback."""
        annotate_report(report, self.prepared.loops, self.prepared.relayouts)
        report.regional = [stack.to_dict() for stack in self.prepared.stacks]
        if self.trace_fallback is not None:
            report.notes.append(self.trace_fallback)
        report.notes.extend(self.uncompiled.notes())
        if self.left_out is not None:
            report.notes.extend(self.left_out.notes())
        if self.as_written is not None:
            report.notes.extend(self.as_written.notes())
        missed = self.shared.counters.trace_scope_missed
        if missed:
            report.notes.append(f"{missed} graph(s) traced without capture_scalar_outputs / "
                                "capture_dynamic_output_shape_ops (no Dynamo compile callback ran for them: "
                                "another compile was in progress): data-dependent ops there break the graph; "
                                "the settings are switched around every call since")

    def _opaque_dict(self) -> dict[str, Any]:
        return self.prepared.opaque.to_dict() if self.prepared.opaque is not None else {}

    def build_report(self, extra_breaks: list[dict[str, str]], notes: list[str],
                     analyses: Optional[list] = None, calls: Optional[dict[int, int]] = None) -> Report:
        """The ahead-of-time report of ``analyses`` (default: those kept); ``calls``: graph index ->
        how often it ran in the traced model call (per-call figures count those runs)."""
        report = build_report(self._analyses if analyses is None else analyses, extra_breaks,
                              self.config.to_dict(), notes, runs=calls)
        report.opaque_modules = self._opaque_dict()
        self._annotate(report)
        return report
