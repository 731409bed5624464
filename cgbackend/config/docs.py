"""Documentation of cgbackend's options, generated from one source: the docstring under each field of
:class:`cgbackend.Config` in config/options.py. ``help(cgbackend.Config)`` shows it (the class docstring is
made here) and the README's options table is :func:`options_table` (a test keeps them equal)."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import re
import textwrap
from typing import Any

__all__ = ["class_docstring", "field_docs", "options_table"]

_INTRO = """Options of cgbackend: one frozen dataclass.

Pass them as keywords (``cgbackend.compile(model, warmup=5)``, ``cgbackend.backend(strict=True)``),
as ``torch.compile(model, backend="cgbackend", options={"warmup": 5})``, on the command line
(``--option warmup=5``) or as environment variables ``CGBACKEND_<NAME>`` (``CGBACKEND_WARMUP=5``);
explicit options win over the environment. An unknown option raises ConfigError listing the valid
ones. ``Config.from_options(...)`` builds one, ``config.replace(...)`` makes a changed copy.

Options (name: default):
"""


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string right under it in the class body), whitespace-normalized."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen or compiled-only installs)
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for stmt, after in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and \
                isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and \
                isinstance(after.value.value, str):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def default_text(value: Any) -> str:
    if isinstance(value, enum.Enum):  # an option parsed into a typed value: shown as its text
        value = value.value
    if isinstance(value, tuple) and len(value) > 8:
        return f"{', '.join(map(str, value[:4]))}, ..., {value[-1]} ({len(value)} sizes)"
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def first_sentence(text: str) -> str:
    """Up to the first full stop, without it; reST ``code`` becomes markdown `code`."""
    match = re.match(r"(.+?)\.(\s|$)", text)
    sentence = match.group(1) if match else text.rstrip(".")
    return sentence.replace("``", "`")


def class_docstring(cls: type) -> str:
    docs = field_docs(cls)
    lines = [_INTRO]
    for f in dataclasses.fields(cls):
        lines.append(f"{f.name}: {default_text(f.default)}")
        doc = docs.get(f.name, "")
        lines.extend(textwrap.wrap(doc, width=96, initial_indent="    ", subsequent_indent="    ") or [""])
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def options_table(cls: type) -> str:
    """The README's options table (markdown): option, default, the first sentence of its docstring."""
    docs = field_docs(cls)
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        meaning = first_sentence(docs.get(f.name, "")).replace("|", "\\|")
        rows.append(f"| `{f.name}` | {default_text(f.default)} | {meaning} |")
    return "\n".join(rows) + "\n"
