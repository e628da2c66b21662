"""One MSA layer's prefill chunk over the page-split cache, at M3's attention shapes: context parallel
(``msa.parallel.context_parallel``) against head-split over the gathered key window
(``msa.parallel.head_split``, what the engine ran before), and against one device.

M3's heads (64 q / 4 KV of 128, one shared index key of 128, block 128, top-16), bf16, one sequence;
for each key window W the chunk is the last ``--chunk`` queries of the window. On n visible GPUs
(n >= 2) both sharded paths run over the same striped, page-split cache and the table gives their wall
time (median of ``--repeat``), the selections they agree on, their output difference, and which one
the rule of ``msa.parallel.prefill_context_parallel`` picks (context parallel once the window's keys
outweigh the chunk's query exchange: W >= 35.6 x chunk for M3 in bf16), so that the rule can be
checked against the measured crossover. On one GPU (n = 1) the context-parallel body runs on a
1-device mesh: the real kernels through the local page gather, the unfused scores + XLA top-k and
the LSE merge, against ``msa.kernels.prefill`` on the gathered window (the single-device path, whose
speed this change does not touch).

Prints a table and writes ``$OUT/cp_prefill.json`` and ``.md`` (``$OUT`` default benchmarks/out).
Under 4 minutes on one H200 with the defaults:

    PYTHONPATH=. python benchmarks/cp_prefill.py                     # every visible GPU
    PYTHONPATH=. python benchmarks/cp_prefill.py --windows 65536 262144 1048576 --chunk 8192
    PYTHONPATH=. python benchmarks/cp_prefill.py --dry               # CPU, interpret mode: tiny shapes, 1 device
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, nargs="+", default=[16384, 65536, 262144])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=5)
    # one device: the GPU interpreter's end-of-kernel barrier check misfires with several devices running
    # at once (tests/multidevice/sharding_checks.py switches it off for its multi-device kernel checks)
    ap.add_argument("--dry", action="store_true", help="CPU, interpret mode: tiny heads on one device")
    args = ap.parse_args(argv)
    if args.dry:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.windows, args.chunk, args.repeat = [256], 16, 1
    import jax
    import jax.numpy as jnp
    import numpy as np

    from m3jax import sharding as sh
    from m3jax.cache import LayerCache, PagedCache
    from m3jax.config import preset
    from m3jax.msa import kernels, parallel

    t = preset("minimax_m3").text
    if args.dry:
        t = dataclasses.replace(t, num_attention_heads=8, num_key_value_heads=2, index_n_heads=2, head_dim=64,
                                index_head_dim=64, index_block_size=64, index_topk_blocks=2)
    n = len(jax.devices())
    mesh = sh.make_mesh(n)
    bs, nh, kh, h, hx = t.index_block_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.index_head_dim
    c = args.chunk
    dt = jnp.bfloat16
    rows = []

    def timed(fn, *a):
        out = jax.block_until_ready(fn(*a))  # compile + first run
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*a))
            times.append(time.perf_counter() - t0)
        return out, statistics.median(times) * 1e3

    for w in args.windows:
        pages = -(-w // (bs * n)) * n  # whole pages, a multiple of the model axis (as padded_capacity)
        key = jax.random.key(w)
        ks = jax.random.split(key, 5)
        # RMS-normed-like index keys / queries (unit variance), K/V random: scores without exact ties
        k = jax.random.normal(ks[0], (pages, bs, kh, h), dt)
        v = jax.random.normal(ks[1], (pages, bs, kh, h), dt)
        ik = jax.random.normal(ks[2], (pages, bs, hx), dt)
        q = jax.random.normal(ks[3], (1, c, nh, h), dt)
        iq = jax.random.normal(ks[4], (1, c, kh, hx), dt)
        table = jnp.asarray(sh.striped_page_table(1, pages, n))
        kv = LayerCache(k, v, ik)
        kv = jax.device_put(kv, sh.cache_shardings(PagedCache([kv], table), mesh).layers[0])
        q_pos = (pages * bs - c + jnp.arange(c, dtype=jnp.int32))[None]

        def gathered(q, iq, kv, table, q_pos):  # the window gathered, then the head-split kernels (n = 1: plain)
            kg, vg, ikg = kv.gather(table)
            return parallel.head_split(kernels.prefill, q, kg, vg, iq, ikg, q_pos, t,
                                       unsupported_reason=kernels.unsupported_reason)

        def context(q, iq, kv, table, q_pos):
            return parallel.context_parallel(kernels.local_prefill(t), q, iq, kv, table, q_pos, t)

        with jax.set_mesh(mesh):
            (o_hs, s_hs), ms_hs = timed(jax.jit(gathered), q, iq, kv, table, q_pos)
            (o_cp, s_cp), ms_cp = timed(jax.jit(context), q, iq, kv, table, q_pos)
        same = np.mean(np.all(np.sort(np.asarray(s_hs), -1) == np.sort(np.asarray(s_cp), -1), -1))
        diff = float(jnp.linalg.norm((o_cp - o_hs).astype(jnp.float32)) / jnp.linalg.norm(o_hs.astype(jnp.float32)))
        rule = parallel.prefill_context_parallel(t, n, queries=c, window_tokens=pages * bs, q_bytes=2, kv_bytes=2)
        rows.append({"devices": n, "window": pages * bs, "chunk": c, "gathered_head_split_ms": round(ms_hs, 3),
                     "context_parallel_ms": round(ms_cp, 3), "rows_same_selection": round(float(same), 5),
                     "output_rel_l2": diff, "rule_picks": "context" if rule else "gathered"})
        print(rows[-1], flush=True)

    md = ["| devices | window | chunk | gathered + head split ms | context parallel ms | same selection | rel L2 | "
          "rule |", "|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['devices']} | {r['window']} | {r['chunk']} | {r['gathered_head_split_ms']} | "
           f"{r['context_parallel_ms']} | {r['rows_same_selection']} | {r['output_rel_l2']:.2e} | {r['rule_picks']} |"
           for r in rows]
    print("\n".join(md))
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    from run_info import header, run_info

    info = run_info("cp_prefill.py", argv)
    (out / "cp_prefill.json").write_text(json.dumps({"run": info, "rows": rows}, indent=1))
    (out / "cp_prefill.md").write_text("\n".join([header(info), "", *md]) + "\n")
    return rows


if __name__ == "__main__":
    main()
