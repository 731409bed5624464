#!/usr/bin/env bash
# Issue 17: does the harness's order (which contender compiles first, whose block runs first) move
# the ratio? qwen2_moe inference and dense-llama8b-shape training (diag12.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 400 python diag12.py zoo:qwen2_moe:infer llama8b:train > $OUT/diag12.txt 2>&1)
grep -E "^==" $OUT/diag12.txt; tail -3 $OUT/diag12.txt | grep -i error
