#!/usr/bin/env bash
# Device call 5 (one command line): the dense reference model, cgbackend (default options) against reduce-overhead (issue 17).
export PYTHONUNBUFFERED=1; pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 150 python -m cgbackend bench --models dense --modes infer,train --contenders eager,reduce-overhead,cgbackend --out $OUT/dense.json --markdown $OUT/dense.md 2>&1 | tee $OUT/dense.log | grep -E "median|rror"
