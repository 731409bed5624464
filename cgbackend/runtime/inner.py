"""Inner compilers: what a static region's FX module becomes before it is captured.

``inner="eager"`` keeps the module as is: eager's kernels, results bitwise equal to eager (the
bitwise mode). ``inner="inductor"`` compiles it with Inductor (Inductor's own CUDA graphs off:
cgbackend captures) using the fake values Dynamo recorded for the region's inputs. ``inner="auto"``
(the default) is Inductor for graphs whose regions will be captured as CUDA graphs (a CUDA graph,
CUDA available, ``capture=True``, not ``simulate_graphs``, ``warmup >= 1``) and eager's kernels where
nothing is captured: a CPU graph, simulated graphs, ``capture=False``; there compiling would only cost
time (:func:`resolve_inner`).

Compilation is lazy and per region (:class:`LazyInner`): a region is compiled at its first warm-up
call, so only regions that are called are compiled, and every warm-up call runs the compiled code
outside any capture (Inductor loads its kernels and, in training, compiles its backward there; and a
training step's peak memory is the compiled code's, not eager's kernels'). A region whose compile or first
compiled call fails runs eager's kernels from then on; the reason is counted
(``stats()["inner_fallbacks"]``) and listed (``stats()["inner_failures"]``, the runtime report).
Training works through Inductor's AOT autograd.
"""

from __future__ import annotations

import functools
import logging
import operator
import time
from typing import Any, Callable, Optional

import torch
import torch.fx

from ..common import progress
from ..config import Config
from ..common.fx_utils import copy_module, fake_value
from .capture import first_line
from .layouts import AdaptedCall, InputLayouts

__all__ = ["InnerFallback", "KEEP_GRAPH", "LazyInner", "compiled_call", "donating", "inductor_compile", "no_donated_buffers",
           "resolve_inner"]

log = logging.getLogger(__name__)


def no_donated_buffers():
    """Around the backward runs cgbackend makes itself: AOT autograd refuses a backward that keeps
    the graph once its code reuses saved tensors' memory (donated buffers), and the captures and
    eager fallbacks keep it. Each of those runs once per forward (replay), so the saved tensors it
    overwrites are written again before anything reads them (runtime/backward.py)."""
    return torch._functorch.config.patch(donated_buffer=False)


KEEP_GRAPH: Optional[Callable[[], bool]] = getattr(getattr(torch._C, "_autograd", None),
                                                  "_get_current_graph_task_keep_graph", None)
"""Does the running backward keep its graph (retain_graph=True)? Private, feature-tested (AOT
autograd reads it to choose its backward); None without it."""


def compiled_call(fn: Any) -> Any:
    """The Inductor call under a region's callable (AdaptedCall wraps it), or ``fn``."""
    return fn.fn if isinstance(fn, AdaptedCall) else fn


def donating(fn: Any) -> bool:
    """Was a region's code compiled with donated buffers? Its backward may then write into saved
    tensors it has read: AOT autograd compiles that backward when it first runs, donating only if
    that run keeps no graph, but a backward loaded from its cache (compiled so before, in this
    process or an earlier one) donates whatever runs first. So any backward of such code may."""
    return getattr(compiled_call(fn), "donating", False)


class InnerFallback:
    """Stable names of the reasons a region that should be compiled by Inductor runs eager's
    kernels (keys of ``stats()["inner_fallbacks"]``)."""

    COMPILE_FAILED = "inductor_compile_failed"
    FIRST_CALL_FAILED = "inductor_first_call_failed"
    OPAQUE_CALL = "opaque_call"
    HOST_SYNC = "host_sync_in_compiled_code"

    DESCRIPTIONS = {
        COMPILE_FAILED: "Inductor raised while compiling the region; it runs eager's kernels",
        FIRST_CALL_FAILED: "the region's Inductor code raised on its first call; it runs eager's kernels",
        OPAQUE_CALL: "the region holds an opaque module call (Transformer Engine), which Inductor "
                     "would trace as its shape only; it runs eager's kernels",
        HOST_SYNC: "the region's Inductor code synchronized with the host in warm-up; it runs eager's "
                   "kernels, so the synchronizing op can be found and split off",
    }


