"""Packaging and discoverability: the wheel's metadata (license, URLs, classifiers, the one version),
``--version``, help() texts that show every option, the README's options table generated from the
same docstrings, module/function names that help() can tell apart, and docs that stay true: the
README's demo excerpt, its results table and the generated benchmark tables checked against what
produced them."""

from __future__ import annotations

import dataclasses
import email
import json
import os
import pathlib
import pydoc
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import cgbackend
from cgbackend import Config
from cgbackend.config.docs import field_docs, options_table

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_metadata(tmp_path_factory) -> email.message.Message:
    """Build the wheel from a copy of the sources (offline, no build isolation: the installed
    setuptools) and read its METADATA."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "cgbackend", src / "cgbackend", ignore=shutil.ignore_patterns("__pycache__"))
    dist = src / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(dist), str(src)],
                          capture_output=True, text=True, timeout=300, cwd=src)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = dist.glob("cgbackend-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
        message = email.message_from_string(zf.read(meta).decode())
        message.files = names  # type: ignore[attr-defined]
        message.entry_points = zf.read(meta.replace("METADATA", "entry_points.txt")).decode()  # type: ignore[attr-defined]
    return message


def test_wheel_metadata_has_license_urls_classifiers(wheel_metadata):
    assert wheel_metadata["License-Expression"] == "BSD-3-Clause"
    assert any(f.endswith(".dist-info/licenses/LICENSE") for f in wheel_metadata.files)
    urls = wheel_metadata.get_all("Project-URL")
    assert {u.split(",")[0] for u in urls} >= {"Homepage", "Source", "Issues"}
    classifiers = wheel_metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert any(c.startswith("Topic ::") for c in classifiers)
    assert wheel_metadata["Requires-Python"] == ">=3.10"
    # The schema ships with the package; the entry points are there.
    assert "cgbackend/reporting/report.schema.json" in wheel_metadata.files
    assert "cgbackend/moe/costs.json" in wheel_metadata.files  # the static-dispatch cost model's rates
    assert "cgbackend/integrations/opaque.py" in wheel_metadata.files
    assert "cgbackend = cgbackend.by_name:dynamo_entry" in wheel_metadata.entry_points
    assert "cgbackend = cgbackend.cli:main" in wheel_metadata.entry_points
    # The long description's relative links point into the repository.
    body = wheel_metadata.get_payload()
    assert "](benchmarks/" not in body and "/blob/main/benchmarks/RESULTS.md)" in body


def test_one_version(wheel_metadata):
    from cgbackend._version import __version__
    assert wheel_metadata["Version"] == __version__ == cgbackend.__version__
    # Written once: nowhere else in the sources.
    for path in [ROOT / "setup.py", ROOT / "pyproject.toml", ROOT / "cgbackend" / "__init__.py"]:
        assert __version__ not in path.read_text(), path
    proc = subprocess.run([sys.executable, "-m", "cgbackend", "--version"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == f"cgbackend {__version__}"


def test_license_file():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "cgbackend developers" in text


def test_help_of_config_shows_every_option_and_its_doc():
    text = pydoc.render_doc(Config, renderer=pydoc.plaintext)
    docs = field_docs(Config)
    assert set(docs) == set(Config.field_names())  # every option has a docstring in config/options.py
    for name in Config.field_names():
        assert re.search(rf"\b{name}: ", text), name
        first_words = " ".join(docs[name].split()[:6])
        assert first_words in " ".join(text.split()), name


def test_readme_options_table_is_generated_from_the_docstrings():
    readme = (ROOT / "README.md").read_text()
    table = options_table(Config)
    assert table in readme, ("README's options table differs from cgbackend.config.docs.options_table("
                             "Config); paste its output into README.md")
    for f in dataclasses.fields(Config):
        assert f"| `{f.name}` |" in readme


def test_help_of_report_shows_the_schema_pointer():
    text = pydoc.render_doc(cgbackend.Report, renderer=pydoc.plaintext)
    assert "report.schema.json" in text and "explain" in text
    # help() of the function cgbackend.report says where the data classes and the schema live.
    assert "report.schema.json" in cgbackend.report.__doc__ and "cgbackend.reporting.report" in cgbackend.report.__doc__
    import importlib
    module = importlib.import_module("cgbackend.reporting.report")
    assert "report.schema.json" in module.__doc__
    assert module.SCHEMA == "cgbackend.report/1"
    assert "training" in cgbackend.explain.__doc__ and "cgbackend.reporting.explain" in cgbackend.explain.__doc__


# ----------------------------------------------------------------------------- README and results tables

def _normalized(line: str) -> str:
    return " ".join(line.split())


def readme_demo_excerpt() -> tuple[list[str], list[str]]:
    """The README's demo excerpt: the command named by the ``<!-- demo-excerpt: COMMAND -->`` comment,
    and the lines of the code block after it (``...`` lines mark what the excerpt leaves out)."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- demo-excerpt: python -m cgbackend (.+?) -->\s*```[^\n]*\n(.*?)\n```", readme, re.S)
    assert found, "README.md lost its <!-- demo-excerpt: python -m cgbackend ... --> comment before the code block"
    lines = [line for line in found.group(2).splitlines() if line.strip() and line.strip() != "..."]
    return found.group(1).split(), lines


