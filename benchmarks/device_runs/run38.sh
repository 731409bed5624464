#!/usr/bin/env bash
# Issue 17: run 37's alternating-timing test found cgbackend's tiny moe training rows inaccurate on
# the GPU (36x eager's error against float64) after inductor and reduce-overhead had run in the
# process. Alone, or only after reduce-overhead? Sequential and alternating, with and without it.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
for c in eager,cgbackend eager,reduce-overhead,cgbackend eager,inductor,cgbackend; do
  for t in sequential alternate; do
    echo "== $c $t"
    timeout 60 python -m cgbackend bench --smoke --device cuda --models moe --modes train --contenders $c --warmup 2 --iters 6 \
      --timing $t --out $OUT/x.json 2>&1 | grep -E "^\[bench\].*(median|ERROR)" | cut -c1-200
  done
done
timeout 60 python -m cgbackend bench --smoke --device cuda --models moe --modes train --contenders eager,cgbackend,cgbackend-eager-kernels --warmup 6 --iters 6 \
  --timing sequential --out $OUT/x.json 2>&1 | grep -E "^\[bench\].*(median|ERROR)" | cut -c1-200
