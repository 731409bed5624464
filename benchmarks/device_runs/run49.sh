#!/usr/bin/env bash
# Issue 17: the zoo's own contender order for qwen2_moe (eager, cgbackend, reduce-overhead; diag12),
# and the hf-llama decode row with alternating timing and the fast path for in-place cache writes.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 200 python diag12.py zoo3:qwen2_moe:infer > $OUT/diag12-zoo3.txt 2>&1)
grep -E "^==" $OUT/diag12-zoo3.txt; tail -3 $OUT/diag12-zoo3.txt | grep -i error
timeout 200 python -m cgbackend bench --models hf-llama --modes decode --contenders eager,reduce-overhead,cgbackend \
  --time-budget 2 --out $OUT/decode-llama.json --markdown $OUT/decode-llama.md 2>&1 | tee $OUT/decode-llama.log | grep -E "median|rror"
