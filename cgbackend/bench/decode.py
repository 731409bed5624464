"""Benchmark mode ``decode``: greedy decoding with a transformers ``StaticCache``, ms per token.

Models (``models.py``): ``hf-llama`` (transformers Llama) and ``hf-mixtral-eager-experts``
(transformers Mixtral with ``set_experts_implementation("eager")``), random weights from a small
config. What each contender compiles is one decode step (:class:`DecodeStep`: one token per
sequence through the model with the static cache, the last position's logits), not ``generate``:
the step has fixed shapes, so every compiler sees the same single graph. The prompt's prefill runs
eagerly for every contender (the same kernels, so every contender decodes from the same cache).

Per contender:
1. ``--warmup`` free-running rounds (prompt, then ``new_tokens`` greedy steps), the first compiles;
2. a free-running round on the accuracy prompt: ``tokens_equal_frac`` = the share of generated
   tokens equal to eager's (greedy tokens diverge for good once one differs);
3. a teacher-forced round on that prompt (each step fed eager's token), so the logits of every
   step compare with eager's and with a float64 run fed the same tokens (the fp64 rule of
   accuracy.py on the group ``output``); ``argmax_agree_frac`` = the share of steps whose
   argmax equals the float64 run's;
4. timed rounds (each step timed on its own, CUDA events around call + argmax), as many as
   ``--iters`` or ``--time-budget`` allow (at least 2; a round's cost is read from the free-running
   round of step 2, the warm-up rounds being the ones that compile). ``median_ms`` is per token. With
   ``--timing alternate`` (the default) every contender is prepared (steps 1-3) and kept, then
   the timed rounds run in ``timing.TIMING_ROUNDS`` alternating blocks; ``--timing sequential``
   times each contender alone right after its preparation.
"""

from __future__ import annotations

import copy
import inspect
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from .cases import Case, empty_row, skip_reason
from .contenders import CONTENDERS
from .verdict import contender_named
from .measure import cleanup, error_text, log, memory_baseline, sync
from .models import DECODE_SHAPES
from .timing import TIMING_ROUNDS, Tally, block_share, put_counts, put_times, read_held, read_peak

__all__ = ["DecodeStep", "make_static_cache", "run_decode"]

def make_static_cache(model: nn.Module, max_len: int, batch: int, device: torch.device, dtype: torch.dtype) -> Any:
    """A transformers StaticCache for ``model`` (newer transformers size it lazily at the first
    update; older ones take the batch, device and dtype)."""
    from transformers import StaticCache
    params = inspect.signature(StaticCache.__init__).parameters
    kwargs: dict[str, Any] = dict(config=model.config, max_cache_len=max_len)
    for key, value in (("max_batch_size", batch), ("device", device), ("dtype", dtype)):
        if key in params:
            kwargs[key] = value
    return StaticCache(**kwargs)


class DecodeStep(nn.Module):
    """One greedy decode step: ``ids [B, 1]`` at ``positions [B, 1]`` through ``model`` with its
    static cache; returns the logits ``[B, vocab]``. ``prefill`` runs the prompt eagerly."""

    def __init__(self, model: nn.Module, cache: Any) -> None:
        super().__init__()
        self.model = model
        self.cache = cache
        self._cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def _kwargs(self, positions: torch.Tensor) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(position_ids=positions, past_key_values=self.cache, use_cache=True,
                                      logits_to_keep=1)
        if self._cache_position:  # older transformers index the static cache by it
            kwargs["cache_position"] = positions[0]
        return kwargs

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, **self._kwargs(positions)).logits[:, -1, :]

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> torch.Tensor:
        self.cache.reset()
        b, p = prompt.shape
        positions = torch.arange(p, device=prompt.device).expand(b, p)
        return self.model(input_ids=prompt, **self._kwargs(positions)).logits[:, -1, :]


