"""GPU check for the MSA index-score and top-k Mosaic kernels: compile + correctness vs the reference
on small shapes (bf16/fp32, block 16-256, top-k 1-64; tolerances from m3jax/pallas/tolerances.py), then
the benchmark rows.

Usage (device machine): PYTHONPATH=. python benchmarks/check_index_gpu.py [OUT_DIR] [contexts...]
(OUT_DIR default: ``$OUT``, else benchmarks/out; it writes ``index_gpu.json`` there.)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

from m3jax import msa
from m3jax.pallas import index_scores, topk as topk_mod
from m3jax.pallas.tolerances import TOL


def check(dtype, bs, k, hi=4, hx=128, t=300, prefix=None, b=2):
    prefix = 8 * bs if prefix is None else prefix
    s = prefix + t
    k1, k2 = jax.random.split(jax.random.key(bs + k))
    iq = jax.random.normal(k1, (b, t, hi, hx), jnp.float32).astype(dtype)
    ik = jax.random.normal(k2, (b, s, hx), jnp.float32).astype(dtype)
    q_pos = jnp.broadcast_to(prefix + jnp.arange(t, dtype=jnp.int32), (b, t))
    q_pos = q_pos.at[1].add(-bs)  # second sequence shorter
    ref = msa.block_scores(iq, ik, q_pos, bs)
    got = index_scores.index_block_scores(iq, ik, q_pos, block_size=bs)
    tol = TOL[("index_scores", jnp.dtype(dtype).name)]  # the table CI holds
    err = float(jnp.max(jnp.where(jnp.isfinite(ref), jnp.abs(got - ref) / (tol["atol"] + tol["rtol"] * jnp.abs(ref)), 0)))
    inf_ok = bool(jnp.all(jnp.isfinite(ref) == jnp.isfinite(got)))
    rid = msa.select_blocks(ref, q_pos, block_size=bs, topk=k)
    fid = index_scores.index_select_blocks(iq, ik, q_pos, block_size=bs, topk=k,
                                           config=index_scores.IndexScoreConfig(fused_topk=True))
    uid = index_scores.index_select_blocks(iq, ik, q_pos, block_size=bs, topk=k)
    tid = topk_mod.select_blocks(ref, q_pos, block_size=bs, topk=k)
    return dict(dtype=jnp.dtype(dtype).name, bs=bs, topk=k, score_err_over_tol=err, inf_pattern_ok=inf_ok,
                fused_topk_match=float(jnp.mean(fid == rid)), unfused_topk_match=float(jnp.mean(uid == rid)), topk_match=float(jnp.mean(tid == rid)))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "benchmarks/out")
    os.makedirs(out, exist_ok=True)
    ctxs = tuple(int(x) for x in sys.argv[2:]) or (32768, 131072, 1048576)
    rows = []

    def emit(r):
        print(json.dumps(r), flush=True)
        rows.append(r)
        with open(os.path.join(out, "index_gpu.json"), "w") as f:
            json.dump(rows, f, indent=1)

    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 references at fp32 (kernels unaffected)
    for args in [(jnp.bfloat16, 128, 16), (jnp.float32, 128, 16), (jnp.float32, 256, 64), (jnp.bfloat16, 64, 8),
                 (jnp.bfloat16, 256, 32), (jnp.bfloat16, 32, 1), (jnp.float32, 16, 64)]:
        t0 = time.time()
        try:
            r = check(*args)
        except Exception:  # noqa: BLE001
            r = dict(args=str(args), error=traceback.format_exc()[-3000:])
        r["s"] = time.time() - t0
        emit(r)
    from benchmarks import msa_index

    try:
        msa_index.bench(emit, contexts=ctxs)
    except Exception:  # noqa: BLE001
        emit(dict(error=traceback.format_exc()[-3000:]))


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
