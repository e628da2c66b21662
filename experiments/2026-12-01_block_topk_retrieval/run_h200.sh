#!/usr/bin/env bash
# Issue #17's GPU measurements on one checkpoint in one call of at most BUDGET seconds (default 540; a 600 s device call):
#   1. the 128K probe (experiments/2026-12-01_probe_long: kernels' selections, streamed dense recall),
#      falling back to 32K on the jnp reference path when the 128K run fails or runs out of its time;
#   2. fp8 vs bf16 index keys at 16K (fp8_index.py);
#   3. the block x top-k quality sweep at 16K with whatever time is left (resumable: the same command
#      continues it), then its plots.
# Everything lands under $OUT (default benchmarks/out): probe_long/, btr/ (quality.jsonl, fp8_index_16k.json,
# plots/). Copy them into the experiments' results/ folders to commit them.
#
#   bash experiments/2026-12-01_block_topk_retrieval/run_h200.sh [CHECKPOINT_DIR] [BUDGET_SECONDS]
# PROBE_CTX / FALLBACK_CTX / SWEEP_CTX (131072 / 32768 / 16384) shrink it for a CPU smoke run.
set -u
cd "$(dirname "$0")/../.."
CKPT=${1:-m3jax/assets/m3-small}
BUDGET=${2:-540}
PROBE_CTX=${PROBE_CTX:-131072}
FALLBACK_CTX=${FALLBACK_CTX:-32768}
SWEEP_CTX=${SWEEP_CTX:-16384}
OUT=${OUT:-benchmarks/out}
PY=${PYTHON:-python3}
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
END=$(( $(date +%s) + BUDGET ))
left() { echo $(( END - $(date +%s) )); }
mkdir -p "$OUT/probe_long" "$OUT/btr"
status=0

echo "== probe at $PROBE_CTX ($(left) s left)"
if ! timeout 180 "$PY" experiments/2026-12-01_probe_long/probe_long.py --checkpoint "$CKPT" --ctx "$PROBE_CTX" \
        --out "$OUT/probe_long"; then
    echo "== the $PROBE_CTX probe failed or timed out: $FALLBACK_CTX on the reference path ($(left) s left)"
    timeout 100 "$PY" experiments/2026-12-01_probe_long/probe_long.py --checkpoint "$CKPT" --ctx "$FALLBACK_CTX" \
        --attention-impl reference --out "$OUT/probe_long" || status=1
fi

echo "== fp8 vs bf16 index keys at $SWEEP_CTX ($(left) s left)"
timeout 150 "$PY" experiments/2026-12-01_block_topk_retrieval/fp8_index.py --checkpoint "$CKPT" --ctx "$SWEEP_CTX" \
    --trials 16 --out "$OUT/btr/fp8_index_$((SWEEP_CTX / 1024))k.json" || status=1

SWEEP_SECONDS=$(( $(left) - 45 ))  # a cell started at the budget's end still finishes, and the plots run
echo "== quality sweep at $SWEEP_CTX, new cells for ${SWEEP_SECONDS} s"
if [ "$SWEEP_SECONDS" -gt 30 ]; then
    timeout $(( SWEEP_SECONDS + 40 )) "$PY" experiments/2026-12-01_block_topk_retrieval/sweep.py \
        --checkpoint "$CKPT" --ctx "$SWEEP_CTX" --query-chunk 512 --out "$OUT/btr" --max-seconds "$SWEEP_SECONDS" \
        || status=1
fi
"$PY" experiments/2026-12-01_block_topk_retrieval/sweep.py --plot --out "$OUT/btr" --plots "$OUT/btr/plots" || status=1
exit $status
