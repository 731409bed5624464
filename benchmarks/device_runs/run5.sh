#!/usr/bin/env bash
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 70 python -m pytest -q -m cuda -n 6 -p no:cacheprovider tests/test_dispatch_forms.py 2>&1 | tail -2
C=eager,cgbackend-static-dispatch,cgbackend-static-dispatch-inductor,grouped-reduce-overhead
for M in moe-mixtral-shape moe-dsv2lite-shape; do
timeout 150 python -m cgbackend bench --models $M --modes infer --contenders $C --time-budget 1.5 \
  --out $OUT/$M.json --markdown $OUT/$M.md 2>&1 | tee $OUT/$M.log | grep -E "^eager |^cgbackend|^grouped|^== " ; done
timeout 100 python -m cgbackend bench --models hf-mixtral-eager-experts --modes decode \
  --contenders eager,cgbackend-static-dispatch,cgbackend-static-dispatch-inductor,hf-grouped-mm-reduce-overhead --time-budget 1.5 \
  --out $OUT/decode.json --markdown $OUT/decode.md 2>&1 | tee $OUT/decode.log | grep -E "^eager |^cgbackend|^hf-|^== "
