"""``python benchmarks/run.py [FLAGS]``: the same as ``python -m cgbackend bench [FLAGS]``.

See benchmarks/README.md for the flags and the results schema.
"""

import os
import sys

if __name__ == "__main__":
    # Run from a checkout without installing: put the repository root on the path.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cgbackend.bench import main

    raise SystemExit(main(sys.argv[1:], prog="python benchmarks/run.py"))
