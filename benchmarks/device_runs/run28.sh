#!/usr/bin/env bash
# Issue 17 after the inference fast path (region.RegionRunner._replay_fast, one _foreach_copy_ for
# the inputs, the output-ownership plan, the split counter mirror): diag5.py again (host time per
# call against reduce-overhead and its parts), then run 26 (the zoo's transformers models, the
# reference moe model, dense-llama8b-shape).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
(cd benchmarks/device_runs && timeout 100 python diag5.py llama,gpt2 > $OUT/diag5.log 2>&1); grep -v Warning $OUT/diag5.log | grep -E "^(=|  )" | grep -v "aten ops" | cut -c1-600
bash benchmarks/device_runs/run26.sh
