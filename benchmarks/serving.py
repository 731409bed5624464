"""``python benchmarks/serving.py [FLAGS]``: the serving-loop benchmark (cgbackend/bench/serving.py)."""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cgbackend.bench.serving import main

    raise SystemExit(main(sys.argv[1:], prog="python benchmarks/serving.py"))
