#!/usr/bin/env bash
# Issue 17: dense-llama8b-shape training, cgbackend's GPU idle inside a step (diag7.py).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 200 python diag7.py > $OUT/diag7.txt 2>&1); grep -v Warn $OUT/diag7.txt | grep -E "^(==|  )" | head -120