def test_readme_demo_excerpt_is_what_the_demo_prints(monkeypatch, capsys):
    """Every line of the README's excerpt is a line the demo prints (whitespace aside). When the demo's
    output changes, paste the new lines into README.md; this test reads them from there."""
    from cgbackend.cli import main

    argv, excerpt = readme_demo_excerpt()
    assert 3 <= len(excerpt) <= 12, excerpt
    for key in [k for k in os.environ if k.startswith("CGBACKEND_")]:
        monkeypatch.delenv(key)
    assert main(argv) == 0
    printed = {_normalized(line) for line in capsys.readouterr().out.splitlines()}
    missing = [line for line in excerpt if _normalized(line) not in printed]
    assert not missing, f"README's demo excerpt lines not printed by `python -m cgbackend {' '.join(argv)}`: {missing}"


def readme_usage_blocks() -> list[str]:
    """The ```python blocks of the README's "Your model" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Your model\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def test_readme_usage_runs_as_written():
    """The README's usage code, run as it is on a small model: every call it shows works, and each
    name it binds is bound once."""
    import torch

    from log_helpers import records_of
    blocks = readme_usage_blocks()
    assert blocks and len((ROOT / "README.md").read_text().splitlines()) <= 220
    bound = [m.group(1) for block in blocks for m in re.finditer(r"^(\w+) = ", block, re.M)]
    assert len(bound) == len(set(bound)), bound
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    inputs = (torch.randn(2, 8),)
    namespace = {"model": model, "inputs": inputs}
    with records_of("cgbackend.dryrun") as shown:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert isinstance(namespace["report"], cgbackend.Report) and namespace["report"].summary["graphs"] == 1
    assert torch.equal(namespace["out"], model(*inputs)) and torch.equal(namespace["out_by_name"], model(*inputs))
    assert len(shown) == 1 and shown[0].getMessage().startswith("cgbackend dry run: graph 0")
    assert cgbackend.stats(namespace["compiled"])["graph_calls"] == 1
    assert namespace["counters"]["graph_calls"] == 1


def _shown_equal(text: str, value: float) -> bool:
    """``text`` is ``value`` as rounded for display (to the decimals it shows)."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-12


_COLUMNS = {"median ms": "median_ms", "x eager": "ratio_to_eager", "x reduce-overhead": "ratio_to_reduce_overhead",
            "x grouped": "ratio_to_grouped", "compile s": "compile_s"}
"""The README's figure columns and the fields of latest.json's rows they quote."""


