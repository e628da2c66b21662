"""Benchmark: MSA block-sparse prefill attention (KV-block-major vs query-major vs cuDNN dense).

``bench(report)`` records rows {"op", "shape", "impl", "ms", "tflops", "baseline", "ratio", "notes"}.
Effective TFLOP/s count only the selected, visible keys: 4 * H * G * Σ_{b, kv head, q} visible keys
(= 4·H·N·Σ_q visible selected keys per KV group). cuDNN dense causal attention over the same
chunk/context is timed in the same process; its row reports dense causal FLOPs and the ratio column
of the sparse rows is cudnn_ms / sparse_ms (wall-clock speedup over dense) or query_major_ms /
kv_major_ms. Selections: own block + min(L, topk-1) distinct random earlier blocks per (query, KV head).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp

from m3jax.pallas.sparse_attention import SparseAttentionConfig, sparse_attention

N, K, H, BS, TOPK = 64, 4, 128, 128, 16
CASES = [  # (queries in the chunk, context after the chunk)
    (8192, 8192),
    (8192, 32768),
    (8192, 131072),
]


def random_selection(key, b, kh, t, prefix, block_size, topk):
    """Own block + min(L, topk-1) distinct random earlier blocks; int32 [B, K, T, topk], -1 padded."""
    q_pos = prefix + jnp.arange(t, dtype=jnp.int32)
    own = q_pos // block_size
    nb = (prefix + t + block_size - 1) // block_size
    r = jax.random.uniform(key, (b, kh, t, nb))
    j = jnp.arange(nb)
    r = jnp.where(j[None, None, None, :] < own[None, None, :, None], r, -1.0)
    vals, idx = jax.lax.top_k(r, topk - 1)
    hist = jnp.where(vals >= 0, idx, -1).astype(jnp.int32)
    own_b = jnp.broadcast_to(own[None, None, :, None], (b, kh, t, 1)).astype(jnp.int32)
    return jnp.concatenate([hist, own_b], axis=-1), jnp.broadcast_to(q_pos, (b, t))


def visible_keys(block_idx, q_pos, block_size):
    own = q_pos[:, None, :, None] // block_size
    full = (block_idx >= 0) & (block_idx < own)
    part = block_idx == own
    return (full * block_size + part * (q_pos[:, None, :, None] % block_size + 1)).sum()


def _time(fn, *args, iters=20):
    from jax.experimental.mosaic.gpu import profiler

    fn = jax.jit(fn)
    jax.block_until_ready(fn(*args))
    _, times = profiler.measure(fn, iterations=iters)(*args)
    return statistics.median(times)


def _breakdown(fn, *args):
    from jax.experimental.mosaic.gpu import profiler

    _, per_kernel = profiler.measure(jax.jit(fn), aggregate=False)(*args)
    agg = {}
    for name, ms in per_kernel or []:
        short = "kv_major_fwd" if "body" in name or "mosaic" in name.lower() else name[:40]
        agg[short] = agg.get(short, 0.0) + ms
    return {k: round(v, 3) for k, v in sorted(agg.items(), key=lambda kv: -kv[1])[:6]}


def bench(report, cases=CASES, cfg: SparseAttentionConfig | None = None):
    cfg = cfg or SparseAttentionConfig()
    for t, ctx in cases:
        prefix = ctx - t
        ks = jax.random.split(jax.random.PRNGKey(t + ctx), 4)
        q = (jax.random.normal(ks[0], (1, t, N, H), jnp.float32) * 0.25).astype(jnp.bfloat16)
        k = (jax.random.normal(ks[1], (1, ctx, K, H), jnp.float32) * 0.25).astype(jnp.bfloat16)
        v = (jax.random.normal(ks[2], (1, ctx, K, H), jnp.float32) * 0.25).astype(jnp.bfloat16)
        block_idx, q_pos = random_selection(ks[3], 1, K, t, prefix, BS, TOPK)
        flops = 4 * H * (N // K) * float(visible_keys(block_idx, q_pos, BS))
        shape = f"T={t} ctx={ctx} N={N} K={K} H={H} bs={BS} topk={TOPK}"
        ms = {}
        for impl in ("kv_major", "query_major"):
            f = lambda q, k, v, bi, qp, impl=impl: sparse_attention(
                q, k, v, bi, qp, block_size=BS, implementation=impl, config=cfg
            )
            try:
                ms[impl] = _time(f, q, k, v, block_idx, q_pos)
            except Exception as e:  # noqa: BLE001
                report({"op": "msa_attention_prefill", "shape": shape, "impl": impl, "ms": None, "tflops": None,
                        "baseline": None, "ratio": None, "notes": f"FAILED: {type(e).__name__}: {str(e)[:300]}"})
        # dense cuDNN over the same chunk: causal when the chunk is the whole context, else the chunk
        # attends to the whole context (prefix + chunk; over-counts the chunk's own triangle).
        causal = prefix == 0
        dense = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
        try:
            ms["cudnn"] = _time(dense, q, k, v)
        except Exception as e:  # noqa: BLE001
            report({"op": "msa_attention_prefill", "shape": shape, "impl": "cudnn_dense", "ms": None, "tflops": None,
                    "baseline": None, "ratio": None, "notes": f"FAILED: {type(e).__name__}: {str(e)[:300]}"})
        dense_flops = 4 * H * N * float(jnp.sum(q_pos + 1)) if causal else 4.0 * H * N * t * ctx
        if "cudnn" in ms:
            report({"op": "msa_attention_prefill", "shape": shape, "impl": "cudnn_dense", "ms": ms["cudnn"],
                    "tflops": dense_flops / ms["cudnn"] / 1e9, "baseline": None, "ratio": None,
                    "notes": "dense causal" if causal else "dense, chunk x full context (non-causal)"})
        for impl in ("query_major", "kv_major"):
            if impl not in ms:
                continue
            notes = f"vs cudnn dense: {ms['cudnn'] / ms[impl]:.2f}x" if "cudnn" in ms else ""
            row = {"op": "msa_attention_prefill", "shape": shape, "impl": impl, "ms": ms[impl],
                   "tflops": flops / ms[impl] / 1e9, "baseline": "cudnn_dense", "ratio":
                   (ms["cudnn"] / ms[impl]) if "cudnn" in ms else None, "notes": notes}
            if impl == "kv_major" and "query_major" in ms:
                row["notes"] += f"; vs query_major: {ms['query_major'] / ms[impl]:.2f}x"
                try:
                    f = lambda q, k, v, bi, qp: sparse_attention(q, k, v, bi, qp, block_size=BS, config=cfg)
                    row["notes"] += f"; kernels(ms): {_breakdown(f, q, k, v, block_idx, q_pos)}"
                except Exception as e:  # noqa: BLE001
                    row["notes"] += f"; breakdown failed {type(e).__name__}"
            report(row)


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    out = os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)
    rows = []

    def report(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(os.path.join(out, "msa_attention.jsonl"), "a") as fh:
            fh.write(json.dumps(row) + "\n")

    cases = CASES
    if len(sys.argv) > 1:  # e.g. "8192:131072,4096:32768"
        cases = [tuple(int(x) for x in c.split(":")) for c in sys.argv[1].split(",")]
    bench(report, cases)
