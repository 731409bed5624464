"""One benchmark case (model x mode x token count): its seed weights, inputs and references, a
contender's runner on it, and how a row is judged against the float64 reference."""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from .contenders import CONTENDERS, Contender
from .measure import cleanup, error_text, log, sync
from .settings import Settings


@dataclasses.dataclass
class Case:
    """One model x mode (x token count): the seed weights (on CPU), the inputs and the references
    (eager in the run dtype; float64 with ``--reference fp64``, see bench/accuracy.py)."""

    model_name: str
    mode: str
    base: nn.Module
    inputs: list[torch.Tensor]
    acc_indices: list[int]
    ref: list[dict[str, Any]]
    floor_ms: Optional[float] = None
    floor_device_events: Optional[float] = None
    floor_error: Optional[str] = None
    spec: Any = None
    tokens: Optional[int] = None
    ref64: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    eager64: dict[str, tuple[float, str]] = dataclasses.field(default_factory=dict)
    """Eager's own error against the float64 reference, per group (worst over the batches)."""
    eager_flips: Optional[float] = None
    ref64_s: Optional[float] = None
    ref64_error: Optional[str] = None
    mem_baseline: Optional[int] = None
    """Device memory allocated when the case's first contender started (alternating timing)."""
    shared: Optional[nn.Module] = None
    """The one device copy every contender runs on (--share-weights, inference)."""

    @property
    def key(self) -> str:
        return f"{self.model_name}/{self.mode}" + (f"/{self.tokens}" if self.tokens is not None else "")


def new_model(case: Case, settings: Settings, contender: Optional[Contender] = None) -> nn.Module:
    if settings.share_weights and case.mode == "infer":
        if case.shared is None:
            spec = case.spec
            case.shared = (spec.to_device(case.base, settings) if spec is not None and spec.to_device is not None
                           else copy.deepcopy(case.base).to(settings.device)).eval()
        if contender is None or contender.convert is None:
            return case.shared
        if contender.share is None:
            raise RuntimeError(f"{contender.name} rebuilds the model and has no form on shared weights "
                               "(--share-weights)")
        return contender.share(case.shared)
    if contender is not None and contender.convert is not None:
        model = contender.convert(case.base, settings.device)
    else:
        model = copy.deepcopy(case.base).to(settings.device)
    model.train(case.mode == "train")
    return model


def _restore_weights(model: nn.Module, base: nn.Module) -> None:
    with torch.no_grad():
        for p, b in zip(model.parameters(), base.parameters()):
            p.copy_(b)
        for p, b in zip(model.buffers(), base.buffers()):
            p.copy_(b)


class Runner:
    """Calls one contender on one case, rotating through the inputs."""

    def __init__(self, contender: Contender, case: Case, model: nn.Module, fn: Callable[..., Any],
                 settings: Settings) -> None:
        self.contender = contender
        self.case = case
        self.model = model
        self.fn = fn
        self.settings = settings
        self.train = case.mode == "train"
        self.opt = torch.optim.SGD(model.parameters(), lr=settings.lr) if self.train else None
        self.next_index = 0

    def call(self, x: torch.Tensor) -> Any:
        if self.contender.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        with self.contender.call_context():
            return self.fn(x)

    def loss(self, out: Any, x: torch.Tensor) -> torch.Tensor:
        return self.case.spec.loss(out, x)

    def step(self, index: Optional[int] = None) -> None:
        """One timed unit: an inference call, or a full training step (forward, loss, backward, SGD)."""
        if index is None:
            index = self.next_index % len(self.case.inputs)
            self.next_index += 1
        x = self.case.inputs[index]
        if self.train:
            self.opt.zero_grad(set_to_none=True)
            out = self.call(x)
            loss = self.loss(out, x)
            loss.backward()
            self.opt.step()
        else:
            with torch.no_grad():
                self.call(x)

    def results_for(self, index: int, x: Optional[torch.Tensor] = None) -> dict[str, Any]:
        """What accuracy compares, for batch ``index`` (or the given ``x``): the output, or the loss
        and every gradient of one step from the seed weights (no SGD step); and the MoE routing.
        The tensors stay on the device, uncopied: compare or store them before the next call."""
        spec = self.case.spec
        x = self.case.inputs[index] if x is None else x
        if not self.train:
            with torch.no_grad():
                out = self.call(x)
                return {"output": spec.output(out).detach(), "routing": spec.routing(out)}
        if self.contender.restore is not None:
            self.contender.restore(self.model, self.case.base)
        else:
            _restore_weights(self.model, self.case.base)
        self.opt.zero_grad(set_to_none=True)
        out = self.call(x)
        loss = self.loss(out, x)
        loss.backward()
        named = (self.contender.named_grads(self.model) if self.contender.named_grads is not None
                 else ((n, p.grad) for n, p in self.model.named_parameters()))
        grads = {name: (None if g is None else g.detach()) for name, g in named}
        routing = spec.routing(out)
        return {"loss": loss.detach(), "grads": grads, "routing": None if routing is None else routing.detach()}


