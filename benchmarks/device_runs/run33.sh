#!/usr/bin/env bash
# Issue 17: run 32 measured the reference moe model 1.22x eager in inference with Inductor in its
# static regions against 0.73x with eager's kernels (training 0.83x against 0.74x). Where does the
# difference go: GPU time of the graphs (a slow Inductor kernel the host syncs wait for) or host?
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for mode in infer train; do
  timeout 200 python benchmarks/profile_step.py --model moe --mode $mode --variants eager,eager-kernels,cgbackend \
    > $OUT/profile-moe-$mode.txt 2>&1; grep -E "^=====|Self CUDA time total|^\{" $OUT/profile-moe-$mode.txt
  grep -A 12 "cgbackend moe $mode" $OUT/profile-moe-$mode.txt | cut -c1-200
done
