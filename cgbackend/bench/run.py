"""``python -m cgbackend bench``: the cases and contenders a run takes, in order, and the entry point."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Optional, Sequence

import torch

from ..common import progress
from .cases import Case, prepare_case
from .contenders import CONTENDERS
from .measure import cleanup, log, sanitize
from .render import acc, device_name, fmt, mib, build_meta, merge_runs, render_markdown, render_table, write_json
from .settings import Settings, UsageError, dtype_name, build_parser, no_cuda_refusal, resolve_settings
from .timing import add_ratios, run_contenders
from .verdict import twin_name


def show_compile_progress() -> None:
    """Long compiles say what they are doing on stderr (cgbackend.progress at INFO), as the bench's
    own lines do: this is the command line, not the library, so it may set up logging."""
    logger = logging.getLogger(progress.log.name)
    if not any(getattr(h, "_cgbackend_bench", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[bench] %(message)s"))
        handler._cgbackend_bench = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def _contenders_for(spec: Any, mode: str, settings: Settings) -> list[str]:
    """The command line's contenders, else the model's own list (every contender when it has none);
    then the ``--twin`` instances of those that run."""
    if "contenders" in settings.explicit:
        names = settings.contenders
    else:  # the defaults: contenders that do not apply to this model are left out without a row
        names = list(spec.contenders) if spec.contenders is not None else [
            n for n in settings.contenders
            if CONTENDERS[n].applies_to is None or CONTENDERS[n].applies_to(spec) is None]
    names = [n for n in names if mode in CONTENDERS[n].modes]
    return names + [twin_name(n) for n in settings.twins if n in names]  # --twin: where its original runs


def _log_row(key: str, row: dict[str, Any], seconds: float) -> None:
    name = row["contender"]
    if row["error"]:
        log(f"{key} {name}: ERROR ({row['error_stage']}) {row['error'][:200]} [{seconds:.1f}s]")
    else:
        log(f"{key} {name}: compile {fmt(row['compile_s'], '.2f')}s, median {fmt(row['median_ms'])} ms "
             f"({fmt(row.get('timed_iters'))} calls), accuracy {acc(row)}, graphs {fmt(row['graphs'])}, "
             f"breaks {fmt(row['graph_breaks'])}, peak {mib(row['peak_mem_bytes'])} MiB [{seconds:.1f}s]")


def _token_cases(spec: Any, ms: Settings) -> tuple:
    """One case per entry: shape and hf models' token counts (4096 unless --tokens), decode models' decode
    batches (None: their scale's own, unless --tokens), one case (None) for the others."""
    if spec.family in ("shape", "hf"):
        return tuple(ms.tokens or (4096,))
    if spec.family == "decode":
        return tuple(ms.tokens or (None,))
    return (None,)


def _case_count(settings: Settings) -> int:
    """Cases (model x mode x token count) the run will take, for its progress lines."""
    from .models import MODELS
    total = 0
    for model_name in settings.models:
        spec = MODELS[model_name]
        ms = settings.for_model(spec)
        for mode in settings.modes:
            if mode in spec.modes:
                total += len(_token_cases(spec, ms))
    return total


def run(settings: Settings, argv: Sequence[str]) -> dict[str, Any]:
    from .models import MODELS
    rows: list[dict[str, Any]] = []
    cases: list[Case] = []
    skipped: list[dict[str, Any]] = []
    total, done = _case_count(settings), 0
    for model_name in settings.models:
        spec = MODELS[model_name]
        ms = settings.for_model(spec)
        for mode in settings.modes:
            if mode not in spec.modes:
                skipped.append({"model": model_name, "mode": mode,
                                "reason": f"{model_name} runs modes {', '.join(spec.modes)}"})
                log(f"{model_name}/{mode}: skipped ({skipped[-1]['reason']})")
                continue
            names = _contenders_for(spec, mode, settings)
            if spec.family == "decode":
                from .decode import run_decode
                for batch in _token_cases(spec, ms):  # --tokens: decode batches (tokens per step)
                    done += 1
                    label = f"{model_name}/{mode}" + (f"/batch {batch}" if batch is not None else "")
                    log(f"case {done} of {total}: {label}, contenders {', '.join(names)}")
                    t_case = time.perf_counter()
                    rows.extend(run_decode(spec, ms, names, log_row=_log_row, batch=batch))
                    log(f"{label}: done [{time.perf_counter() - t_case:.1f}s]")
                continue
            for tokens in _token_cases(spec, ms):
                t_case = time.perf_counter()
                label = f"{model_name}/{mode}" + (f"/{tokens}" if tokens is not None else "")
                done += 1
                log(f"case {done} of {total}: {label}, contenders {', '.join(names)}; preparing inputs, "
                    "eager reference and floor")
                case = prepare_case(spec, mode, ms, tokens)
                cases.append(case)
                if case.floor_ms is not None:
                    log(f"{label}: floor {case.floor_ms:.3f} ms/step")
                rows.extend(run_contenders(case, names, ms, _log_row))
                # Free the case's device inputs before the next one.
                case.inputs = []
                case.base = None
                cleanup(settings.device)
                log(f"{label}: done [{time.perf_counter() - t_case:.1f}s]")
    add_ratios(rows)
    device = device_name(settings.device)
    for row in rows:  # rows of several devices stand side by side in one results file (merge_runs)
        row["device"] = device
    return {"meta": build_meta(settings, argv, cases, skipped, rows), "rows": rows}


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m cgbackend bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (argparse already printed it)
        return int(exc.code or 0)
    if args.list_models:
        from .models import MODELS
        for name, spec in MODELS.items():
            print(f"{name:26s} {spec.family:9s} {','.join(spec.modes):12s} {spec.description}")
        return 0
    if args.list_contenders:
        for name, c in CONTENDERS.items():
            kind = "stock" if c.stock else ("model rewritten by hand" if c.convert else "cgbackend")
            flags = kind + (", needs CUDA" if c.needs_cuda else "")
            print(f"{name:24s} {c.description} ({flags})")
        return 0
    refusal = no_cuda_refusal("bench", args)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        settings = resolve_settings(args)
    except UsageError as exc:
        print(f"cgbackend bench: error: {exc}", file=sys.stderr)
        return 2
    if settings.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    else:
        show_compile_progress()
    log(f"device {settings.device} ({device_name(settings.device)}), dtype {dtype_name(settings.dtype)}, "
         f"models {','.join(settings.models)}, modes {','.join(settings.modes)}, "
         f"contenders {','.join(settings.contenders)}")
    print(f"cgbackend bench: results will be written to {settings.out}", flush=True)
    saved_threads = torch.get_num_threads()
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    try:
        results = run(settings, argv)
    finally:
        torch.set_num_threads(saved_threads)
    if settings.append and settings.out.exists():
        results = merge_runs(json.loads(settings.out.read_text(encoding="utf-8")), results)
    write_json(results, settings.out)
    log(f"wrote {settings.out}")
    if settings.markdown is not None:
        settings.markdown.parent.mkdir(parents=True, exist_ok=True)
        settings.markdown.write_text(render_markdown(sanitize(results)), encoding="utf-8")
        log(f"wrote {settings.markdown}")
    print(render_table(results))
    print(f"results: {settings.out}" + (f", {settings.markdown}" if settings.markdown is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