def _readme_tables(section: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, rows of cells) of each Markdown table in ``section``."""
    tables, lines = [], section.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| model ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("| "):
                    break
                rows.append([c.strip().strip("`") for c in row.strip("|").split("|")])
            tables.append((header, rows))
    return tables


def test_readme_results_tables_quote_latest_json_with_their_runs():
    """Each row of the README's results tables is a row of benchmarks/results/latest.json: its figures
    as rounded there, its depth as the model has it, and its run named by GPU and date (RESULTS.md,
    rendered from the same file, names each run's command)."""
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    runs = results["meta"]["runs"]
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    rows: dict = {}  # by the row's key and its GPU's name (H100 and H200 rows stand side by side)
    for r in results["rows"]:
        rows.setdefault((r["model"], r["mode"], r["contender"], r.get("tokens")), {})[r["device"]] = r
    tables = _readme_tables(section)
    assert len(tables) == 2 and all(rows_ for _, rows_ in tables)
    assert "compile s" in tables[1][0]
    for header, cells_of in tables:
        assert {"model", "layers", "mode", "tokens", "contender", "run"} <= set(header), header
        for cells in cells_of:
            cell = dict(zip(header, cells))
            key = (cell["model"], cell["mode"], cell["contender"], None if cell["tokens"] == "-" else int(cell["tokens"]))
            gpu, date = cell["run"].split()
            row = next((r for device, r in rows.get(key, {}).items() if gpu in device.split()), None)
            assert row is not None, f"README quotes a row latest.json does not hold: {cells}"
            run = runs[row["run"]]
            assert gpu in run["device"].split() and date == run["date"][:10], (cells, run["device"], run["date"])
            assert int(cell["layers"]) == _layers_of(cell["model"]), cells
            for column, key_ in _COLUMNS.items():
                if column not in cell:
                    continue
                if cell[column] == "-":
                    assert row.get(key_) is None, (cells, key_, row.get(key_))
                else:
                    assert _shown_equal(cell[column], row[key_]), (cells, key_, row[key_])


def _layers_of(model: str) -> int:
    """The depth of a benchmark model as its registry entry builds it: the reference models' size, or
    the "N layers" of its description."""
    from cgbackend.bench.models import MODELS
    from cgbackend.models import SIZES
    spec = MODELS[model]
    if spec.family == "reference":
        return SIZES["bench"]["n_layers"]
    return int(re.search(r"(\d+) layers", spec.description).group(1))


def test_the_readme_carries_no_figure_outside_its_tables():
    """The README links its measurements: a time or a ratio appears in its tables (checked against
    latest.json above), not in its prose; the one exception is the test suite's own time."""
    readme = (ROOT / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", readme, flags=re.S)
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("|"))
    prose = prose.split("\n## Test\n", 1)[0] + prose.split("\n## Test\n", 1)[1].split("\n## ", 1)[1]
    figures = re.findall(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?: ?(?:ms|s|us)|x|%)(?![\w-])", prose)
    assert not figures, figures


def test_the_readme_states_the_suites_measured_time_and_the_machines_load():
    """The Test section says how long the suite took on a fresh clone, on which machine and under
    what load (a time measured on a busy machine says little without it)."""
    section = (ROOT / "README.md").read_text().split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"\b\d+ min \d+ s\b", section) and "fresh clone" in section, section
    assert re.search(r"\d-core", section) and "load average" in section, section
    assert not re.search(r"\b[A-Z]{3,}_[A-Z_]{3,}\b", section), section  # no placeholder left


