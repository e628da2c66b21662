"""MXFP8 grouped GEMMs at decode: the gemv schedule against the MMA schedules and the bytes floor (GPU).

For 1, 8 and 16 decode tokens at M3 widths (D = 6144, F = 3072, 128 experts, top-4: each token's 4
rows in 4 distinct random experts), three projections: the routed gate (``[4T, D] x [128, D, F]``), the
routed down (``[4T, F] x [128, F, D]``) and the shared expert's gate (``[T, D] x [1, D, F]``). Per
projection, device ms (CUPTI) of

  bf16       the bf16 grouped-GEMM kernel on the dequantised weights, ``layer_config``'s config
  mma        the MXFP8 kernel on the MMA schedules ``layer_config`` chose before the gemv schedule
  gemv       the MXFP8 gemv schedule at ``gemv.decode_split`` for one weight per launch (``layer_config``'s
             choice up to 8 rows per group) and, beside it, half and twice its K split. Each projection is
             a launch of its own here; the model runs gate and up in one launch (``weights=2``), which
             halves the shared gate's split (16 against 32) and leaves the routed ones' as they are
  floor      the fp8 values + scales of the experts with rows, at this process's copy bandwidth

with max |diff| of the MXFP8 outputs against the dequantised weights' fp32 product.

    PYTHONPATH=. python benchmarks/mxfp8_gemv.py [--tokens 1 8 16]    # one H200: about five minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_m3_width import best, copy_bandwidth, on_gpu, timed
from run_info import header, run_info

from m3jax.pallas.grouped_matmul import gemv, grouped_matmul, grouped_matmul_mxfp8, kernel, layer_config, reference

EXPERTS, D, F, TOP_K = 128, 6144, 3072, 4


def _mma_config(m, k, n, g, k_groups):
    saved = kernel.GEMV_MAX_ROWS
    kernel.GEMV_MAX_ROWS = 0
    try:
        return layer_config(m, k, n, g, k_groups)
    finally:
        kernel.GEMV_MAX_ROWS = saved


def projection(label, tokens, values, scales, w_bf16, bandwidth, shared=False) -> dict:
    g, k, n = values.shape
    if shared:
        m, sizes = tokens, jnp.full((1,), tokens, jnp.int32)
    else:
        m = tokens * TOP_K
        choice = jax.vmap(lambda key: jax.random.choice(key, EXPERTS, (TOP_K,), replace=False))(
            jax.random.split(jax.random.key(tokens), tokens))
        sizes = jnp.bincount(choice.reshape(-1), length=EXPERTS).astype(jnp.int32)
    x = (0.5 * jax.random.normal(jax.random.key(9), (m, k))).astype(jnp.bfloat16)
    want = reference.grouped_matmul_mxfp8(x.astype(jnp.float32), values, scales, sizes)
    live = int(jnp.sum(sizes > 0))
    floor_ms = live * (k * n + k // 32 * n) / bandwidth * 1e3
    row = {"projection": label, "tokens": tokens, "rows": m, "experts_with_rows": live, "floor_ms": floor_ms}

    cb = layer_config(m, k, n, g)
    fb = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, config=cb))
    row["bf16_ms"] = best(timed(lambda: fb(x, w_bf16, sizes), 10))

    def mx(config):
        f = jax.jit(lambda x, v, sc, s: grouped_matmul_mxfp8(x, v, sc, s, config=config))
        ms = best(timed(lambda: f(x, values, scales, sizes), 10))
        err = float(jnp.max(jnp.abs(f(x, values, scales, sizes).astype(jnp.float32) - want)))
        return {"config": str(config), "ms": ms, "max_abs_diff": err}

    row["mma"] = mx(_mma_config(m, k, n, g, k // 32))
    row["layer_config"] = str(layer_config(m, k, n, g, k // 32))
    chosen = kernel.GroupedMatmulConfig(block_m=64, block_n=gemv.BLOCK_N, block_k=gemv.BLOCK_K, schedule="gemv",
                                        split_k=gemv.decode_split(m, k, n, g))
    row["gemv"] = mx(chosen)
    row["gemv_splits"] = {}
    for s in (chosen.split_k // 2, chosen.split_k * 2):  # the neighbours of the chosen split
        cfg = kernel.GroupedMatmulConfig(block_m=64, block_n=gemv.BLOCK_N, block_k=gemv.BLOCK_K, schedule="gemv",
                                         split_k=s)
        if s >= 1 and gemv.unsupported_reason(m, k, n, g, k // 32, cfg) is None:
            row["gemv_splits"][s] = mx(cfg)["ms"]
    row["gemv_splits"][chosen.split_k] = row["gemv"]["ms"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16])
    args = ap.parse_args()
    if not on_gpu():
        sys.exit("benchmarks/mxfp8_gemv.py measures GPU kernels: run it on a GPU")
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    info = run_info("mxfp8_gemv.py")
    bandwidth = copy_bandwidth(4.0)

    def weights(seed, g, k, n):
        v = (jax.random.normal(jax.random.key(seed), (g, k, n)) * 64).astype(jnp.float8_e4m3fn)
        s = jax.random.randint(jax.random.key(seed + 1), (g, k // 32, n), 110, 125).astype(jnp.uint8)
        return v, s, reference.dequantize_mxfp8(v, s).astype(jnp.bfloat16)

    gate, down, shared = weights(0, EXPERTS, D, F), weights(2, EXPERTS, F, D), weights(4, 1, D, F)
    rows = []
    for tokens in args.tokens:
        rows.append(projection("routed gate", tokens, *gate, bandwidth))
        rows.append(projection("routed down", tokens, *down, bandwidth))
        rows.append(projection("shared gate", tokens, *shared, bandwidth, shared=True))
    title = f"MXFP8 decode GEMMs, gemv vs MMA schedules (copy bandwidth {bandwidth / 1e9:,.0f} GB/s); device ms"
    columns = ("| projection | tokens | floor | bf16 | MXFP8 mma | MXFP8 gemv (split) | gemv / bf16 | gemv / floor | "
              "splits (ms) | max abs diff gemv / mma |")
    lines = [title, "", header(info), "", columns, "|---" * 10 + "|"]
    for r in rows:
        split = r["gemv"]["config"].split("split_k=")[1].split(",")[0]
        splits = ", ".join(f"{s}: {ms:.3f}" for s, ms in sorted(r["gemv_splits"].items()))
        lines.append(f"| {r['projection']} | {r['tokens']} | {r['floor_ms']:.3f} | {r['bf16_ms']:.3f} | "
                     f"{r['mma']['ms']:.3f} | {r['gemv']['ms']:.3f} ({split}) | {r['gemv']['ms'] / r['bf16_ms']:.2f} | "
                     f"{r['gemv']['ms'] / r['floor_ms']:.2f} | {splits} | "
                     f"{r['gemv']['max_abs_diff']:.2g} / {r['mma']['max_abs_diff']:.2g} |")
    print("\n".join(lines))
    (out / "mxfp8_gemv.md").write_text("\n".join(lines) + "\n")
    (out / "mxfp8_gemv.json").write_text(json.dumps({"run": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
