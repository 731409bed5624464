"""A second process that compiles the same model reuses the first one's Inductor work (the FX graph
and AOTAutograd caches under TORCHINDUCTOR_CACHE_DIR), as docs/usage.md describes. The first
compile runs in the test's own process (its interpreter is up already), the second in a fresh one."""
import json
import os
import subprocess
import sys

import torch

_SCRIPT = r"""
import json, torch, torch.nn as nn, cgbackend
from torch._dynamo.utils import counters
exec(MODEL)
st = cgbackend.stats(compiled)
print(json.dumps({"ok": ok, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "replays": st["replays"],
                  "inductor_regions": st["inner_compiled"]}))
"""

MODEL = r"""
torch.manual_seed(0)
# Two matrix products: Inductor's code calls the BLAS kernels, so nothing goes through the C++
# compiler (which took most of a cold compile's time); the FX graph cache holds the graph as any.
model = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.Linear(64, 32, bias=False)).eval()
compiled = cgbackend.compile(model, simulate_graphs=True, inner="inductor", warmup=1)
xs = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
with torch.no_grad():
    outs = [compiled(x) for x in xs]
    ok = all(torch.allclose(o, model(x), rtol=1e-5, atol=1e-6) for o, x in zip(outs, xs))
"""


def _here(cache_dir, monkeypatch) -> dict:
    import cgbackend
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    torch._dynamo.reset()
    before = dict(counters["inductor"])
    scope = {"torch": torch, "cgbackend": cgbackend}
    with torch._inductor.config.patch(fx_graph_cache=True):
        exec(MODEL, scope)
    st = cgbackend.stats(scope["compiled"])
    after = counters["inductor"]
    return {"ok": scope["ok"], "hit": after["fxgraph_cache_hit"] - before.get("fxgraph_cache_hit", 0),
            "miss": after["fxgraph_cache_miss"] - before.get("fxgraph_cache_miss", 0),
            "replays": st["replays"], "inductor_regions": st["inner_compiled"]}


def _fresh(cache_dir) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    done = subprocess.run([sys.executable, "-c", _SCRIPT.replace("exec(MODEL)", MODEL)], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_hits_the_inductor_cache(tmp_path, monkeypatch):
    cold = _here(tmp_path / "cache", monkeypatch)
    warm = _fresh(tmp_path / "cache")
    assert cold["ok"] and warm["ok"] and cold["replays"] > 0 and warm["replays"] > 0
    assert cold["inductor_regions"] == warm["inductor_regions"] == 1
    assert cold["miss"] >= 1 and cold["hit"] == 0
    assert warm["hit"] == cold["miss"] and warm["miss"] == 0