class _Session:
    """One model (one contender's copy) with its cache and compiled step."""

    def __init__(self, model: nn.Module, fn_of: Callable[[nn.Module], Callable[..., Any]], shape: dict[str, Any],
                 device: torch.device, dtype: torch.dtype, mark_step: bool = False,
                 call_context: Callable[[], Any] = None) -> None:
        self.new_tokens = shape["new_tokens"]
        cache = make_static_cache(model, shape["prompt"] + shape["new_tokens"], shape["batch"], device, dtype)
        self.step = DecodeStep(model, cache)
        self.fn = fn_of(self.step)
        self.mark_step = mark_step
        self.call_context = call_context
        self.prompt_len = shape["prompt"]
        self.positions = [torch.full((shape["batch"], 1), self.prompt_len + i, device=device, dtype=torch.long)
                          for i in range(self.new_tokens)]

    def call(self, ids: torch.Tensor, i: int) -> torch.Tensor:
        if self.mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        if self.call_context is not None:
            with self.call_context():
                return self.fn(ids, self.positions[i])
        return self.fn(ids, self.positions[i])

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, forced: Optional[torch.Tensor] = None, keep_logits: bool = False,
                 times: Optional[list[float]] = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy tokens ``[B, new_tokens]`` (the first from the prefill); with ``forced``, each
        step is fed ``forced[:, i]`` instead of its own token. ``keep_logits``: each step's logits
        (CPU). ``times``: each step's ms is appended."""
        cuda = prompt.device.type == "cuda"
        ids = self.step.prefill(prompt).argmax(-1, keepdim=True)
        tokens, logits = [ids], []
        if cuda and times is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for i in range(self.new_tokens - 1):
            feed = ids if forced is None else forced[:, i:i + 1]
            if times is not None:
                if cuda:
                    torch.cuda.synchronize()
                    start.record()
                else:
                    t0 = time.perf_counter()
            out = self.call(feed, i)
            ids = out.argmax(-1, keepdim=True)
            if times is not None:
                if cuda:
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    times.append((time.perf_counter() - t0) * 1e3)
            if keep_logits:
                logits.append(out.detach().float().cpu())
            tokens.append(ids)
        return torch.cat(tokens, dim=1), logits


def _logits_errors(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, tuple[float, str]]:
    from .accuracy import rel_err
    err = max((rel_err(a, b) for a, b in zip(got, ref)), default=0.0)
    if len(got) != len(ref):
        err = float("inf")
    return {"output": (err, "logits")}


def run_decode(spec: Any, s: Any, names: Sequence[str], log_row: Callable[[str, dict, float], None],
               batch: Optional[int] = None) -> list[dict[str, Any]]:
    """Rows (one per contender) of the decode benchmark of ``spec`` under settings ``s``, at decode
    batch ``batch`` (sequences per step; the scale's own by default)."""
    shape = dict(DECODE_SHAPES[s.scale])
    if batch is not None:
        shape["batch"] = batch
    device, dtype = s.device, s.dtype
    label = f"{spec.name}/decode/batch {shape['batch']}"
    log(f"{label}: batch {shape['batch']}, prompt {shape['prompt']}, {shape['new_tokens']} tokens; "
               "eager and float64 references")
    base = spec.build(s)
    gen = torch.Generator().manual_seed(s.seed + 1)
    prompts = [torch.randint(0, shape["vocab"], (shape["batch"], shape["prompt"]), generator=gen).to(device)
               for _ in range(max(1, s.batches))]
    case = Case(spec.name, "decode", base, prompts, [0], ref=[], spec=spec)

    eager = CONTENDERS["eager"]
    model = copy.deepcopy(base).to(device)
    session = _Session(model, eager.make, shape, device, dtype)
    ref_tokens, ref_logits = session.generate(prompts[0], keep_logits=True)
    ref_tokens = ref_tokens.clone()
    del session, model
    cleanup(device)
    ref64: Optional[list[torch.Tensor]] = None
    if s.reference == "fp64":
        try:
            t0 = time.perf_counter()
            model = copy.deepcopy(base).to(device=device, dtype=torch.float64)
            session = _Session(model, eager.make, shape, device, torch.float64)
            _, ref64 = session.generate(prompts[0], forced=ref_tokens, keep_logits=True)
            ref64 = [t.double() for t in ref64]
            del session, model
            case.eager64 = _logits_errors(ref_logits, ref64)
            case.ref64 = [{"logits": ref64}]
            case.ref64_s = time.perf_counter() - t0
            log(f"{label}: float64 reference in {case.ref64_s:.1f}s; eager's logits error against it "
                       f"{case.eager64['output'][0]:.1e}")
        except Exception as exc:
            case.ref64, case.eager64, ref64 = [], {}, None
            case.ref64_error = error_text(exc)
            log(f"{label}: float64 reference failed ({case.ref64_error}); accuracy falls back to --tol")
        finally:
            cleanup(device)

    if s.timing == "sequential":
        rows = []
        for name in names:
            t_row = time.perf_counter()
            prepared = _prepare_one(case, contender_named(name), s, shape, prompts, ref_tokens, ref_logits, ref64,
                                    alone=True)
            if prepared.session is not None:
                prepared.time_rounds(prepared.rounds, prompts)
                prepared.finish()
                cleanup(s.device)
            rows.append(prepared.row)
            log_row(label, prepared.row, time.perf_counter() - t_row)
        return rows
    return _run_alternating(case, names, s, shape, prompts, ref_tokens, ref_logits, ref64, label, log_row)


