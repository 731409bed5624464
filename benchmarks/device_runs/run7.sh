#!/usr/bin/env bash
# Session of 2026-11-23 (afternoon), device call 1: issue 20's measured launch coverage; every cuda
# test with inner="auto" as the default (CGBACKEND_INNER=auto) to list what the switch breaks; the
# decode row with Inductor's precision-cast emulation, to see whether greedy tokens then match eager.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for opt in "" "--option static_dispatch=auto"; do
  timeout 60 python benchmarks/launch_coverage.py --demo moe $opt 2>&1 | tee -a $OUT/coverage.log | tail -8
done
CGBACKEND_INNER=auto timeout 400 python -m pytest -q -m cuda -n 6 -p no:cacheprovider tests/ --maxfail=40 2>&1 \
  | tee $OUT/cuda_tests_auto.log | grep -E "passed|failed|FAILED|ERROR" | tail -40
TORCHINDUCTOR_EMULATE_PRECISION_CASTS=1 timeout 110 python -m cgbackend bench --models hf-mixtral-eager-experts --modes decode \
  --contenders eager,cgbackend-static-dispatch-inductor,hf-grouped-mm-reduce-overhead --time-budget 1 \
  --out $OUT/decode_emulate.json --markdown $OUT/decode_emulate.md 2>&1 | tee $OUT/decode_emulate.log | grep -E "^eager |^cgbackend|^hf-|^== "
