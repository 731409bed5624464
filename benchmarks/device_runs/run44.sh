#!/usr/bin/env bash
# Issue 17: kernel-by-kernel GPU time of cgbackend against reduce-overhead on the two rows still over
# 1.0x (diag8.py: qwen2_moe inference, dense-llama8b-shape training), and the hf-llama decode row
# re-measured after handout graphs.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 300 python diag8.py zoo:qwen2_moe:infer llama8b:train > $OUT/diag8.txt 2>&1)
grep -v -i warn $OUT/diag8.txt | grep -E "^(==|  )" | head -200
timeout 150 python -m cgbackend bench --models hf-llama --modes decode --contenders eager,reduce-overhead,cgbackend \
  --time-budget 1 --out $OUT/decode-llama.json --markdown $OUT/decode-llama.md 2>&1 | tee $OUT/decode-llama.log | grep -E "median|rror"
