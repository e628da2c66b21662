"""The built-in end-to-end job: build a random M3 from a preset, save it as an HF checkpoint (official
tensor names), load it back, run a forward pass with MSA, and print timings.

    python -m m3jax.demo                      # m3jax/configs/m3_tiny.json, 512 tokens, CPU-friendly
    python -m m3jax.demo --config m3_tiny --seq-len 2048 --batch 2 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import m3jax
from m3jax import cli
from m3jax.config import describe_presets, preset
from m3jax.params import count_params


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(argv=None) -> dict:
    ap = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="m3_tiny", help=f"preset name: {describe_presets()}")
    ap.add_argument("--out", type=Path, help="checkpoint directory to write (default: a temporary one)")
    ap.add_argument("--overwrite", action="store_true", help="replace a checkpoint that --out already holds")
    ap.add_argument("--seq-len", type=cli.positive_int, default=512)
    ap.add_argument("--batch", type=cli.positive_int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=cli.seed, default=0)
    cli.add_debug_flag(ap)
    args = ap.parse_args(argv)

    cfg = preset(args.config)
    t = cfg.text
    print(f"config {args.config}: {count_params(cfg) / 1e6:.2f}M params, {t.num_hidden_layers} layers "
          f"({sum(map(t.is_sparse_attention, range(t.num_hidden_layers)))} MSA), {t.num_local_experts} experts "
          f"top-{t.num_experts_per_tok}, MSA block {t.index_block_size} top-{t.index_topk_blocks}; "
          f"devices: {jax.devices()}")
    timings = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "checkpoint"
        t0 = time.perf_counter()
        model = m3jax.init_random(cfg, seed=args.seed, dtype=args.dtype)
        timings["init"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        m3jax.save_pretrained(model, out, overwrite=args.overwrite)
        timings["save"] = time.perf_counter() - t0
        print(f"saved HF checkpoint to {out} ({_dir_bytes(out) / 1e6:.1f} MB)")

        t0 = time.perf_counter()
        loaded = m3jax.load_pretrained(out, dtype=args.dtype)
        timings["load"] = time.perf_counter() - t0

    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, min(t.vocab_size, cfg.image_token_id), (args.batch, args.seq_len))
    t0 = time.perf_counter()
    res = m3jax.forward(loaded, ids, return_block_indices=True)
    res.logits.block_until_ready()
    timings["forward_first (compile+run)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = m3jax.forward(loaded, ids, return_block_indices=True)
    res.logits.block_until_ready()
    timings["forward"] = time.perf_counter() - t0

    same = np.array_equal(np.asarray(m3jax.forward(model, ids).logits), np.asarray(res.logits))
    n_tok = args.batch * args.seq_len
    for k, v in timings.items():
        print(f"  {k:<28s} {v * 1e3:10.1f} ms")
    print(f"  forward throughput           {n_tok / timings['forward']:10.0f} tokens/s ({n_tok} tokens)")
    for layer, sel in res.block_indices.items():
        valid = (np.asarray(sel) >= 0).sum(-1)
        print(f"  MSA layer {layer}: blocks attended per (query, group) min {valid.min()} mean {valid.mean():.2f} "
              f"max {valid.max()} (top-k {t.index_topk_blocks})")
    print(f"logits {tuple(res.logits.shape)}; reloaded checkpoint reproduces the in-memory model: {same}")
    if not same:
        raise SystemExit("checkpoint round trip changed the logits")
    return timings


if __name__ == "__main__":
    cli.run(main)
