#!/usr/bin/env bash
# Indexer-only retraining of the shipped m3-small (native block 64, top-k 8 = 512 selected tokens)
# for two other block sizes at the same token budget: block 32 / top-k 16 and block 128 / top-k 4.
# Main weights stay frozen bit-for-bit; only the index branch (wq, wk, norms) trains on the
# KL objective. Held-out recall is logged every EVAL steps (train_log.csv), before (step 0) and after.
#   bash experiments/2026-11-29_indexer_retrain/run.sh          # one H200: ~3 min
set -euo pipefail
cd "$(dirname "$0")"
ROOT=../..
CKPT=$ROOT/m3jax/assets/m3-small
STEPS=${STEPS:-120}
mkdir -p "${RUN_DIR:-/tmp/retrain}"
# The two runs share the GPU (each is far from filling it).
for cell in 32:16 128:4; do
  bs=${cell%:*} k=${cell#*:}
  ( "${PYTHON:-python}" -m m3jax.train --mode indexer_only --init-from "$CKPT" --tokenizer-from "$CKPT" \
    --block-size "$bs" --topk "$k" --steps "$STEPS" --seq-len 4096 --batch 8 --lr 2e-3 --warmup 10 \
    --eval-every "${EVAL:-10}" --eval-batches 2 --ckpt-every 1000000 --save-format bfloat16 --out "${RUN_DIR:-/tmp/retrain}/b$bs" > "${RUN_DIR:-/tmp/retrain}/b$bs.log" 2>&1
    mkdir -p "results/b${bs}_k${k}"
    cp "${RUN_DIR:-/tmp/retrain}/b$bs"/{summary.json,train_log.csv} "results/b${bs}_k${k}/" ) &
done
wait
"${PYTHON:-python}" plot.py
