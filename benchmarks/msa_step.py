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
from m3jax.msa.kernels import prefill as _msa_pallas

N, K, H, HX, BS, TOPK = 64, 4, 128, 128, 128, 16


def _median_ms(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[len(ts) // 2]


def make_inputs(ctx: int, chunk: int, *, n=N, kh=K, h=H, hx=HX, dtype=jnp.bfloat16):
    """Random (q, k, v, iq, ik, pos) of one prefill chunk of ``chunk`` queries at the end of ``ctx`` keys."""
    ks = jax.random.split(jax.random.key(ctx), 5)
    q = (jax.random.normal(ks[0], (1, chunk, n, h)) * 0.25).astype(dtype)
    k = (jax.random.normal(ks[1], (1, ctx, kh, h)) * 0.25).astype(dtype)
    v = (jax.random.normal(ks[2], (1, ctx, kh, h)) * 0.25).astype(dtype)
    iq = jax.random.normal(ks[3], (1, chunk, kh, hx)).astype(dtype)
    ik = jax.random.normal(ks[4], (1, ctx, hx)).astype(dtype)
    pos = (ctx - chunk + jnp.arange(chunk, dtype=jnp.int32))[None]
    return q, k, v, iq, ik, pos


def time_msa_step(cfg, inputs, iters=10) -> float:
    """Median ms of the whole pallas MSA step (``cfg``: a TextConfig, its block size and top-k used)."""
    step = jax.jit(lambda q, k, v, iq, ik, pos: _msa_pallas(q, k, v, iq, ik, pos, cfg)[0])
    return _median_ms(step, *inputs, iters=iters)


def time_dense(inputs, implementation="cudnn", iters=10) -> float:
    """Median ms of dense attention of the chunk's queries over the whole context (no causal trim)."""
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation))
    return _median_ms(dense, *inputs[:3], iters=iters)


def bench(report, contexts=(131072, 1048576), chunk=8192):
    cfg = preset("minimax_m3").text
    for ctx in contexts:
        inputs = make_inputs(ctx, chunk)
        ms_sparse = time_msa_step(cfg, inputs)
        ms_dense = time_dense(inputs)
        shape = f"T={chunk} ctx={ctx} N={N} K={K} H={H} bs={BS} topk={TOPK}"
        report(dict(op="msa_step", shape=shape, impl="pallas: scores+topk+kv_major+combine", ms=ms_sparse,
                    baseline="cudnn dense", ratio=ms_dense / ms_sparse, notes=f"cudnn dense {ms_dense:.2f} ms"))
