#!/usr/bin/env bash
# Rebuild the built-in default model, m3-small, from scratch: train a byte-level BPE tokenizer and the
# 17.8M-parameter M3 of m3jax/configs/m3_small.json on this Python's own standard-library sources, then save
# it in the HF layout (MXFP8 like MiniMax-M3-MXFP8) with its tokenizer into m3jax/assets/m3-small.
#
#   bash scripts/build_m3_small.sh                 # one H200: ~8 min (the shipped model: BUDGET=380)
#   BUDGET=1500 bash scripts/build_m3_small.sh     # longer: the step count follows the time budget
#
# The step count is chosen from a timed run of a few steps (train.py --time-budget) and recorded in
# summary.json; pass the recorded --steps to train.py to repeat a run exactly. On a CPU use the small
# variant in the README (m3_tiny) instead: this one needs a GPU to finish in minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/m3-small}
"${PYTHON:-python}" -m m3jax.train --config m3_small --time-budget "${BUDGET:-380}" --dense-warmup-frac 0.1 \
  --seq-len 4096 --batch 8 --lr 2e-3 --warmup 50 --eval-every 100 --eval-batches 4 --ckpt-every 1000000 \
  --save-format mxfp8 --out "$RUN_DIR" "$@"
mkdir -p m3jax/assets/m3-small
cp "$RUN_DIR"/model/* "$RUN_DIR"/summary.json "$RUN_DIR"/train_log.csv "$RUN_DIR"/loss_curve.png m3jax/assets/m3-small/
echo "m3-small written to m3jax/assets/m3-small"
