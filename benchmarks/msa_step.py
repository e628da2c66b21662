"""The whole MSA attention step of one prefill chunk (index scoring + top-k + KV-block-major sparse
attention + combine, i.e. what ``attention_impl="pallas"`` runs) against cuDNN dense attention of
the same queries over the same context, M3 shapes, bf16.

The dense baseline attends each of the chunk's queries to the whole context (no causal trim: the
chunk sits at the end, so this over-counts its work by at most chunk/2 keys per query).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from m3jax.config import preset
from m3jax.model import _msa_pallas

N, K, H, HX, BS, TOPK = 64, 4, 128, 128, 128, 16


def _median_ms(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[len(ts) // 2]


def bench(report, contexts=(131072, 1048576), chunk=8192):
    cfg = preset("minimax_m3").text
    step = jax.jit(lambda q, k, v, iq, ik, pos: _msa_pallas(q, k, v, iq, ik, pos, cfg)[0])
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    for ctx in contexts:
        ks = jax.random.split(jax.random.key(ctx), 5)
        bf = jnp.bfloat16
        q = (jax.random.normal(ks[0], (1, chunk, N, H)) * 0.25).astype(bf)
        k = (jax.random.normal(ks[1], (1, ctx, K, H)) * 0.25).astype(bf)
        v = (jax.random.normal(ks[2], (1, ctx, K, H)) * 0.25).astype(bf)
        iq = jax.random.normal(ks[3], (1, chunk, K, HX)).astype(bf)
        ik = jax.random.normal(ks[4], (1, ctx, HX)).astype(bf)
        pos = (ctx - chunk + jnp.arange(chunk, dtype=jnp.int32))[None]
        ms_sparse = _median_ms(step, q, k, v, iq, ik, pos)
        ms_dense = _median_ms(dense, q, k, v)
        shape = f"T={chunk} ctx={ctx} N={N} K={K} H={H} bs={BS} topk={TOPK}"
        report(dict(op="msa_step", shape=shape, impl="pallas: scores+topk+kv_major+combine", ms=ms_sparse,
                    baseline="cudnn dense", ratio=ms_dense / ms_sparse, notes=f"cudnn dense {ms_dense:.2f} ms"))
