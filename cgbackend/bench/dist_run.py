"""One distributed scenario on one rank, every contender in one run (``bench-dist``, and the
scenarios of tests/integrations/test_distributed.py).

1. **Build**: each contender builds its own model from the same seed (dist_models.build), in its
   form (the loop model, or the grouped-GEMM form of the same weights), wraps it in the scenario's
   engine (DDP, FSDP2, or none for expert parallelism) and compiles it: ``eager`` not at all,
   ``cgbackend`` with ``cgbackend.compile(model)`` and the scenario's options (none by default),
   ``grouped-inductor`` with ``torch.compile(model)``.
2. **Compare** (``Scenario.steps`` steps): every contender takes the same step on the same batch
   (distinct batches per step and per rank); each one's loss and every gradient are compared with
   eager's before the SGD steps (dist_accuracy). The graph count and eager calls of each cgbackend
   contender are read after each step.
3. **Time** (``time_steps``): two warm steps each, then the timed steps in alternating blocks
   (dist_timing.time_alternating), each step synchronized and the ranks aligned before it.
4. **Memory** (``peak_steps``): each contender alone (dist_timing.isolated_peaks): eager kept (it
   is warm), the others freed (graphs released, Dynamo reset, caches emptied) and each built again
   from the seed and warmed up (``warmup + 3`` steps: cgbackend captures at call ``warmup + 1``),
   the peak counter reset, then ``peak_steps`` steps: the peak allocated and reserved memory, and
   what was allocated right after the forward. A replayed graph's temporaries live in its pool's
   reserved segments, not in the allocated count, so both figures are kept.

A contender that fails (its build, a step, or its comparison) is recorded and dropped on every rank
(the ranks agree on failures after each step), and the others go on.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .dist_accuracy import grad_diff, grouped_grad_diff
from .dist_models import GROUPED_MODELS, Scenario, batches, build, loss_of, wrap
from .dist_timing import isolated_peaks, time_alternating
from .measure import cleanup, error_text, sync

__all__ = ["DistContender", "CONTENDERS", "ep_variant", "contender", "run_contenders", "train_step",
           "WARM_STEPS", "PEAK_STEPS"]

WARM_STEPS = 2
"""Untimed steps of each contender between the compared steps and the timed ones."""
PEAK_STEPS = 3
"""Steps measured for a contender's peak memory, after its warm-up."""
MIB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class DistContender:
    name: str
    compiler: str
    """"eager" (the engine alone), "cgbackend" (cgbackend.compile) or "inductor" (torch.compile)."""
    form: str = "loop"
    """"loop" (the model as written) or "grouped" (experts stacked, torch._grouped_mm)."""
    local_dispatch: Optional[str] = None
    """moe-ep: the local experts' dispatch this contender builds (None: the scenario's)."""
    description: str = ""


CONTENDERS = {c.name: c for c in (
    DistContender("eager", "eager", description="the engine without cgbackend"),
    DistContender("cgbackend", "cgbackend", description="cgbackend.compile(model), the scenario's options "
                                                        "(default options: none)"),
    DistContender("grouped-inductor", "inductor", form="grouped",
                  description="the same weights with the experts stacked and run with torch._grouped_mm "
                              "(device-side offsets), under torch.compile(model) (Inductor, default mode)"),
)}


def ep_variant(local_dispatch: str) -> DistContender:
    """``cgbackend-<local_dispatch>``: cgbackend on the expert-parallel model whose local experts run
    with that dispatch (models/ep.py), compared with and timed beside eager on the loop model."""
    return DistContender(f"cgbackend-{local_dispatch}", "cgbackend", local_dispatch=local_dispatch,
                         description=f'cgbackend.compile(model), local_dispatch="{local_dispatch}"')


def contender(name: str) -> DistContender:
    if name in CONTENDERS:
        return CONTENDERS[name]
    if name.startswith("cgbackend-"):
        return ep_variant(name[len("cgbackend-"):])
    raise ValueError(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)} or cgbackend-<local_dispatch>")


