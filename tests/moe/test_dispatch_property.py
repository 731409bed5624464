"""Random MoE dispatch loops, compared with eager in float64: outputs and every gradient.

Each case is a forward built from a small grammar of what real dispatch loops do:

* skip form: the loop over the experts that received tokens (``e = e[0]``, ``e = int(e)``, or
  ``e = e[0]`` with ``e.item()`` in the body), ``if counts[e] == 0: continue`` over
  ``bincount(...).tolist()``, or a plain ``range`` loop; optionally the routing rebound between the
  count (hit test) and the loop;
* side effects: a counter, an append, an auxiliary accumulator, an attribute write, a temporary of
  the body, a value of the body read after the loop;
* accumulation: ``index_add_``, ``acc[tok] += v``, or an accumulator the experts also read;
* a per-expert reduction (an ``amax()`` scale, which the graph rewrite leaves dynamic);
* experts: SwiGLU, linear, or half of them ``sqrt(x + 3)`` with the routing keeping negative tokens
  away from those;
* routing: random, everything on two experts (the other two get no token), or by sign.

Two checks. The source rewrite, run eagerly, for every case: called as it is (eagerly it keeps the
skip) and with the traced meaning (``is_compiling`` true: the skip is gone), it equals the user's
loop, and it rewrites exactly the loops the grammar makes sound. The whole pipeline
(``cgbackend.compile`` with static dispatch, simulated graphs): a stratified subset by default, every
case with ``-m slow`` (``python -m pytest tests/moe/test_dispatch_property.py -m slow``).
"""

from __future__ import annotations

import copy
import dataclasses
import linecache
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cgbackend
from cgbackend.models.layers import Expert
from moe_helpers import SqrtExpert, top_k_routing
from cgbackend.moe.source_rewrite import rewrite_function

D, E, K, T = 8, 4, 2, 10
SEED, CASES = 36, 240

SKIPS = ("hit", "hit_int", "hit_item", "count", "range")
EFFECTS = ("counter", "append", "aux", "attr", "temp", "read_after")
UNSOUND = {"counter", "append", "aux", "attr", "read_after"}
"""Effects that an expert without tokens would change: the loop must stay as written."""


@dataclasses.dataclass(frozen=True)
class Case:
    index: int
    skip: str
    rebind: bool
    effects: tuple[str, ...]
    acc: str          # "index_add" | "setitem" | "self_read"
    reduction: bool
    expert: str       # "swiglu" | "linear" | "sqrt"
    routing: str      # "random" | "skewed" | "sign"
    mode: str         # static_dispatch for the pipeline

    @property
    def sound(self) -> bool:
        """The grammar's own verdict: rewriting this loop keeps its meaning."""
        return (self.skip not in ("range", "hit_item") and not self.rebind
                and not UNSOUND & set(self.effects))

    def __str__(self) -> str:
        return (f"case{self.index}-{self.skip}{'-rebind' if self.rebind else ''}-{'+'.join(self.effects) or 'pure'}"
                f"-{self.acc}{'-amax' if self.reduction else ''}-{self.expert}-{self.routing}-{self.mode}")


def _draw(rng: random.Random, index: int) -> Case:
    skip = rng.choice(SKIPS)
    expert = rng.choice(("swiglu", "swiglu", "linear", "sqrt"))
    routing = "sign" if expert == "sqrt" else rng.choice(("random", "skewed"))
    rebind = skip in ("hit", "count") and rng.random() < 0.2
    # An amax() of an empty selection fails eagerly too: only where the loop skips empty experts.
    reduction = skip != "range" and not rebind and rng.random() < 0.25
    effects = tuple(sorted(rng.sample(EFFECTS, rng.choice((0, 0, 1, 1, 2)))))
    acc = rng.choice(("index_add", "index_add", "setitem", "self_read"))
    return Case(index, skip, rebind, effects, acc, reduction, expert, routing,
                rng.choice(("masked_dense", "grouped", "auto")))


def _cases() -> list[Case]:
    rng = random.Random(SEED)
    return [_draw(rng, i) for i in range(CASES)]


# ----------------------------------------------------------------------------- the generated code

