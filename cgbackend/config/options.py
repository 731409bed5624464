"""Options of cgbackend: one frozen dataclass, the only reader of ``CGBACKEND_*``.

Precedence, lowest first: the defaults below, then environment variables
(``CGBACKEND_<FIELD>`` in upper case, e.g. ``CGBACKEND_WARMUP=5``), then the
options passed to :func:`cgbackend.backend` / :func:`cgbackend.compile`.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any, Mapping

from .dispatch_mode import DispatchMode
from .suggest import did_you_mean, torch_compile_argument

__all__ = ["BOOL_OR_PATH", "Config", "ConfigError", "DispatchMode", "ENV_PREFIX", "parse_value"]

ENV_PREFIX = "CGBACKEND_"

BOOL_OR_PATH = ("dryrun",)
"""Options that take True / False or a file path (from text: a boolean word, else the path)."""

_INNER_COMPILERS = ("auto", "eager", "inductor")
_GRAPH_CACHES = ("lru", "keep")

DEFAULT_CAPTURE_SIZES: tuple[int, ...] = (
    1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60, 64, 80, 96, 112, 128, 160, 192,
    224, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584,
    4096, 5120, 6144, 7168, 8192)
"""Steps of 4 up to 64, then four steps per doubling: padding adds at most 3 rows up to 64 (4% of
the rows for sizes drawn from 1..64) and at most 25% above. Sizes 1..64 hit 18 of them, 1..128
hit 22. Coarser steps measured 10-18% more GPU time at mid sizes (benchmarks/SERVING.md)."""


class ConfigError(ValueError):
    """An option that does not exist or has a value outside its range."""


@dataclasses.dataclass(frozen=True)
class Config:
    warmup: int = 3
    """Eager calls of each static region before it is captured (per input signature)."""

    capture: bool = True
    """Capture static regions as CUDA graphs. False: partition and report, run everything eagerly."""

    min_region_ops: int = 2
    """A static region with fewer estimated kernel launches than this runs eagerly (folded)."""

    max_graphs_per_region: int = 32
    """Bound on the graphs one region holds, for each layer whose parameters its graph serves
    (input signatures or buckets, replaced parameters, training slots; a training forward and its
    backward count as one). At the bound, a new signature
    either evicts the least recently used graph (``graph_cache="lru"``) or runs eagerly
    (``"keep"``, or when every held graph is in use); each eager call is counted with its reason."""

    graph_cache: str = "lru"
    """What a region at ``max_graphs_per_region`` does with a new signature: "lru" evicts the graph
    used least recently (its memory goes back to the pool for the next capture), "keep" keeps the
    graphs it has and runs the new signature eagerly."""

    capture_sizes: tuple[int, ...] = DEFAULT_CAPTURE_SIZES
    """Bucketing: a static region proven row-independent along a symbolic size (passes/bucket.py)
    pads that size up to the next of these in inference calls and slices its outputs, so N sizes
    need only as many graphs as buckets. Sizes above the largest are captured exactly; () turns
    bucketing off (``CGBACKEND_CAPTURE_SIZES=off``; an empty variable is an error)."""

    max_capture_size: int = 0
    """Serving: an inference call of a bucketed region (see ``capture_sizes``) whose size is above
    this runs the region's compiled code without a graph (counted in eager_calls as
    ``above_max_capture_size``) instead of being padded or captured at its exact size, so a rare
    large batch costs no capture and no graph memory. Sizes up to it are padded as before. 0: no
    limit."""

    max_pending_forwards: int = 4
    """Training: how many forwards of one region may wait for their backward at once, for each layer
    whose parameters the region's graph serves (a deep model's layers each wait in a slot of their
    own: runtime/sharing.py), each with graphs of its own in the shared pool. A forward beyond that
    runs eagerly (counted)."""

    handout_graphs: int = 2
    """Inference: extra graphs of a region whose outputs are the call's (no static region reads
    them), each captured in a memory pool of its own when first needed, whose outputs go to the
    caller without a copy. A call replays one whose earlier outputs nobody holds any more (no
    tensor, view or storage of them is alive), so an output the caller keeps is never overwritten;
    when every such graph's outputs are still held, the region's own graph runs and its outputs are
    copied, as with 0. Each costs a capture and the region's memory once more (counted in
    ``handout_graphs``; ``outputs_handed`` counts the outputs returned without a copy)."""

    strict: bool = False
    """Raise instead of falling back to eager when a capture fails or a region cannot be replayed. A
    graph nothing of which can be captured (it computes on the CPU, or the machine has no CUDA
    device) raises at its first call too; ``simulate_graphs=True`` tests the runtime on CPU."""

    inner: str = "auto"
    """How static regions are compiled before capture: "auto" (the default): Inductor where regions
    are captured as CUDA graphs, eager's kernels where nothing is captured (CPU, simulate_graphs,
    capture=False, warmup=0); "inductor"; or "eager" (eager's kernels, results bitwise equal to
    eager: the bitwise mode). Compiled lazily, per region, at its first warm-up call; a region
    Inductor fails on runs eager's kernels (counted in stats()["inner_fallbacks"]). See
    cgbackend/runtime/inner.py."""

    dynamic_ops: tuple[str, ...] = ()
    """Operator names ("mylib::op", "torch.nonzero", "Tensor.item") always kept out of graphs. Each
    must name an existing operator (a registered op, an attribute of torch or of an importable
    module, a Tensor method): a typo is an error, not a silent no-op."""

    dynamic_modules: tuple[str, ...] = ()
    """fnmatch patterns of module paths ("layers.*.moe.experts*") always kept out of graphs."""

    capture_collectives: bool = False
    """Let a static region hold the functional all-to-all and all-reduce (and their waits) whose
    sizes are fixed by shapes, such as an expert-parallel exchange with a fixed capacity: NCCL work
    captured in the region's CUDA graph (passes/collectives.py). Collectives with host-read sizes
    run eagerly whatever this says. Off by default, every collective running eagerly between
    graphs: measured wrong on two H200s before torch 2.11's wait inside an autograd.Function was
    classified, equal to eager there since, and not yet shown to pay (docs/distributed.md)."""

    static_dispatch: DispatchMode = DispatchMode.AUTO
    """Rewrite data-dependent MoE dispatch loops into static, sync-free code so the whole layer is
    captured (cgbackend/moe/): "auto" (the default: a measured cost model picks the form per layer,
    and leaves a loop dynamic where no static form pays), a form ("grouped", "masked_dense", or
    "small_batch": the grouped form's routing with per-row products, for decode's few rows per
    expert; "auto" weighs it for layers that need no gradient), or "off". A rewrite is applied only
    where it is proven to compute what the loop computes; with it on, cgbackend.compile also
    rewrites skip-loops in the model's source (over nonzero() results or .tolist() counts) where the
    loop body is proven to leave nothing behind for a skipped expert, and lays out per-module expert
    weights as one block. The report lists every rewrite and every
    loop left alone, with why. Given as its text; read as a ``DispatchMode`` (config/dispatch_mode.py)."""

    regional_min_layers: int = 6
    """cgbackend.compile compiles a stack of at least this many identical layers (an nn.ModuleList or
    nn.Sequential of one class with equal parameter shapes) one layer at a time: Dynamo traces,
    cgbackend analyses and Inductor compiles one layer, which every layer of the stack reuses, and
    each layer captures its own graphs, so compile time stays flat in depth (regional.py). Layers
    Dynamo specialises apart (a Python value of their own such as self.layer_idx, hooks on their
    submodules) are compiled in groups of their own, and a layer call Dynamo runs without cgbackend
    is counted and reported (regional_calls.py). Each layer is then a graph call of its own (tens of
    microseconds of host time per layer); a shallower stack stays inside one whole-model graph. 0
    turns it off."""

    opaque_modules: bool = True
    """``cgbackend.compile`` and ``cgbackend.explain`` make each module Dynamo cannot trace but
    cgbackend knows (Transformer Engine's, cgbackend/integrations/te.py) one opaque call in the graph, so its
    kernels join the static regions (cgbackend/integrations/opaque.py). False leaves them to Dynamo: a graph
    break at each, their kernels eager."""

    profile: bool = False
    """Time every region call of the forward (CUDA events on a GPU, perf_counter otherwise), split
    into graph replays and eager calls; shown in cgbackend.report(compiled) and its HTML page
    (runtime/region_timer.py). Costs two event records per region call."""

    simulate_graphs: bool = False
    """Test aid for machines without a GPU: "capture" runs the region once into static buffers and
    "replay" re-runs it and writes into the same buffers, so buffer reuse, hand-offs, copies and
    counters can be tested on CPU. Never a speed-up; off by default."""

    dryrun: bool | str = False
    """Show the partition report of each graph once, at its first call, and run the model as
    compiled. True logs the report's text at WARNING on the ``cgbackend.dryrun`` logger (stderr
    unless logging is configured otherwise); a file path (a string) writes the JSON report of every
    graph so far there instead and logs one line naming the file (dryrun.py; Torch-TensorRT's dry
    run does the same at compile time)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in BOOL_OR_PATH:
                if not isinstance(value, bool) and not (isinstance(value, str) and value.strip()):
                    raise ConfigError(f"cgbackend option {f.name} takes True, False or a file path, got {value!r}")
                continue
            if isinstance(f.default, bool) and not isinstance(value, bool):
                # A string such as "false" is truthy: never guess, the environment has its spellings.
                raise ConfigError(f"cgbackend option {f.name} takes True or False, got {value!r}")
        _check_int(self, "warmup", 0)
        _check_int(self, "min_region_ops", 1)
        _check_int(self, "max_graphs_per_region", 1)
        _check_int(self, "max_pending_forwards", 1)
        _check_int(self, "handout_graphs", 0)
        _check_int(self, "regional_min_layers", 0)
        _check_int(self, "max_capture_size", 0)
        if self.inner not in _INNER_COMPILERS:
            raise ConfigError(
                f"cgbackend option inner={self.inner!r} is not one of {', '.join(_INNER_COMPILERS)}"
                + did_you_mean(self.inner, _INNER_COMPILERS)
            )
        if self.inner == "inductor" and self.warmup < 1 and self.capture:
            raise ConfigError("cgbackend option inner='inductor' needs warmup >= 1: Inductor compiles "
                              "its backward at the first backward, which must not happen during a capture")
        if self.graph_cache not in _GRAPH_CACHES:
            raise ConfigError(f"cgbackend option graph_cache={self.graph_cache!r} is not one of "
                              f"{', '.join(_GRAPH_CACHES)}{did_you_mean(self.graph_cache, _GRAPH_CACHES)}")
        object.__setattr__(self, "capture_sizes", _capture_sizes(self.capture_sizes))
        object.__setattr__(self, "static_dispatch", _dispatch_mode(self.static_dispatch))
        for name in ("dynamic_ops", "dynamic_modules"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"cgbackend option {name} takes a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        from ..common.op_names import unresolved_op_names
        unknown = unresolved_op_names(self.dynamic_ops)
        if unknown:
            raise ConfigError(
                f"cgbackend option dynamic_ops: {', '.join(map(repr, unknown))} names no operator; use "
                "'namespace::op' (a registered op), 'torch.fn', 'torch.nn.functional.fn', "
                "'Tensor.method' or 'module.fn' of an importable module")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None,
                     environ: Mapping[str, str] | None = None) -> "Config":
        """Defaults, then ``CGBACKEND_*`` from ``environ`` (default ``os.environ``), then ``options``."""
        options = dict(options or {})
        valid = cls.field_names()
        unknown = sorted(set(options) - set(valid))
        for name in unknown:  # mode="reduce-overhead", options={...}: torch.compile's, given to cgbackend
            tailored = torch_compile_argument(name, options[name])
            if tailored:
                raise ConfigError(tailored)
        if unknown:
            raise ConfigError(
                f"unknown cgbackend option(s) {', '.join(u + did_you_mean(u, valid) for u in unknown)}; "
                f"valid options: {', '.join(valid)}"
            )
        values: dict[str, Any] = {}
        env = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for key, raw in env.items():
            if not key.startswith(ENV_PREFIX):
                continue
            name = key[len(ENV_PREFIX):].lower()
            if name not in fields:
                raise ConfigError(
                    f"environment variable {key} names no cgbackend option"
                    f"{did_you_mean(key, [ENV_PREFIX + v.upper() for v in valid])}; valid: "
                    + ", ".join(ENV_PREFIX + v.upper() for v in valid)
                )
            values[name] = parse_value(key, raw, fields[name].default, path_ok=name in BOOL_OR_PATH)
        values.update(options)
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return Config.from_options({**dataclasses.asdict(self), **changes}, environ={})

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON takes them: tuples as lists, a parsed option as its text."""
        return {k: (list(v) if isinstance(v, tuple) else v.value if isinstance(v, enum.Enum) else v)
                for k, v in dataclasses.asdict(self).items()}


def _dispatch_mode(value: Any) -> DispatchMode:
    """The static_dispatch option as its typed value: the one place its text is read."""
    if isinstance(value, DispatchMode):
        return value
    names = [m.value for m in DispatchMode]
    if not isinstance(value, str) or value not in names:
        raise ConfigError(f"cgbackend option static_dispatch={value!r} is not one of "
                          f"{', '.join(names)}{did_you_mean(value, names)}")
    return DispatchMode(value)


def _capture_sizes(value: Any) -> tuple[int, ...]:
    """Sorted distinct positive ints; accepts the strings an environment variable gives."""
    if isinstance(value, (str, int)):
        raise ConfigError(f"cgbackend option capture_sizes takes a sequence of sizes, got {value!r}")
    sizes = []
    for v in value:
        try:
            size = int(v)
        except (TypeError, ValueError):
            size = 0
        if isinstance(v, bool) or size < 1 or (not isinstance(v, str) and size != v):
            raise ConfigError(f"cgbackend option capture_sizes: {v!r} is not a positive integer")
        sizes.append(size)
    return tuple(sorted(set(sizes)))


def _check_int(cfg: Config, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"cgbackend option {name} must be an integer >= {minimum}, got {value!r}")


def parse_value(key: str, raw: str, default: Any, path_ok: bool = False) -> Any:
    """Parse an option's text (environment variable, command line) by the type of its default;
    ``path_ok``: a boolean option that also takes a file path (BOOL_OR_PATH)."""
    text = raw.strip()
    if isinstance(default, bool):
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        if path_ok and text:
            return text
        raise ConfigError(f"{key}={raw!r}: expected one of 1/0/true/false/yes/no/on/off")
    if isinstance(default, int):
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected an integer") from None
    if isinstance(default, tuple):
        if default and all(isinstance(v, int) for v in default):  # capture_sizes
            if not text:
                raise ConfigError(f"{key} is empty: give sizes (e.g. 1,2,4,8) or 'off' to turn "
                                  "bucketing off")
            if text.lower() in ("off", "none"):
                return ()
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


def _document() -> None:
    from .docs import class_docstring
    Config.__doc__ = class_docstring(Config)


_document()
