"""GPU check of the MSA decode kernels against their references (Mosaic GPU lowering + numerics).

Each kernel is checked on its own (an error in one is reported and does not hide the other):
``decode_index_scores`` vs the reference scores, and ``sparse_decode_attention`` fed with the
selection of the REFERENCE scores (``msa.select_blocks``), vs the reference attention. Shapes are
M3's (N=64, K=4, H=128, Hi=4, Hx=128, page 128, top-k 16), Q=1 and Q=4, batch 2 with different
~128K lengths (not multiples of the page), one unused page-table column, shuffled page table, bf16
and fp32; then fp8 e4m3 index-key pages (an fp8 index cache, read by the scoring kernel as stored)
with bf16 and fp32 queries. A few other block sizes / top-k follow at the end.

Tolerances: m3jax/pallas/tolerances.py, the table CI holds (index scores, decode attention); the
references run at full fp32 precision (``jax.default_matmul_precision("highest")``: XLA's GPU default
for fp32 dots is TF32).
``err`` = max |got - ref| / (atol + rtol |ref|) (<= 1 passes); ``maxabs`` the raw max abs difference.

Run on the device: ``PYTHONPATH=. python benchmarks/check_decode_gpu.py``.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from m3jax import msa
from m3jax.pallas import decode as D
from m3jax.pallas.tolerances import TOL
M3 = dict(n=64, kh=4, h=128, hx=128, bs=128, topk=16)


def make_case(b, q_len, n, kh, h, hx, bs, seq_lens, dtype, seed=0, ik_dtype=None):
    seq_lens = jnp.asarray(seq_lens, jnp.int32)
    max_pages = -(-int(max(seq_lens)) // bs) + 1  # one column never used: must give -inf / no effect
    num_pages = b * max_pages + 3
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (b, q_len, n, h), jnp.float32).astype(dtype)
    iq = jax.random.normal(ks[1], (b, q_len, kh, hx), jnp.float32).astype(dtype)
    kp = jax.random.normal(ks[2], (num_pages, bs, kh, h), jnp.float32).astype(dtype)
    vp = jax.random.normal(ks[3], (num_pages, bs, kh, h), jnp.float32).astype(dtype)
    ikp = jax.random.normal(ks[4], (num_pages, bs, hx), jnp.float32).astype(ik_dtype or dtype)
    pt = jax.random.permutation(ks[5], num_pages)[: b * max_pages].astype(jnp.int32).reshape(b, max_pages)
    return q, iq, kp, vp, ikp, pt, seq_lens


def _err(got, ref, tol):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    d = np.abs(got - ref)
    return (float(np.max(d / (tol["atol"] + tol["rtol"] * np.abs(ref)))), float(np.max(d)),
            bool(np.isfinite(got).all()))


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:240]}"


_printed_tb: set[str] = set()


def _report_exc(kernel: str, e: BaseException) -> str:
    if kernel not in _printed_tb:  # full traceback once per kernel, on stderr
        _printed_tb.add(kernel)
        tb = traceback.format_exception(e)
        print(f"---- {kernel} traceback (last 60 lines) ----", file=sys.stderr)
        print("".join(tb)[-8000:], file=sys.stderr, flush=True)
    return _short(e)


def check(b, q_len, n, kh, h, hx, bs, topk, seq_lens, dtype, ik_dtype=None):
    dt = jnp.dtype(dtype).name
    pages = "" if ik_dtype is None else f" index pages {jnp.dtype(ik_dtype).name}"
    name = f"{dt:8s} B={b} Q={q_len} bs={bs} topk={topk} lens={list(seq_lens)}{pages}"
    q, iq, kp, vp, ikp, pt, sl = make_case(b, q_len, n, kh, h, hx, bs, seq_lens, dtype, ik_dtype=ik_dtype)
    rows = []

    # 1. index scores
    t0 = time.time()
    ref_s = jax.jit(functools.partial(D.decode_index_scores, block_size=bs, implementation="reference"))
    s_r = np.asarray(ref_s(iq, ikp, pt, sl))
    try:
        s_k = np.asarray(D.decode_index_scores(iq, ikp, pt, sl, block_size=bs))
        inf_ok = bool((np.isneginf(s_k) == np.isneginf(s_r)).all())
        fin = np.isfinite(s_r)
        err, maxabs, _ = _err(s_k[fin], s_r[fin], TOL[("index_scores", dt)])
        ok = inf_ok and err <= 1 and not np.isnan(s_k).any()
        rows.append(("index_scores", name, "PASS" if ok else "FAIL", f"{err:.3g}", f"{maxabs:.3g}",
                     f"-inf pattern {'ok' if inf_ok else 'MISMATCH'}", time.time() - t0))
    except Exception as e:  # noqa: BLE001
        rows.append(("index_scores", name, "ERROR", "", "", _report_exc("index_scores", e), time.time() - t0))

    # 2. sparse attention on the reference selection
    t0 = time.time()
    try:
        q_pos = D.query_positions(sl, q_len)
        bidx = jax.jit(functools.partial(msa.select_blocks, block_size=bs, topk=topk))(jnp.asarray(s_r), q_pos)
        ref_a = jax.jit(functools.partial(D.sparse_decode_attention, block_size=bs, implementation="reference"))
        o_r = np.asarray(ref_a(q, kp, vp, pt, bidx, sl), np.float32)
    except Exception as e:  # noqa: BLE001
        rows.append(("sparse_attention", name, "ERROR", "", "", "reference: " + _short(e), time.time() - t0))
        return rows
    try:
        o_k = D.sparse_decode_attention(q, kp, vp, pt, bidx, sl, block_size=bs)
        assert o_k.dtype == q.dtype and o_k.shape == q.shape, (o_k.dtype, o_k.shape)
        err, maxabs, finite = _err(o_k, o_r, TOL[("decode_attention", dt)])
        ok = finite and err <= 1
        n_sel = int((np.asarray(bidx) >= 0).sum())
        rows.append(("sparse_attention", name, "PASS" if ok else "FAIL", f"{err:.3g}", f"{maxabs:.3g}",
                     f"{n_sel} selected blocks{'' if finite else ', NON-FINITE'}", time.time() - t0))
    except Exception as e:  # noqa: BLE001
        rows.append(("sparse_attention", name, "ERROR", "", "", _report_exc("sparse_attention", e), time.time() - t0))
    return rows


def _print_row(r):
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]:.1f} |", flush=True)


def main():
    jax.config.update("jax_default_matmul_precision", "highest")  # fp32 references at fp32 (kernels unaffected)
    print(jax.devices(), jax.__version__, flush=True)
    lens = [131072 - 45, 117003]  # ~128K, different, neither a multiple of the page
    cases = [
        (2, 1, *M3.values(), lens, jnp.bfloat16),
        (2, 4, *M3.values(), lens, jnp.bfloat16),
        (2, 1, *M3.values(), lens, jnp.float32),
        (2, 4, *M3.values(), lens, jnp.float32),
        (2, 1, *M3.values(), lens, jnp.bfloat16, jnp.float8_e4m3fn),
        (2, 4, *M3.values(), lens, jnp.float32, jnp.float8_e4m3fn),
        # other page sizes / top-k (short contexts; one request shorter than topk * page)
        (2, 2, 64, 4, 128, 128, 256, 8, [9000, 1000], jnp.bfloat16),
        (2, 2, 64, 4, 128, 128, 64, 32, [9000, 1000], jnp.bfloat16),
    ]
    print("| kernel | case | result | err/tol | maxabs | notes | s |\n|---|---|---|---|---|---|---|", flush=True)
    all_rows = []
    for c in cases:
        try:
            rows = check(*c)
        except Exception as e:  # noqa: BLE001  (setup failure: report, go on)
            rows = [("setup", str(c[-2:]), "ERROR", "", "", _short(e), 0.0)]
        for r in rows:
            _print_row(r)
        all_rows += rows
    bad = [r for r in all_rows if r[2] != "PASS"]
    print(f"\n{len(all_rows) - len(bad)}/{len(all_rows)} checks passed", flush=True)


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
