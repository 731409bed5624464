#!/usr/bin/env bash
# Issue 17, first call of the 2026-11-24 session: which private storage APIs torch 2.11 has (lazy
# output ownership), the reference moe model with both inner compilers (is Inductor what made
# training 0.84-0.88x eager, against 0.76x with eager's kernels in latest.json?), where a moe
# training step's host time goes, dense-llama8b-shape training with both inner compilers, and the
# zoo's dense transformers models as a baseline on this machine.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python - <<'PY' 2>&1 | tee $OUT/api.txt
import torch
print(torch.__version__, torch.cuda.get_device_name())
for n in ("_swap_data_ptr_", "_resize_with_addr_"):
    print("UntypedStorage." + n, hasattr(torch.UntypedStorage, n))
for n in ("_storage_Use_Count", "_construct_storage_from_data_pointer", "_unsafe_reset_storage"):
    print("torch._C." + n, hasattr(torch._C, n))
print("torch._foreach_clone", hasattr(torch, "_foreach_clone"))
PY
timeout 150 python -m cgbackend bench --models moe --modes train,infer --contenders eager,cgbackend,cgbackend-eager-kernels \
  --out $OUT/moe.json --markdown $OUT/moe.md 2>&1 | tee $OUT/moe.log | grep -E "median|rror"
timeout 90 python benchmarks/profile_step.py --model moe --mode train > $OUT/profile-moe-train.txt 2>&1; tail -2 $OUT/profile-moe-train.txt
timeout 130 python -m cgbackend bench --models dense-llama8b-shape --modes train --contenders eager,reduce-overhead,cgbackend,cgbackend-eager-kernels \
  --time-budget 2 --acc-batches 2 --out $OUT/llama8b.json --markdown $OUT/llama8b.md 2>&1 | tee $OUT/llama8b.log | grep -E "median|rror"
timeout 150 python benchmarks/zoo.py --device cuda --dtype bfloat16 --time --models llama,gpt2,mistral \
  --out $OUT/ZOO_tf.md > $OUT/zoo_tf.txt 2>&1; grep "^\[zoo\]" $OUT/zoo_tf.txt | cut -c1-300