def resolve_inner(config: Config, compute_device: str) -> str:
    """The inner compiler one graph's static regions get: "eager" or "inductor".

    "auto" means Inductor exactly where regions will be captured as CUDA graphs; where nothing is
    captured (CPU graphs, simulated graphs, capture=False) eager's kernels run, as with "eager"."""
    if config.inner != "auto":
        return config.inner
    captured = (config.capture and not config.simulate_graphs and config.warmup >= 1
                and compute_device == "cuda" and torch.cuda.is_available())
    return "inductor" if captured else "eager"


def _example_inputs(module: torch.fx.GraphModule) -> list[Any]:
    return [fake_value(n) for n in module.graph.nodes if n.op == "placeholder"]


def _hoist_input_views(module: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, list[tuple[Callable, list]]]:
    """Take the no-copy views of the region's inputs out of what Inductor compiles.

    ``stacked_view(w_0, ..., w_{E-1})`` (moe/expert_layout.py) is a view of one block only for real
    tensors; traced with fake ones it is a ``torch.stack``, and Inductor would copy every expert's
    weights on every call. ``block_view(w_0, E)`` reads past ``w_0``'s own elements, which Inductor
    does not expect of an input. Each such call whose tensor arguments are all inputs of the region
    becomes a new input, computed (a view, no kernel) by the caller. Returns the module to compile
    (a copy when anything was hoisted) and, per new input, (function, its arguments: an input's
    index, or a constant as ``(value,)``)."""
    from ..moe.expert_layout import block_view, stacked_view

    placeholders = [n for n in module.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(placeholders)}
    hoist = [n for n in module.graph.nodes
             if n.op == "call_function" and n.target in (stacked_view, block_view) and not n.kwargs
             and all(a in index if isinstance(a, torch.fx.Node) else isinstance(a, int) for a in n.args)
             and fake_value(n) is not None]
    if not hoist:
        return module, []
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    copied = copy_module(module, env)
    graph = copied.graph
    last = env[placeholders[-1]]
    views = []
    for n in hoist:
        with graph.inserting_after(last):
            new = graph.placeholder(f"{n.name}_input")
        new.meta = dict(n.meta)
        env[n].replace_all_uses_with(new)
        graph.erase_node(env[n])
        last = new
        views.append((n.target, [index[a] if isinstance(a, torch.fx.Node) else (a,) for a in n.args]))
    copied.recompile()
    return copied, views


class _Reach:
    """One eager call's backward through Inductor code: which outputs received a gradient."""

    __slots__ = ("reach", "got", "live")

    def __init__(self, reach: tuple) -> None:
        self.reach = reach
        self.got: set[int] = set()
        self.live: Optional[set[int]] = None

    def reached(self, j: int) -> bool:
        if self.live is None:  # every output's gate ran before the compiled node's backward
            self.live = set().union(*[self.reach[k] for k in self.got]) if self.got else set()
        return j in self.live


class _OutMark:
    """Hook on one output of an eager call: notes that the output received a gradient.

    A hook, not an identity Function: a Function's output is a view of its input, and a write
    through another view of the same memory (``y.view(-1)`` returned beside ``y``) would make
    reading it an error that eager code never raises."""

    __slots__ = ("state", "k")

    def __init__(self, state: _Reach, k: int) -> None:
        self.state, self.k = state, k

    def __call__(self, grad: Optional[torch.Tensor]) -> None:
        if grad is not None:  # the engine calls an output's hooks with None when it got no gradient
            self.state.got.add(self.k)


class _InGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, state: _Reach, j: int, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.state, ctx.j = state, j
        # An alias that is not a view (detach shares memory and the version counter): outputs that
        # are views of this input (``p[0]``) must stay writable as eager's are, and a view made
        # inside a Function forbids writes through its other views.
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: Optional[torch.Tensor]) -> tuple:  # type: ignore[override]
        return None, None, (grad if ctx.state.reached(ctx.j) else None)


