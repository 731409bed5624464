#!/usr/bin/env bash
# Issue 17: cost of alternating two CUDA graphs (raw), and the decode step with the caller holding or
# dropping the previous logits, reduce-overhead against cgbackend handout_graphs 2/1/0 (diag10.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 300 python diag10.py > $OUT/diag10.txt 2>&1)
grep -E "^(==|   )" $OUT/diag10.txt