def _eager_floor(case: Case, settings: Settings) -> tuple[Optional[float], Optional[float]]:
    """Per-step device time of eager: the device events (kernels, memcpy, memset) recorded by
    torch.profiler over ``floor_steps`` eager steps, summed and divided by the step count."""
    if settings.device.type != "cuda" or settings.floor_steps == 0:
        return None, None
    from torch.profiler import ProfilerActivity, profile
    model = new_model(case, settings)
    runner = Runner(CONTENDERS["eager"], case, model, model, settings)
    try:
        for _ in range(3):
            runner.step()
        sync(settings.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(settings.floor_steps):
                runner.step()
            sync(settings.device)
        total_us, count = 0.0, 0
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                total_us += event.self_device_time_total or event.time_range.elapsed_us()
                count += 1
        if count == 0:
            raise RuntimeError("the profiler recorded no CUDA device events")
        return total_us / 1e3 / settings.floor_steps, count / settings.floor_steps
    finally:
        del runner, model
        cleanup(settings.device)


def _reference64(case: Case, settings: Settings) -> None:
    """The float64 run: a copy of the seed weights in float64 on the run device, the accuracy
    batches upcast; fills ``case.ref64``, eager's own errors against it and eager's routing flips."""
    from .accuracy import flip_fraction, group_errors, merge, store, upcast_inputs
    t0 = time.perf_counter()
    spec = case.spec
    if case.mode == "infer" and spec is not None and spec.reference_forward is not None and settings.share_weights:
        _streamed_reference64(case, settings)
        case.ref64_s = time.perf_counter() - t0
        return
    model = copy.deepcopy(case.base).to(device=settings.device, dtype=torch.float64)
    model.train(case.mode == "train")
    runner = Runner(CONTENDERS["eager"], case, model, model, settings)
    flips = []
    try:
        for j, i in enumerate(case.acc_indices):
            got = runner.results_for(i, upcast_inputs(case.inputs[i]))
            merge(case.eager64, group_errors(case.ref[j], got))
            flips.append(flip_fraction(case.ref[j].get("routing"), got.get("routing")))
            case.ref64.append(store(got, settings.dtype))
            del got
    finally:
        del runner, model
        cleanup(settings.device)
    case.eager_flips = max(flips) if flips and None not in flips else None
    case.ref64_s = time.perf_counter() - t0


def _streamed_reference64(case: Case, settings: Settings) -> None:
    """The float64 reference of an inference case computed layer by layer (the model's float64
    copy would not fit the device: BenchModel.reference_forward)."""
    from .accuracy import flip_fraction, group_errors, merge, store, upcast_inputs
    spec = case.spec
    flips = []
    for j, i in enumerate(case.acc_indices):
        out = spec.reference_forward(case.base, upcast_inputs(case.inputs[i]), settings)
        got = {"output": spec.output(out).detach(), "routing": spec.routing(out)}
        merge(case.eager64, group_errors(case.ref[j], got))
        flips.append(flip_fraction(case.ref[j].get("routing"), got.get("routing")))
        case.ref64.append(store(got, settings.dtype))
        del got, out
    cleanup(settings.device)
    case.eager_flips = max(flips) if flips and None not in flips else None


def prepare_case(spec: Any, mode: str, settings: Settings, tokens: Optional[int] = None) -> Case:
    from .accuracy import store
    if isinstance(spec, str):
        from .models import MODELS
        spec = MODELS[spec]
    base = spec.build(settings)
    inputs = spec.inputs(base, settings, tokens)
    step = max(1, len(inputs) // max(settings.acc_batches, 1))
    acc_indices = [i * step for i in range(settings.acc_batches)]
    case = Case(spec.name, mode, base, inputs, acc_indices, ref=[], spec=spec, tokens=tokens)
    cleanup(settings.device)
    model = new_model(case, settings)
    runner = Runner(CONTENDERS["eager"], case, model, model, settings)
    case.ref = [store(runner.results_for(i), settings.dtype) for i in acc_indices]
    del runner, model
    cleanup(settings.device)
    if settings.reference == "fp64" and acc_indices:
        try:
            _reference64(case, settings)
            log(f"{case.key}: float64 reference in {case.ref64_s:.1f}s; eager's error against it "
                 + ", ".join(f"{g} {e:.1e}" for g, (e, _) in case.eager64.items())
                 + ("" if case.eager_flips is None else f", routing flips {case.eager_flips:.2%}"))
        except Exception as exc:  # judged against eager instead, and said so in every row
            case.ref64, case.eager64 = [], {}
            case.ref64_error = error_text(exc)
            log(f"{case.key}: float64 reference failed ({case.ref64_error}); accuracy falls back to --tol")
    try:
        case.floor_ms, case.floor_device_events = _eager_floor(case, settings)
    except Exception as exc:  # the floor is informative; never fatal
        case.floor_error = error_text(exc)
        log(f"{case.key}: floor failed: {case.floor_error}")
    return case


def empty_row(case: Case, contender: Contender, settings: Settings) -> dict[str, Any]:
    return {
        "model": case.model_name, "mode": case.mode, "contender": contender.name, "stock": contender.stock,
        "family": case.spec.family if case.spec is not None else None, "tokens": case.tokens,
        "median_ms": None, "p10_ms": None, "p90_ms": None, "mean_ms": None, "floor_ms": case.floor_ms,
        "floor_device_events_per_step": case.floor_device_events, "timed_iters": None,
        "accuracy_ok": None, "accuracy_err": None, "accuracy_worst": None, "accuracy_tol": settings.tol,
        "accuracy_rule": "fp64" if case.ref64 else "eager-tol",
        "ref64_err": None, "ref64_ratio": None, "ref64_worst": None, "ref64_limit": None,
        "eager_ref64_err": ({g: e for g, (e, _) in case.eager64.items()} if case.ref64 else None),
        "ref64_error": case.ref64_error, "routing_flip_frac": None,
        "peak_mem_bytes": None, "peak_reserved_bytes": None, "mem_baseline_bytes": None,
        "peak_mem_over_baseline_bytes": None, "held_mem_over_baseline_bytes": None,
        "compile_s": None, "first_call_s": None,
        "graphs": None, "graph_breaks": None, "graph_break_reasons": None, "recompiles": None,
        "rerecords": None, "dynamo_graphs": None,
        "cudagraph_skips": None, "backend_stats": None,
        "ratio_to_eager": None, "ratio_to_best_stock": None, "ratio_to_floor": None, "beats_best_stock": None,
        "error": None, "error_stage": None, "skip_reason": None,
    }


STATS_KEYS = ("graphs_captured", "static_regions", "dynamic_regions", "replays", "eager_calls",
               "capture_time_s", "capture_failures", "pool_bytes", "nothing_captured_reason",
               "handout_graphs", "handout_replays", "outputs_handed", "output_clones", "fast_replays",
               "dispatch_forms")


def skip_reason(contender: Contender, spec: Any, settings: Settings) -> Optional[str]:
    """Why ``contender`` does not run on this model/device/dtype, or None."""
    if spec is not None and contender.applies_to is not None:
        reason = contender.applies_to(spec)
        if reason:
            return reason
    if contender.unsupported is not None:
        return contender.unsupported(settings.device, settings.dtype)
    return None


def timed_iterations(settings: Settings, warm_s: Sequence[float]) -> int:
    """``--iters``, lowered to fit ``--time-budget`` seconds at the pace of the fastest of the last
    three warm-up calls (at least 5)."""
    if not settings.time_budget or not warm_s:
        return settings.iters
    pace = min(warm_s[-3:])  # the fastest of the last warm-up calls: the first ones compile
    if pace <= 0:
        return settings.iters
    return max(min(5, settings.iters), min(settings.iters, int(settings.time_budget / pace)))


def judge_row(row: dict[str, Any], case: Case, settings: Settings, errs: dict, errs64: dict,
               flips: list[Optional[float]]) -> None:
    from .accuracy import LIMIT, judge, worst
    if not case.acc_indices:
        row["accuracy_ok"] = None
        return
    err, where = worst(errs)
    row["accuracy_err"], row["accuracy_worst"] = err, where
    if case.ref64:
        verdict = judge(errs64, case.eager64, settings.dtype)
        row["ref64_err"], row["ref64_ratio"], row["ref64_worst"] = verdict.errors, verdict.ratio, verdict.worst
        row["ref64_limit"] = LIMIT
        row["accuracy_ok"] = verdict.ok
    else:
        row["accuracy_ok"] = bool(err <= settings.tol)
    if flips and None not in flips:
        row["routing_flip_frac"] = max(flips)
