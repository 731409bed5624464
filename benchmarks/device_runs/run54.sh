#!/usr/bin/env bash
# Issue 17: dense-llama8b-shape, reduce-overhead against a second reduce-overhead and cgbackend in
# one process (diag13.py): how large is the harness's own gap between identical contenders?
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 400 python diag13.py infer train > $OUT/diag13.txt 2>&1)
grep -E "^==" $OUT/diag13.txt; tail -3 $OUT/diag13.txt | grep -i error