def _source(case: Case) -> str:
    """The forward of ``case``, as a user would write it."""
    lines = ["def forward(self, x):",
             f"    h = x.reshape(-1, {D})",
             "    w, ind = self.route(h)",
             "    out = h.clone()" if case.acc == "self_read" else "    out = torch.zeros_like(h)"]
    pre = {"counter": "n = 0", "append": "used = []", "aux": "aux = h.new_zeros(())", "attr": "self.seen = -1"}
    lines += [f"    {pre[e]}" for e in case.effects if e in pre]
    e_id = "e.item()" if case.skip == "hit_item" else "e"
    if case.skip.startswith("hit"):
        lines += [f"    mask = F.one_hot(ind, num_classes={E}).permute(2, 1, 0)",
                  "    hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()"]
        if case.rebind:
            lines.append(f"    mask = F.one_hot((ind + 1) % {E}, num_classes={E}).permute(2, 1, 0)")
        lines += ["    for e in hit:", "        e = int(e)" if case.skip == "hit_int" else "        e = e[0]",
                  "        slot, tok = torch.where(mask[e])"]
    else:
        if case.skip == "count":
            lines.append(f"    counts = torch.bincount(ind.flatten(), minlength={E}).tolist()")
            if case.rebind:
                lines.append(f"    ind = (ind + 1) % {E}")
        lines.append(f"    for e in range({E}):")
        if case.skip == "count":
            lines += ["        if counts[e] == 0:", "            continue"]
        lines.append("        tok, slot = torch.where(ind == e)")
    src = "out" if case.acc == "self_read" else "h"
    lines.append(f"        y = self.experts[{e_id}]({src}[tok])")
    if case.reduction:
        lines.append("        y = y / y.abs().amax()")
    lines.append("        v = y * w[tok, slot, None]")
    if "temp" in case.effects:
        lines += ["        part = v * 0.5", "        v = part + part"]
    lines.append("        out[tok] += v" if case.acc == "setitem" else "        out.index_add_(0, tok, v)")
    body = {"counter": "n += 1", "append": "used.append(y.pow(2).mean())",
            "aux": f"aux = aux + self.experts[{e_id}].w1.weight.pow(2).mean()", "attr": "self.seen = e",
            "read_after": "last = v.sum()"}
    lines += [f"        {body[e]}" for e in case.effects if e in body]
    post = {"counter": "out = out / (n + 1)", "append": "out = out + torch.stack(used).mean()",
            "aux": "out = out + aux", "attr": "out = out + 0.001 * self.seen", "read_after": "out = out + last"}
    lines += [f"    {post[e]}" for e in case.effects if e in post]
    lines.append("    return out.reshape(x.shape)")
    return "\n".join(lines) + "\n"


class LinearExpert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w1(x)


