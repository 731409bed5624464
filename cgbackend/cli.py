"""Command line: ``explain`` (partition report), ``bench`` (benchmark harness) and ``serve-bench``
(serving loop with random batch sizes)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import sys
from typing import Any, Optional, Sequence

__all__ = ["main"]


class CLIError(Exception):
    """A one-line error for the user; main() prints it and exits with status 2."""


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _load_factory(spec: str):
    if ":" not in spec:
        raise CLIError(f"expected MODULE:FACTORY (e.g. mymodels:make), got {spec!r}")
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            path = os.path.abspath(module_name)
            if not os.path.exists(path):
                raise CLIError(f"no such file: {module_name}")
            mod_spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
            module = importlib.util.module_from_spec(mod_spec)
            sys.path.insert(0, os.path.dirname(path))
            mod_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(module_name)
    except CLIError:
        raise
    except ImportError as exc:
        raise CLIError(f"cannot import {module_name!r}: {_one_line(exc)}") from None
    except Exception as exc:
        raise CLIError(f"importing {module_name!r} failed: {type(exc).__name__}: {_one_line(exc)}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise CLIError(f"{module_name!r} has no callable {attr!r}")
    return factory


def _split_inputs(made: Any) -> tuple[Any, tuple, dict]:
    if not (isinstance(made, tuple) and len(made) == 2):
        raise CLIError("the factory must return (model, example_inputs)")
    model, inputs = made
    if isinstance(inputs, dict):
        return model, (), inputs
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], dict):
            return model, tuple(inputs[0]), dict(inputs[1])
        return model, tuple(inputs), {}
    return model, (inputs,), {}


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    from .config import Config, parse_value
    fields = {f: Config.__dataclass_fields__[f].default for f in Config.field_names()}
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise CLIError(f"--option takes KEY=VALUE, got {item!r}")
        if key not in fields:
            raise CLIError(f"unknown option {key!r}; valid: {', '.join(fields)}")
        options[key] = parse_value(f"--option {key}", raw, fields[key])
    return options


def _cmd_explain(args: argparse.Namespace) -> int:
    import torch
    from .explain import ExplainError, explain
    if bool(args.target) == bool(args.demo):
        raise CLIError("give either MODULE:FACTORY or --demo moe|dense")
    if args.demo:
        from .models import demo_model
        model, inputs = demo_model(args.demo, device=args.device)
        call_args, call_kwargs = (inputs,), {}
    else:
        factory = _load_factory(args.target)
        try:
            made = factory()
        except Exception as exc:
            raise CLIError(f"the factory {args.target} raised {type(exc).__name__}: {_one_line(exc)}") from None
        model, call_args, call_kwargs = _split_inputs(made)
    for dim in args.dynamic or ():
        tensors = [a for a in call_args if isinstance(a, torch.Tensor)]
        if not tensors or dim >= tensors[0].dim():
            raise CLIError(f"--dynamic {dim}: the first input has no dimension {dim}")
        torch._dynamo.mark_dynamic(tensors[0], dim)
    options = _parse_options(args.option or [])
    grad = torch.enable_grad() if args.train else torch.no_grad()
    if hasattr(model, "train") and hasattr(model, "eval"):
        model.train(args.train)
    try:
        with grad:
            report = explain(model, *call_args, options=options, **call_kwargs)
    except ExplainError as exc:
        raise CLIError(str(exc)) from None
    if args.html:  # before printing: a closed pipe (`| head`) must not cost the file
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(report.to_html())
        print(f"wrote {args.html}", file=sys.stderr)
    print(report.to_json() if args.json else report.to_text())
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cgbackend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="partition report, ahead of time (no GPU needed)")
    ex.add_argument("target", nargs="?", help="MODULE:FACTORY returning (model, example_inputs)")
    ex.add_argument("--demo", choices=("moe", "dense"), help="a built-in reference model")
    ex.add_argument("--json", action="store_true", help="print the report as JSON")
    ex.add_argument("--train", action="store_true", help="trace in training mode (grad on)")
    ex.add_argument("--device", default="cpu", help="device for --demo models (default cpu)")
    ex.add_argument("--option", action="append", metavar="KEY=VALUE", help="a cgbackend option")
    ex.add_argument("--dynamic", type=int, action="append", metavar="DIM",
                    help="mark this dimension of the first input dynamic (a symbolic size), repeatable")
    ex.add_argument("--html", metavar="PATH", help="also write the report as one self-contained HTML page")
    ex.add_argument("-v", "--verbose", action="store_true", help="log cgbackend's INFO lines")
    ex.set_defaults(func=_cmd_explain)
    bench = sub.add_parser("bench", help="side-by-side benchmark (see benchmarks/README.md)", add_help=False)
    bench.set_defaults(func=None)
    serve = sub.add_parser("serve-bench", help="serving loop, random batch sizes (benchmarks/README.md)",
                           add_help=False)
    serve.set_defaults(func=None)
    dist_bench = sub.add_parser("bench-dist", help="DDP / FSDP2 / expert-parallel training, run with torchrun "
                                "(benchmarks/README.md)", add_help=False)
    dist_bench.set_defaults(func=None)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main
        return bench_main(rest)
    if args.command == "bench-dist":
        from .bench_dist import main as bench_dist_main
        return bench_dist_main(rest)
    if args.command == "serve-bench":
        from .serving import main as serving_main
        return serving_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "verbose", False):
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .config import ConfigError
    try:
        return args.func(args)
    except (CLIError, ConfigError) as exc:
        print(f"cgbackend: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head` closed the pipe: not an error
        sys.stderr.close()
        return 0
