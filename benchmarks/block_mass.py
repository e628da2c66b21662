"""Benchmark: the indexer objective's target mass, Mosaic GPU kernel vs the XLA reference.

    PYTHONPATH=. python benchmarks/block_mass.py           # GPU: m3-small at 16K/32K/64K, M3-width at 16K, bf16
    PYTHONPATH=. python benchmarks/block_mass.py --small   # smoke run: tiny shapes (interpreted off-GPU)

Per shape it prints one JSON row, both sides measured in this process on the same inputs:

- ``kernel_ms``: :func:`m3jax.pallas.block_mass.block_mass` (the bf16 kernel's two passes, the head-chunk
  sum, the transpose to [B, K, T, nb] and the visibility mask);
- ``reference_ms``: :func:`m3jax.msa.reference.causal_block_mass` as training runs it, over query
  chunks of ``REF_CHUNK`` rows (``lax.map``: the whole [T, S] softmax of a 16K row does not fit);
- ``kernel_chunked_ms``: the kernel over query chunks of ``KERNEL_CHUNK`` rows (``lax.map``), as
  training calls it per chunk (the key spans fill the GPU);
- ``speedup`` = reference / kernel, and the kernel's TF/s: two Q K^T products over the visible keys
  (2 · 2·H·N·Σ visible keys per batch row).

Device time comes from Mosaic GPU's profiler (CUPTI, median of 10 runs after a warm-up); ``--small``
off-GPU times one wall-clock call, compile included (a smoke run, not a measurement). Rows are also
appended to $OUT/block_mass.jsonl (default benchmarks/out).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from m3jax.msa import reference as msa
from m3jax.pallas import _backend
from m3jax.pallas.block_mass import block_mass

# (name, B, T = context, N, K, H, block)
SHAPES = [
    ("m3-small", 1, 16384, 8, 2, 64, 64),
    ("m3-small", 1, 32768, 8, 2, 64, 64),
    ("m3-small", 1, 65536, 8, 2, 64, 64),
    ("M3-width", 1, 16384, 64, 4, 128, 128),
]
SMALL = [("tiny", 1, 192, 8, 2, 64, 64)]
REF_CHUNK = 1024
KERNEL_CHUNK = 256  # training's attention_chunk default


def _timer(wall: bool):
    def device_ms(fn, *args, iters=10):
        fn = jax.jit(fn)
        if wall:  # one call, compile included: a smoke run, not a measurement
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            return (time.perf_counter() - t0) * 1e3
        jax.block_until_ready(fn(*args))
        from jax.experimental.mosaic.gpu import profiler

        _, times = profiler.measure(fn, iterations=iters)(*args)
        return statistics.median(times)

    return device_ms


def chunked(mass_fn, chunk_rows, q, k, q_pos):
    """mass_fn(q chunk, k, q_pos chunk) over query chunks (``lax.map``), merged to [B, K, T, nb]."""
    out, merge = msa.map_query_chunks(lambda qp, qc: mass_fn(qc, k, qp), chunk_rows, q_pos, q)
    return merge(out, 2)


def bench(report, shapes, wall: bool):
    device_ms = _timer(wall)
    for name, b, t, n, kh, h, bs in shapes:
        k1, k2 = jax.random.split(jax.random.PRNGKey(t))
        q = jax.random.normal(k1, (b, t, n, h), jnp.float32).astype(jnp.bfloat16)
        k = jax.random.normal(k2, (b, t, kh, h), jnp.float32).astype(jnp.bfloat16)
        q_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        nb = -(-t // bs)
        kern = lambda q, k, qp: block_mass(q, k, qp, block_size=bs, num_blocks=nb)
        kern_chunked = lambda q, k, qp: chunked(kern, KERNEL_CHUNK, q, k, qp)
        ref = lambda q, k, qp: chunked(lambda qc, k, qp: msa.causal_block_mass(qc, k, qp, bs, nb), REF_CHUNK, q, k, qp)
        err = float(jnp.max(jnp.abs(jax.jit(kern)(q, k, q_pos) - jax.jit(ref)(q, k, q_pos))))
        kern_ms = device_ms(kern, q, k, q_pos)
        chunked_ms = device_ms(kern_chunked, q, k, q_pos)
        ref_ms = device_ms(ref, q, k, q_pos)
        visible = b * t * (t + 1) / 2
        report({"op": "block_mass", "shape": f"{name}: B={b} T=ctx={t} N={n} K={kh} H={h} bs={bs} bf16",
                "kernel_ms": round(kern_ms, 3), "kernel_chunked_ms": round(chunked_ms, 3),
                "reference_ms": round(ref_ms, 3),
                "speedup": round(ref_ms / kern_ms, 2), "kernel_tflops": round(4 * h * n * visible / kern_ms / 1e9, 2),
                "max_abs_err": err, "wall_clock": wall})


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    small = "--small" in sys.argv[1:]
    out = os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)

    def report(row):
        print(json.dumps(row), flush=True)
        with open(os.path.join(out, "block_mass.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")

    if not small:
        bench(report, SHAPES, wall=False)
    elif _backend.on_gpu():
        bench(report, SMALL, wall=False)
    else:
        with _backend.interpret_as(_backend.HOPPER):
            bench(report, SMALL, wall=True)