class _Gated:
    """Eager calls of Inductor code under autograd (warm-up, eager fallbacks), with eager's None.

    AOT autograd's forward is one autograd node reaching every input, and it hands zeros for the
    outputs the loss did not use, so inputs only those outputs reach would get a zero ``.grad``
    where eager autograd leaves None (an optimizer with momentum or weight decay treats the two
    differently). Hooks on the outputs note which received a gradient; identity gates on the inputs
    hand None on to the inputs none of those outputs reach (reach from a fake run of the FX module,
    once per pattern of inputs that require grad). Graph replays do this in the runner (region.py)."""

    def __init__(self, module: torch.fx.GraphModule) -> None:
        self.module = module
        self.reach: dict[tuple, Any] = {}

    def __call__(self, fn: Callable[..., Any], args: tuple) -> Any:
        diff_in = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad)
        if not diff_in or not torch.is_grad_enabled() or _capturing():
            return fn(*args)
        if diff_in not in self.reach:
            from .reach import fake_output_reach
            self.reach[diff_in] = fake_output_reach(self.module, args, diff_in)
        found = self.reach[diff_in]
        if found is None or all(len(r) == len(diff_in) for r in found[1]):
            return fn(*args)  # every output reaches every input: no gradient can be None
        diff_out, reach = found
        state = _Reach(reach)
        gated = list(args)
        for j, i in enumerate(diff_in):
            gated[i] = _InGate.apply(state, j, args[i])
        outs = fn(*gated)
        seq = outs if isinstance(outs, (tuple, list)) else (outs,)
        for n, k in enumerate(diff_out):
            if k < len(seq) and isinstance(seq[k], torch.Tensor) and seq[k].grad_fn is not None:
                seq[k].register_hook(_OutMark(state, n))
        return outs


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def inference_patches() -> dict[str, Any]:
    """Inductor options a region compiled now gets beyond Inductor's defaults: only for regions
    compiled without gradients (inference, decode); a training region keeps Inductor's default
    code, forward and backward. Feature-tested (torch 2.11 and 2.13 have it).

    ``combo_kernels``: independent small kernels, such as the rotary embedding of q and of k or the
    key and value cache writes of a decode step, launched as one. Inside a CUDA graph each launch
    still costs the GPU its gap, and a decode step of a small model is tens of such launches: on an
    H100, a step of the Llama decode benchmark (batch 8) took 185 us of GPU time with them, 205 us
    without."""
    from torch._inductor import config as inductor_config
    if torch.is_grad_enabled() or not hasattr(inductor_config, "combo_kernels"):
        return {}
    return {"combo_kernels": True}


