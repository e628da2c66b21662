"""Benchmark: MSA index block scoring + top-k at M3 shapes (Hi=4, Hx=128, block 128, top-16).

Chunked prefill: the queries are the last ``chunk`` tokens of a ``ctx``-token context (prefix =
ctx - chunk). FLOPs follow docs/MSA.md §1.7: indexer = 2 * Hx * Hi * causal_elements, causal_elements =
sum_t (q_pos_t + 1). Baseline: a bf16 ``jnp.dot`` with the same FLOP count (8192 x 8192 x K) in the
same process (the tensor-core ceiling as XLA/cuBLAS reaches it), and the XLA reference
(``m3jax.msa.block_scores`` / ``select_blocks``) where its [T, S] scores fit in memory.

``bench(report)`` records rows for: the unfused score kernel, the fused score + top-k kernel, the
top-k kernel alone on block-major scores, and ``jax.lax.top_k`` (the reference) on the same rows.
Run ``python benchmarks/msa_index.py [ctx ...]`` to print the rows.

``bench_fp8(report)`` (``python benchmarks/msa_index.py --fp8 [ctx ...]``, default 64K, 256K, 1M keys
under 4096 queries) times the fp8 indexer's score kernel (``score_dtype="float8_e4m3fn"``: e4m3 x e4m3
MMA) against the bf16 score kernel in the same process, both writing block-major scores: the fp8 kernel
with the quantisation of the queries and of every key in XLA (what a prefill chunk pays when the index
cache is not fp8), and alone (operands quantised beforehand) at the default tile and two others.
ratio = bf16 ms / fp8 ms.
``bench_fp8_decode(report)`` (run by ``--fp8`` too: 128K and 1M keys, B=1 and 8, one token) times the
paged decode scoring kernel on fp8 index pages under the fp8 indexer (e4m3 x e4m3 wgmma, the query
quantised in XLA) against the same kernel on the same fp8 pages with the bf16 indexer (each page
converted in SMEM) and on bf16 pages; ratio = that baseline's ms / fp8 indexer ms.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp

from m3jax import msa
from m3jax.pallas import index_scores, topk as topk_mod

HI, HX, BS, TOPK = 4, 128, 128, 16


def _time_ms(f, *args, iters: int = 20) -> float:
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, t = profiler.measure(f, iterations=iters)(*args)
        if isinstance(t, (list, tuple)):
            t = statistics.median(t)
        return float(t)
    except Exception:  # noqa: BLE001  (CPU or profiler API change: wall clock)
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)


def _inputs(chunk, ctx, dtype=jnp.bfloat16, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    iq = jax.random.normal(k1, (1, chunk, HI, HX), jnp.float32).astype(dtype)
    ik = jax.random.normal(k2, (1, ctx, HX), jnp.float32).astype(dtype)
    q_pos = (ctx - chunk + jnp.arange(chunk, dtype=jnp.int32))[None]
    return iq, ik, q_pos


def _matmul_rate(flops):
    k = max(128, int(round(flops / (2 * 8192 * 8192) / 128)) * 128)
    # Random operands: all-ones ran 12% faster on the H200 (916 vs 821 TF/s, benchmarks/msa_tune.py),
    # which would flatter the ceiling the index kernel is compared against.
    ka, kb = jax.random.split(jax.random.key(7))
    a = jax.random.normal(ka, (8192, k), jnp.bfloat16)
    b = jax.random.normal(kb, (k, 8192), jnp.bfloat16)
    ms = _time_ms(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)), a, b)
    return 2 * 8192 * 8192 * k / ms / 1e9, ms


def bench(report, contexts=(32768, 131072, 1048576), chunk=8192):
    for ctx in contexts:
        iq, ik, q_pos = _inputs(chunk, ctx)
        causal = float(chunk) * (ctx - chunk) + chunk * (chunk + 1) / 2  # sum_t (q_pos_t + 1)
        flops = 2 * HX * HI * causal
        mm_tflops, _ = _matmul_rate(flops)
        shape = f"B=1 T={chunk} S={ctx} Hi={HI} Hx={HX} bs={BS}"

        f_scores = jax.jit(lambda a, b, c: index_scores.index_block_scores_blockmajor(a, b, c, block_size=BS)[0])
        ms = _time_ms(f_scores, iq, ik, q_pos)
        report(dict(op="msa_index_scores", shape=shape, impl="pallas (block-major out)", ms=ms,
                    tflops=flops / ms / 1e9, baseline=f"bf16 jnp.dot {mm_tflops:.0f} TF/s",
                    ratio=(flops / ms / 1e9) / mm_tflops, notes="unfused, writes [nb, T*Hi] fp32"))

        f_pub = jax.jit(lambda a, b, c: index_scores.index_block_scores(a, b, c, block_size=BS))
        ms_pub = _time_ms(f_pub, iq, ik, q_pos)
        report(dict(op="msa_index_scores", shape=shape, impl="pallas ([B,Hi,T,nb] out)", ms=ms_pub,
                    tflops=flops / ms_pub / 1e9, baseline=f"bf16 jnp.dot {mm_tflops:.0f} TF/s",
                    ratio=(flops / ms_pub / 1e9) / mm_tflops, notes="kernel + XLA transpose"))

        fused_cfg = index_scores.IndexScoreConfig(fused_topk=True)
        f_fused = jax.jit(lambda a, b, c: index_scores.index_select_blocks(a, b, c, block_size=BS, topk=TOPK,
                                                                           config=fused_cfg))
        ms_f = _time_ms(f_fused, iq, ik, q_pos)
        report(dict(op="msa_index_topk_fused", shape=shape + f" topk={TOPK}", impl="pallas fused", ms=ms_f,
                    tflops=flops / ms_f / 1e9, baseline="unfused scores+topk",
                    ratio=None, notes="score matrix never written"))

        scores_bm, rowpos = jax.jit(
            lambda a, b, c: index_scores.index_block_scores_blockmajor(a, b, c, block_size=BS))(iq, ik, q_pos)
        f_topk = jax.jit(lambda s, r: topk_mod.select_blocks_blockmajor(s, r, block_size=BS, topk=TOPK))
        ms_t = _time_ms(f_topk, scores_bm, rowpos)
        rows = chunk * HI
        report(dict(op="msa_topk", shape=f"rows={rows} nb={ctx // BS} topk={TOPK}", impl="pallas (block-major)",
                    ms=ms_t, gbps=rows * (ctx // BS) * 4 / ms_t / 1e6, baseline=None, ratio=None,
                    notes=f"unfused scores+topk = {ms + ms_t:.3f} ms vs fused {ms_f:.3f} ms"))

        scores = jnp.transpose(scores_bm[:, : ctx // BS, :rows].reshape(1, ctx // BS, chunk, HI), (0, 3, 2, 1))
        del scores_bm
        f_ref_topk = jax.jit(lambda s, p: msa.select_blocks(s, p, block_size=BS, topk=TOPK))
        ms_rt = _time_ms(f_ref_topk, scores, q_pos)
        report(dict(op="msa_topk", shape=f"rows={rows} nb={ctx // BS} topk={TOPK}", impl="xla lax.top_k (reference)",
                    ms=ms_rt, gbps=rows * (ctx // BS) * 4 / ms_rt / 1e6, baseline=None, ratio=ms_rt / ms_t,
                    notes="ratio = reference / pallas"))
        del scores
        if ctx <= 131072:
            f_ref = jax.jit(lambda a, b, c: msa.block_scores(a, b, c, BS))
            ms_r = _time_ms(f_ref, iq, ik, q_pos, iters=5)
            report(dict(op="msa_index_scores", shape=shape, impl="xla reference (fp32 einsum)", ms=ms_r,
                        tflops=flops / ms_r / 1e9, baseline=None, ratio=ms_r / ms, notes="ratio = reference / pallas"))


def bench_fp8(report, contexts=(65536, 262144, 1048576), chunk=4096):
    from m3jax.pallas.index_scores import kernel

    fp8 = "float8_e4m3fn"
    for ctx in contexts:
        iq, ik, q_pos = _inputs(chunk, ctx)
        causal = float(chunk) * (ctx - chunk) + chunk * (chunk + 1) / 2
        flops = 2 * HX * HI * causal
        shape = f"B=1 T={chunk} S={ctx} Hi={HI} Hx={HX} bs={BS}"
        f_bf16 = jax.jit(lambda a, b, c: index_scores.index_block_scores_blockmajor(a, b, c, block_size=BS)[0])
        ms_bf16 = _time_ms(f_bf16, iq, ik, q_pos)
        report(dict(op="msa_index_scores", shape=shape, impl="pallas bf16 (block-major out)", ms=ms_bf16,
                    tflops=flops / ms_bf16 / 1e9, baseline=None, ratio=None, notes="the fp8 rows' baseline"))

        f_q = jax.jit(lambda a, b, c: index_scores.index_block_scores_blockmajor(a, b, c, block_size=BS,
                                                                                 score_dtype=fp8)[0])
        ms_q = _time_ms(f_q, iq, ik, q_pos)
        report(dict(op="msa_index_scores", shape=shape, impl="pallas fp8 + XLA quantisation", ms=ms_q,
                    tflops=flops / ms_q / 1e9, baseline="pallas bf16", ratio=ms_bf16 / ms_q,
                    notes="ratio = bf16 / fp8; q and every key quantised per call"))

        # the default tile, then other tiles (the e4m3 operands take half the SMEM of bf16's: more buffers
        # or 128-row tiles fit), each against the bf16 kernel's default
        default = index_scores.IndexScoreConfig()
        tiles = (default, dataclasses.replace(default, rows=128), dataclasses.replace(default, max_concurrent_steps=4))
        for config in tiles:
            config = config.for_block(BS, fused=False)
            qs, ks, scales, rowpos, info, nb, _ = kernel._prepare(iq, ik, q_pos, BS, config.rows, fp8)
            f_k = jax.jit(lambda qs, ks, scales, rowpos, info, config=config: kernel._kernel_call(
                qs, ks, scales, rowpos, info, s_len=ctx, block_size=BS, nb=nb, config=config, fused=False, topk=0,
                local_blocks=0, init_blocks=0))
            ms_k = _time_ms(f_k, qs, ks, scales, rowpos, info)
            report(dict(op="msa_index_scores", shape=shape,
                        impl=f"pallas fp8 kernel alone, rows={config.rows} buffers={config.max_concurrent_steps}",
                        ms=ms_k, tflops=flops / ms_k / 1e9, baseline="pallas bf16", ratio=ms_bf16 / ms_k,
                        notes="ratio = bf16 / fp8; operands quantised beforehand"))
            del qs, ks, scales
        del iq, ik


def bench_fp8_decode(report, contexts=(131072, 1048576), batches=(1, 8)):
    from m3jax.pallas import decode

    fp8 = "float8_e4m3fn"
    for ctx in contexts:
        for b in batches:
            pages = ctx // BS
            k1, k2, k3 = jax.random.split(jax.random.key(b), 3)
            iq = jax.random.normal(k1, (b, 1, HI, HX), jnp.bfloat16)
            ik16 = jax.random.normal(k2, (b * pages, BS, HX), jnp.bfloat16)
            ik8 = ik16.astype(jnp.float8_e4m3fn)  # unit normals: far inside e4m3's range
            pt = jax.random.permutation(k3, b * pages).astype(jnp.int32).reshape(b, pages)
            sl = jnp.full((b,), ctx, jnp.int32)
            shape = f"B={b} Q=1 ctx={ctx} Hi={HI} Hx={HX} bs={BS}"
            f = {s: jax.jit(lambda *a, s=s: decode.decode_index_scores(*a, block_size=BS, score_dtype=s))
                 for s in ("bfloat16", fp8)}
            ms16 = _time_ms(f["bfloat16"], iq, ik16, pt, sl)
            ms_conv = _time_ms(f["bfloat16"], iq, ik8, pt, sl)
            ms8 = _time_ms(f[fp8], iq, ik8, pt, sl)
            for impl, ms, nbytes in (("bf16 pages, bf16 indexer", ms16, ik16.nbytes),
                                     ("fp8 pages, bf16 indexer (converted)", ms_conv, ik8.nbytes)):
                report(dict(op="msa_decode_index_scores", shape=shape, impl=impl, ms=ms, gbps=nbytes / ms / 1e6,
                            baseline=None, ratio=None, notes="baseline of the fp8 indexer row"))
            report(dict(op="msa_decode_index_scores", shape=shape, impl="fp8 pages, fp8 indexer (e4m3 x e4m3)",
                        ms=ms8, gbps=ik8.nbytes / ms8 / 1e6, baseline="fp8 pages, bf16 indexer", ratio=ms_conv / ms8,
                        notes=f"ratio = converted / fp8 indexer; bf16 pages / fp8 indexer = {ms16 / ms8:.3f}"))
            del ik16, ik8


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    import sys

    args = sys.argv[1:]
    fp8_only = "--fp8" in args
    ctxs = tuple(int(x) for x in args if x != "--fp8")
    report = lambda row: print(json.dumps(row), flush=True)  # noqa: E731
    if fp8_only:
        bench_fp8(report, **({"contexts": ctxs} if ctxs else {}))
        bench_fp8_decode(report)
    else:
        bench(report, **({"contexts": ctxs} if ctxs else {}))
