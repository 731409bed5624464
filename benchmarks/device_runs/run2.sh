#!/usr/bin/env bash
# Device run 2: every cuda test of the merged tree (4 workers), then the dispatch cost constants.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 400 python -m pytest -q -m cuda -n 4 -p no:cacheprovider tests/ 2>&1 | tee $OUT/cuda_tests.log | grep -E "passed|failed|FAILED|ERROR|Error" | tail -40
timeout 120 python benchmarks/dispatch_costs.py --out $OUT --quick 2>&1 | tee $OUT/costs.log | tail -12
