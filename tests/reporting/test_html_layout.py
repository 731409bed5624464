"""The HTML page as a browser lays it out (headless Chromium, at 800 and 1400 px): nothing wider
than the window, no label cut, every box named on hover; the structure without a browser: hints
above the graph breaks, break texts folded, a layer's graph repeated as it ran, the runtime split
per region. Skips where no Chromium is installed (CI installs it: .ci/run)."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess

import pytest
import torch

import cgbackend
from cgbackend.models import demo_model

BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome", "chrome")
                if shutil.which(n)), None)

_MEASURE = """<script>
const out = {innerWidth: innerWidth, scrollWidth: document.documentElement.scrollWidth, cut: [], untitled: 0,
             labelled: 0, boxes: 0, outside: []};
for (const el of document.querySelectorAll(".region")) {
  out.boxes += 1;
  if (!el.title) out.untitled += 1;
  if (el.innerText.trim()) out.labelled += 1;
  if (el.scrollWidth > el.clientWidth + 1) out.cut.push(el.dataset.id || el.dataset.source);
}
for (const el of document.querySelectorAll("section, .scroll, table, p, li, details")) {
  if (el.closest(".scroll") && el.tagName === "TABLE") continue;  // scrolls inside its box
  if (el.getBoundingClientRect().right > innerWidth + 0.5) out.outside.push(el.tagName + "#" + el.id);
}
document.body.setAttribute("data-measure", JSON.stringify(out));
</script>"""


@pytest.fixture(scope="module")
def pages():
    """The by-name MoE demo (breaks, uncompiled code, a layer's graph run once per layer) and a
    compiled model's page after a run with per-region timing."""
    model, x = demo_model("moe")
    with torch.no_grad():
        by_name = cgbackend.explain(model, x, by_name=True, compare=True)
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    compiled = cgbackend.compile(mlp, simulate_graphs=True, warmup=1, profile=True)
    with torch.no_grad():
        for _ in range(3):
            compiled(torch.randn(4, 8))
    return {"by_name": by_name, "runtime": cgbackend.report(compiled)}


def test_structure_hints_before_folded_breaks_and_repeated_graphs(pages):
    report = pages["by_name"]
    page = report.to_html()
    assert page.index('<section id="hints">') < page.index('<section id="breaks">') < page.index('id="timeline"')
    assert page.count('<details class="break">') == len(report.graph_breaks) == 3
    assert "in the order Dynamo compiled them" not in page and "Regions in the order they run in one call" in page
    ids = re.findall(r'<div class="region (?:static|dynamic)[^"]*" data-id="([^"]+)"', page)
    sequence = [e["id"] for e in report.summary["launches"]["sequence"] if e["kind"] == "region"]
    assert ids == sequence and len(ids) == report.summary["graph_runs_per_call"] > len(set(ids))
    assert page.index('class="region uncompiled"') < page.rindex('data-id="g0.S0"')  # in place, not apart
    assert ">g0.S" not in page.replace(">g0.S0<", "")  # no label cut to "g0.S"


def test_runtime_page_splits_each_regions_time(pages):
    page = pages["runtime"].to_html()
    assert "<th class=\"num\">eager ms</th><th class=\"num\">replay ms</th><th class=\"num\">capture ms</th>" in page
    row = re.search(r'<tr data-id="g0.S0">(.*?)</tr>', page).group(1)
    eager, replay, capture = (float(v) for v in re.findall(r'<td class="num">([\d.]+)</td>', row)[:3])
    assert eager > 0 and replay > 0 and capture > 0
    assert "time in regions (profile=True)" in page and "capture 1 x " in html.unescape(page)


def _measure(path, width: int) -> dict:
    proc = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--window-size={width},2000", "--dump-dom", path.as_uri()],
                          capture_output=True, text=True, timeout=60)
    found = re.search(r'data-measure="([^"]*)"', proc.stdout)
    assert found, proc.stderr[-2000:]
    return json.loads(html.unescape(found.group(1)))


@pytest.mark.skipif(BROWSER is None, reason="no Chromium (apt-get install chromium)")
@pytest.mark.parametrize("width", [800, 1400])
def test_headless_chromium_lays_it_out_without_overflow_or_cut_labels(pages, width, tmp_path):
    for name, report in pages.items():
        page = report.to_html()
        path = tmp_path / f"{name}.html"
        path.write_text(page.replace("</body>", _MEASURE + "</body>"))
        m = _measure(path, width)
        assert m["innerWidth"] == width
        assert m["scrollWidth"] <= width, (name, m)  # no horizontal scrolling of the page
        assert m["outside"] == [] and m["cut"] == [], (name, m)
        assert m["boxes"] == page.count('class="region ') and m["untitled"] == 0
        assert m["labelled"] >= 1
        if name == "by_name":
            shot = tmp_path / f"{name}-{width}.png"
            subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--window-size={width},1400", f"--screenshot={shot}", path.as_uri()],
                           capture_output=True, timeout=60)
            assert int.from_bytes(shot.read_bytes()[16:20], "big") == width  # the PNG's width