class _Base(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        self.gate = nn.Linear(D, E, bias=False)
        make = {"swiglu": lambda e: Expert(D, 12), "linear": lambda e: LinearExpert(),
                "sqrt": lambda e: SqrtExpert(D) if e >= E // 2 else Expert(D, 12)}[case.expert]
        self.experts = nn.ModuleList(make(e) for e in range(E))
        with torch.no_grad():
            if case.routing == "skewed":  # every token to experts 1 and 3
                self.gate.weight[:, 0] = 0.0
                self.gate.weight[1, 0], self.gate.weight[3, 0] = 50.0, 40.0
            elif case.routing == "sign":  # positive first feature: the sqrt experts; negative: the others
                self.gate.weight.zero_()
                self.gate.weight[:, 0] = torch.tensor([-10.0, -10.0, 10.0, 10.0])

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k_routing(self.gate, h, K)


def _model(case: Case) -> tuple[nn.Module, str]:
    text = _source(case)
    filename = f"<cgbackend-dispatch-property-{case.index}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)  # for inspect and tracebacks
    namespace = {"torch": torch, "F": F}
    exec(compile(text, filename, "exec"), namespace)
    cls = type(f"Case{case.index}", (_Base,), {"forward": namespace["forward"]})
    torch.manual_seed(case.index)
    return cls(case).double(), text


def _batches(case: Case) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + case.index)
    xs = [torch.randn(2, T // 2, D, generator=g, dtype=torch.float64) for _ in range(2)]
    if case.routing == "skewed":
        for x in xs:
            x[..., 0] = 4.0
    elif case.routing == "sign":
        for i, x in enumerate(xs):
            x.abs_()
            x[..., 0] += 1.0
            if i == 0:  # the first batch also has tokens below -3, for the SwiGLU experts
                x[:, ::2] = -5.0
    return xs


# ----------------------------------------------------------------------------- comparison

def _run(model: nn.Module, fn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_(True)
    out = fn(xg)
    out.backward(torch.ones_like(out))
    return out.detach(), xg.grad, {n: p.grad for n, p in model.named_parameters()}


def _compare(case: Case, text: str, got: tuple, want: tuple, tol: float, what: str) -> None:
    """Outputs, input gradients and parameter gradients equal; an expert eager never ran (None)
    may have an exactly zero gradient."""
    msg = f"{what}: {case}\n{text}"
    kw = dict(rtol=tol, atol=tol, equal_nan=True)
    torch.testing.assert_close(got[0], want[0], **kw, msg=lambda m: f"output: {m}\n{msg}")
    torch.testing.assert_close(got[1], want[1], **kw, msg=lambda m: f"input gradient: {m}\n{msg}")
    for name, a in want[2].items():
        b = got[2][name]
        if a is None and b is not None and name.startswith("experts."):
            assert torch.count_nonzero(b) == 0, f"{name}: nonzero gradient of an expert without tokens\n{msg}"
            continue
        assert (a is None) == (b is None), f"{name}: gradient None in one run only\n{msg}"
        if a is not None:
            torch.testing.assert_close(b, a, **kw, msg=lambda m: f"{name}: {m}\n{msg}")


ALL = _cases()


def test_grammar_covers_every_form():
    assert len(ALL) >= 200
    seen = {(c.skip, c.sound) for c in ALL}
    assert {("hit", True), ("hit", False), ("count", True), ("count", False), ("hit_item", False),
            ("hit_int", True), ("range", False)} <= seen
    for field, values in (("acc", {"index_add", "setitem", "self_read"}), ("expert", {"swiglu", "linear", "sqrt"}),
                          ("mode", {"masked_dense", "grouped", "auto"})):
        assert {getattr(c, field) for c in ALL} == values, field
    assert set(EFFECTS) <= {e for c in ALL for e in c.effects}
    assert any(c.reduction and c.sound for c in ALL) and any(c.rebind for c in ALL)


def test_source_rewrite_equals_the_loop_on_every_case():
    """Every case, eagerly: the rewrite applies exactly where the grammar says the loop is sound,
    and its code equals the user's loop both as run eagerly and with the traced meaning."""
    traced_only = 0
    for case in ALL:
        model, text = _model(case)
        original = type(model).forward
        eager_new, records = rewrite_function(original)
        traced_new, _ = rewrite_function(original, is_compiling=lambda: True)
        rewritten = any(r.form for r in records)
        assert rewritten == case.sound, f"rewritten={rewritten}: {[r.to_dict() for r in records]}\n{case}\n{text}"
        if not rewritten:
            continue
        for x in _batches(case):
            want = _run(model, lambda t: original(model, t), x)
            _compare(case, text, _run(model, lambda t: eager_new(model, t), x), want, 0.0, "rewritten, eagerly")
            if case.reduction:
                continue  # an amax() of no rows fails: the graph rewrite keeps those units' skip
            _compare(case, text, _run(model, lambda t: traced_new(model, t), x), want, 0.0, "traced meaning")
            traced_only += 1
    assert traced_only > 50


def _pipeline(case: Case) -> None:
    model, text = _model(case)
    ref = copy.deepcopy(model)
    compiled = cgbackend.compile(model, static_dispatch=case.mode, simulate_graphs=True, warmup=1, inner="eager")
    for x in _batches(case):
        _compare(case, text, _run(model, compiled, x), _run(ref, ref, x), 1e-9, "compiled")
    loops = cgbackend.report(compiled).loop_rewrites
    rewritten = [r for r in loops if r["form"]]
    assert bool(rewritten) == case.sound, f"{loops}\n{case}\n{text}"
    # a loop left as written says why; one over range(E) as written (nothing to rewrite) says
    # whether it was folded, and why not
    assert all(r["reason"] or r["fold"] for r in loops if not r["form"]), f"{loops}\n{case}\n{text}"


def _stratified(cases: list[Case]) -> list[Case]:
    """The first case of each kind: skip form x the feature that matters most for it."""
    def kind(c: Case) -> tuple:
        feature = ("rebind" if c.rebind else "unsound" if UNSOUND & set(c.effects) else "amax" if c.reduction
                   else "self_read" if c.acc == "self_read" else c.expert if c.expert == "sqrt" else "plain")
        return c.skip, feature
    chosen: dict = {}
    for c in cases:
        if c.skip in ("hit", "count") or kind(c) not in {("hit_int", "plain"), ("range", "plain")}:
            chosen.setdefault(kind(c), c)
    order = ["hit", "count", "hit_int", "hit_item", "range"]
    picked = sorted(chosen.values(), key=lambda c: (order.index(c.skip), c.index))
    return [c for c in picked if c.skip in ("hit", "count")][:10] + [
        next(c for c in picked if c.skip == s) for s in ("hit_int", "hit_item", "range")]


SUBSET = _stratified(ALL)


@pytest.mark.parametrize("case", SUBSET, ids=str)
def test_pipeline_equals_eager_on_a_stratified_subset(case):
    _pipeline(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ALL, ids=str)
def test_pipeline_equals_eager_on_every_case(case):
    _pipeline(case)