TOPK_SELECT_MAX_WIDTH = 512
"""Widest dimension whose ``topk`` an inference region computes by selection (:func:`topk_by_keys`):
a MoE router's experts (8 to 256), not a vocabulary, where ATen's topk is the faster kernel."""
TOPK_SELECT_MAX_K = 16
"""Largest ``k`` computed by selection: each of the k picks is one reduction over the dimension."""
_SELECT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Values whose float32 bit pattern orders them (float64 would not fit a key with its index)."""
_INT32_MAX = 2 ** 31 - 1
_PICKED = -(2 ** 63) + 1
"""A picked key's new value: below every real key (those are at least ``(-2**31 + 1) * 2**32``),
and not int64's minimum, whose literal (``-9223372036854775808``) a kernel source would write as
the negation of a constant that only fits an unsigned type."""


def _topk_parts(node: torch.fx.Node) -> Optional[tuple]:
    """(x, k, dim, largest) of a ``torch.topk`` / ``Tensor.topk`` node that selection can replace,
    or None (its ``sorted`` must be a literal too: selection returns the values sorted either way)."""
    is_topk = ((node.op == "call_function" and node.target is torch.topk)
               or (node.op == "call_method" and node.target == "topk"))
    if not is_topk or "out" in node.kwargs:
        return None
    names = ("input", "k", "dim", "largest", "sorted")
    found = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        found["input" if key == "self" else key] = value
    x, k = found.get("input"), found.get("k")
    dim, largest, ordered = found.get("dim", -1), found.get("largest", True), found.get("sorted", True)
    if not isinstance(x, torch.fx.Node) or not isinstance(k, int) or not isinstance(dim, int) \
            or not isinstance(largest, bool) or not isinstance(ordered, bool):
        return None
    value = fake_value(x)
    if value is None or value.dim() == 0 or getattr(value, "fake_mode", None) is None \
            or "example_value" not in x.meta or value.dtype not in _SELECT_DTYPES:
        return None
    width = value.shape[dim]
    if not isinstance(width, int) or width > TOPK_SELECT_MAX_WIDTH or not 1 <= k <= min(width, TOPK_SELECT_MAX_K):
        return None
    if any(u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1)
           for u in node.users):
        return None
    return x, k, dim % value.dim(), largest


def _traced(graph: torch.fx.Graph, fn: Any, args: tuple, kwargs: Optional[dict] = None) -> torch.fx.Node:
    """A new ``call_function`` node (``call_method`` where ``fn`` is a method's name) with the fake
    value Dynamo's nodes carry (``example_value``; ``val`` too), computed from its arguments' (the
    caller is in their fake mode): AOT autograd's cache takes only graphs whose nodes have them."""
    kwargs = kwargs or {}
    fake_args = torch.fx.node.map_arg(args, lambda n: n.meta["example_value"])
    fake_kwargs = torch.fx.node.map_arg(kwargs, lambda n: n.meta["example_value"])
    if isinstance(fn, str):
        node = graph.call_method(fn, args, kwargs)
        value = getattr(fake_args[0], fn)(*fake_args[1:], **fake_kwargs)
    else:
        node = graph.call_function(fn, args, kwargs)
        value = fn(*fake_args, **fake_kwargs)
    node.meta["example_value"] = node.meta["val"] = value
    return node


def _selection(graph: torch.fx.Graph, x: torch.fx.Node, k: int, dim: int, largest: bool) -> tuple:
    """Nodes computing topk's (values, indices) of ``x`` along ``dim`` by k picks of the largest
    key. A value's key is its float32 bit pattern made monotonic (as a signed integer: negative
    patterns have their magnitude bits flipped), -0.0 folded onto 0.0 and every NaN above +inf as
    topk ranks it (below every number where ``largest=False``), bit-inverted where
    ``largest=False``; shifted up 32 bits with the index's complement below, so every key in a row
    is distinct and a tie goes to the lower index. Each pick is a max reduction; the picked key is
    then set below every real key."""
    value = fake_value(x)
    width, trailing = value.shape[dim], value.dim() - 1 - dim

    def op(fn: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        return _traced(graph, fn, args, kwargs)

    bits = op("view", op("float", x), torch.int32)
    key = op(torch.where, op(torch.ge, bits, 0), bits, op(torch.bitwise_xor, bits, _INT32_MAX))
    key = op(torch.where, op(torch.eq, x, 0), 0, key)
    if not largest:
        key = op(torch.bitwise_not, key)
    # NaN: above +inf's key where largest, below -inf's (inverted) key where smallest, and there
    # still above the picked marker's upper half.
    key = op(torch.where, op(torch.isnan, x), _INT32_MAX if largest else -_INT32_MAX, key)
    below = op(torch.arange, width - 1, -1, -1, dtype=torch.int64, device=value.device)
    if trailing:
        below = op("view", below, (width,) + (1,) * trailing)
    key = op(torch.add, op(torch.mul, op("to", key, torch.int64), 2 ** 32), below)
    picks = []
    for j in range(k):
        top = op(torch.amax, key, dim, True)
        picks.append(op(torch.rsub, op(torch.bitwise_and, top, 2 ** 32 - 1), width - 1))
        if j + 1 < k:
            key = op(torch.where, op(torch.eq, key, top), _PICKED, key)
    index = op(torch.cat, picks, dim) if k > 1 else picks[0]
    return op(torch.gather, x, dim, index), index


def topk_by_keys(module: torch.fx.GraphModule) -> int:
    """Compute a region's small ``topk`` calls (a MoE router's choice of experts) by selection, in
    place; returns how many. The k largest (smallest) values in descending (ascending) order and
    their indices, as topk returns them with ``sorted=True`` (also a valid result where
    ``sorted=False`` leaves the order free); among equal values (-0.0 equals 0.0, NaN equals NaN)
    the lower index comes first, where topk leaves the choice unspecified. Inductor fuses the k max
    reductions with the softmax before them into one kernel; ATen's topk is two kernels (a gather,
    then a bitonic sort of the k values), and a sort (Inductor's other one-kernel form) took 25-32 s
    more Triton compile than topk on an H100's host. Written as plain torch calls, each node with its fake value, so the
    graph stays one that Inductor's caches take. Only for inference regions compiled by Inductor
    (inductor_compile): the eager kernels (``inner="eager"``) stay bitwise eager's."""
    graph = module.graph
    done = 0
    for node in list(graph.nodes):
        parts = _topk_parts(node)
        if parts is None:
            continue
        x, k, dim, largest = parts
        with graph.inserting_before(node), fake_value(x).fake_mode:
            results = _selection(graph, x, k, dim, largest)
        for user in list(node.users):
            user.replace_all_uses_with(results[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        done += 1
    if done:
        module.recompile()
    return done


def inductor_compile(module: torch.fx.GraphModule, donate: bool = False) -> Callable[..., Any]:
    """Compile one region's FX module with Inductor (no CUDA graphs of its own).

    ``donate``: let its backward reuse the memory of the saved tensors it has read (AOT autograd's
    donated buffers, on by default under torch.compile), in the region's warm-up calls and its
    backward graph (dense-llama8b-shape, H100: the first warm-up backward peaks 81 MiB lower).
    Only for a region that can compute its forward again: the caller reads each forward's saved
    tensors in one backward, and computes the forward again for any other (runtime/backward.py)."""
    from torch._inductor.compile_fx import compile_fx  # imported only when a region is compiled

    gate = _Gated(module)
    module, views = _hoist_input_views(module)
    if not torch.is_grad_enabled() and any(_topk_parts(n) is not None for n in module.graph.nodes):
        module = copy_module(module)  # the region's own module stays as traced (eager fallback)
        topk_by_keys(module)
    example_inputs = _example_inputs(module)
    patches: dict[str, Any] = {"triton.cudagraphs": False, "triton.cudagraph_trees": False}
    extra = inference_patches()
    donating = donate and torch.is_grad_enabled() and bool(torch._functorch.config.donated_buffer)
    # Read when AOT autograd partitions the region: at compile and on the first call.
    donation = functools.partial(torch._functorch.config.patch, donated_buffer=donating)
    with donation():
        try:
            compiled = compile_fx(module, example_inputs, config_patches={**patches, **extra})
        except Exception as exc:
            if not extra:
                raise
            # An option off by Inductor's default: where a compile fails with it, the region gets
            # Inductor's default code (logged; the region is still compiled).
            log.info("cgbackend: Inductor failed with %s (%s); compiling without", ", ".join(extra), first_line(exc))
            compiled = compile_fx(module, example_inputs, config_patches=patches)

    def run(*args: Any) -> Any:
        if views:
            args = args + tuple(fn(*[args[a] if isinstance(a, int) else a[0] for a in spec]) for fn, spec in views)
        with donation():  # parts of AOT compile on first call
            return compiled(*args)

    def call(*args: Any) -> Any:  # Dynamo's calling convention: compiled(*args)
        out = gate(run, args)
        if not call.backward_seen and torch.is_grad_enabled() and not _capturing():
            _note_backward(out, call)
        return out

    call.needs_backward_prewarm = True
    call.backward_seen = False
    """Set once a backward of the compiled code ran outside a capture (AOT autograd compiles its
    backward then): runtime/backward.py may capture a backward without running one first."""
    call.donating = donating
    """Compiled with donated buffers: any backward of it may write into saved tensors (donating)."""
    return call


def _note_backward(out: Any, call: Any) -> None:
    """Mark ``call.backward_seen`` when a gradient reaches the first output that has a grad_fn."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            def seen(grad: torch.Tensor) -> None:
                call.backward_seen = True
            t.register_hook(seen)
            return


class LazyInner:
    """One region's pending Inductor compile (owned by its RegionRunner).

    ``compile()`` is called by the runner at the region's first warm-up call; it returns the
    callable the region runs from then on: the compiled code, or the FX module after a counted
    fallback. ``first_call(fn, ins)`` runs the first compiled call and falls back the same way if it
    raises. ``copied``: positions of the inputs the runner copies (their layouts are the compiled
    code's to choose, runtime/layouts.py); ``written``: those the region writes in place."""

    __slots__ = ("module", "name", "counters", "strict", "compiler", "state", "reason", "detail",
                 "seconds", "copied", "written", "donate")

    def __init__(self, module: torch.fx.GraphModule, name: str, counters: Any, strict: bool = False,
                 compiler: Optional[Callable[..., Callable[..., Any]]] = None,
                 copied: tuple[int, ...] = (), written: tuple[int, ...] = (), donate: bool = False) -> None:
        self.module = module
        self.donate = donate
        """Compile with donated buffers (inductor_compile): only for a region that can compute its
        forward again, and not for simulated graphs (their capture runs the backward that their
        first replay runs again)."""
        self.copied = copied
        self.written = written
        self.strict = strict
        self.name = name
        self.counters = counters
        self.compiler = compiler if compiler is not None else inductor_compile
        self.state = "pending"
        """pending -> compiled | eager (fallback, with reason and detail)."""
        self.reason: Optional[str] = None
        self.detail = ""
        self.seconds = 0.0

    def compile(self) -> Callable[..., Any]:
        """The compiled code, wrapped to take the copied inputs in any layout (AdaptedCall), or the
        FX module after a counted fallback."""
        start = time.perf_counter()
        try:
            layouts, module = InputLayouts.plan(self.module, self.copied, self.written)
            fn = self.compiler(module, donate=True) if self.donate else self.compiler(module)
        except Exception as exc:  # any Inductor error: this region keeps eager's kernels
            log.debug("cgbackend: Inductor's error on region %s, whose code is\n%s", self.name, self.module.code,
                      exc_info=exc)
            return self.fall_back(InnerFallback.COMPILE_FAILED, first_line(exc))
        finally:
            self.seconds = time.perf_counter() - start
            self.counters.inner_compile_s += self.seconds
        self.state = "compiled"
        self.counters.inner_compiled += 1
        progress.log.log(progress.level(self.seconds), "cgbackend: %s compiled by Inductor in %.1f s",
                         self.name, self.seconds)
        return AdaptedCall(fn, self.module, layouts, self.counters) if layouts.layouts else fn

    def first_call(self, fn: Callable[..., Any], ins: list) -> tuple[Callable[..., Any], Any]:
        """Run the first call of the compiled code; (the callable to keep, the outputs)."""
        try:
            return fn, fn(*ins)
        except Exception as exc:
            module = self.fall_back(InnerFallback.FIRST_CALL_FAILED, first_line(exc))
            return module, module(*ins)

    def fall_back(self, reason: str, detail: str) -> torch.fx.GraphModule:
        if self.strict:
            raise RuntimeError(f"cgbackend: region {self.name} cannot run Inductor's code ({reason}): "
                               f"{detail}; strict=True forbids falling back to eager's kernels")
        if self.state == "compiled":
            self.counters.inner_compiled -= 1
        self.state = "eager"
        self.reason = reason
        self.detail = detail
        self.counters.inner_fallbacks[reason] += 1
        self.counters.inner_failures.append({"region": self.name, "reason": reason, "detail": detail})
        log.warning("cgbackend: region %s runs eager's kernels instead of Inductor's (%s): %s",
                    self.name, reason, detail)
        return self.module

    def summary(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "detail": self.detail,
                "compile_s": round(self.seconds, 3)}
