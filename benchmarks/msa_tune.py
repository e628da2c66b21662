"""Tile-configuration sweep for the MSA prefill kernels at M3 shapes (one process, one device call).

    PYTHONPATH=. python benchmarks/msa_tune.py [--ctx 131072] [--chunk 8192]

Times, at the same shapes as ``msa_index`` / ``msa_attention``:

* the bf16 matmul ceiling on random inputs and on all-ones inputs (METHOD.md: constant inputs can
  run faster than real data, which would flatter the baseline);
* the index-score kernel under several ``IndexScoreConfig`` tile/pipeline settings;
* the KV-block-major sparse attention under several ``SparseAttentionConfig`` settings, total and
  forward kernel alone (CUPTI per-kernel times).

Prints one JSON row per measurement; the chosen defaults and the reasoning live in
``benchmarks/NOTES_msa.md``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.msa_attention import BS, H, K, N, TOPK, _breakdown, random_selection, visible_keys
from benchmarks.msa_index import HI, HX, _inputs, _time_ms
from m3jax.pallas import index_scores
from m3jax.pallas.sparse_attention import SparseAttentionConfig, sparse_attention

INDEX_CONFIGS = [
    dict(rows=128, max_concurrent_steps=3, group=16),
    dict(rows=64, max_concurrent_steps=2, group=16),
    dict(rows=64, max_concurrent_steps=2, group=32),
    dict(rows=64, max_concurrent_steps=2, group=8),
]
ATTENTION_CONFIGS = [
    dict(q_stages=2),
    dict(q_stages=2, ctas_per_sm=1),
    dict(q_stages=3),
    dict(q_stages=2, tiles_per_item=32),
    dict(q_stages=2, tiles_per_item=8),
]


def matmul_ceiling(report, k=16384):
    for name, make in (("random", lambda key, s: jax.random.normal(key, s, jnp.bfloat16)),
                       ("ones", lambda key, s: jnp.ones(s, jnp.bfloat16))):
        ka, kb = jax.random.split(jax.random.key(1))
        a, b = make(ka, (8192, k)), make(kb, (k, 8192))
        ms = _time_ms(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), a, b)
        report(dict(op="bf16_matmul", inputs=name, shape=f"8192x{k}x8192", ms=ms, tflops=2 * 8192 * 8192 * k / ms / 1e9))


def index_sweep(report, ctx, chunk):
    iq, ik, q_pos = _inputs(chunk, ctx)
    flops = 2 * HX * HI * (float(chunk) * (ctx - chunk) + chunk * (chunk + 1) / 2)
    for kw in INDEX_CONFIGS:
        cfg = index_scores.IndexScoreConfig(**kw)
        f = jax.jit(lambda a, b, c, cfg=cfg: index_scores.index_block_scores_blockmajor(
            a, b, c, block_size=BS, config=cfg)[0])
        try:
            ms = _time_ms(f, iq, ik, q_pos)
            report(dict(op="msa_index_scores", ctx=ctx, config=kw, ms=ms, tflops=flops / ms / 1e9))
        except Exception as e:  # noqa: BLE001  (a config that does not fit is a result too)
            report(dict(op="msa_index_scores", ctx=ctx, config=kw, error=f"{type(e).__name__}: {str(e)[:200]}"))


def attention_sweep(report, ctx, chunk):
    ks = jax.random.split(jax.random.PRNGKey(chunk + ctx), 4)
    q = (jax.random.normal(ks[0], (1, chunk, N, H), jnp.float32) * 0.25).astype(jnp.bfloat16)
    k = (jax.random.normal(ks[1], (1, ctx, K, H), jnp.float32) * 0.25).astype(jnp.bfloat16)
    v = (jax.random.normal(ks[2], (1, ctx, K, H), jnp.float32) * 0.25).astype(jnp.bfloat16)
    block_idx, q_pos = random_selection(ks[3], 1, K, chunk, ctx - chunk, BS, TOPK)
    flops = 4 * H * (N // K) * float(visible_keys(block_idx, q_pos, BS))
    ref = None
    for kw in ATTENTION_CONFIGS:
        cfg = SparseAttentionConfig(**kw)
        f = lambda q, k, v, bi, qp, cfg=cfg: sparse_attention(q, k, v, bi, qp, block_size=BS, config=cfg)
        try:
            out = jax.jit(f)(q, k, v, block_idx, q_pos)
            if ref is None:
                ref = out
            err = float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
            ms = _time_ms(jax.jit(f), q, k, v, block_idx, q_pos)
            report(dict(op="msa_attention_prefill", ctx=ctx, config=kw, ms=ms, tflops=flops / ms / 1e9,
                        rel_l2_vs_first_config=err, kernels_ms=_breakdown(f, q, k, v, block_idx, q_pos)))
        except Exception as e:  # noqa: BLE001
            report(dict(op="msa_attention_prefill", ctx=ctx, config=kw, error=f"{type(e).__name__}: {str(e)[:200]}"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, nargs="+", default=[131072])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--only", nargs="+", default=["matmul", "index", "attention"])
    args = ap.parse_args()
    report = lambda row: print(json.dumps(row), flush=True)
    if "matmul" in args.only:
        matmul_ceiling(report)
    for ctx in args.ctx:
        if "index" in args.only:
            index_sweep(report, ctx, args.chunk)
        if "attention" in args.only:
            attention_sweep(report, ctx, args.chunk)


if __name__ == "__main__":
    main()
