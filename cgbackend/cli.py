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


def _option_value(key: str, raw: str, default: Any) -> Any:
    """One --option value: the text the environment takes (``static_dispatch=auto``,
    ``capture_sizes=1,2,4``), or a Python literal as a hint prints it and a user pastes it
    (``static_dispatch="auto"``, ``dynamic_ops=("torch.nonzero",)``, ``strict=True``)."""
    import ast
    from .config import BOOL_OR_PATH, parse_value
    text = raw.strip()
    if text[:1] in ("'", '"', "(", "["):
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise CLIError(f"--option {key}={raw}: not a valid Python literal (quotes unbalanced?); "
                           f"write {key}=VALUE without quotes") from None
        if isinstance(value, (list, tuple)):
            return tuple(value)
        text = str(value)
    return parse_value(f"--option {key}", text, default, path_ok=key in BOOL_OR_PATH)


def _parse_options(items: Sequence[str]) -> dict[str, Any]:
    from .config import Config
    from .config.suggest import did_you_mean
    fields = {f: Config.__dataclass_fields__[f].default for f in Config.field_names()}
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep:
            raise CLIError(f"--option takes KEY=VALUE, got {item!r}")
        if key not in fields:
            raise CLIError(f"unknown option {key!r}{did_you_mean(key, fields)}; valid: {', '.join(fields)}")
        options[key] = _option_value(key, raw, fields[key])
    return options