def unsupported(spec: DistContender, sc: Scenario, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why ``spec`` cannot run this scenario here, or None."""
    if spec.form == "grouped":
        if sc.model not in GROUPED_MODELS:
            return f"{sc.model} has no grouped-GEMM form"
        from ..models.realsize import grouped_mm_unsupported
        return grouped_mm_unsupported(device, dtype)
    if spec.local_dispatch is not None and sc.model != "moe-ep":
        return f"local_dispatch applies to moe-ep only, not {sc.model}"
    return None


@dataclasses.dataclass
class Live:
    """A built contender: the engine-wrapped model, what a step calls, its optimizer."""
    spec: DistContender
    module: Any
    fn: Any
    opt: Any
    fresh: bool = False
    """Built alone for its memory reading (it needs a warm-up first)."""
    resident_before: Optional[int] = None
    """Bytes allocated on the device just before it was built alone: what the others left."""


def make_live(spec: DistContender, sc: Scenario, rank: int, world: int, device: torch.device, dtype: torch.dtype,
              simulate: bool) -> Live:
    import cgbackend
    model = build(sc, rank, world, device, dtype, form=spec.form, local_dispatch=spec.local_dispatch)
    module = wrap(sc, model, device)
    del model
    if spec.compiler == "cgbackend":
        options = dict(sc.options)  # nothing here scales an option with the depth
        if simulate:
            options["simulate_graphs"] = True
        fn = cgbackend.compile(module, **options)
    elif spec.compiler == "inductor":
        fn = torch.compile(module)
    else:
        fn = module
    return Live(spec, module, fn, torch.optim.SGD(module.parameters(), lr=sc.lr))


def forward_backward(live: Live, x: torch.Tensor, after_forward: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """zero_grad(set_to_none=True), forward, loss, backward; the loss, detached."""
    live.opt.zero_grad(set_to_none=True)
    out = live.fn(x)
    if after_forward is not None:
        after_forward()
    loss = loss_of(out)
    del out
    loss.backward()
    return loss.detach()


def train_step(live: Live, x: torch.Tensor) -> None:
    """One training step, holding nothing after it (the timed step)."""
    forward_backward(live, x)
    live.opt.step()


def _agree(failed: dict[str, str]) -> dict[str, str]:
    """The failures of every rank (name -> first error), so that all ranks drop the same contenders."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, failed)
    out: dict[str, str] = {}
    for rank, part in enumerate(gathered):
        for name, text in part.items():
            out.setdefault(name, f"rank {rank}: {text}")
    return out


def _cg_stats(live: Live) -> dict[str, Any]:
    import cgbackend
    return cgbackend.stats(live.fn)


def _release(live: Live) -> None:
    """Drop a contender: its graphs released (cgbackend), its model, code and optimizer let go."""
    if live.spec.compiler == "cgbackend" and live.fn is not None:
        from ..distributed import release
        try:
            release(live.fn)
        except Exception:  # nothing captured, or already released
            pass
    live.fn = live.module = live.opt = None


def _free(live: Live, device: torch.device) -> None:
    """:func:`_release`, then Dynamo's caches and the device's emptied (measure.cleanup): only when
    no other compiled contender is to run again."""
    _release(live)
    cleanup(device)


class _Run:
    """The state of one scenario's run on this rank."""

    def __init__(self, sc: Scenario, names: list[str], rank: int, world: int, device: torch.device,
                 dtype: torch.dtype, simulate: bool) -> None:
        self.sc, self.rank, self.world, self.device, self.dtype, self.simulate = sc, rank, world, device, dtype, simulate
        self.specs = [contender(n) for n in names]
        if not self.specs or self.specs[0].name != "eager":
            raise ValueError("the first contender must be eager (the reference)")
        self.xs = batches(sc, rank, device, dtype)
        self.live: dict[str, Live] = {}
        self.record: dict[str, dict[str, Any]] = {s.name: {"contender": s.name} for s in self.specs}

    def make(self, name: str) -> Live:
        spec = next(s for s in self.specs if s.name == name)
        return make_live(spec, self.sc, self.rank, self.world, self.device, self.dtype, self.simulate)

    def drop(self, failed: dict[str, str], stage: str) -> None:
        for name, text in failed.items():
            self.record[name].update(error=text, error_stage=stage)
            live = self.live.pop(name, None)
            if live is not None:
                _release(live)
        if "eager" in failed:
            raise RuntimeError(f"eager failed ({stage}): {failed['eager']}")

    def build_all(self) -> None:
        failed = {}
        for spec in self.specs:
            reason = unsupported(spec, self.sc, self.device, self.dtype)
            if reason is not None:
                self.record[spec.name]["skipped"] = reason
                continue
            try:
                self.live[spec.name] = self.make(spec.name)
            except Exception as exc:
                failed[spec.name] = error_text(exc)
        self.drop(_agree(failed), "build")

    def compare(self) -> None:
        sc = self.sc
        for name, live in self.live.items():
            self.record[name].update(losses=[], loss_diff=0.0, grad_diff=0.0, grad_scale=0.0)
            if live.spec.compiler == "cgbackend":
                self.record[name].update(graphs=[], eager_calls=[])
        for i in range(sc.steps):
            x = self.xs[i % len(self.xs)]
            losses, failed = {}, {}
            for name, live in self.live.items():
                try:
                    losses[name] = float(forward_backward(live, x))
                except Exception as exc:
                    failed[name] = error_text(exc)
            self.drop(_agree(failed), "step")
            failed = {}
            eager = self.live["eager"]
            for name, live in self.live.items():
                rec = self.record[name]
                rec["losses"].append(losses[name])
                if name == "eager":
                    continue
                try:
                    where = f"rank {self.rank} step {i} {name}"
                    diff, scale = (grouped_grad_diff(live.module, eager.module, where) if live.spec.form == "grouped"
                                   else grad_diff(live.module, eager.module, where))
                except Exception as exc:
                    failed[name] = error_text(exc)
                    continue
                rec["loss_diff"] = max(rec["loss_diff"], abs(losses[name] - losses["eager"]))
                rec["grad_diff"], rec["grad_scale"] = max(rec["grad_diff"], diff), max(rec["grad_scale"], scale)
            self.drop(_agree(failed), "accuracy")
            for name, live in self.live.items():
                live.opt.step()
                if live.spec.compiler == "cgbackend":
                    stats = _cg_stats(live)
                    self.record[name]["graphs"].append(stats["graphs_captured"])
                    self.record[name]["eager_calls"].append(dict(stats["eager_calls"]))

    def time(self, iters: int) -> None:
        names = list(self.live)
        taken = dict.fromkeys(names, 0)

        def step(name: str) -> None:
            k = taken[name]
            taken[name] = k + 1
            train_step(self.live[name], self.xs[k % len(self.xs)])

        for _ in range(WARM_STEPS):
            for name in names:
                step(name)
        before = {name: dict(_cg_stats(live)["eager_calls"]) for name, live in self.live.items()
                  if live.spec.compiler == "cgbackend"}
        sync(self.device)
        gc.collect()
        times = time_alternating(names, step, iters, before=self._align, after=lambda: sync(self.device))
        for name, ts in times.items():
            self.record[name]["times_ms"] = ts
        for name, calls in before.items():
            stats = _cg_stats(self.live[name])
            self.record[name]["graphs_after_timing"] = stats["graphs_captured"]
            self.record[name]["eager_calls_timed"] = {k: v - calls.get(k, 0) for k, v in stats["eager_calls"].items()
                                                      if v - calls.get(k, 0)}

    def _align(self) -> None:
        """Ranks aligned and the device idle before a timed step (outside its time)."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        sync(self.device)

    def finish_stats(self) -> None:
        for name, live in self.live.items():
            if live.spec.compiler == "cgbackend":
                stats = _cg_stats(live)
                self.record[name]["stats"] = {k: stats.get(k) for k in (
                    "graphs_captured", "replays", "fwd_replays", "bwd_replays", "static_regions", "dynamic_regions",
                    "capture_failures", "inner_fallbacks")}
                self.record[name]["final_eager_calls"] = dict(stats.get("eager_calls", {}))

    def memory(self, steps: int) -> None:
        names = [s.name for s in self.specs if s.name in self.live]
        peaks = isolated_peaks(names, keep="eager", live=self.live, build=self._fresh,
                               measure=lambda name, live: self._measure(live, steps),
                               free=lambda live: _free(live, self.device))
        for name, mem in peaks.items():
            self.record[name]["memory"] = mem

    def _fresh(self, name: str) -> Live:
        cleanup(self.device)
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
        live = self.make(name)
        live.fresh, live.resident_before = True, before
        return live

    def _measure(self, live: Live, steps: int) -> dict[str, Any]:
        from ..config import Config
        cuda = self.device.type == "cuda"
        warmup = dict(self.sc.options).get("warmup", Config().warmup) + 3 if live.fresh else 0
        for k in range(warmup):  # cgbackend captures at call warmup + 1; and two steps more
            train_step(live, self.xs[k % len(self.xs)])
        sync(self.device)
        gc.collect()
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        after_fwd: list[int] = []
        read = (lambda: after_fwd.append(torch.cuda.memory_allocated(self.device))) if cuda else None
        for k in range(steps):
            forward_backward(live, self.xs[k % len(self.xs)], after_forward=read)
            live.opt.step()
        sync(self.device)
        before = live.resident_before
        if not cuda:
            return {"peak_mb": None, "reserved_mb": None, "alloc_after_fwd_mb": None, "resident_before_mb": None}
        return {"peak_mb": round(torch.cuda.max_memory_allocated(self.device) / MIB, 1),
                "reserved_mb": round(torch.cuda.max_memory_reserved(self.device) / MIB, 1),
                "alloc_after_fwd_mb": round(max(after_fwd) / MIB, 1) if after_fwd else None,
                "resident_before_mb": None if before is None else round(before / MIB, 1)}


def run_contenders(sc: Scenario, names: list[str], rank: int, world: int, device: torch.device, *,
                   dtype: torch.dtype, simulate: bool, time_steps: int = 0, peak_steps: int = 0) -> dict[str, Any]:
    """Run the contenders ``names`` (eager first) on one scenario on this rank; per contender: its
    losses, largest loss and gradient differences to eager, graph counts per compared step and eager
    calls (cgbackend), step times (``time_steps``), memory alone (``peak_steps``), or why it was
    skipped or failed."""
    run = _Run(sc, names, rank, world, device, dtype, simulate)
    run.build_all()
    run.compare()
    if time_steps:
        run.time(time_steps)
    run.finish_stats()
    if peak_steps:
        try:
            run.memory(peak_steps)
        except Exception as exc:  # the rows keep their timing; the memory phase says why it stopped
            for rec in run.record.values():
                if "memory" not in rec and not rec.get("error") and not rec.get("skipped"):
                    rec["memory_error"] = error_text(exc)
            for live in run.live.values():
                _release(live)
            run.live.clear()
            cleanup(device)
    else:
        for live in run.live.values():
            _release(live)
        run.live.clear()
    return {"rank": rank, "scenario": sc.name, "contenders": run.record}
