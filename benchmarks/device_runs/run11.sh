#!/usr/bin/env bash
# Session of 2026-11-23 (evening), device call 1: host time per call of dsv2lite (diag3.py), the
# real-size MoE training rows and dsv2lite inference re-measured after the region-key change (issue 16).
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 90 python benchmarks/device_runs/diag3.py moe-dsv2lite-shape > $OUT/diag3.log 2>&1; grep -E "=====|static_regions" $OUT/diag3.log
C=eager,cgbackend-static-dispatch,grouped-reduce-overhead
timeout 230 python -m cgbackend bench --models moe-dsv2lite-shape --modes infer,train --contenders $C --time-budget 1 \
  --out $OUT/dsv2lite.json --markdown $OUT/dsv2lite.md 2>&1 | tee $OUT/dsv2lite.log | grep -E "median|reference in|rror"
timeout 230 python -m cgbackend bench --models moe-mixtral-shape --modes train --contenders $C --time-budget 1 --acc-batches 2 \
  --out $OUT/mixtral-train.json --markdown $OUT/mixtral-train.md 2>&1 | tee $OUT/mixtral-train.log | grep -E "median|reference in|rror"