def _run_alternating(case: Any, names: Sequence[str], s: Any, shape: dict[str, Any], prompts: list[torch.Tensor],
                     ref_tokens: torch.Tensor, ref_logits: list[torch.Tensor], ref64: Optional[list[torch.Tensor]],
                     label: str, log_row: Callable[[str, dict, float], None]) -> list[dict[str, Any]]:
    """Every contender prepared in turn (compiled, warmed up, judged) and kept; then timed in
    ``timing.TIMING_ROUNDS`` alternating blocks of decode rounds, as the other modes are (a change
    of the machine's pace shows in every contender alike: a decode step is host-bound, and two
    sequential runs of the same row had put cgbackend at 0.78x and 1.44x reduce-overhead)."""
    device = s.device
    cleanup(device)
    case.mem_baseline = int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    # Each contender's DecodeStep is its own object: Dynamo's cache for the shared code holds them all.
    limit = max(torch._dynamo.config.recompile_limit, 8 * len(names))
    prepared: list[_Prepared] = []
    rows: list[dict[str, Any]] = []
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            for name in names:
                t0 = time.perf_counter()
                one = _prepare_one(case, contender_named(name), s, shape, prompts, ref_tokens, ref_logits, ref64,
                                   alone=False)
                one.seconds = time.perf_counter() - t0
                prepared.append(one)
            timed = [p for p in prepared if p.session is not None]
            for r in range(TIMING_ROUNDS):
                for p in timed:
                    t0 = time.perf_counter()
                    p.time_rounds(block_share(p.rounds, r), prompts)
                    p.seconds += time.perf_counter() - t0
            for p in timed:
                p.finish()
        for p in prepared:
            log_row(label, p.row, p.seconds)
            rows.append(p.row)
    finally:
        for p in prepared:
            p.session = None
        prepared.clear()
        cleanup(device)
    return rows


class _Prepared:
    """One contender of a decode case after its warm-up and accuracy rounds: its row, its session
    (None when it failed or was skipped: the row says why), and its timings so far."""

    def __init__(self, row: dict[str, Any], contender: Any, s: Any, shape: dict[str, Any]) -> None:
        self.row = row
        self.contender = contender
        self.s = s
        self.shape = shape
        self.session: Optional[_Session] = None
        self.warm: list[float] = []
        self.times: list[float] = []
        self.rounds = 0
        self.seconds = 0.0
        self.tally = Tally(s.device)
        """Dynamo's and Inductor's counters over this contender's own windows (timing.Tally)."""

    def time_rounds(self, n: int, prompts: list[torch.Tensor]) -> None:
        """``n`` timed decode rounds; an exception is recorded in the row (stage ``timing``)."""
        if self.session is None:
            return
        try:
            start = len(self.times) // max(1, self.shape["new_tokens"] - 1)
            with self.tally:
                for r in range(n):
                    self.session.generate(prompts[(start + r) % len(prompts)], times=self.times)
                sync(self.s.device)
        except Exception as exc:
            self.row["error"], self.row["error_stage"] = error_text(exc), "timing"
            self.session = None

    def finish(self) -> None:
        """Timing figures and counters into the row."""
        row = self.row
        if row["error"] is not None or not self.times:
            self.session = None
            return
        put_times(row, self.times)
        row["ms_per_token"] = row["median_ms"]
        row["first_call_s"] = self.warm[0]
        steps = self.shape["new_tokens"] - 1
        row["compile_s"] = max(0.0, sum(self.warm) - len(self.warm) * steps * row["median_ms"] / 1e3)
        try:
            put_counts(row, self.tally, self.contender, self.session.fn)
        except Exception as exc:
            row["error"], row["error_stage"] = error_text(exc), "counters"
        self.session = None


