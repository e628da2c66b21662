"""Prefill time of short and long prompts with and without prefill buckets (m3jax.engine.prefill_chunk_sizes).

The built-in m3-small (what ``python -m m3jax.generate`` runs), one engine per mode at the CLI's defaults
(--ctx 4096, --prefill-chunk 2048, the dtype and attention path the CLI picks on this device): each
mode's programs are compiled first (warmup with the prompt lengths), then each prompt is prefilled
``--repeat`` times and the median wall time to its logits is reported, with the tokens/s it implies.
The table is printed and written to ``$OUT/prefill_buckets.md`` (``$OUT`` default benchmarks/out).

    PYTHONPATH=. python benchmarks/prefill_buckets.py [--lens 15,1500] [--repeat 5] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

import m3jax
from m3jax.api import resolve_attention_impl
from m3jax.engine import Engine, SamplingParams
from m3jax.generate import DEFAULT_CHECKPOINT
from run_info import header, run_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="15,1500", help="prompt lengths, comma-separated")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    info = run_info("prefill_buckets.py")

    cfg = m3jax.load_config(DEFAULT_CHECKPOINT)
    impl = resolve_attention_impl("auto", cfg, "bfloat16")
    model = m3jax.load_pretrained(DEFAULT_CHECKPOINT, dtype="bfloat16", attention_impl=impl, progress=False)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, model.config.text.vocab_size, n).tolist() for n in lens}
    rows = []
    for buckets in (False, True):
        e = Engine(model.params, model.config, batch=1, capacity=args.ctx, prefill_chunk=args.chunk,
                   prefill_buckets=buckets)
        e.warmup(sampling=SamplingParams(temperature=0.0), prompt_lens=lens)
        for n, p in prompts.items():
            times = []
            for _ in range(args.repeat + 1):  # the first call is not counted (host-side first-call costs)
                t0 = time.perf_counter()
                jax.block_until_ready(e.prefill(0, p))
                times.append(time.perf_counter() - t0)
            med = statistics.median(times[1:])
            sizes = [size for *_, size in e._prefill_plan(n)]
            rows.append((buckets, n, sizes, med))
    lines = [header(info), "",
             f"m3-small, bf16, attention_impl={impl}, --ctx {args.ctx}, --prefill-chunk {args.chunk}, "
             f"median of {args.repeat}", "",
             "| buckets | prompt tokens | chunk sizes run | prefill ms | tokens/s |", "|---|---|---|---|---|"]
    lines += [f"| {'on' if b else 'off'} | {n} | {', '.join(map(str, sizes))} | {med * 1e3:.1f} | {n / med:.0f} |"
              for b, n, sizes, med in rows]
    print("\n".join(lines))
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_buckets.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
