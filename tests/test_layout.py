"""The package's shape: no import cycles (imports inside functions and ``if TYPE_CHECKING`` blocks
count: a type-checking import of the class that owns you is a back-pointer too), no private name
imported from another package, every module importable on its own, no module or class too large to
hold in mind, and a region runner that hands its collaborators no back-pointer (docs/design.md,
"Layout")."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "cgbackend"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 350


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import of ``name``, function-level
    imports and ``if TYPE_CHECKING`` blocks included."""
    path = MODULES[name]
    is_pkg = path.name == "__init__.py"
    found: list[tuple[str, list[str], int]] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[:len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                names = [a.name for a in child.names]
                subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
                if subs and len(subs) == len(names):
                    found.extend((s, [], child.lineno) for s in subs)  # from pkg import submodule
                else:
                    found.append((target, names, child.lineno))
            elif isinstance(child, ast.Import):
                found.extend((a.name, [], child.lineno) for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    return [(t, names, line) for t, names, line in found if t in MODULES and t != name]


def import_cycles() -> list[list[str]]:
    """Strongly connected components of more than one module in the import graph (Tarjan)."""
    graph = {m: sorted({t for t, _, _ in _imports(m)}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            strong(v)
    return cycles


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def test_no_import_cycles():
    assert import_cycles() == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path, monkeypatch):
    pkg = tmp_path / "cgbackend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n")
    (pkg / "d.py").write_text("from .e import E\n")
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", _modules())
    assert import_cycles() == [["cgbackend.a", "cgbackend.b"], ["cgbackend.d", "cgbackend.e"]]


def test_no_private_name_imported_from_another_package():
    wrong = []
    for name in MODULES:
        for target, names, line in _imports(name):
            if _package_of(target) == _package_of(name):
                continue
            wrong += [f"{MODULES[name].relative_to(ROOT)}:{line} imports {n} from {target}"
                      for n in names if n.startswith("_") and not n.startswith("__")]
    assert wrong == []


def test_modules_and_classes_fit_in_mind():
    big = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                big.append(f"{path.relative_to(ROOT)}: class {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert big == []


RUNNER = "cgbackend.runtime.region"
"""The module of RegionRunner."""
RUNNER_OWNERS = {"cgbackend.runtime.executor", "cgbackend.runtime.runners"}
"""The executor's modules: they make runners (runners.py) and run them in order (executor.py)."""
HOLDING_RUNNERS = {RUNNER, *RUNNER_OWNERS, "cgbackend.runtime.split", "cgbackend.runtime.syncsplit"}
"""Modules whose objects hold runners (split.Step holds one; syncsplit makes steps)."""


def _runner_collaborators() -> set[str]:
    """The runtime modules region.py imports: the runner's collaborators."""
    return {t for t, _, _ in _imports(RUNNER) if t.startswith("cgbackend.runtime.")}


def _passes_self(node: ast.AST) -> bool:
    """Does ``node`` (an argument) pass ``self`` itself, or inside a tuple, list, set or dict?"""
    if isinstance(node, ast.Name):
        return node.id == "self"
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_passes_self(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(v is not None and _passes_self(v) for v in node.values)
    if isinstance(node, ast.Starred):
        return _passes_self(node.value)
    return False


def runner_back_pointers(tree: ast.AST) -> list[str]:
    """Where a module hands ``self`` to another object: as a call argument (itself or in a
    container), or stored in another object's attribute or item."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            args = list(node.args) + [k.value for k in node.keywords]
            if any(_passes_self(a) for a in args):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _passes_self(node.value):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(not isinstance(t, ast.Name) for t in targets):
                found.append((node.lineno, ast.unparse(node)))
    return [f"line {line}: {text}" for line, text in sorted(found)]


def test_the_region_runner_hands_its_collaborators_no_back_pointer():
    """RegionRunner gives its collaborators (graph cache, fast path, recorder, caller graphs,
    backward side, warm-up) what they read (runtime/spec.py), never itself: region.py passes
    ``self`` to no call and stores it in no other object; no collaborator imports a module whose
    objects hold runners (type-checking imports included), so none can name one in a signature;
    and none takes a parameter named ``runner``."""
    assert runner_back_pointers(ast.parse(MODULES[RUNNER].read_text())) == []
    collaborators = _runner_collaborators()
    assert {"cgbackend.runtime.graph_cache", "cgbackend.runtime.fast", "cgbackend.runtime.recorder",
            "cgbackend.runtime.backward", "cgbackend.runtime.warmup"} <= collaborators
    wrong = []
    for name in sorted(collaborators):
        for target, _, line in _imports(name):
            if target in HOLDING_RUNNERS:
                wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}")
        for node in ast.walk(ast.parse(MODULES[name].read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                wrong += [f"{MODULES[name].relative_to(ROOT)}:{node.lineno} {node.name}({p.arg})"
                          for p in params if p.arg == "runner"
                          or (p.annotation is not None and "RegionRunner" in ast.unparse(p.annotation))]
    importers = sorted(m for m in MODULES if m not in RUNNER_OWNERS and m != RUNNER
                       and any(t == RUNNER for t, _, _ in _imports(m)))
    assert wrong == [] and importers == []


def test_the_back_pointer_finder_sees_self_passed_on():
    tree = ast.parse("class R:\n"
                     "    def f(self):\n"
                     "        self.cache = Cache(self)\n"
                     "        Fn.apply((self, 1), 2)\n"
                     "        other.owner = self\n"
                     "        me = self\n"
                     "        self.fast.replay(x, key=self.spec)\n")
    assert [f.split(":")[0] for f in runner_back_pointers(tree)] == ["line 3", "line 4", "line 5"]


_IMPORT_EACH = """
import importlib.machinery, json, os, sys, traceback
import torch
OPTIONAL = {"transformer_engine"}  # the te extra: cgbackend.integrations.te is imported only where it is installed
modules = json.loads(sys.argv[1])  # name -> path
# Importing any module runs the package's __init__ first, in its fixed order: for a module that
# __init__ loads itself, importing it alone is importing the package. Those are checked once, by
# importing the package; each other module in a child forked after the package alone was imported,
# the state a fresh interpreter is in when it comes to the module itself.
import cgbackend
by_package = {m for m in sys.modules if m == "cgbackend" or m.startswith("cgbackend.")}
print(json.dumps(sorted(by_package)))
# The other modules' bytecode is compiled here, once, and inherited by every child: with
# PYTHONDONTWRITEBYTECODE (no .pyc) each child would compile the sources it imports anew.
_get_code = importlib.machinery.SourceFileLoader.get_code
_compiled = {name: _get_code(importlib.machinery.SourceFileLoader(name, path), name)
             for name, path in modules.items() if name not in by_package}
def _get_code_once(loader, fullname):
    code = _compiled.get(fullname)
    return _get_code(loader, fullname) if code is None else code
importlib.machinery.SourceFileLoader.get_code = _get_code_once
failed = []
for name in [n for n in modules if n not in by_package]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: import, tell the parent what failed, exit at once (no exit handlers)
        os.close(read)
        error = ""
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name not in OPTIONAL:
                error = traceback.format_exc().strip().splitlines()[-1]
        except BaseException:
            error = traceback.format_exc().strip().splitlines()[-1]
        os.write(write, error.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        error = pipe.read().decode()
    status = os.waitpid(pid, 0)[1]
    if error or status:
        failed.append(name + ": " + (error or f"the child exited with status {status}"))
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.fixture(scope="module")
def import_each() -> tuple[subprocess.CompletedProcess, list[str]]:
    """A fresh interpreter imports torch and the package, then each other module in a child of its
    own (os.fork: no interpreter start-up or torch import per module); returns the process and the
    cgbackend modules that ``import cgbackend`` loaded."""
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    names = {n: str(p) for n, p in MODULES.items() if not n.endswith("__main__")}
    done = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(names)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    first = done.stdout.splitlines()[:1]
    return done, json.loads(first[0]) if first else []


def test_every_module_imports_on_its_own(import_each):
    """Each module first, with no other cgbackend module loaded (torch stays loaded: the part that
    takes time), as a fresh interpreter would import it (those the package's __init__ imports are
    checked by importing the package)."""
    done, _ = import_each
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]



# ----------------------------------------------------------------------------- the package by job

MAX_TOP_MODULES = 10
DISPATCH_PARSER = "cgbackend.config.options"
"""The one module that reads the static_dispatch option's text (into a config.DispatchMode)."""
DISPATCH_MODE_NAMES = {"off", "auto", "masked_dense", "grouped", "small_batch"}


def test_at_most_ten_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def _string_values(node: ast.AST) -> set[str]:
    """The string constants ``node`` is, or holds (a tuple, list or set of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {v for e in node.elts for v in _string_values(e)}
    return set()


def _dispatch_text_compares(tree: ast.AST, in_moe: bool) -> list[str]:
    """Comparisons of the static_dispatch option's text: ``x.static_dispatch == ...`` (or ``in``, ``!=``)
    with anything, and a mode name compared with an expression that names the dispatch mode (any
    module) or a ``mode`` (in moe/, where ``mode`` is the option's value)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        texts = [ast.unparse(o) for o in operands]
        names = set().union(*(_string_values(o) for o in operands))
        if any("static_dispatch" in t for t in texts):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif names & DISPATCH_MODE_NAMES and any(
                "dispatch" in t.lower() or (in_moe and (t == "mode" or t.endswith(".mode"))) for t in texts):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_config_reads_the_static_dispatch_text():
    """The option is parsed once (config/options.py) into a DispatchMode; every other module reads
    that typed value, so none compares it with a string."""
    wrong = []
    for name, path in MODULES.items():
        if name == DISPATCH_PARSER:
            continue
        for hit in _dispatch_text_compares(ast.parse(path.read_text()), name.startswith("cgbackend.moe")):
            wrong.append(f"{path.relative_to(ROOT)}:{hit}")
    assert wrong == []


def test_the_dispatch_text_check_sees_a_string_comparison():
    seen = _dispatch_text_compares(ast.parse(
        'if config.static_dispatch != "off": pass\n'
        'if dispatch_mode in ("grouped", "small_batch"): pass\n'
        'if form == "grouped": pass\n'          # a form, not the option
        'if config.inner == "auto": pass\n'), in_moe=False)
    assert [s.split(":")[0] for s in seen] == ["1", "2"]
    assert _dispatch_text_compares(ast.parse('if mode == "auto": pass\n'), in_moe=True)


def test_importing_the_package_loads_neither_the_harness_nor_the_demo_models(import_each):
    """``cgbackend.bench`` and ``cgbackend.models`` are imported by the command line, the tests and
    the benchmarks, never by ``import cgbackend`` (in a fresh interpreter: the import check's)."""
    done, by_package = import_each
    assert "cgbackend" in by_package, done.stderr[-3000:]
    assert [m for m in by_package if m.startswith(("cgbackend.bench", "cgbackend.models"))] == []


def test_every_folder_of_the_package_is_a_regular_package():
    """An __init__.py in every folder: setuptools' package discovery (pyproject.toml) skips a folder
    without one, and the wheel would lack its modules."""
    folders = {p.parent for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").exists()) == []
