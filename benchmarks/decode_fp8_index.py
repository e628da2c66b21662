"""fp8 e4m3 index-key pages in MSA decode (``index_cache_dtype="float8_e4m3fn"``): speed and selections.

At MiniMax-M3's widths (the ``minimax_m3`` preset: N=64 query heads, K=4 KV heads, H=128, Hi=4 index
heads, Hx=128, block (page) 128, top-16), caches of 128K and 1M tokens, B=1 and B=8, Q=1, on one GPU:

- ``index_scores``: the decode index-score kernel (``m3jax.pallas.decode.decode_index_scores``) on bf16
  pages, on fp8 pages read as stored with the keys met in bf16 (``DecodeScoreConfig.fp8_mma="bfloat16"``,
  the default: e4m3 -> f16 -> bf16) and in f16 (``"float16"``: e4m3 -> f16, the query scaled into
  f16), each converted into an SMEM page the wgmma reads (``fp8_convert="smem"``, the default) or in
  registers as the wgmma's A operand (``"registers"``), and on fp8 pages upcast to bf16 in XLA first
  (what the model did before the kernel took fp8);
- ``select_fused``: the fused selection (``decode_select_blocks``: scores, block max and the splits'
  top-k in one launch) on bf16 pages and on fp8 pages converted in SMEM and in registers;
- ``decode_step``: the model's whole MSA decode step (``m3jax.msa.kernels.decode``: index scores,
  top-k, sparse paged attention) with the cache's index pages in bf16 and in fp8 (both ``fp8_mma``,
  both ``fp8_convert``).

Columns: device time (CUPTI, ``jax.experimental.mosaic.gpu.profiler.measure``, median of 20), ``ratio``
= bf16 ms / ms (> 1: faster than bf16 pages), ``floor_ms`` = the index-key bytes the step reads
(B x ctx x Hx x 1 or 2 B) / the copy bandwidth measured here ((read + written bytes) / time of an XLA
copy of a 4 GiB buffer), ``x_floor`` = ms / floor_ms (1: at the copy's rate), and ``GB/s`` =
index-key bytes / ms. Selections (per request and KV head):
``rows_equal_bf16`` = fraction of selection rows (as sets) the fp8 pages select exactly as the bf16
pages do, ``overlap_bf16`` = mean fraction of selected blocks they share (random keys: block maxima
lie close together, so e4m3's 3 mantissa bits flip many near-ties; this measures that, not a model);
``rows_equal_ref`` = fraction of rows where the kernel's selection from fp8 pages equals the jnp
reference's selection from the same pages (``m3jax.msa.reference``, which upcasts: must be 1.0 up to
exact fp32 near-ties), with ``score_err`` = max |kernel - reference| / the index-score tolerance
(m3jax/pallas/tolerances.py; <= 1 passes).

Run on one GPU: ``PYTHONPATH=. python benchmarks/decode_fp8_index.py``. Prints the table and writes
``$OUT/decode_fp8_index.md`` and ``.json`` (``$OUT`` default ``benchmarks/out``).
``FP8_BENCH_CTX=131072,1048576`` / ``FP8_BENCH_BATCH=1,8`` choose the shapes, ``FP8_BENCH_PARTS`` the
parts (default ``index_scores,select_fused,decode_step``: ``index_scores`` alone is the bytes-floor table,
four shapes in one short call); ``FP8_BENCH_BUDGET_S`` (default 150) stops starting new shapes after that
many seconds (they are reported as skipped).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import jax
from run_info import header, run_info
import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
PARTS = ("index_scores", "select_fused", "decode_step")


def _time_ms(f, *args, iters: int = 20) -> float:
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(f(*args))  # compile + warm-up
    _, times = profiler.measure(f, iterations=iters)(*args)
    return float(statistics.median(times))


def copy_bandwidth() -> float:
    """Bytes per second of an XLA copy (read + write) of a 1 GiB bf16 buffer (far past L2; 4 GiB ran out of
    memory on an H100 80GB beside the benchmark's pages)."""
    x = jnp.ones((1 << 29,), jnp.bfloat16)
    ms = _time_ms(jax.jit(lambda x: x + jnp.bfloat16(1)), x)
    return 2 * x.nbytes / (ms * 1e-3)


def _ptxas_isa() -> int | None:
    """PTX ISA version of the ptxas Mosaic compiles with (>= 92: e4m3 -> bf16 in one cvt per pair)."""
    try:
        from jax.experimental.mosaic.gpu import fragmented_array as fa

        return int(fa.mgpu_lib._mosaic_gpu_ext._get_ptxas_isa_version())
    except Exception:  # noqa: BLE001  (a private API: report None rather than fail the run)
        return None


def _inputs(t, b: int, ctx: int, seed: int = 0):
    bs, pages = t.index_block_size, ctx // t.index_block_size
    ks = jax.random.split(jax.random.key(seed), 6)
    bf = jnp.bfloat16
    q = jax.random.normal(ks[0], (b, 1, t.num_attention_heads, t.head_dim), bf)
    iq = jax.random.normal(ks[1], (b, 1, t.index_n_heads, t.index_head_dim), bf)
    kp = jax.random.normal(ks[2], (b * pages, bs, t.num_key_value_heads, t.head_dim), bf)
    vp = jax.random.normal(ks[3], (b * pages, bs, t.num_key_value_heads, t.head_dim), bf)
    ikp = jax.random.normal(ks[4], (b * pages, bs, t.index_head_dim), bf)
    pt = jax.random.permutation(ks[5], b * pages).astype(jnp.int32).reshape(b, pages)
    return q, iq, kp, vp, ikp, pt, jnp.full((b,), ctx, jnp.int32)


def _rows(sel) -> np.ndarray:
    """Selections as sorted rows [rows, topk] (order within a row is not part of the contract)."""
    s = np.sort(np.asarray(sel), -1)
    return s.reshape(-1, s.shape[-1])


def _agreement(a, b) -> tuple[float, float]:
    """(fraction of equal rows, mean fraction of shared valid ids per row) of two selections."""
    a, b = _rows(a), _rows(b)
    equal = float((a == b).all(-1).mean())
    shared = [len(set(x[x >= 0]) & set(y[y >= 0])) / max(1, (x >= 0).sum()) for x, y in zip(a, b)]
    return equal, float(np.mean(shared))


def run_shape(t, b: int, ctx: int, bw: float, parts=PARTS) -> list[dict]:
    from m3jax import msa
    from m3jax.cache import LayerCache
    from m3jax.msa import kernels
    from m3jax.pallas import decode as D
    from m3jax.pallas.tolerances import TOL

    bs, hx = t.index_block_size, t.index_head_dim
    q, iq, kp, vp, ikp, pt, sl = _inputs(t, b, ctx)
    ik8 = ikp.astype(FP8)  # unit normals: far inside e4m3's range
    q_pos = D.query_positions(sl, 1)
    shape = (f"B={b} ctx={ctx // 1024}K N={t.num_attention_heads} K={t.num_key_value_heads} H={t.head_dim} "
             f"Hi={t.index_n_heads} Hx={hx} bs={bs} topk={t.index_topk_blocks}")
    select = jax.jit(functools.partial(msa.select_blocks, block_size=bs, topk=t.index_topk_blocks,
                                       local_blocks=t.index_local_blocks, init_blocks=t.index_init_blocks))
    variants = [(m, c) for m in ("bfloat16", "float16") for c in ("smem", "registers")]  # (fp8_mma, fp8_convert)
    configs = {v: D.DecodeScoreConfig(fp8_mma=v[0], fp8_convert=v[1]) for v in variants}
    scores = {v: jax.jit(functools.partial(D.decode_index_scores, block_size=bs, config=configs[v])) for v in variants}
    fused = {c: jax.jit(functools.partial(D.decode_select_blocks, block_size=bs, topk=t.index_topk_blocks,
                                          local_blocks=t.index_local_blocks, init_blocks=t.index_init_blocks,
                                          config=D.DecodeScoreConfig(fp8_convert=c)))
             for c in ("smem", "registers")}

    ref_scores = jax.jit(functools.partial(D.decode_index_scores, block_size=bs, implementation="reference"))
    upcast_scores = jax.jit(lambda iq, ik, pt, sl: D.decode_index_scores(iq, ik.astype(jnp.bfloat16), pt, sl,
                                                                         block_size=bs))

    def step(cfg, variant=("bfloat16", "smem")):
        """The model's decode step, its index scoring traced with the ``(fp8_mma, fp8_convert)`` variant's
        config (the model passes the default config: msa.kernels.decode looks the function up when traced)."""
        scoring = D.decode_index_scores

        def run(q, iq, kp, vp, ik, pt):
            D.decode_index_scores = functools.partial(scoring, config=configs[variant])
            try:
                return kernels.decode(q, iq, LayerCache(kp, vp, ik), pt, q_pos, cfg)
            finally:
                D.decode_index_scores = scoring

        return jax.jit(run)

    rows = []

    def row(op, pages, ms, nbytes, base_ms=None, **extra) -> dict:
        rows.append({"op": op, "shape": shape, "index_pages": pages, "ms": ms, "index_bytes": nbytes,
                     "gbps": nbytes / ms / 1e6, "floor_ms": nbytes / bw * 1e3, "x_floor": ms / (nbytes / bw * 1e3),
                     "ratio": None if base_ms is None else base_ms / ms, **extra})
        return rows[-1]

    # 1. the index-score kernel alone: bf16 pages; fp8 pages met in bf16 (the default) and in f16
    # (DecodeScoreConfig.fp8_mma: one conversion per key pair instead of three), converted in SMEM or in
    # registers (fp8_convert); fp8 upcast in XLA first. Selections from each fp8 variant's scores:
    # against the bf16 pages' and the reference's on fp8 pages.
    n16, n8 = ikp.nbytes, ik8.nbytes
    tol = TOL[("index_scores", "bfloat16")]
    base = scores[variants[0]]  # bf16 pages: the config's fp8 fields do not apply
    ms16 = _time_ms(base, iq, ikp, pt, sl)
    row("index_scores", "bfloat16", ms16, n16)
    sel16 = select(base(iq, ikp, pt, sl), q_pos)
    r8 = ref_scores(iq, ik8, pt, sl)
    fin = np.isfinite(np.asarray(r8))
    sel_ref = select(r8, q_pos)
    for fp8_mma, convert in variants:
        f = scores[(fp8_mma, convert)]
        s8 = f(iq, ik8, pt, sl)
        d = np.abs(np.asarray(s8)[fin] - np.asarray(r8)[fin]) / (tol["atol"] + tol["rtol"] * np.abs(np.asarray(r8)[fin]))
        sel8 = select(s8, q_pos)
        eq16, overlap16 = _agreement(sel8, sel16)
        row("index_scores", f"float8_e4m3fn, fp8_mma={fp8_mma}, fp8_convert={convert}", _time_ms(f, iq, ik8, pt, sl),
            n8, ms16, rows_equal_bf16=eq16, overlap_bf16=overlap16, rows_equal_ref=_agreement(sel8, sel_ref)[0],
            score_err=float(d.max()))
    row("index_scores", "float8_e4m3fn upcast in XLA (before)", _time_ms(upcast_scores, iq, ik8, pt, sl), n8, ms16)
    del r8
    if "select_fused" not in parts and "decode_step" not in parts:
        return rows

    # 2. the fused selection (one launch: scores, block max, the splits' top-k): bf16 pages, fp8 pages
    # converted in SMEM and in registers; its selections from fp8 pages against the reference's
    if "select_fused" in parts:
        fs16 = _time_ms(fused["smem"], iq, ikp, pt, sl)
        row("select_fused", "bfloat16", fs16, n16)
        for convert in ("smem", "registers"):
            f = fused[convert]
            row("select_fused", f"float8_e4m3fn, fp8_convert={convert}", _time_ms(f, iq, ik8, pt, sl), n8, fs16,
                rows_equal_ref=_agreement(f(iq, ik8, pt, sl), sel_ref)[0])
    if "decode_step" not in parts:
        return rows

    # 3. the model's whole MSA decode step (index scores, top-k, sparse attention); its selection too
    kv_bytes = b * t.num_key_value_heads * t.index_topk_blocks * bs * t.head_dim * 2 * 2
    cfg16 = dataclasses.replace(t, index_cache_dtype="bfloat16")
    cfg8 = dataclasses.replace(t, index_cache_dtype="float8_e4m3fn")
    st16 = _time_ms(step(cfg16), q, iq, kp, vp, ikp, pt)
    row("decode_step", "bfloat16", st16, n16, kv_bytes=kv_bytes)
    for fp8_mma, convert in variants:
        f8 = step(cfg8, (fp8_mma, convert))
        eq_step, _ = _agreement(f8(q, iq, kp, vp, ik8, pt)[1], sel_ref)
        row("decode_step", f"float8_e4m3fn, fp8_mma={fp8_mma}, fp8_convert={convert}",
            _time_ms(f8, q, iq, kp, vp, ik8, pt), n8, st16, kv_bytes=kv_bytes, rows_equal_ref=eq_step)
    return rows


COLS = ("op", "shape", "index_pages", "ms", "ratio", "floor_ms", "x_floor", "gbps", "rows_equal_bf16", "overlap_bf16",
        "rows_equal_ref", "score_err", "notes")


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main() -> None:
    import m3jax

    t = m3jax.preset("minimax_m3").text
    ctxs = [int(x) for x in os.environ.get("FP8_BENCH_CTX", "131072,1048576").split(",")]
    batches = [int(x) for x in os.environ.get("FP8_BENCH_BATCH", "1,8").split(",")]
    parts = os.environ.get("FP8_BENCH_PARTS", ",".join(PARTS)).split(",")
    if "index_scores" not in parts or not set(parts) <= set(PARTS):
        raise SystemExit(f"FP8_BENCH_PARTS={','.join(parts)}: a subset of {','.join(PARTS)} holding index_scores "
                         "(the other parts compare against its bf16 row and reference selections)")
    deadline = time.time() + float(os.environ.get("FP8_BENCH_BUDGET_S", "150"))
    bw = copy_bandwidth()
    info = run_info("decode_fp8_index.py",
                    env=("FP8_BENCH_CTX", "FP8_BENCH_BATCH", "FP8_BENCH_PARTS", "FP8_BENCH_BUDGET_S"))
    head = {"run": info, "copy_gbps": bw / 1e9, "ptxas_isa": _ptxas_isa()}
    print(json.dumps(head), flush=True)
    print("| " + " | ".join(COLS) + " |\n|" + "---|" * len(COLS), flush=True)
    rows = []
    for ctx in ctxs:
        for b in batches:
            if time.time() > deadline:
                new = [{"op": "-", "shape": f"B={b} ctx={ctx // 1024}K", "notes": "skipped: time budget"}]
            else:
                try:
                    new = run_shape(t, b, ctx, bw, parts)
                except Exception as e:  # noqa: BLE001  (one failing shape must not hide the others)
                    new = [{"op": "-", "shape": f"B={b} ctx={ctx // 1024}K",
                            "notes": f"failed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"}]
            for r in new:
                print("| " + " | ".join(_fmt(r.get(c)) for c in COLS) + " |", flush=True)
            rows += new
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_fp8_index.json").write_text(json.dumps({**head, "rows": rows}, indent=1))
    title = f"copy bandwidth {bw / 1e9:.0f} GB/s, ptxas ISA {head['ptxas_isa']}"
    md = [header(info), "", title, "", "| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in COLS) + " |" for r in rows]
    (out / "decode_fp8_index.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / 'decode_fp8_index.md'} and .json", flush=True)


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    main()
