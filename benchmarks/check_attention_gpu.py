"""GPU correctness check of the MSA sparse-attention kernels against the jnp reference (docs/MSA.md §4.3).

Run on the device machine: ``PYTHONPATH=. python benchmarks/check_attention_gpu.py``. Prints one JSON line
per case (max abs / rel errors of out and LSE, pass/fail at m3jax/pallas/tolerances.py, bitwise
determinism of reruns).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import msa
from m3jax.pallas.sparse_attention import sparse_attention
from m3jax.pallas.tolerances import TOL

CASES = [
    # (B, T, prefix, N, K, H, block_size, topk, dtype)
    (1, 200, 0, 16, 2, 64, 64, 4, "bfloat16"),
    (2, 256, 512, 64, 4, 128, 128, 16, "bfloat16"),
    (1, 384, 2048, 64, 4, 128, 128, 8, "bfloat16"),
    (1, 256, 4096, 64, 4, 128, 256, 16, "bfloat16"),
    (1, 256, 8192, 64, 4, 128, 64, 32, "bfloat16"),
    (2, 256, 512, 64, 4, 128, 128, 16, "float32"),  # M3 heads in fp32: bf16x3, 64-key sub-blocks
    (1, 256, 1024, 16, 4, 64, 64, 8, "float32"),  # m3-small (G=4, block 64)
    (1, 300, 512, 8, 8, 128, 16, 16, "bfloat16"),  # G=1, block 16
    (1, 300, 512, 16, 8, 64, 32, 16, "float32"),  # G=2, block 32
]


def make(b, t, prefix, n, kh, h, bs, topk, dtype="bfloat16", seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    s = prefix + t
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, kh, h), jnp.float32).astype(dtype)
    q_pos = jnp.broadcast_to(prefix + jnp.arange(t, dtype=jnp.int32), (b, t))
    iq = jax.random.normal(ks[3], (b, t, kh, 32))
    ik = jax.random.normal(ks[4], (b, s, 32))
    scores = msa.block_scores(iq, ik, q_pos, bs)
    return q, k, v, msa.select_blocks(scores, q_pos, block_size=bs, topk=topk), q_pos


def main():
    out_dir = os.environ.get("OUT")
    ok_all = True
    for case in CASES:
        q, k, v, bi, qp = make(*case)
        bs = case[6]
        ref, ref_lse = sparse_attention(q, k, v, bi, qp, block_size=bs, implementation="reference", return_lse=True)
        ref = np.asarray(ref, np.float32)
        for impl in ("kv_major", "query_major"):
            row = {"case": case, "impl": impl}
            try:
                f = jax.jit(lambda q, k, v, bi, qp: sparse_attention(q, k, v, bi, qp, block_size=bs,
                                                                     implementation=impl, return_lse=True))
                o, lse = f(q, k, v, bi, qp)
                o2, _ = f(q, k, v, bi, qp)
                o = np.asarray(o, np.float32)
                err = np.abs(o - ref)
                lerr = np.abs(np.asarray(lse) - np.asarray(ref_lse))
                tol, ltol = TOL[("attention", case[-1])], TOL[("lse", case[-1])]
                row.update(max_abs=float(err.max()), out_ok=bool(np.all(err <= tol["atol"] + tol["rtol"] * np.abs(ref))),
                           lse_max_abs=float(lerr.max()),
                           lse_ok=bool(np.all(lerr <= ltol["atol"] + ltol["rtol"] * np.abs(np.asarray(ref_lse)))),
                           finite=bool(np.isfinite(o).all()),
                           deterministic=bool(np.array_equal(np.asarray(o2, np.float32), o)))
                ok_all &= row["out_ok"] and row["lse_ok"] and row["finite"]
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
                ok_all = False
            print(json.dumps(row), flush=True)
            if out_dir:
                with open(os.path.join(out_dir, "check_attention_gpu.jsonl"), "a") as fh:
                    fh.write(json.dumps(row) + "\n")
    print("ALL_OK" if ok_all else "SOME_FAILED")


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
