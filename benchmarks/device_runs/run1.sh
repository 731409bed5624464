#!/usr/bin/env bash
# Device run: install, issue-16 GPU tests, dispatch cost measurement.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv
timeout 300 python -m pytest -q -x -m cuda tests/test_dispatch_forms.py tests/test_static_dispatch.py 2>&1 | tee $OUT/tests.log | tail -25
timeout 200 python benchmarks/dispatch_costs.py --out $OUT --quick 2>&1 | tee $OUT/costs.log | tail -20