def _check_device(device: str) -> None:
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {device!r} is not a device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        from .common.machine import torch_build
        raise CLIError(f"--device {device}: no CUDA device is available ({torch_build()}); "
                       "drop --device to trace on the CPU (the report then names the dispatch forms a GPU run "
                       "would choose differently)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise CLIError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _dynamic_target(spec: str, call_args: tuple, call_kwargs: dict) -> tuple[str, Any, int]:
    """--dynamic DIM (the first tensor input, positional or keyword) or NAME:DIM (the keyword input
    NAME, or the positional input at index NAME)."""
    import torch
    name, sep, dim_text = spec.rpartition(":")
    try:
        dim = int(dim_text)
    except ValueError:
        raise CLIError(f"--dynamic takes DIM or NAME:DIM (e.g. 0, input_ids:1), got {spec!r}") from None
    inputs = [(str(i), a) for i, a in enumerate(call_args)] + list(call_kwargs.items())
    tensors = [(n, a) for n, a in inputs if isinstance(a, torch.Tensor)]
    if sep:
        found = [(n, a) for n, a in inputs if n == name]
        if not found:
            names = ", ".join(n for n, _ in inputs) or "none"
            raise CLIError(f"--dynamic {spec}: no input named {name!r} (inputs: {names})")
        if not isinstance(found[0][1], torch.Tensor):
            raise CLIError(f"--dynamic {spec}: input {name!r} is not a tensor")
        name, tensor = found[0]
    else:
        if not tensors:
            raise CLIError(f"--dynamic {spec}: the model takes no tensor input")
        name, tensor = tensors[0]
    if not -tensor.dim() <= dim < tensor.dim():
        raise CLIError(f"--dynamic {spec}: input {name!r} has {tensor.dim()} dimension(s), "
                       f"shape {tuple(tensor.shape)}")
    return name, tensor, dim % tensor.dim()


class _quiet_torch_logs:
    """Without --verbose, torch's own log lines (fake-tensor errors, graph-break warnings) stay out
    of the CLI's output: the report lists the breaks and an error names its cause in one line."""

    def __init__(self, verbose: bool) -> None:
        self.verbose = verbose

    def __enter__(self) -> None:
        if not self.verbose:
            self._previous = logging.root.manager.disable
            logging.disable(logging.CRITICAL)

    def __exit__(self, *exc: Any) -> None:
        if not self.verbose:
            logging.disable(self._previous)


def _to_device(model: Any, call_args: tuple, call_kwargs: dict, device: str) -> tuple[Any, tuple, dict]:
    """The factory's model and inputs on ``device`` (tensors inside lists, tuples and dicts too)."""
    import torch
    from torch.utils._pytree import tree_map

    def move(v: Any) -> Any:
        return v.to(device) if isinstance(v, torch.Tensor) else v

    if isinstance(model, torch.nn.Module):
        model = model.to(device)
    return model, tree_map(move, tuple(call_args)), tree_map(move, dict(call_kwargs))


def _cmd_explain(args: argparse.Namespace) -> int:
    import torch
    from .reporting.explain import ExplainError, explain
    if bool(args.target) == bool(args.demo):
        raise CLIError("give either MODULE:FACTORY or --demo moe|dense")
    _check_device(args.device)
    if args.demo:
        from .models import demo_model
        try:
            model, inputs = demo_model(args.demo, device=args.device)
        except Exception as exc:
            raise CLIError(f"building the --demo {args.demo} model on {args.device} failed: "
                           f"{type(exc).__name__}: {_one_line(exc)}") from None
        call_args, call_kwargs = (inputs,), {}
    else:
        factory = _load_factory(args.target)
        try:
            made = factory()
        except Exception as exc:
            raise CLIError(f"the factory {args.target} raised {type(exc).__name__}: {_one_line(exc)}") from None
        model, call_args, call_kwargs = _split_inputs(made)
        if args.device != "cpu":  # traced where the run will be: the device's forms and partition
            model, call_args, call_kwargs = _to_device(model, call_args, call_kwargs, args.device)
    for spec in args.dynamic or ():
        name, tensor, dim = _dynamic_target(spec, call_args, call_kwargs)
        torch._dynamo.mark_dynamic(tensor, dim)
    options = _parse_options(args.option or [])
    if hasattr(model, "train") and hasattr(model, "eval"):
        model.train(args.train)
    try:
        with _quiet_torch_logs(args.verbose):
            report = explain(model, *call_args, options=options, training=args.train, by_name=args.by_name,
                             compare=args.compare, **call_kwargs)
    except ExplainError as exc:
        raise CLIError(str(exc)) from None
    if args.html:  # before printing: a closed pipe (`| head`) must not cost the file
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(report.to_html())
        print(f"wrote {args.html}", file=sys.stderr)
    print(report.to_json() if args.json else report.to_text())
    return 0


def build_parser(prog: str = "cgbackend") -> argparse.ArgumentParser:
    from ._version import __version__
    parser = argparse.ArgumentParser(prog=prog, description="cgbackend: explain (partition report), bench (benchmark harness), serve-bench (serving loop with random batch sizes).")
    parser.add_argument("--version", action="version", version=f"cgbackend {__version__}",
                        help="print cgbackend's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ex = sub.add_parser("explain", help="partition report, ahead of time (no GPU needed)",
                        description="Trace a model with Dynamo and print how cgbackend would split it: "
                                    "every region, its role, what stays eager and why. Captures nothing.")
    ex.add_argument("target", nargs="?", help="MODULE:FACTORY or FILE.py:FACTORY; FACTORY() returns "
                                              "(model, example_inputs): a tensor, a tuple of "
                                              "positional inputs, a dict of keyword inputs, or (args, kwargs)")
    ex.add_argument("--demo", choices=("moe", "dense"), help="a built-in reference model instead of a target")
    ex.add_argument("--json", action="store_true", help="print the report as JSON (schema: "
                                                        "cgbackend/report.schema.json)")
    ex.add_argument("--train", "--training", dest="train", action="store_true",
                    help="trace for training: model.train() and grad mode on (default: model.eval() "
                         "under torch.no_grad(), inference)")
    ex.add_argument("--by-name", action="store_true",
                    help="show the partition torch.compile(model, backend=\"cgbackend\") gives (Dynamo's "
                         "settings as they are: a graph break at each data-dependent op) instead of "
                         "cgbackend.compile(model)'s")
    ex.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also trace the other entry point (without counting launches) and give its graph "
                         "and break counts in the report's first line (default on)")
    ex.add_argument("--device", default="cpu",
                    help="device the model and inputs are traced on (default cpu); --device cuda traces as "
                         "the GPU run will (the dispatch forms the cost model picks there, host tensors kept "
                         "out of graphs); an error where CUDA is not available")
    ex.add_argument("--option", action="append", metavar="KEY=VALUE",
                    help="a cgbackend option (see cgbackend.Config), repeatable")
    ex.add_argument("--dynamic", action="append", metavar="[NAME:]DIM",
                    help="mark a dimension dynamic (a symbolic size), repeatable: DIM of the first "
                         "tensor input, or NAME:DIM of the keyword input NAME (or of the positional "
                         "input at index NAME)")
    ex.add_argument("--html", metavar="PATH", help="also write the report as one self-contained HTML page")
    ex.add_argument("-v", "--verbose", action="store_true", help="log cgbackend's INFO lines and torch's logs")
    ex.set_defaults(func=_cmd_explain)
    bench = sub.add_parser("bench", help="side-by-side benchmark; --help for its options "
                                         "(benchmarks/README.md)", add_help=False)
    bench.set_defaults(func=None)
    serve = sub.add_parser("serve-bench", help="serving loop with random batch sizes; --help for its "
                                               "options (benchmarks/README.md)", add_help=False)
    serve.set_defaults(func=None)
    dist_bench = sub.add_parser("bench-dist", help="DDP / FSDP2 / expert-parallel training, run with torchrun "
                                "(benchmarks/README.md)", add_help=False)
    dist_bench.set_defaults(func=None)
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "cgbackend") -> int:
    """The ``cgbackend`` console script; ``python -m cgbackend`` passes its own ``prog``."""
    parser = build_parser(prog)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from .bench import main as bench_main
        return bench_main(rest, prog=f"{prog} bench")
    if args.command == "bench-dist":
        from .bench.dist import main as bench_dist_main
        return bench_dist_main(rest)
    if args.command == "serve-bench":
        from .bench.serving import main as serving_main
        return serving_main(rest, prog=f"{prog} serve-bench")
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
