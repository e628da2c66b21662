"""MoE grouped matmul at M3 shapes: the Mosaic GPU kernel vs ``jax.lax.ragged_dot`` vs a dense bf16
``jnp.dot`` of the same useful FLOPs.

8192 tokens x top-4 = 32768 rows routed over 128 experts by a random router (sigmoid scores of
random logits, top-4), bf16 operands, fp32 accumulation, bf16 out. Two GEMMs of an expert MLP:
gate/up (K = 6144 -> N = 3072) and down (K = 3072 -> N = 6144). Timing: CUPTI
(``jax.experimental.mosaic.gpu.profiler.measure``, every kernel of the call, median of the
iterations) when available, else wall clock with ``block_until_ready``. The kernel's result is
checked against ``ragged_dot`` (relative L2) in the same run.

    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py [--out benchmarks/RESULTS.md]
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --dry     # CPU: interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.msa_index import _time_ms
from m3jax.pallas.grouped_matmul import GroupedMatmulConfig, grouped_matmul

M3 = dict(tokens=8192, topk=4, experts=128, cases=(("gate/up", 6144, 3072), ("down", 3072, 6144)))
DRY = dict(tokens=48, topk=4, experts=8, cases=(("gate/up", 128, 128), ("down", 128, 256)))
CONFIGS = {
    "bm128_bn128": GroupedMatmulConfig(block_m=128, block_n=128),
    "bm64_bn256": GroupedMatmulConfig(block_m=64, block_n=256),
}
DRY_CONFIGS = {"bm64_bn128": GroupedMatmulConfig(block_m=64, block_n=128, max_concurrent_steps=2)}


def router_group_sizes(tokens: int, topk: int, experts: int, seed: int = 0) -> jax.Array:
    """int32 [experts]: rows per expert from a random sigmoid router's top-k (as m3jax.moe.route)."""
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts), jnp.float32)
    _, ids = jax.lax.top_k(jax.nn.sigmoid(logits), topk)
    return jnp.bincount(ids.reshape(-1), length=experts).astype(jnp.int32)


def _rel_l2(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def bench(shape: dict, configs: dict, iters: int, ragged_iters: int) -> list[tuple]:
    gs = router_group_sizes(shape["tokens"], shape["topk"], shape["experts"])
    m, g = shape["tokens"] * shape["topk"], shape["experts"]
    sizes = np.asarray(gs)
    print(f"group sizes: min {sizes.min()} median {int(np.median(sizes))} max {sizes.max()} sum {sizes.sum()}",
          flush=True)
    rows = []
    for name, k, n in shape["cases"]:
        k1, k2 = jax.random.split(jax.random.key(1))
        lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
        rhs = (jax.random.normal(k2, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
        flops = 2 * m * k * n
        desc = f"{name}: M={m} (T={shape['tokens']} x top-{shape['topk']}) K={k} N={n} G={g}"

        dense_w = rhs[0]
        dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        dense_ms = _time_ms(dense, lhs, dense_w, iters=iters)
        ragged = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s))
        try:  # dense-emulated on cuDNN < 9.22: slow and memory-hungry
            ragged_ms = _time_ms(ragged, lhs, rhs, gs, iters=ragged_iters)
            ref, note = ragged(lhs, rhs, gs), ""
        except Exception as e:  # noqa: BLE001
            ragged_ms, ref, note = float("nan"), None, f"failed: {type(e).__name__}: {str(e)[:80]}"
        rows.append((desc, "dense jnp.dot (same FLOPs)", dense_ms, flops, dense_ms, ragged_ms, ""))
        rows.append((desc, "jax.lax.ragged_dot", ragged_ms, flops, dense_ms, ragged_ms, note))
        for cname, cfg in configs.items():
            f = jax.jit(lambda a, b, s, cfg=cfg: grouped_matmul(a, b, s, config=cfg))
            ms = _time_ms(f, lhs, rhs, gs, iters=iters)
            note = ""
            if ref is not None:
                err = _rel_l2(np.asarray(f(lhs, rhs, gs), np.float32), np.asarray(ref, np.float32))
                note = f"rel. L2 vs ragged_dot {err:.1e}"
            rows.append((desc, f"pallas grouped_matmul {cname}", ms, flops, dense_ms, ragged_ms, note))
            print(f"  {name} {cname}: {ms:.3f} ms", flush=True)
    return rows


def table(rows) -> str:
    out = ["| case | impl | ms | TFLOP/s | vs dense | speed-up vs ragged_dot | notes |",
           "|---|---|---|---|---|---|---|"]
    for desc, impl, ms, flops, dense_ms, ragged_ms, notes in rows:
        out.append(f"| {desc} | {impl} | {ms:.3g} | {flops / ms / 1e9:.0f} | {dense_ms / ms:.2f} | "
                   f"{ragged_ms / ms:.1f} | {notes} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="results file (default benchmarks/RESULTS.md; "
                    "--dry writes only when --out is given)")
    ap.add_argument("--dry", action="store_true", help="CPU smoke run: interpret mode, tiny shapes")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    shape, configs = (DRY, DRY_CONFIGS) if args.dry else (M3, CONFIGS)
    iters = 1 if args.dry else args.iters
    rows = bench(shape, configs, iters=iters, ragged_iters=1 if args.dry else 3)
    dev = jax.devices()[0]
    cmd = "python benchmarks/moe_grouped_matmul.py" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    text = (f"\n## MoE grouped matmul — {datetime.date.today().isoformat()}, {dev.device_kind} "
            f"({jax.default_backend()}), jax {jax.__version__}\n\n"
            f"Command: `{cmd}`. bf16 in, fp32 accumulate, bf16 out; group sizes from a random top-{shape['topk']} "
            f"router; dense = one [M, K] x [K, N] bf16 `jnp.dot`; ratios from times in this run.\n\n")
    text += table(rows)
    print(text)
    out = args.out if (args.out or args.dry) else Path(__file__).with_name("RESULTS.md")
    if out is not None:
        with open(out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
