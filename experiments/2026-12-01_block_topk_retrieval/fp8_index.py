"""fp8 e4m3 index keys (``index_cache_dtype="float8_e4m3fn"``) against bf16 ones on the same model and
held-out rows: share of selection rows (batch, KV group, query) whose block sets are equal, recall of
the dense attention mass, and needle accuracy. One JSON file; see README.md beside this file.

    python experiments/2026-12-01_block_topk_retrieval/fp8_index.py --ctx 16384 --out results/fp8_index_16k.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import m3jax
from m3jax.needle import DEFAULT_CHECKPOINT, evaluate as needle_eval, heldout_stream
from m3jax.probe import probe
from m3jax.data import text_encoder

FP8 = "float8_e4m3fn"


def rows_equal(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows (all axes but the last) whose selected block sets are equal (-1 = padding)."""
    return float((np.sort(a, -1) == np.sort(b, -1)).all(-1).mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--n-docs", type=int, default=2, help="held-out rows for rows-equal and recall")
    ap.add_argument("--trials", type=int, default=16, help="needle trials per key dtype")
    ap.add_argument("--query-chunk", type=int, default=256)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.time()
    ckpt = Path(args.checkpoint)
    model = m3jax.load_pretrained(ckpt, dtype=args.dtype, attention_impl="reference", progress=False)
    tok = None
    if (ckpt / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    t = model.config.text
    encode = text_encoder(tok, t.vocab_size)
    eos = t.eos_token_id[0] if isinstance(t.eos_token_id, tuple) else (t.eos_token_id or 2)
    stream = heldout_stream(encode, max((args.n_docs + 2) * args.ctx, 150_000), eos)
    docs = np.stack([stream[i * args.ctx : (i + 1) * args.ctx] for i in range(args.n_docs)])
    models = {"bfloat16": model, FP8: m3jax.M3Model(model.config.replace_text(index_cache_dtype=FP8), model.params)}
    res, sels = {"checkpoint": str(ckpt), "ctx": args.ctx, "n_docs": args.n_docs, "dtype": args.dtype}, {}
    for name, m in models.items():
        p = probe(m, docs, query_chunk=args.query_chunk, share_compilation=True)
        sels[name] = {i: p.layers[i].block_indices for i in p.msa_layers}
        n = needle_eval(m, encode, stream[args.n_docs * args.ctx :], ctx=args.ctx, trials=args.trials, batch=1)
        res[name] = {"recall_per_layer": {str(r["layer"]): r["recall_mean"] for r in p.summary()},
                     "needle_accuracy": n["accuracy"], "needle_block_selected": n["needle_block_selected"]}
        res[name]["recall_mean"] = float(np.mean(list(res[name]["recall_per_layer"].values())))
    res["rows_equal_per_layer"] = {str(i): rows_equal(sels["bfloat16"][i], sels[FP8][i]) for i in sels["bfloat16"]}
    res["rows_equal"] = float(np.mean(list(res["rows_equal_per_layer"].values())))
    res["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"ctx {args.ctx}: rows equal {res['rows_equal']:.4f}; recall bf16 {res['bfloat16']['recall_mean']:.4f} "
          f"fp8 {res[FP8]['recall_mean']:.4f}; needle bf16 {res['bfloat16']['needle_accuracy']:.3f} "
          f"fp8 {res[FP8]['needle_accuracy']:.3f} ({res['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
