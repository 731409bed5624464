#!/usr/bin/env bash
# Device run 4: moe-mixtral-shape (infer, train) and transformers Mixtral decode.
set -o pipefail
export PYTHONUNBUFFERED=1
pip install -q --no-deps --no-build-isolation -e . > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 1; }
timeout 300 python -m cgbackend bench --models moe-mixtral-shape --contenders eager,cgbackend-static-dispatch,grouped-reduce-overhead \
  --time-budget 2 --out $OUT/mixtral.json --markdown $OUT/mixtral.md 2>&1 | tee $OUT/mixtral.log | grep -E "^\[bench\].*(median|error|failed)|^==|^contender|^eager|^cgbackend|^grouped" | tail -14
timeout 200 python -m cgbackend bench --models hf-mixtral-eager-experts --modes decode \
  --contenders eager,cgbackend-static-dispatch,hf-grouped-mm-reduce-overhead --time-budget 2 \
  --out $OUT/decode.json --markdown $OUT/decode.md 2>&1 | tee $OUT/decode.log | grep -E "^==|^contender|^eager|^cgbackend|^hf-|error" | tail -10
