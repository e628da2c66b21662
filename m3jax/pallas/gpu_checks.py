"""The MSA kernels against their jnp references at M3's shapes: the GPU checks of a first run on a new
node (``python -m m3jax.selfcheck --full``; ``benchmarks/check_*_gpu.py`` print the same rows).

Where the canaries (:mod:`m3jax.pallas.canaries`) run each kernel's tile paths on tiny cases, these
run the kernels at M3's sizes: 4 index / KV heads, G = 16, head dims 128, block 128, top-16, with
batches of unequal lengths up to ~128K keys for decode (shuffled page tables, an unused page-table
column), plus other blocks, head counts and dtypes, fp8 index-key pages included. Three families:

- ``attention``: the sparse prefill attention (KV-major; the query-major baseline too where the target
  has wgmma), output and LSE, and whether a rerun is bitwise equal (reported, not required);
- ``index``: the index scores (their -inf pattern and values), and how often the fused top-k, the
  unfused selection and the top-k kernel pick the reference's block ids (reported);
- ``decode``: the paged decode index scores and the sparse decode attention over the reference's
  selection (each kernel on its own: an error in one does not hide the other), and the fused
  selection (``decode_select_blocks``): equal, ids in order, to the top-k of the scoring kernel's
  scores (the same MMAs); the rows whose sets differ from the reference selection are reported.

Each row holds ``err_over_tol`` = max |got - ref| / (atol + rtol |ref|) at the kernel tests' tolerances
(m3jax/pallas/tolerances.py; <= 1 passes), the raw max abs error, notes and seconds; a kernel that
raises gives a row with its error. The references run at full fp32 precision (XLA's GPU default for
fp32 dots is TF32). ``size="small"`` runs one small case per family (interpret mode on a CPU: the
same code path, in seconds).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.pallas import _backend
from m3jax.pallas import decode as D
from m3jax.pallas import index_scores as I
from m3jax.pallas import topk as K
from m3jax.pallas.sparse_attention import sparse_attention
from m3jax.pallas.tolerances import TOL

FAMILIES = ("attention", "index", "decode")

# (B, T, prefix, N, K, H, block, top-k, dtype)
ATTENTION_CASES = {
    "m3": [(1, 200, 0, 16, 2, 64, 64, 4, "bfloat16"),
           (2, 256, 512, 64, 4, 128, 128, 16, "bfloat16"),  # M3
           (1, 384, 2048, 64, 4, 128, 128, 8, "bfloat16"),
           (1, 256, 4096, 64, 4, 128, 256, 16, "bfloat16"),
           (1, 256, 8192, 64, 4, 128, 64, 32, "bfloat16"),
           (2, 256, 512, 64, 4, 128, 128, 16, "float32"),  # M3's heads in fp32: bf16x3, 64-key sub-blocks
           (1, 256, 1024, 16, 4, 64, 64, 8, "float32"),  # m3-small (G 4, block 64)
           (1, 300, 512, 8, 8, 128, 16, 16, "bfloat16"),  # G 1, block 16
           (1, 300, 512, 16, 8, 64, 32, 16, "float32")],  # G 2, block 32
    "small": [(1, 2, 16, 8, 1, 64, 16, 2, "bfloat16")],
}
# (dtype, block, top-k, Hi, Hx, T, prefix, B); the second sequence ends one block earlier
INDEX_CASES = {
    "m3": [("bfloat16", 128, 16, 4, 128, 300, 1024, 2), ("float32", 128, 16, 4, 128, 300, 1024, 2),
           ("float32", 256, 64, 4, 128, 300, 2048, 2), ("bfloat16", 64, 8, 4, 128, 300, 512, 2),
           ("bfloat16", 256, 32, 4, 128, 300, 2048, 2), ("bfloat16", 32, 1, 4, 128, 300, 256, 2),
           ("float32", 16, 64, 4, 128, 300, 128, 2)],
    "small": [("bfloat16", 16, 2, 1, 64, 4, 32, 2)],
}
_LENS = (131072 - 45, 117003)  # ~128K keys, unequal, neither a multiple of the page
_M3_DECODE = (64, 4, 128, 128, 128, 16)  # N, K, H, Hx, block, top-k
# (B, Q, N, K, H, Hx, block, top-k, lengths, dtype, index-page dtype or None)
DECODE_CASES = {
    "m3": [(2, 1, *_M3_DECODE, _LENS, "bfloat16", None), (2, 4, *_M3_DECODE, _LENS, "bfloat16", None),
           (2, 1, *_M3_DECODE, _LENS, "float32", None), (2, 4, *_M3_DECODE, _LENS, "float32", None),
           (2, 1, *_M3_DECODE, _LENS, "bfloat16", "float8_e4m3fn"),
           (2, 4, *_M3_DECODE, _LENS, "float32", "float8_e4m3fn"),
           # other page sizes / top-k; one request shorter than top-k pages
           (2, 2, 64, 4, 128, 128, 256, 8, (9000, 1000), "bfloat16", None),
           (2, 2, 64, 4, 128, 128, 64, 32, (9000, 1000), "bfloat16", None)],
    "small": [(2, 1, 8, 1, 64, 64, 64, 1, (40, 100), "bfloat16", "float8_e4m3fn")],
}


def _err(got, ref, tol: dict) -> tuple[float, float]:
    """(max |got - ref| / (atol + rtol |ref|), max |got - ref|) over the reference's finite entries."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    d = np.abs(got[fin] - ref[fin])
    if not d.size:
        return 0.0, 0.0
    return float(np.max(d / (tol["atol"] + tol["rtol"] * np.abs(ref[fin])))), float(d.max())