def test_compile_time_figures_name_model_depth_and_machine():
    """A compile time quoted anywhere in the README and the user docs says which model, at which depth,
    on which machine: figures measured on different models, depths and machines differ."""
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
             *(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")]
    seconds = re.compile(r"\b\d+(?:\.\d+)? s\b")
    machine = re.compile(r"H100|H200|A100|\d-core CPU|CPU")
    depth = re.compile(r"\b\d+ layers?\b|\bone (?:MoE )?layer\b|\| layers \|")  # or a table's column
    model = re.compile(r"`?(moe-128e|moe|dense|hf-[\w-]+|MoE)")
    function = re.compile(r"one-line function")  # a compile of no model: no depth to name
    bad = []
    for page in pages:
        for paragraph in re.split(r"\n\s*\n", page.read_text()):
            if paragraph.startswith("```"):
                continue
            sentences = re.split(r"(?<=[.;])\s+", paragraph)
            if not any("compil" in t.lower() and seconds.search(t) for t in sentences):
                continue
            named = function.search(paragraph) or (depth.search(paragraph) and model.search(paragraph))
            if not (machine.search(paragraph) and named):
                bad.append(f"{page.relative_to(ROOT)}: {paragraph[:160]}")
    assert not bad, bad


def test_results_md_is_rendered_from_latest_json():
    from cgbackend.bench.render import render_markdown

    results = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    assert render_markdown(results) in (ROOT / "benchmarks" / "RESULTS.md").read_text(), (
        "benchmarks/RESULTS.md differs from render_markdown(latest.json); render it again (see its header)")


def test_serving_md_is_rendered_from_serving_json():
    from cgbackend.bench.serving import render_markdown

    results = json.loads((ROOT / "benchmarks" / "results" / "serving.json").read_text())
    rendered = render_markdown(results)
    text = (ROOT / "benchmarks" / "SERVING.md").read_text()
    body = rendered.split("\n", 1)[1].strip()  # the title line is followed by the page's own text
    assert rendered.split("\n", 1)[0] in text and body in text


def test_docs_have_no_issue_or_run_numbers():
    """History lives in git: no issue numbers, run numbers or device runs in the README and the docs."""
    pattern = re.compile(r"[Ii]ssues? [0-9]+|\brun [0-9]+|device runs? [0-9]+|(?<![\w&])#[0-9]{1,3}\b")
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages for m in pattern.finditer(p.read_text())]
    assert not hits, hits


def test_design_layout_table_names_every_module():
    """docs/design.md's Layout table is the map of the package: every module is named in its folder's row."""
    design = (ROOT / "docs" / "design.md").read_text()
    table = design.split("## Layout", 1)[1].split("\n\n**", 1)[0]
    rows = {m.group(1): line for line in table.splitlines()
            if (m := re.match(r"\| `cgbackend/([a-z_]*)/?`", line))}
    missing = []
    for path in sorted((ROOT / "cgbackend").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(ROOT / "cgbackend").as_posix()
        folder = "" if folder == "." else folder
        if f"`{path.name}`" not in rows.get(folder, ""):
            missing.append(path.relative_to(ROOT).as_posix())
    assert not missing, f"docs/design.md's Layout table does not name: {missing}"


def test_benchmarks_readme_names_every_model_and_flag():
    """Every model the bench registers and every flag it takes is described in benchmarks/README.md."""
    from cgbackend.bench.models import MODELS
    from cgbackend.bench.settings import build_parser
    text = (ROOT / "benchmarks" / "README.md").read_text()
    assert not [name for name in MODELS if f"`{name}`" not in text]
    flags = [f for action in build_parser()._actions for f in action.option_strings if f.startswith("--")]
    assert not [f for f in flags if f not in ("--help", "--verbose") and f not in text]


def test_the_glossary_explains_the_words_the_report_uses():
    from cgbackend.passes.label import MIXED, ROLES
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    words = [*ROLES, MIXED, "static region", "dynamic region", "graph break", "uncompiled code", "launch coverage",
             "graph launch", "kernel launches per call (estimated from the traced ops)",
             "graph memory (estimated before capture)", "capture size", "hand-off", "handout graph", "dropless",
             "masked dense", "grouped", "small batch", "folded", "step-floor", "ok 1.00x64", "compile s"]
    assert not [w for w in words if f"`{w}`" not in glossary and f"**{w}**" not in glossary and w not in glossary]
    for page in ("README.md", "docs/usage.md"):
        assert "glossary.md" in (ROOT / page).read_text(), page
