"""Run one Dynamo graph as its regions: static ones through RegionRunner, dynamic ones eagerly.

Per call: values flow between regions through a flat list (no copies, freed
after their last use); tensors returned to the caller that live in graph
memory are cloned, so a later replay never overwrites them, and outputs that
eager returns as views (of an input, a parameter, a buffer, another output)
are rebuilt as such views (runtime/outputs.py).

Training calls take a *call slot*: slot ``k`` means "the k-th forward still
waiting for its backward". Every graph replayed in the call belongs to slot
``k`` (its own entries and pool), and the slot stays busy until the backward
pass through the call has finished (``queue_callback`` at the first graphed
backward of the call), or until the call's autograd graph is freed without a
backward. Inference calls use slot 0 and release it when they return.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..passes.pipeline import Analysis
from ..fx_utils import fake_value
from ..opaque import opaque_info, region_hooks
from .backward import QUEUE_CALLBACK
from .entries import COPY, EAGER, HANDOFF, PARAM, VALUE, RuntimeShared, is_static_address
from .region import RegionRunner
from ..passes.bucket import mutated_input_positions, written_positions
from ..passes.effects import Effects
from ..passes.gather import rewrite_gathers
from .outputs import INPUT, OutputBuilder, output_aliases
from .inner import InnerFallback, LazyInner, resolve_inner
from ..passes.constants import make_constant
from .split import Step, build_region_module
from .syncsplit import apply_splits
from .memory import add_up, entry_memory
from .stats import EagerReason
from .capture_watch import settle_call

__all__ = ["CompiledGraph", "CallState", "SlotTable", "run_step"]

log = logging.getLogger(__name__)


class SlotTable:
    """Busy flags and generations of the call slots of one compiled graph (training)."""

    def __init__(self, max_slots: int) -> None:
        self.max_slots = max_slots
        self.busy: list[bool] = []
        self.generation: list[int] = []

    def acquire(self) -> Optional[tuple[int, int]]:
        for k, busy in enumerate(self.busy):
            if not busy:
                break
        else:
            if len(self.busy) >= self.max_slots:
                return None
            self.busy.append(False)
            self.generation.append(0)
            k = len(self.busy) - 1
        self.busy[k] = True
        self.generation[k] += 1
        return k, self.generation[k]

    def release(self, k: int, generation: int, live: list) -> None:
        if self.busy[k] and self.generation[k] == generation:
            self.busy[k] = False
            for pool, index in live:
                pool.release(index)
            live.clear()

    def pending(self) -> int:
        return sum(self.busy)


class CallState:
    """One call of a compiled graph: its slot, the graphs it replayed, its training anchors."""

    __slots__ = ("slot", "generation", "training", "live", "tokens", "_table", "_scheduled",
                 "__weakref__")

    def __init__(self, slot: int, generation: int, training: bool, table: Optional[SlotTable]) -> None:
        self.slot = slot
        self.generation = generation
        self.training = training
        self.live: list = []
        self.tokens = 0
        self._table = table
        self._scheduled = False

    def add_token(self) -> None:
        self.tokens += 1

    def still_valid(self, generation: int) -> bool:
        table = self._table
        return table is None or table.generation[self.slot] == generation

    def release(self) -> None:
        if self._table is not None:
            self._table.release(self.slot, self.generation, self.live)
        else:
            for pool, index in self.live:
                pool.release(index)
            self.live.clear()

    def on_backward(self) -> None:
        """A graphed backward of this call runs: free the slot once the whole backward pass is over."""
        if self._scheduled:
            return
        self._scheduled = True
        if QUEUE_CALLBACK is not None:
            QUEUE_CALLBACK(self.release)
        else:  # no engine hook: no forward can start before this backward pass returns anyway
            self.release()


def _never() -> bool:
    return False


_profiler_enabled: Callable[[], bool] = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", _never)
"""Is an autograd/Kineto profiler (or emit_nvtx) recording? One C call; feature-tested."""


def _runs_twice_alike(effects: Effects, nodes: list, inputs: list) -> bool:
    """Running ``nodes`` (a graph, or a region of it, reading ``inputs``) a second time on the same
    inputs gives the same outputs and leaves the same state: they write none of their inputs, draw
    no random number, touch no global state and call no opaque module (whose own state they cannot
    see)."""
    members = set(nodes)
    if any(n in members for n in effects.random_nodes) or any(n in members for n in effects.barriers):
        return False
    if any(opaque_info(n) is not None for n in nodes):
        return False
    return not written_positions(effects, nodes, inputs)


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
        nodes = list(analysis.gm.graph.nodes)
        self._check_after_launch = bool(self._layout_checks) and _runs_twice_alike(
            analysis.effects, nodes, [n for n in nodes if n.op == "placeholder"])
        """The checks of a list seen before are made once the graph is launched, while the GPU runs
        it (their hundreds of address comparisons were host time before each launch); a call whose
        check finds a changed address runs again on the laid-out parameters."""
        gm = analysis.gm
        partition = analysis.partition
        self.training_graph = analysis.classification.training
        self.slots = SlotTable(self.config.max_pending_forwards * shared.layer_copies)

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.n_inputs = len(placeholders)
        slot_of: dict[torch.fx.Node, int] = {n: i for i, n in enumerate(placeholders)}
        # Whether each input is a parameter or buffer (read in place), not the example tensors
        # themselves: Dynamo passes the first call's real inputs, which kept for good would hold
        # that batch's memory as long as the graph lives.
        self._static_address = {n: i < len(example_inputs) and is_static_address(example_inputs[i])
                                for i, n in enumerate(placeholders)}
        # Hoisted constants (passes/constants.py): made once, in slots right after the inputs.
        self.constants = tuple(analysis.constants.nodes)
        self._constant_set = set(self.constants)
        made: dict = {}
        for node in self.constants:  # in graph order: a conversion reads a constant made before it
            made[node] = make_constant(node, made)
        self._constant_values: list = list(made.values())
        self._device_scalars = tuple(analysis.scalars.inputs.items())
        """Float inputs the graph reads as device values (passes/scalars.py): moved there first."""
        # A constant the graph returns is copied out on every call, like graph memory: the caller
        # may write its copy (runtime/outputs.py copies outputs lying in these storages).
        shared.register_persistent([made[n] for n in analysis.constants.returned], handoff=False)
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
        self._builder = OutputBuilder(self.output_aliases, self._output_template, slot_of, shared)
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
        self._runner_of: dict[torch.fx.Node, RegionRunner] = {}
        """Node -> the runner of the static region computing it (hand-off producers)."""
        self._pending_splits: list = []
        self.steps: list[Step] = []
        self.runners: list[RegionRunner] = []
        self.gather_rewrites: dict[int, int] = {}
        """Dynamic region index -> row gathers rewritten to index_select (passes/gather.py)."""
        for step_index, region in enumerate(partition.regions):
            module = build_region_module(gm, region, analysis.schedule.order.get(region.index))
            ins = tuple(slot_of[n] for n in region.inputs)
            outs = tuple(slot_of[n] for n in region.outputs)
            frees = tuple(s for s in ins if last_use.get(s) == step_index and s not in self._graph_outputs)
            runner = None
            if region.is_static:
                bucketing = analysis.buckets.regions.get(region.index)
                runner = self._make_runner(region, module, bucketing.plan if bucketing is not None else None)
            else:
                # Only pays off under autograd (its backward is the cheap part); in inference the
                # two-index form costs one more launch.
                if self.training_graph:
                    self.gather_rewrites[region.index] = rewrite_gathers(module)
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
        self._mirror = getattr(shared, "mirror", None)
        """runtime/mirror.py: torch._dynamo.utils.counters["cgbackend"] reads the counters when read;
        each call first checks that it was not cleared since (CounterMirror.begin)."""

    def _input_kinds(self, region) -> tuple[list[str], list[Optional[RegionRunner]]]:
        """How a static region reads each input (region.py), and the runner producing hand-offs."""
        kinds, producers = [], []
        for inp in region.inputs:
            value = fake_value(inp)
            producer = self._runner_of.get(inp)
            if not isinstance(value, torch.Tensor):
                kinds.append(VALUE)
                producers.append(None)
            elif inp in self._constant_set:
                kinds.append(PARAM)  # made once, never written: read in place like a parameter
                producers.append(None)
            elif inp.op == "placeholder":
                kinds.append(PARAM if self._static_address[inp] else COPY)
                producers.append(None)
            elif producer is not None:
                kinds.append(HANDOFF)
                producers.append(producer)
            else:
                kinds.append(EAGER)
                producers.append(None)
        return kinds, producers

    def _make_runner(self, region, module: torch.fx.GraphModule, bucket) -> RegionRunner:
        kinds, producers = self._input_kinds(region)
        hooks = region_hooks(region.nodes)
        opaque_calls = any(opaque_info(n) is not None for n in region.nodes)
        name = f"g{self.index}.{region.name}"  # the report's region id
        mutated = mutated_input_positions(self.analysis.effects, region)
        fn = module
        lazy = None
        recomputable = hooks is None and _runs_twice_alike(self.analysis.effects, region.nodes, region.inputs)
        if self._inner is not None:
            # Inductor would trace an opaque call with fake tensors and keep only its shape:
            # regions holding one run their FX module as it is.
            fn = module if opaque_calls else self._inner(module, region)
        elif self.inner_mode == "inductor" and self.blocked is None:
            lazy = LazyInner(module, name, self.shared.counters, strict=self.config.strict,
                             copied=tuple(p for p, k in enumerate(kinds) if k in (COPY, EAGER)),
                             written=tuple(sorted(mutated)),
                             donate=recomputable and not self.shared.capturer.simulate)
            if opaque_calls:  # a policy, not an error: counted, never raised under strict
                lazy.strict = False
                lazy.fall_back(InnerFallback.OPAQUE_CALL, "opaque module call in the region")
                lazy = None
        runner = RegionRunner(name, fn, kinds, producers, mutated, self.shared,
                              bucket=bucket, device=_region_device(region), hooks=hooks)
        runner.lazy_inner = lazy
        runner.recomputable = recomputable
        runner.caller_only = frozenset(i for i, node in enumerate(region.outputs)
                                       if node.users and all(u.op == "output" for u in node.users))
        runner.on_sync = self._request_split
        if self.blocked is not None:
            runner.disable(self.blocked, _BLOCKED_DETAIL.get(self.blocked, self.blocked))
        for node in region.outputs:
            self._runner_of[node] = runner
        self.runners.append(runner)
        return runner

    def mark_terminal(self) -> None:
        """The last static region of the graph: no static region reads its outputs, so its
        inference graphs may hand them out without a copy (runtime/handout.py)."""
        runners = [step.runner for step in self.steps if step.runner is not None]
        for runner in runners[:-1]:
            if runner.terminal:
                # A static region now reads its outputs, which its graphs may have released
                # (runtime/loose_outputs.py): those graphs go, and it captures again.
                for key, entry in [(k, e) for k, e in runner.entries.items() if e.out_released]:
                    del runner.entries[key]
                    runner.cache.release(entry)
            runner.terminal = False
        if runners:
            runners[-1].terminal = True

    def _request_split(self, runner: RegionRunner, hit: Any) -> bool:
        """A runner saw its op ``hit.node`` synchronize in warm-up: split it after this call."""
        if runner.entries or runner.n_graphs:
            return False  # graphs of other signatures exist: keep the region whole (eager)
        step = next((s for s in self.steps if s.runner is runner), None)
        if step is None:
            return False
        node = step.module.meta.get("cgbackend_origin", {}).get(hit.node)
        if node is None or node not in step.region.nodes:
            return False
        self._pending_splits.append((step, type(hit)(node, hit.detail)))
        return True

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
        # Static buffers, graphs and slots are shared by every call: calls from several threads run
        # one after the other (a graph's backward runs on autograd's thread, outside this lock).
        with self._lock:
            return self._call(args)

    def _call(self, args: tuple) -> Any:
        if self._mirror is not None:
            self._mirror.begin(self.shared.counters)
        self.shared.counters.graph_calls += 1
        self.calls += 1
        training = self.training_graph and torch.is_grad_enabled()
        checks = self._layout_checks
        check_after = (checks and self._check_after_launch and not training
                       and all(check.settled(args) for check in checks))
        if checks and not check_after:
            for check in checks:
                check(args)
        if self.shared.handed:
            self.shared.reclaim_handed()
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
                result = None  # the first run's outputs let go before the second (handout graphs)
                result = self._run(args, call)
        finally:
            if not training or call.tokens == 0:
                call.release()
        if self._pending_splits:
            apply_splits(self)
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
            return self._builder.build(env, anchor=lambda values: self._anchor(values, call))
        return self._builder.build(env)

    def _anchor(self, values: dict, call: CallState) -> None:
        """A training call that replayed graphs but made no graphed backward (no region had an input
        that requires grad): eager ops may have saved graph outputs for their backward. Tie the slot
        to the outputs' backward through a clone, so it stays busy until that backward has run."""
        grads = [(node, v) for node, v in values.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not grads:
            return
        clones = _AnchorClone.apply(call, *(v for _, v in grads))
        self.shared.counters.output_clones += len(grads)
        for (node, _), clone in zip(grads, clones):
            values[node] = clone

    def _run_all_eager(self, args: tuple, reason: str) -> Any:
        env = self._env(args)
        for step in self.steps:
            if step.runner is not None:
                step.runner.count_eager(reason)
            out = step.module(*[env[i] for i in step.ins])
            for i, value in zip(step.outs, out):
                env[i] = value
        return self._builder.build(env)

    # ------------------------------------------------------------------ logs and reports

    def _log_capture_once(self) -> None:
        if any(r.n_graphs == 0 and r.disabled is None for r in self.runners):
            return  # some regions are still warming up
        self._capture_logged = True
        graphs = sum(r.n_graphs for r in self.runners)
        seconds = sum(r.capture_time_s for r in self.runners)
        eager = [f"{r.name} ({r.disabled}: {r.disabled_detail})" for r in self.runners if r.disabled]
        pool_mib = self.shared.counters.pool_bytes / 2**20
        log.info("cgbackend: graph %d: %d static regions, %d graphs captured in %.2f s, pool %.1f MiB%s",
                 self.index, len(self.runners), graphs, seconds, pool_mib,
                 f"; eager: {', '.join(eager)}" if eager else "")

    def runtime_summary(self) -> dict[str, Any]:
        memories = {r.name: memory_of([r]) for r in self.runners}
        return {
            "blocked": self.blocked,
            "regions": {
                r.name: {"graphs": r.n_graphs, "held": len(r.entries), "evicted": r.evicted,
                         "recaptured": r.recaptured,
                         "pool_bytes": sum(e.nbytes for e in r.entries.values()),
                         "bucketed": r.bucket.symbol if r.bucket is not None else None,
                         "captured_sizes": sorted({e.size for e in r.entries.values() if e.size is not None}),
                         "memory": {k: v for k, v in memories[r.name].items() if k != "by_size"},
                         "memory_by_size": memories[r.name]["by_size"],
                         "thrashing": r.thrashing,
                         "replays": r.replays, "eager_calls": dict(r.eager_calls),
                         "handout_graphs": sum(len(e.handouts or ()) for e in r.entries.values()),
                         "disabled": r.disabled, "disabled_detail": r.disabled_detail,
                         "capture_time_s": round(r.capture_time_s, 4),
                         "inner": (r.lazy_inner.summary() if r.lazy_inner is not None
                                   else {"state": "eager" if self._inner is None else "compiled"})}
                for r in self.runners
            },
            "inner": self.inner_mode,
            "constants": self.analysis.constants.to_dict(),
            "pending_forwards": self.slots.pending(),
            "gather_rewrites": {f"D{i}": n for i, n in self.gather_rewrites.items() if n},
        }


def memory_of(runners: Any) -> dict[str, Any]:
    """What the held graphs of ``runners`` hold and reserved (runtime/memory.py), in all, and per
    capture size of their bucketed entries (``by_size``); each entry measured once."""
    parts, sizes = [], {}
    for r in runners:
        for e in r.entries.values():
            part = entry_memory(e)
            parts.append(part)
            if e.size is not None:
                sizes.setdefault(e.size, []).append(part)
    out: dict[str, Any] = add_up(parts)
    out["by_size"] = {size: add_up(group) for size, group in sorted(sizes.items())}
    return out


def run_step(step: Step, ins: list, call: CallState) -> Any:
    """One region of one call, as ``_run`` runs it; what a watch (RuntimeShared.watch) wraps."""
    if step.runner is not None:
        return step.runner(ins, call)
    return step.module(*ins)


class _AnchorClone(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: CallState, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        call.add_token()
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.call.on_backward()
        return (None,) + grads


_BLOCKED_DETAIL = {
    EagerReason.NO_CUDA: "the graph computes on the CPU; CUDA graphs need CUDA tensors",
    EagerReason.CAPTURE_DISABLED: "the option capture=False",
}


def _region_device(region) -> Optional[torch.device]:
    """Where a region computes, from the fake values of its nodes (for regions fed only numbers)."""
    for node in region.outputs + region.nodes:
        value = fake_value(node)
        if isinstance(value, torch.Tensor):
            return value.device
    return None
