"""Run one Dynamo graph as its regions: static ones through RegionRunner, dynamic ones eagerly.

Per call: values flow between regions through a flat list (no copies, freed
after their last use); tensors returned to the caller that live in graph
memory are cloned, so a later replay never overwrites them, and outputs that
eager returns as views (of an input, a parameter, a buffer, another output)
are rebuilt as such views (runtime/outputs.py).

Training calls take a *call slot* (runtime/calls.py). The static regions' runners are made by
runtime/runners.py; a region split at a host synchronization found in its warm-up is replaced by
its parts after the call that found it (runtime/syncsplit.py).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..passes.partition import Region
from ..passes.pipeline import Analysis
from .calls import AnchorClone, CallState, SlotTable
from .sharing import LayerSharing
from .capture_watch import settle_call
from .constants import make_constants
from .entries import is_static_address
from .inner import resolve_inner
from .memory import memory_of
from .outputs import INPUT, OutputBuilder, output_aliases
from .region import RegionRunner
from .runners import RunnerBuilder
from .shared import RuntimeShared
from .split import Step, build_region_module
from .static_grads import reclaim_all
from ..common.reasons import EagerReason
from ..common.wording import count
from .syncsplit import count_split, split_step
from .warmup import SyncHit

__all__ = ["CompiledGraph", "run_step"]

log = logging.getLogger(__name__)


def _never() -> bool:
    return False


_profiler_enabled: Callable[[], bool] = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", _never)
"""Is an autograd/Kineto profiler (or emit_nvtx) recording? One C call; feature-tested."""


class CompiledGraph:
    """The callable cgbackend hands back to Dynamo for one graph."""

    def __init__(self, analysis: Analysis, example_inputs: list, shared: RuntimeShared, index: int,
                 inner: Optional[Callable[[torch.fx.GraphModule, list], Callable]] = None) -> None:
        """``inner``: compile every static region up front with this (tests, tools); without it the
        option ``inner`` decides, and regions are compiled lazily (inner.py)."""
        self.analysis = analysis
        self.shared = shared
        self.index = index
        self.config = shared.config
        self._layout_checks = tuple(analysis.dispatch.layout_checks)
        """Run at every call: expert parameters read from one block still are its slices."""
        self._check_after_launch = bool(self._layout_checks) and analysis.facts.reruns_alike
        """The checks of a list seen before are made once the graph is launched, while the GPU runs
        it (their hundreds of address comparisons were host time before each launch); a call whose
        check finds a changed address runs again on the laid-out parameters."""
        gm = analysis.gm
        partition = analysis.partition
        self.training_graph = analysis.classification.training
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.n_inputs = len(placeholders)
        slot_of: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
        # Whether each input is a parameter or buffer (read in place), not the example tensors
        # themselves: Dynamo passes the first call's real inputs, which kept for good would hold
        # that batch's memory as long as the graph lives.
        static_address = {n: i < len(example_inputs) and is_static_address(example_inputs[i])
                          for i, n in enumerate(placeholders)}
        first_param = next((i for i, n in enumerate(placeholders) if static_address[n]), None)
        self.params_key = (example_inputs[first_param].data_ptr()
                           if first_param is not None and isinstance(example_inputs[first_param], torch.Tensor) else None)
        """Where this graph's first parameter lies: graphs of one function compiled for different
        layers (Dynamo specialises each layer on its layer_idx) differ here (capture_watch.py)."""
        self.sharing = LayerSharing(shared.layer_copies, first_param)
        """How many layers share this graph (runtime/sharing.py): scales the per-layer bounds."""
        self.slots = SlotTable(self.config.max_pending_forwards, self.sharing)
        # Hoisted constants (passes/constants.py): made once, in slots right after the inputs.
        self.constants = tuple(analysis.constants.nodes)
        made = make_constants(self.constants)
        self._constant_values: list = list(made.values())
        self._device_scalars = tuple(analysis.scalars.inputs.items())
        """Float inputs the graph reads as device values (passes/scalars.py): moved there first."""
        # A constant the graph returns is copied out on every call, like graph memory: the caller
        # may write its copy (runtime/outputs.py copies outputs lying in these storages).
        shared.register_persistent([made[n] for n in analysis.constants.returned], in_place=False)
        for node in self.constants:
            slot_of[node] = len(slot_of)
        shared.counters.constants_hoisted += len(self.constants)
        for region in partition.regions:
            for node in region.outputs:
                slot_of[node] = len(slot_of)
        self.n_values = len(slot_of)
        output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        self._output_template = output_node.args[0]
        self._slot_of = slot_of
        # Outputs that view an input, another output or each other are rebuilt as views at the end
        # of each call (runtime/outputs.py); the values they are rebuilt from stay until then.
        self.output_aliases = output_aliases(gm, set(slot_of))
        self._outputs = OutputBuilder(self.output_aliases, self._output_template, slot_of, shared)
        graph_outputs = {slot_of[n] for n in output_node.all_input_nodes}
        graph_outputs |= {slot_of[n] for n in self.output_aliases.leaves}
        graph_outputs |= {slot_of[g.root] for g in self.output_aliases.groups
                          if g.kind == INPUT and self.output_aliases.unreplayable}
        self._graph_outputs = graph_outputs

        last_use: dict[int, int] = {}
        for step_index, region in enumerate(partition.regions):
            for inp in region.inputs:
                last_use[slot_of[inp]] = step_index

        blocked = self._blocked_reason()
        self.blocked = blocked
        self.inner_mode = "eager" if inner is not None else resolve_inner(
            self.config, analysis.classification.compute_device)
        """What the static regions of this graph are compiled with (inner.py): "eager" or "inductor"."""
        self._inner = inner
        self._make = RunnerBuilder(shared, index, static_address, set(self.constants), inner, self.inner_mode,
                                   blocked, on_sync=self._request_split, sharing=self.sharing)
        """Makes the static regions' runners (runtime/runners.py)."""
        self._pending_splits: list = []
        self.steps: list[Step] = []
        self.runners: list[RegionRunner] = self._make.runners
        self.gather_rewrites = {i: len(found) for i, found in analysis.gathers.regions.items()}
        """Dynamic region index -> row gathers rewritten to index_select (passes/gather.py)."""
        for step_index, region in enumerate(partition.regions):
            module = build_region_module(gm, region, analysis.schedule.order.get(region.index),
                                         analysis.gathers.regions.get(region.index))
            ins = tuple(slot_of[n] for n in region.inputs)
            outs = tuple(slot_of[n] for n in region.outputs)
            frees = tuple(s for s in ins if last_use.get(s) == step_index and s not in self._graph_outputs)
            runner = None
            if region.is_static:
                bucketing = analysis.buckets.regions.get(region.index)
                runner = self._make.make(region, module, bucketing.plan if bucketing is not None else None,
                                         analysis.facts.regions[region.index])
            role = analysis.labels.region_roles.get(region.index, "other")
            self.steps.append(Step(ins, outs, frees, runner, module, region,
                                    f"cgbackend g{index}.{region.name} {role}"))

        self.mark_terminal()
        counters = shared.counters
        counters.compiled_graphs += 1
        counters.static_regions += len(self.runners)
        counters.dynamic_regions += len(self.steps) - len(self.runners)
        self._capture_logged = blocked is not None
        self._lock = threading.RLock()
        self.calls = 0
        """Calls of this graph (each runs every dynamic region once): the runtime launch coverage."""
        self._settle_at = settle_call(self.config, shared.layer_copies)
        """The call after which this graph's regions have captured if they will (capture_watch.py)."""
        self._mirror = shared.mirror
        """runtime/mirror.py: torch._dynamo.utils.counters["cgbackend"] reads the counters when read;
        each call first checks that it was not cleared since (CounterMirror.begin)."""
        self._plain = (gm.forward if not self.runners and not self.constants and not self._device_scalars
                       and not self._layout_checks else None)
        """A graph with nothing to capture, hoist or check (every region dynamic: a loop body's
        activation that Dynamo compiles as a frame of its own, called once per expert) runs as one
        eager call of its graph, the same ops: the region-by-region walk cost more host time than
        such a graph's few ops (31 us against 5 us for a SiLU on a CPU)."""

    def mark_terminal(self) -> None:
        """The last static region of the graph: no static region reads its outputs, so its
        inference graphs may hand them out without a copy (runtime/caller_graphs.py)."""
        runners = [step.runner for step in self.steps if step.runner is not None]
        for runner in runners[:-1]:
            runner.set_terminal(False)
        if runners:
            runners[-1].set_terminal(True)

    def _request_split(self, region: Region, hit: SyncHit) -> bool:
        """The runner of ``region`` saw its op ``hit.node`` synchronize in warm-up: split the
        region after this call (False: it cannot be, and the region then runs eagerly)."""
        step = next((s for s in self.steps if s.region is region), None)
        if step is None or step.runner is None:
            return False
        runner = step.runner
        if runner.cache.entries or runner.counts.graphs:
            return False  # graphs of other signatures exist: keep the region whole (eager)
        node = step.module.meta.get("cgbackend_origin", {}).get(hit.node)
        if node is None or node not in step.region.nodes:
            return False
        self._pending_splits.append((step, SyncHit(node, hit.detail)))
        return True

    def _apply_splits(self) -> None:
        """Replace each region whose runner asked to be split by its parts (runtime/syncsplit.py)."""
        pending, self._pending_splits = self._pending_splits, []
        for step, hit in pending:
            new_steps, self.n_values, parts = split_step(
                step, hit.node, self.steps, self._slot_of, self.n_values, self.analysis, self.config.min_region_ops,
                self._make.make)
            position = self.steps.index(step)
            self.steps[position:position + 1] = new_steps
            self.mark_terminal()
            # Later regions read the values the old region computed from the parts computing them
            # now, or, where an eager part does, as eager values.
            self._make.retire(step.runner, step.region)
            count_split(self.shared.counters, step.runner.name, hit, parts)

    def _blocked_reason(self) -> Optional[str]:
        if not self.config.capture:
            return EagerReason.CAPTURE_DISABLED
        device = self.analysis.classification.compute_device
        if self.config.simulate_graphs:
            return None
        if device != "cuda" or not torch.cuda.is_available():
            return EagerReason.NO_CUDA
        return None

    # ------------------------------------------------------------------ call

    def __call__(self, *args: Any) -> Any:
        if self._plain is not None and self.shared.watch is None and not _profiler_enabled():
            self._count_call()
            return self._plain(*args)
        # Static buffers, graphs and slots are shared by every call: calls from several threads run
        # one after the other (a graph's backward runs on autograd's thread, outside this lock).
        with self._lock:
            return self._call(args)

    def _count_call(self) -> None:
        if self._mirror is not None:
            self._mirror.begin(self.shared.counters)
        self.shared.counters.graph_calls += 1
        self.calls += 1

    def _call(self, args: tuple) -> Any:
        self._count_call()
        self.sharing.note(args)
        training = self.training_graph and torch.is_grad_enabled()
        checks = self._layout_checks
        check_after = (checks and self._check_after_launch and not training
                       and all(check.settled(args) for check in checks))
        if checks and not check_after:
            for check in checks:
                check(args)
        if self.shared.handed:
            reclaim_all(self.shared.handed, self.shared.counters)
        if training:
            acquired = self.slots.acquire()
            if acquired is None:
                return self._run_all_eager(args, EagerReason.PENDING_FORWARDS)
            call = CallState(acquired[0], acquired[1], True, self.slots)
            weakref.finalize(call, SlotTable.release, self.slots, acquired[0], acquired[1], call.live)
        else:
            call = CallState(0, 0, False, None)
        try:
            result = self._run(args, call)
            if check_after and any([check(args) for check in checks]):  # a list: every check runs
                # An address changed since the last call (a replaced parameter, laid out again
                # now): what the launch read may be stale. Nothing it wrote is an input, so it
                # runs again on the parameters as they are.
                self.shared.counters.layout_reruns += 1
                log.info("cgbackend: graph %d: an expert parameter's address changed; the call "
                         "runs again on the laid-out parameters", self.index)
                result = None  # the first run's outputs let go before the second (caller graphs)
                result = self._run(args, call)
        finally:
            if not training or call.tokens == 0:
                call.release()
        if self._pending_splits:
            self._apply_splits()
        if not self._capture_logged:
            self._log_capture_once()
        if self.calls == self._settle_at and self.shared.capture_watch is not None:
            self._settle_at = self.shared.capture_watch.on_settled(self) or 0
        return result

    def _env(self, args: tuple) -> list:
        env: list = list(args)
        for position, device in self._device_scalars:
            env[position] = env[position].to(device, non_blocking=True)
        env.extend(self._constant_values)
        env.extend([None] * (self.n_values - len(env)))
        return env

    def _run(self, args: tuple, call: CallState) -> Any:
        env = self._env(args)
        watch = self.shared.watch
        profiling = _profiler_enabled()
        for position, step in enumerate(self.steps):
            ins = step.take(env)
            if watch is not None:  # launch counting (explain) or per-region timing (profile=True)
                out = watch(self, position, run_step, step, ins, call)
            elif profiling:
                # One profiler range per region (Kineto traces; NVTX under emit_nvtx), named by the
                # report id and role, around its replay, capture or eager run alike.
                with torch.profiler.record_function(step.range_name):
                    out = run_step(step, ins, call)
            elif step.runner is not None:
                out = step.runner(ins, call)
            else:
                out = step.module(*ins)
            for i, value in zip(step.outs, out):
                env[i] = value
            for i in step.frees:
                env[i] = None
        if call.training and call.tokens == 0 and call.live:
            return self._outputs.build(env, anchor=lambda values: self._anchor(values, call))
        return self._outputs.build(env)

    def _anchor(self, values: dict, call: CallState) -> None:
        """A training call that replayed graphs but made no graphed backward (no region had an input
        that requires grad): eager ops may have saved graph outputs for their backward. Tie the slot
        to the outputs' backward through a clone, so it stays busy until that backward has run."""
        grads = [(node, v) for node, v in values.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not grads:
            return
        clones = AnchorClone.apply(call, *(v for _, v in grads))
        self.shared.counters.output_clones += len(grads)
        for (node, _), clone in zip(grads, clones):
            values[node] = clone

    def _run_all_eager(self, args: tuple, reason: str) -> Any:
        env = self._env(args)
        for step in self.steps:
            if step.runner is not None:
                step.runner.counts.eager(reason)
            out = step.module(*[env[i] for i in step.ins])
            for i, value in zip(step.outs, out):
                env[i] = value
        return self._outputs.build(env)

    # ------------------------------------------------------------------ logs and reports

    def _log_capture_once(self) -> None:
        if any(r.counts.graphs == 0 and r.state.disabled is None for r in self.runners):
            return  # some regions are still warming up
        self._capture_logged = True
        graphs = sum(r.counts.graphs for r in self.runners)
        seconds = sum(r.counts.capture_time_s for r in self.runners)
        eager = [f"{r.name} ({r.state.disabled}: {r.state.disabled_detail})" for r in self.runners
                 if r.state.disabled]
        pool_mib = self.shared.counters.pool_bytes / 2**20
        log.info("cgbackend: graph %d: %s, %s captured in %.2f s, pool %.1f MiB%s",
                 self.index, count(len(self.runners), "static region"), count(graphs, "graph"), seconds, pool_mib,
                 f"; eager: {', '.join(eager)}" if eager else "")

    def runtime_summary(self) -> dict[str, Any]:
        return {
            "blocked": self.blocked,
            "regions": {r.name: self._region_summary(r) for r in self.runners},
            "inner": self.inner_mode,
            "constants": self.analysis.constants.to_dict(),
            "pending_forwards": self.slots.pending(),
            "layers_sharing": self.sharing.copies,
            "gather_rewrites": {f"D{i}": n for i, n in self.gather_rewrites.items() if n},
        }

    def _region_summary(self, r: RegionRunner) -> dict[str, Any]:
        entries = r.cache.entries
        memory = memory_of(entries.values())
        state, counts, lazy = r.state, r.counts, r.code.lazy
        return {"graphs": counts.graphs, "held": len(entries), "evicted": r.cache.evicted,
                "recaptured": r.cache.recaptured,
                "pool_bytes": sum(e.nbytes for e in entries.values()),
                "bucketed": r.spec.bucket.symbol if r.spec.bucket is not None else None,
                "captured_sizes": sorted({e.size for e in entries.values() if e.size is not None}),
                "memory": {k: v for k, v in memory.items() if k != "by_size"},
                "memory_by_size": memory["by_size"],
                "thrashing": r.cache.thrashing, "shapes_vary": r.cache.churn.varying,
                "replays": counts.replays, "eager_calls": dict(counts.eager_calls),
                "handout_graphs": sum(len(e.caller_graphs or ()) for e in entries.values()),
                "disabled": state.disabled, "disabled_detail": state.disabled_detail,
                "capture_time_s": round(counts.capture_time_s, 4),
                "inner": (lazy.summary() if lazy is not None
                          else {"state": "eager" if self._inner is None else "compiled"})}


def run_step(step: Step, ins: list, call: CallState) -> Any:
    """One region of one call, as ``_run`` runs it; what a watch (RuntimeShared.watch) wraps."""
    if step.runner is not None:
        return step.runner(ins, call)
    return step.module(*ins)