def _row(check: str, kernel: str, case: str, fn: Callable[[], dict]) -> dict:
    """One check's row: what ``fn`` returns (``passed``, errors, notes), or the error it raised."""
    t0 = time.perf_counter()
    row = {"check": check, "kernel": kernel, "case": case}
    try:
        row.update(fn())
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile or launch fails its row)
        text = " ".join(str(e).split())
        row.update(passed=False, error=f"{type(e).__name__}: {text[:300]}")
    row["seconds"] = round(time.perf_counter() - t0, 3)
    return row


def _normal(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def check_attention(b, t, prefix, n, kh, h, bs, topk, dtype) -> list[dict]:
    ks = jax.random.split(jax.random.key(0), 5)
    s = prefix + t
    q = _normal(ks[0], (b, t, n, h), dtype)
    k, v = _normal(ks[1], (b, s, kh, h), dtype), _normal(ks[2], (b, s, kh, h), dtype)
    q_pos = jnp.broadcast_to(prefix + jnp.arange(t, dtype=jnp.int32), (b, t))

    @jax.jit  # the references in one program (op by op, they would take longer than the kernels' checks)
    def reference(q, k, v, iq, ik, q_pos):
        scores = I.index_block_scores(iq, ik, q_pos, block_size=bs, implementation="reference")
        sel = K.select_blocks(scores, q_pos, block_size=bs, topk=topk, implementation="reference")
        return sel, *sparse_attention(q, k, v, sel, q_pos, block_size=bs, implementation="reference", return_lse=True)

    sel, ref, ref_lse = reference(q, k, v, _normal(ks[3], (b, t, kh, 32), jnp.float32),
                                  _normal(ks[4], (b, s, 32), jnp.float32), q_pos)
    case = f"{dtype} B={b} T={t} prefix={prefix} N={n} K={kh} H={h} block={bs} topk={topk}"
    rows = []
    impls = ("kv_major", "query_major") if _backend.current_target().mma == "wgmma" else ("kv_major",)
    for impl in impls:  # the query-major baseline issues wgmma: Hopper only, never picked elsewhere
        def run(impl=impl):
            f = jax.jit(lambda *a: sparse_attention(*a, block_size=bs, implementation=impl, return_lse=True))
            o, lse = f(q, k, v, sel, q_pos)
            o2, _ = f(q, k, v, sel, q_pos)
            err, maxabs = _err(o, ref, TOL[("attention", dtype)])
            lse_err, _ = _err(lse, ref_lse, TOL[("lse", dtype)])
            finite = bool(np.isfinite(np.asarray(o, np.float32)).all())
            return {"passed": err <= 1 and lse_err <= 1 and finite, "err_over_tol": err, "max_abs": maxabs,
                    "lse_err_over_tol": lse_err, "finite": finite,
                    "deterministic": bool(np.array_equal(np.asarray(o), np.asarray(o2)))}
        rows.append(_row("attention", f"sparse_attention_{impl}", case, run))
    return rows


def check_index(dtype, bs, topk, hi, hx, t, prefix, b) -> list[dict]:
    s = prefix + t
    k1, k2 = jax.random.split(jax.random.key(bs + topk))
    iq, ik = _normal(k1, (b, t, hi, hx), dtype), _normal(k2, (b, s, hx), dtype)
    q_pos = jnp.broadcast_to(prefix + jnp.arange(t, dtype=jnp.int32), (b, t))
    q_pos = q_pos.at[1:].add(-bs)  # the other sequences one block shorter
    ref = jax.jit(lambda *a: I.index_block_scores(*a, block_size=bs, implementation="reference"))(iq, ik, q_pos)
    case = f"{dtype} B={b} T={t} prefix={prefix} Hi={hi} Hx={hx} block={bs} topk={topk}"

    def run():
        got = I.index_block_scores(iq, ik, q_pos, block_size=bs)
        inf_ok = bool(np.array_equal(np.isneginf(np.asarray(got)), np.isneginf(np.asarray(ref))))
        err, maxabs = _err(got, ref, TOL[("index_scores", dtype)])
        rid = np.asarray(jax.jit(lambda *a: K.select_blocks(*a, block_size=bs, topk=topk, implementation="reference"))(
            ref, q_pos))
        picks = {"fused_topk": I.index_select_blocks(iq, ik, q_pos, block_size=bs, topk=topk,
                                                     config=I.IndexScoreConfig(fused_topk=True)),
                 "unfused_topk": I.index_select_blocks(iq, ik, q_pos, block_size=bs, topk=topk),
                 "topk_kernel": K.select_blocks(ref, q_pos, block_size=bs, topk=topk)}
        match = {f"{k}_match": float(np.mean(np.asarray(v) == rid)) for k, v in picks.items()}
        return {"passed": inf_ok and err <= 1, "err_over_tol": err, "max_abs": maxabs, "inf_pattern_ok": inf_ok,
                **match}
    return [_row("index", "index_scores", case, run)]


def check_decode(b, q_len, n, kh, h, hx, bs, topk, seq_lens, dtype, ik_dtype=None) -> list[dict]:
    sl = jnp.asarray(seq_lens, jnp.int32)
    max_pages = -(-max(seq_lens) // bs) + 1  # one column never used: must give -inf / no effect
    num_pages = b * max_pages + 3
    ks = jax.random.split(jax.random.key(0), 6)
    q, iq = _normal(ks[0], (b, q_len, n, h), dtype), _normal(ks[1], (b, q_len, kh, hx), dtype)
    kp, vp = _normal(ks[2], (num_pages, bs, kh, h), dtype), _normal(ks[3], (num_pages, bs, kh, h), dtype)
    ikp = _normal(ks[4], (num_pages, bs, hx), ik_dtype or dtype)
    pt = jax.random.permutation(ks[5], num_pages)[: b * max_pages].astype(jnp.int32).reshape(b, max_pages)
    case = (f"{dtype} B={b} Q={q_len} N={n} K={kh} H={h} block={bs} topk={topk} lens={list(seq_lens)}"
            + (f" index pages {ik_dtype}" if ik_dtype else ""))
    ref_s = jax.jit(lambda *a: D.decode_index_scores(*a, block_size=bs, implementation="reference"))(iq, ikp, pt, sl)

    def scores():
        got = D.decode_index_scores(iq, ikp, pt, sl, block_size=bs)
        inf_ok = bool(np.array_equal(np.isneginf(np.asarray(got)), np.isneginf(np.asarray(ref_s))))
        err, maxabs = _err(got, ref_s, TOL[("index_scores", dtype)])
        return {"passed": inf_ok and err <= 1, "err_over_tol": err, "max_abs": maxabs, "inf_pattern_ok": inf_ok}

    @jax.jit
    def reference(q, kp, vp, pt, ref_s, sl):
        sel = K.select_blocks(ref_s, D.query_positions(sl, q_len), block_size=bs, topk=topk, implementation="reference")
        return sel, D.sparse_decode_attention(q, kp, vp, pt, sel, sl, block_size=bs, implementation="reference")

    def attention():
        sel, ref = reference(q, kp, vp, pt, ref_s, sl)
        got = D.sparse_decode_attention(q, kp, vp, pt, sel, sl, block_size=bs)
        err, maxabs = _err(got, ref, TOL[("decode_attention", dtype)])
        finite = bool(np.isfinite(np.asarray(got, np.float32)).all())
        return {"passed": finite and err <= 1 and got.dtype == q.dtype, "err_over_tol": err, "max_abs": maxabs,
                "finite": finite, "selected_blocks": int((np.asarray(sel) >= 0).sum())}
    def fused():
        q_pos = D.query_positions(sl, q_len)
        got = np.asarray(D.decode_select_blocks(iq, ikp, pt, sl, block_size=bs, topk=topk))
        select = jax.jit(lambda s: K.select_blocks(s, q_pos, block_size=bs, topk=topk, implementation="reference"))
        own = np.asarray(select(D.decode_index_scores(iq, ikp, pt, sl, block_size=bs)))
        differ = (np.sort(got, -1) != np.sort(np.asarray(select(ref_s)), -1)).any(-1)
        equal = bool(np.array_equal(got, own))  # ids compared exactly: err_over_tol 0 or inf
        return {"passed": equal, "err_over_tol": 0.0 if equal else float("inf"),
                "rows_differing_from_reference": int(differ.sum())}

    return [_row("decode", "decode_index_scores", case, scores),
            _row("decode", "sparse_decode_attention", case, attention),
            _row("decode", "decode_select_fused", case, fused)]


_CHECKS = {"attention": (check_attention, ATTENTION_CASES), "index": (check_index, INDEX_CASES),
           "decode": (check_decode, DECODE_CASES)}


def run(families=FAMILIES, size: str = "m3", emit: Callable[[dict], None] | None = None) -> list[dict]:
    """Every case of ``families`` at ``size`` ("m3" or "small"); ``emit`` sees each row as it ends."""
    rows = []
    with jax.default_matmul_precision("highest"):  # the fp32 references at fp32 (the kernels are unaffected)
        for family in families:
            check, cases = _CHECKS[family]
            for case in cases[size]:
                try:
                    got = check(*case)
                except Exception as e:  # noqa: BLE001  (inputs or references that fail: the row says so)
                    got = [{"check": family, "kernel": "-", "case": str(case), "passed": False,
                            "error": f"setup: {type(e).__name__}: {' '.join(str(e).split())[:300]}", "seconds": 0.0}]
                for row in got:
                    rows.append(row)
                    if emit:
                        emit(row)
    return rows