def _prepare_one(case: Any, contender: Any, s: Any, shape: dict[str, Any], prompts: list[torch.Tensor],
                 ref_tokens: torch.Tensor, ref_logits: list[torch.Tensor], ref64: Optional[list[torch.Tensor]],
                 alone: bool) -> _Prepared:
    """Steps 1-3 of the module docstring for one contender. ``alone``: nothing else is held (the
    device is cleaned first, peak memory read from a reset); otherwise earlier contenders stay
    compiled and in memory, and what they hold is taken off this one's peak."""
    from .accuracy import LIMIT, judge
    device = s.device
    row = empty_row(case, contender, s)
    # A decode step runs one token per sequence: the batch is the step's token count too (``tokens``,
    # which tells rows of one model apart in tables and in ``--append``).
    row.update(batch=shape["batch"], tokens=shape["batch"], decode_batch=shape["batch"], prompt_len=shape["prompt"],
               new_tokens=shape["new_tokens"], tokens_equal_frac=None, argmax_agree_frac=None)
    out = _Prepared(row, contender, s, shape)
    if contender.needs_cuda and device.type != "cuda":
        row["error"], row["error_stage"] = "needs CUDA", "setup"
        return out
    reason = skip_reason(contender, case.spec, s)
    if reason:
        row["error"], row["error_stage"], row["skip_reason"] = f"skipped: {reason}", "setup", reason
        return out
    cuda = device.type == "cuda"
    stage = "setup"
    session = model = None
    try:
        memory_baseline(device, alone, row)
        with out.tally:
            stage = "compile"
            if contender.convert is not None:
                model = contender.convert(case.base, device)
            else:
                model = copy.deepcopy(case.base).to(device)
            model.eval()
            session = _Session(model, contender.make, shape, device, s.dtype, contender.mark_step,
                               contender.call_context)
            warm = out.warm
            for r in range(max(1, s.warmup)):
                sync(device)
                t0 = time.perf_counter()
                session.generate(prompts[r % len(prompts)])
                sync(device)
                warm.append(time.perf_counter() - t0)

            stage = "accuracy"
            sync(device)
            t0 = time.perf_counter()
            tokens, _ = session.generate(prompts[0])
            sync(device)
            compiled_round = time.perf_counter() - t0  # what a timed round costs (warm-up rounds compile)
            _, logits = session.generate(prompts[0], forced=ref_tokens, keep_logits=True)
        row["graph_breaks"], row["graph_break_reasons"] = out.tally.graph_breaks()
        row["tokens_equal_frac"] = float((tokens == ref_tokens).float().mean().item())
        errs = _logits_errors(logits, ref_logits)
        row["accuracy_err"], row["accuracy_worst"] = errs["output"][0], "logits"
        if ref64 is not None:
            verdict = judge(_logits_errors(logits, ref64), case.eager64, s.dtype)
            row.update(ref64_err=verdict.errors, ref64_ratio=verdict.ratio, ref64_worst=verdict.worst,
                       ref64_limit=LIMIT, accuracy_ok=verdict.ok)
            agree = [(a.argmax(-1) == b.argmax(-1)).float().mean().item() for a, b in zip(logits, ref64)]
            row["argmax_agree_frac"] = float(sum(agree) / len(agree)) if agree else None
        else:
            row["accuracy_ok"] = bool(errs["output"][0] <= s.tol)
        if cuda:
            if alone:
                row["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(device))
                row["peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
                row["peak_mem_over_baseline_bytes"] = row["peak_mem_bytes"] - row["mem_baseline_bytes"]
                read_held(row, device)
            else:
                read_peak(row, case, device)

        rounds = s.iters
        if s.time_budget and compiled_round > 0:
            rounds = max(min(2, s.iters), min(s.iters, int(s.time_budget / compiled_round)))
        out.rounds = rounds
        out.session = session
    except Exception as exc:
        row["error"], row["error_stage"] = error_text(exc), stage
        if s.verbose:
            import traceback
            traceback.print_exc()
    finally:
        del session, model
        if alone and out.session is None:
            cleanup(device)
    return out
