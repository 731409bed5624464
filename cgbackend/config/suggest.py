""""Did you mean" for a mistyped option name or value: the closest valid one, by difflib."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = ["check_callable", "did_you_mean", "torch_compile_argument"]


def did_you_mean(word: Any, choices: Iterable[Any]) -> str:
    """``" (did you mean 'auto'?)"`` for the choice closest to ``word``, or "" when none is close."""
    if not isinstance(word, str):
        return ""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    if not close:  # a case slip ("Auto") or a prefix ("induct")
        close = [n for n in names if n.lower() == word.lower() or (len(word) >= 3 and n.startswith(word))][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


_TORCH_COMPILE_ARGUMENTS = {
    "mode": ("{name}={value!r} picks torch.compile's Inductor presets, which cgbackend does not take: cgbackend "
             "captures the CUDA graphs itself (what mode=\"reduce-overhead\" adds); drop mode= and pass "
             "cgbackend options instead"),
    "options": ("{name}= is how torch.compile passes a backend's options by name; cgbackend.compile and "
                "cgbackend.backend take them as keywords"),
    "backend": "{name}={value!r}: cgbackend.compile and cgbackend.backend are the backend already",
    "fullgraph": ("{name} is torch.compile's argument, not a cgbackend option: "
                  "torch.compile(model, backend=cgbackend.backend(...), {name}=...)"),
    "dynamic": ("{name} is torch.compile's argument, not a cgbackend option: "
                "torch.compile(model, backend=cgbackend.backend(...), {name}=...)"),
}
_EXAMPLE = ("e.g. cgbackend.compile(model, warmup=3), or by name torch.compile(model, backend=\"cgbackend\", "
            "options={\"warmup\": 3})")


def torch_compile_argument(name: str, value: Any) -> str:
    """The message for a torch.compile argument given where cgbackend options go (``mode=``,
    ``options=``, ...), or "" for any other name."""
    text = _TORCH_COMPILE_ARGUMENTS.get(name)
    return f"{text.format(name=name, value=value)}; {_EXAMPLE}" if text else ""


def check_callable(model: Any, entry: str) -> None:
    """``entry`` (``cgbackend.compile``) takes a module or a function: anything else is a TypeError
    naming what was passed, raised at the caller's line rather than deep inside torch.compile."""
    if not callable(model):
        shown = repr(model)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(f"{entry} takes an nn.Module or a function to compile, got {type(model).__name__}: {shown}")
