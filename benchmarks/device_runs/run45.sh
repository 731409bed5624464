#!/usr/bin/env bash
# Issue 17: host latency of a decode step (hf-llama) and of a qwen2_moe inference call, cgbackend
# against reduce-overhead (diag9.py: latency, one step's CUDA calls on a timeline, cProfile).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 400 python diag9.py decode zoo:qwen2_moe > $OUT/diag9.txt 2>&1)
grep -E "^(==|  )" $OUT/diag9.txt | grep -E "^==|latency" 
