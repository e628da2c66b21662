"""Benchmark: the MSA sparse-attention backward kernel against its forward, on the same selections.

    PYTHONPATH=. python benchmarks/msa_backward.py              # GPU: m3-small and M3-width at 16K, bf16
    PYTHONPATH=. python benchmarks/msa_backward.py --interpret  # smoke run: tiny shapes, interpreted

Per (shape, selection) it prints one JSON row: forward (KV-major kernel + combine, with the LSE) and
backward (:func:`m3jax.pallas.sparse_attention.backward.kv_major_backward`: D, the CSR, the kernel,
the dQ reduce) device time in ms, their TF/s and the ratio backward TF/s / forward TF/s. FLOPs count
the selected visible keys only: the forward 2 matmuls (4·H·G·Σ visible keys per KV head), the
backward 5 (S again, dP, dV, dK, dQ: 10·H·G·Σ). Selections:

- ``random``: own block + distinct uniformly random earlier blocks (benchmarks/msa_attention.py's);
- ``indexer``: :func:`m3jax.msa.select_blocks` (own block and the first block forced) over random
  block scores with a recency bias, as a trained indexer's are local-heavy: recent blocks are
  selected by many queries, which makes the KV-major rows long and uneven.

Backward variants, timed in the same process: ``default`` (two consumer warpgroups over each
128-key block where the shapes allow, else one; rows cut into items of half a CTA's share, the deepest
Q/dO ring that fits), ``one warpgroup, P^T in SMEM`` (the kernel before the two-warpgroup split: 64-key
sub-blocks, one warpgroup) and ``one warpgroup`` (the same with P^T fed to its MMA from registers). The
ratio is the default's.

Device time comes from Mosaic GPU's profiler (CUPTI, median of 10 runs after a warm-up);
``--interpret`` times one wall-clock call, compile included (the numbers say nothing about speed). Rows are also appended to $OUT/msa_backward.jsonl
(default benchmarks/out).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from m3jax import msa
from m3jax.pallas import _backend
from m3jax.pallas.sparse_attention import SparseAttentionConfig, backward, sparse_attention

from msa_attention import random_selection, visible_keys

# (name, B, T = context, N, K, H, block, top-k)
SHAPES = [
    ("m3-small", 1, 16384, 8, 2, 64, 64, 8),
    ("M3-width", 1, 16384, 64, 4, 128, 128, 16),
]
TINY = [("tiny", 1, 80, 8, 2, 64, 64, 2)]
RECENCY = 0.5  # score bias per block of distance (index scores are unit normals)


def indexer_selection(key, b, kh, t, block_size, topk):
    """select_blocks over unit-normal block scores minus RECENCY x distance, first block forced."""
    q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    nb = -(-t // block_size)
    dist = (q_pos // block_size)[:, None, :, None] - jnp.arange(nb)[None, None, None, :]
    scores = jax.random.normal(key, (b, kh, t, nb)) - RECENCY * dist
    scores = jnp.where(dist >= 0, scores, -jnp.inf)
    return msa.select_blocks(scores, q_pos, block_size=block_size, topk=topk, init_blocks=1), q_pos


def _timer(interpret: bool):
    def device_ms(fn, *args, iters=10):
        fn = jax.jit(fn)
        if interpret:  # one call, compile included: a smoke run, not a measurement
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return (time.perf_counter() - t0) * 1e3
        jax.block_until_ready(fn(*args))
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(fn, iterations=iters)(*args)
        return statistics.median(times)

    return device_ms


VARIANTS = {
    "default": SparseAttentionConfig(),
    # the kernel before the two-warpgroup split (stop 53): one warpgroup over 64-key sub-blocks, P^T
    # through SMEM; and the same with P^T from registers (what one warpgroup runs now)
    "one warpgroup, P^T in SMEM": SparseAttentionConfig(backward_warpgroups=1, p_via_smem=True),
    "one warpgroup": SparseAttentionConfig(backward_warpgroups=1),
}


def bench(report, shapes, interpret: bool):
    device_ms = _timer(interpret)
    cfg = SparseAttentionConfig()
    for name, b, t, n, kh, h, bs, topk in shapes:
        ks = jax.random.split(jax.random.PRNGKey(t), 6)
        q, do = ((jax.random.normal(k_, (b, t, n, h), jnp.float32) * 0.5).astype(jnp.bfloat16) for k_ in ks[:2])
        k, v = ((jax.random.normal(k_, (b, t, kh, h), jnp.float32) * 0.5).astype(jnp.bfloat16) for k_ in ks[2:4])
        shape = f"{name}: B={b} T=ctx={t} N={n} K={kh} H={h} bs={bs} topk={topk} bf16"
        for selection in ("random", "indexer"):
            if selection == "random":
                block_idx, q_pos = random_selection(ks[4], b, kh, t, 0, bs, topk)
            else:
                block_idx, q_pos = indexer_selection(ks[5], b, kh, t, bs, topk)
            fwd = lambda q, k, v, bi, qp: sparse_attention(q, k, v, bi, qp, block_size=bs, config=cfg,
                                                           return_lse=True)
            o, lse = jax.jit(fwd)(q, k, v, block_idx, q_pos)
            fwd_ms = device_ms(fwd, q, k, v, block_idx, q_pos)
            bwd_ms = {}
            for variant, vcfg in VARIANTS.items():
                bwd = functools.partial(backward.kv_major_backward, block_size=bs, cfg=vcfg)
                bwd_ms[variant] = device_ms(bwd, q, k, v, block_idx, q_pos, o, lse, do)
            vis = float(visible_keys(block_idx, q_pos, bs)) * (n // kh)
            fwd_tf, bwd_tf = 4 * h * vis / fwd_ms / 1e9, 10 * h * vis / bwd_ms["default"] / 1e9
            report({"op": "msa_attention_backward", "shape": shape, "selection": selection,
                    "fwd_ms": round(fwd_ms, 3), "bwd_ms": round(bwd_ms["default"], 3),
                    "bwd_ms_variants": {name: round(ms, 3) for name, ms in bwd_ms.items()},
                    "fwd_tflops": round(fwd_tf, 2), "bwd_tflops": round(bwd_tf, 2),
                    "bwd_over_fwd_tflops": round(bwd_tf / fwd_tf, 3), "interpret": interpret})


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    interpret = "--interpret" in sys.argv[1:]
    out = os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)

    def report(row):
        print(json.dumps(row), flush=True)
        with open(os.path.join(out, "msa_backward.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")

    if interpret:
        with _backend.interpret_as(_backend.HOPPER):
            bench(report, TINY, interpret=True)
    else:
        bench(report, SHAPES, interpret=False)
