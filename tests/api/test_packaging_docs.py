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
    """The ```python blocks of the README's "Use" section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)\n```", section, re.S)


def test_readme_usage_runs_as_written():
    """The README's usage code, run as it is on a small model: every call it shows works."""
    import torch

    from log_helpers import records_of
    blocks = readme_usage_blocks()
    assert blocks and len((ROOT / "README.md").read_text().splitlines()) <= 220
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    inputs = (torch.randn(2, 8),)
    namespace = {"model": model, "inputs": inputs}
    with records_of("cgbackend.dryrun") as shown:
        for block in blocks:
            exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - the README's own code
    assert isinstance(namespace["report"], cgbackend.Report) and namespace["report"].summary["graphs"] == 1
    assert torch.equal(namespace["out"], model(*inputs))
    assert len(shown) == 1 and shown[0].getMessage().startswith("cgbackend dry run: graph 0")
    assert cgbackend.stats(namespace["compiled"])["graph_calls"] == 1


def _shown_equal(text: str, value: float) -> bool:
    """``text`` is ``value`` as rounded for display (to the decimals it shows)."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-12


def test_readme_results_table_quotes_latest_json():
    """Each row of the README's results table is a row of benchmarks/results/latest.json, with its
    median and ratios as rounded there, and the text names the device and date of that file's runs
    (RESULTS.md, rendered from it, names each run's command)."""
    readme = (ROOT / "README.md").read_text()
    results = json.loads((ROOT / "benchmarks" / "results" / "latest.json").read_text())
    section = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    runs = results["meta"].get("runs") or [results["meta"]]
    for run in runs:
        assert run["device"] in section and run["date"][:10] in section, run
    rows = {(r["model"], r["mode"], r["contender"], r.get("tokens")): r for r in results["rows"]}
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| model "))
    table = lines[start + 2:]
    quoted = table[:next((i for i, line in enumerate(table) if not line.startswith("| ")), len(table))]
    assert quoted
    for line in quoted:
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        model, mode, tokens, contender, median, x_eager, x_ro, x_grouped = cells
        row = rows.get((model, mode, contender, None if tokens == "-" else int(tokens)))
        assert row is not None, f"README quotes a row latest.json does not hold: {line}"
        for text, key in ((median, "median_ms"), (x_eager, "ratio_to_eager"),
                          (x_ro, "ratio_to_reduce_overhead"), (x_grouped, "ratio_to_grouped")):
            if text == "-":
                assert row.get(key) is None, (line, key, row.get(key))
            else:
                assert _shown_equal(text, row[key]), (line, key, row[key])


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
