"""Vision encoder throughput at M3's real ViT size (32 layers, width 1280, 16 heads) with random bf16
weights: images/s at 672x672 (48x48 patches, 576 merged tokens each) and one 64-frame video
(32 temporal patches -> 8 attention segments of 4), attention per segment (no cross-segment mask).

    PYTHONPATH=. python benchmarks/vision_encoder.py [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from m3jax.config import preset
from m3jax.params import init_random_on_device
from m3jax.vision import encode_media


def _time(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    ap.add_argument("--images", type=int, default=8)
    args = ap.parse_args(argv)
    cfg = preset("minimax_m3")
    params = init_random_on_device(cfg, seed=0, dtype=jnp.bfloat16, parts=("vision", "projector", "merger"))
    v = cfg.vision
    rows = []
    cases = [
        (f"{args.images} images 672x672", tuple((1, 48, 48) for _ in range(args.images)), args.images, "images/s"),
        ("64-frame video 448x448 (8 segments of 4 temporal patches)", tuple((4, 32, 32) for _ in range(8)), 64, "frames/s"),
    ]
    for name, grid, units, unit in cases:
        n = sum(t * h * w for t, h, w in grid)
        pix = jax.random.normal(jax.random.key(1), (n, v.patch_dim), jnp.float32)
        fn = jax.jit(lambda p, x, grid=grid: encode_media(x, grid, p, cfg)[1])
        sec = _time(fn, params, pix)
        # ViT FLOPs: 24*N*D^2 per layer (qkv/o + 4x MLP) + attention 4*D*sum(L^2) per layer
        seg = [t * h * w for t, h, w in grid]
        flops = v.num_hidden_layers * (24 * n * v.hidden_size**2 + 4 * v.hidden_size * sum(s * s for s in seg))
        rows.append((name, n, sec * 1e3, units / sec, unit, flops / sec / 1e12))
        print(f"{name}: {n} patches, {sec * 1e3:.2f} ms, {units / sec:.1f} {unit}, {flops / sec / 1e12:.0f} TFLOP/s", flush=True)
    dev = jax.devices()[0]
    text = (f"\n## Vision encoder — {datetime.date.today().isoformat()}, {dev.device_kind}, jax {jax.__version__}\n\n"
            "Command: `python benchmarks/vision_encoder.py`. Real M3 ViT + projector + 2x2 merger, random bf16 weights, "
            "cuDNN attention per segment, median of 10.\n\n| input | patches | ms | throughput | ViT TFLOP/s |\n|---|---|---|---|---|\n")
    text += "".join(f"| {a} | {b} | {c:.2f} | {d:.1f} {e} | {f:.0f} |\n" for a, b, c, d, e, f in rows)
    with open(args.out, "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
