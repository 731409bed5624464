"""Host time per call: cgbackend static dispatch (default options) vs the hand-written grouped layer
under reduce-overhead, one real-size MoE model, inference (usage: diag3.py moe-dsv2lite-shape [tokens]).
Prints, per contender, the median host time of a call (returned, not synchronized), the median
synchronized time, and a cProfile of 50 calls sorted by own time."""
import sys

from hosttime import measure  # noqa: E402
from pair import contenders  # noqa: E402  (it puts the repository root on the path)

import cgbackend  # noqa: E402

tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
xs, c, ro = contenders(sys.argv[1], tokens)


measure(c, xs, "cgbackend static dispatch")
s = cgbackend.stats(c)
print({k: s[k] for k in ("static_regions", "dynamic_regions", "graphs_captured", "replays", "copies_made",
                         "copied_by_kind", "output_clones", "inner_compiled", "inner_fallbacks")})
measure(ro, xs, "grouped reduce-overhead")
