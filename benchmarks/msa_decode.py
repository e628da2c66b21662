"""MSA decode benchmark (one layer, one step): index scoring + top-k + sparse paged attention.

The pallas decode step runs the Mosaic top-k (``m3jax.pallas.topk``, the row-split kernel at these
row counts); the top-k is also timed alone, XLA ``msa.select_blocks`` vs the row-split kernel.
M3 shapes: N=64 query heads, K=4 KV heads, H=128, index Hx=128 with Hi=4 heads, block (page) 128,
top-k 16, bf16 caches, Q=1 new token; contexts 128K and 1M, batch 1 and 8. Bytes counted: index keys
scanned (256 B/token) + selected K/V pages (K * topk * 128 * 128 * 2 * 2 B per request). The
baseline is cuDNN dense decode attention (``jax.nn.dot_product_attention(implementation="cudnn")``,
T=1 query over the full context) measured in the same process; ``ratio`` = baseline_ms / ms
(> 1: the MSA step is faster than dense attention). Timing: CUPTI kernel time
(``jax.experimental.mosaic.gpu.profiler.measure``), median of 20 iterations after a warm-up.

Run: ``PYTHONPATH=. python benchmarks/msa_decode.py`` (prints one JSON row per result).
``MSA_BENCH_BUDGET_S=<seconds>``: stop starting new measurements after that long (the remaining ones
are reported as skipped), so a time-limited device run still writes its table; a shape that starts
always times its cuDNN baseline first, so its ratios are never missing.
``MSA_BENCH_CTX=131072,1048576`` / ``MSA_BENCH_BATCH=1,8``: the contexts / batches to run (default both).

``model_decode_step`` rows time the model's own decode path (``m3jax.msa.kernels.decode``) with the
index-key pages in bf16, in fp8 e4m3 (``index_cache_dtype="float8_e4m3fn"``, same keys rounded), and in
fp8 under the fp8 indexer (``index_score_dtype="float8_e4m3fn"`` too: e4m3 x e4m3 scoring); ``ratio``
there = bf16 ms / ms (> 1: the setting makes the step faster), cuDNN's ratio in the notes, which also say
whether the step's block ids equal XLA's top-k over the scoring kernel's own scores.
``MSA_BENCH_MODEL_ONLY=1``: only these rows and cuDNN (the decode table in a short run).
``MSA_BENCH_TUNE=1``: only cuDNN, the row-split top-k per ``rows_per_step`` (1, 2, 4, 8; ids checked
against XLA's), the scoring kernel per ``DecodeScoreConfig`` waves and stages
(``index_scores[pages]`` rows), bf16 and fp8 pages, and the sparse attention per
``SparseDecodeConfig`` splits and stages.

The fused paged selection (``m3jax.pallas.decode.decode_select_blocks``: one launch for scores, block
max and each context split's top-k, then the merge of the splits' lists; the model's
``msa_decode_select="fused"``), per index-page dtype (bf16, fp8 e4m3): ``selection[pages]`` rows time
the existing pair (scoring kernel + top-k kernel, ``impl=scores+topk``) and the fused selection
(``impl=fused``, its ids checked equal to the pair's on the device); ``ratio`` = pair ms / fused ms
(> 1: fusing is faster), cuDNN's ratio in the notes. ``decode_step[pages]`` rows time the whole MSA
step (``kernels.decode_pages``) with each (``impl=separate`` / ``fused``); ``ratio`` = cudnn ms / ms,
and the fused row's notes give separate ms / fused ms. ``MSA_BENCH_FUSED_ONLY=1``: only these rows
and cuDNN (a shorter run). ``MSA_BENCH_FUSED_WAVES=1,2`` / ``MSA_BENCH_FUSED_STAGES=2,4``: time the
fused selection with each of those waves of context splits and page loads in flight
(``DecodeScoreConfig.waves`` / ``.stages``; rows ``fused[waves=w,stages=s]``, naming what differs from
the default config, whose row is ``fused``). The selection and step rows' notes list each launch's median
time (Mosaic kernels and XLA fusions by CUPTI name): the fused selection is its kernel, the merge of the
splits' lists in the top-k kernel and the XLA reshapes around it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp

N, K, H, HX, HI, BS, TOPK = 64, 4, 128, 128, 4, 128, 16


def _time_ms(f, *args, iters: int = 20, parts: bool = False):
    """Median device ms of ``f``; with ``parts`` also ``{kernel name: median ms}`` of each launch."""
    from jax.experimental.mosaic.gpu import profiler

    jax.block_until_ready(f(*args))  # compile + warm-up
    _, times = profiler.measure(f, aggregate=False, iterations=iters)(*args)
    total = float(statistics.median(sum(t for _, t in it) for it in times))
    if not parts:
        return total
    names = [name for name, _ in times[0]]
    return total, {f"{k}:{name[:48]}": float(statistics.median(it[k][1] for it in times))
                   for k, name in enumerate(names)}


def _inputs(b: int, ctx: int, q_len: int = 1, seed: int = 0):
    pages_per_seq = ctx // BS
    num_pages = b * pages_per_seq
    ks = jax.random.split(jax.random.key(seed), 6)
    dt = jnp.bfloat16
    q = jax.random.normal(ks[0], (b, q_len, N, H), dt)
    iq = jax.random.normal(ks[1], (b, q_len, HI, HX), dt)
    k_pages = jax.random.normal(ks[2], (num_pages, BS, K, H), dt)
    v_pages = jax.random.normal(ks[3], (num_pages, BS, K, H), dt)
    ik_pages = (jax.random.normal(ks[4], (num_pages, BS, HX), dt) * 0.1).astype(dt)
    page_table = jax.random.permutation(ks[5], num_pages).astype(jnp.int32).reshape(b, pages_per_seq)
    seq_lens = jnp.full((b,), ctx, jnp.int32)
    return q, iq, k_pages, v_pages, ik_pages, page_table, seq_lens


def bench(report) -> None:
    import m3jax
    from m3jax import msa
    from m3jax.cache import LayerCache
    from m3jax.msa import kernels
    from m3jax.pallas import decode as D
    from m3jax.pallas import topk as T
    from m3jax.pallas.topk import rowsplit as R

    M3_TEXT = dataclasses.replace(m3jax.preset("minimax_m3").text, num_attention_heads=N, num_key_value_heads=K,
                                  head_dim=H, index_n_heads=HI, index_head_dim=HX, index_block_size=BS,
                                  index_topk_blocks=TOPK)
    deadline = time.time() + float(os.environ.get("MSA_BENCH_BUDGET_S", "inf"))
    ctxs = [int(x) for x in os.environ.get("MSA_BENCH_CTX", f"{128 * 1024},{1024 * 1024}").split(",")]
    batches = [int(x) for x in os.environ.get("MSA_BENCH_BATCH", "1,8").split(",")]
    model_only = os.environ.get("MSA_BENCH_MODEL_ONLY") == "1"
    tune = os.environ.get("MSA_BENCH_TUNE") == "1"

    for ctx in ctxs:
        for b in batches:
            shape = f"B={b} ctx={ctx // 1024}K Q=1 N={N} K={K} H={H} Hx={HX} Hi={HI} bs={BS} topk={TOPK}"
            if time.time() > deadline:
                report({"op": "msa_decode", "shape": shape, "impl": "-", "ms": None, "notes": "skipped: time budget"})
                continue
            q, iq, kp, vp, ikp, pt, sl = _inputs(b, ctx)
            idx_bytes = b * ctx * HX * 2
            kv_bytes = b * K * TOPK * BS * H * 2 * 2
            q_pos = D.query_positions(sl, 1)

            def step(impl, q, iq, kp, vp, ikp, pt, sl):  # index scores -> top-k -> sparse paged attention
                if impl == "pallas":
                    return kernels.decode_pages(q, iq, kp, vp, ikp, pt, sl, block_size=BS, topk=TOPK)[0]
                s = D.decode_index_scores(iq, ikp, pt, sl, block_size=BS, implementation="reference")
                sel = msa.select_blocks(s, D.query_positions(sl, q.shape[1]), block_size=BS, topk=TOPK)
                return D.sparse_decode_attention(q, kp, vp, pt, sel, sl, block_size=BS, implementation="reference")

            scores = jax.jit(functools.partial(D.decode_index_scores, block_size=BS))
            select = jax.jit(lambda s: msa.select_blocks(s, q_pos, block_size=BS, topk=TOPK))
            select_rowsplit = jax.jit(lambda s: T.select_blocks(s, q_pos, block_size=BS, topk=TOPK,
                                                                implementation="pallas_rowsplit"))
            attn = jax.jit(functools.partial(D.sparse_decode_attention, block_size=BS))
            s_val = D.decode_index_scores(iq, ikp, pt, sl, block_size=BS, implementation="reference")
            bidx = select(s_val)

            # cuDNN dense decode baseline: the same context as contiguous K/V. Timed first and never skipped
            # for the budget once a shape has started: every ratio of the shape divides it.
            kd = kp[pt].reshape(b, ctx, K, H)
            vd = vp[pt].reshape(b, ctx, K, H)
            dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
            try:
                t_dense = _time_ms(dense, q, kd, vd)
                dense_note = ""
            except Exception as e:  # noqa: BLE001
                t_dense, dense_note = float("nan"), f"cudnn failed: {type(e).__name__}: {str(e)[:120]}"
            dense_bytes = b * ctx * K * H * 2 * 2
            report({"op": "dense_decode_attention", "shape": shape, "impl": "cudnn", "ms": t_dense,
                    "gbps": dense_bytes / t_dense / 1e6, "baseline": None, "ratio": None, "notes": dense_note})
            del kd, vd

            rows = []

            def timed(op, impl, nbytes, f, *args, want=None, want_name="xla", parts=False):
                if time.time() > deadline:
                    rows.append((op, impl, float("nan"), nbytes, "skipped: time budget"))
                    return
                try:
                    ms = _time_ms(f, *args, parts=parts)
                    note = ""
                    if parts:  # where the time goes: each launch (Mosaic kernels, XLA fusions)
                        ms, per = ms
                        note = "launches: " + ", ".join(f"{k} {v:.4f} ms" for k, v in per.items()) + "; "
                    # the interpret-mode tests cannot see races inside a warpgroup: check on the device too
                    wrong = want is not None and not bool(jnp.array_equal(f(*args), want))
                    rows.append((op, impl, ms, nbytes, note + (f"WRONG: differs from {want_name}" if wrong else "")))
                except Exception as e:  # noqa: BLE001  (a failing piece must not hide the others)
                    rows.append((op, impl, float("nan"), nbytes, f"failed: {type(e).__name__}: {str(e)[:200]}"))

            if tune:  # the top-k per rows per step, the attention per (splits, stages), the scoring per (waves, stages)
                for u in (1, 2, 4, 8):
                    timed("topk(select_blocks)", f"pallas_rowsplit[rows_per_step={u}]", b * HI * (ctx // BS) * 4,
                          jax.jit(lambda s, u=u: R.select_blocks(s, q_pos, block_size=BS, topk=TOPK, rows_per_step=u)),
                          s_val, want=bidx)
                for splits in (None, 4, 8, 16):
                    for st in (2, 3):
                        cfg = D.SparseDecodeConfig(num_splits=splits, stages=st)
                        timed("sparse_attention", f"pallas[splits={splits},stages={st}]", kv_bytes,
                              jax.jit(functools.partial(D.sparse_decode_attention, block_size=BS, config=cfg)),
                              q, kp, vp, pt, bidx, sl)
                for name, pages, nbytes in (("bf16", ikp, idx_bytes), ("fp8", ikp.astype(jnp.float8_e4m3fn),
                                                                       idx_bytes // 2)):
                    for w in (1, 2):
                        for st in (4, 6):
                            cfg = D.DecodeScoreConfig(waves=w, stages=st)
                            timed(f"index_scores[{name}]", f"pallas[waves={w},stages={st}]", nbytes,
                                  jax.jit(functools.partial(D.decode_index_scores, block_size=BS, config=cfg)),
                                  iq, pages, pt, sl)
            if not model_only and not tune:
                # The fused selection against the scoring + top-k kernel pair, and the MSA step with each.
                pair = jax.jit(lambda iq, ik, pt, sl: T.select_blocks(
                    D.decode_index_scores(iq, ik, pt, sl, block_size=BS), D.query_positions(sl, 1), block_size=BS,
                    topk=TOPK, implementation="pallas"))
                default = D.DecodeScoreConfig()
                env_waves = os.environ.get("MSA_BENCH_FUSED_WAVES")
                waves = [int(w) for w in env_waves.split(",")] if env_waves else [default.waves]
                stages = [int(x) for x in os.environ.get("MSA_BENCH_FUSED_STAGES", str(default.stages)).split(",")]

                def fused_name(w, st):
                    cfg = [f"waves={w}"] * (w != default.waves) + [f"stages={st}"] * (st != default.stages)
                    return "fused" + (f"[{','.join(cfg)}]" if cfg else "")

                fused = {fused_name(w, st): jax.jit(functools.partial(D.decode_select_blocks, block_size=BS, topk=TOPK,
                                                                      config=D.DecodeScoreConfig(waves=w, stages=st)))
                         for w in waves for st in stages}
                steps = {mode: jax.jit(functools.partial(kernels.decode_pages, block_size=BS, topk=TOPK,
                                                         fused_select=mode == "fused"))
                         for mode in ("separate", "fused")}
                for name, nbytes in (("bf16", idx_bytes), ("fp8", idx_bytes // 2)):
                    pages = ikp if name == "bf16" else ikp.astype(jnp.float8_e4m3fn)
                    timed(f"selection[{name}]", "scores+topk", nbytes, pair, iq, pages, pt, sl, parts=True)
                    want = pair(iq, pages, pt, sl)
                    for impl, f in fused.items():
                        timed(f"selection[{name}]", impl, nbytes, f, iq, pages, pt, sl, want=want,
                              want_name="scores+topk", parts=True)
                    for mode, f in steps.items():
                        timed(f"decode_step[{name}]", mode, nbytes + kv_bytes, lambda *a, f=f: f(*a)[0],
                              q, iq, kp, vp, pages, pt, sl, parts=True)
                    del pages

            model_ms = {}
            if os.environ.get("MSA_BENCH_FUSED_ONLY") != "1" and not tune:
                if not model_only:
                    timed("index_scores", "pallas", idx_bytes, scores, iq, ikp, pt, sl)
                    timed("index_scores", "xla_reference", idx_bytes,
                          jax.jit(functools.partial(D.decode_index_scores, block_size=BS, implementation="reference")),
                          iq, ikp, pt, sl)
                    timed("topk(select_blocks)", "xla", b * HI * (ctx // BS) * 4, select, s_val)
                    timed("topk(select_blocks)", "pallas_rowsplit", b * HI * (ctx // BS) * 4, select_rowsplit, s_val,
                          want=bidx)
                    timed("sparse_attention", "pallas", kv_bytes, attn, q, kp, vp, pt, bidx, sl)
                    timed("decode_step", "pallas", idx_bytes + kv_bytes, jax.jit(functools.partial(step, "pallas")),
                          q, iq, kp, vp, ikp, pt, sl, parts=True)
                    timed("decode_step", "xla_reference", idx_bytes + kv_bytes,
                          jax.jit(functools.partial(step, "reference")), q, iq, kp, vp, ikp, pt, sl)
                fp8_pages = ikp.astype(jnp.float8_e4m3fn)
                for name, score, pages, nbytes in (("bfloat16", "bfloat16", ikp, idx_bytes),
                                                   ("float8_e4m3fn", "bfloat16", fp8_pages, idx_bytes // 2),
                                                   ("float8_e4m3fn", "float8_e4m3fn", fp8_pages, idx_bytes // 2)):
                    cfg = dataclasses.replace(M3_TEXT, index_cache_dtype=name, index_score_dtype=score)
                    # the positions are an argument, as in the model's step (a constant closed over
                    # would be materialised by a launch of its own)
                    model = jax.jit(lambda q, iq, kp, vp, ik, pt, pos, cfg=cfg: kernels.decode(
                        q, iq, LayerCache(kp, vp, ik), pt, pos, cfg))
                    label = f"index {name}" + (", fp8 indexer" if score != "bfloat16" else "")
                    timed(f"model_decode_step[{label}]", "pallas", nbytes + kv_bytes, lambda *a: model(*a)[0],
                          q, iq, kp, vp, pages, pt, q_pos, parts=True)
                    model_ms[label] = rows[-1][2]
                    op, impl, ms, nb, note = rows[-1]
                    if not math.isnan(ms):  # it ran: its ids against the scoring kernel's
                        sel = model(q, iq, kp, vp, pages, pt, q_pos)[1]
                        rows[-1] = (op, impl, ms, nb, note + _ids_note(sel, iq, pages, pt, sl, q_pos, cfg))
            ms_of = {(op, impl): t for op, impl, t, _, _ in rows}

            for op, impl, t, nbytes, note in rows:
                ratio, baseline, why = _ratio(op, impl, t, t_dense, model_ms, ms_of)
                report({"op": f"msa_decode/{op}", "shape": shape, "impl": impl, "ms": t, "gbps": nbytes / t / 1e6,
                        "baseline": baseline, "ratio": ratio, "notes": why + note})
            del q, iq, kp, vp, ikp, pt, sl


def _ids_note(sel, iq, pages, pt, sl, q_pos, cfg) -> str:
    """Whether the model step's block ids (its scoring kernel's rows read in place by the row-split top-k)
    equal XLA's top-k over the same scoring kernel's [B, Hi, Q, pages] scores: a check on the device, where
    a race inside a warpgroup would show and interpret mode cannot."""
    from m3jax import msa
    from m3jax.pallas import decode as D

    scores = D.decode_index_scores(iq, pages, pt, sl, block_size=BS, score_dtype=cfg.index_score_dtype)
    want = msa.select_blocks(scores, q_pos, block_size=BS, topk=cfg.index_topk_blocks,
                             local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
    same = bool(jnp.array_equal(sel, want))
    return "; ids = scoring kernel + XLA top-k" if same else "; WRONG: ids differ from scoring kernel + XLA top-k"


def _ratio(op: str, impl: str, t: float, t_dense: float, model_ms: dict, ms_of: dict):
    """(ratio, baseline, notes) of one row, every ratio against a time measured in this process."""
    cudnn = f"cudnn dense decode {t_dense:.4f} ms"
    if op.startswith("decode_step"):
        note = "ratio = cudnn_ms / ms; "
        if impl == "fused":
            sep = ms_of.get((op, "separate"), float("nan"))
            note += f"separate_ms / fused_ms = {sep / t:.3g}; "
        return t_dense / t, cudnn, note
    if op.startswith("model_decode_step"):
        return (model_ms["index bfloat16"] / t, cudnn,
                f"ratio = bf16-index ms / ms; cudnn_ms / ms = {t_dense / t:.3g}; ")
    if op.startswith("selection[") and impl.startswith("fused"):
        pair = ms_of.get((op, "scores+topk"), float("nan"))
        return (pair / t, f"scores+topk kernels {pair:.4f} ms",
                f"ratio = scores+topk ms / fused ms; cudnn_ms / ms = {t_dense / t:.3g}; ")
    if op.startswith("selection["):
        return None, cudnn, f"cudnn_ms / ms = {t_dense / t:.3g}; "
    if impl.startswith("pallas_rowsplit[rows_per_step="):
        one = ms_of.get((op, "pallas_rowsplit[rows_per_step=1]"), float("nan"))
        return one / t, f"one row per step {one:.4f} ms", "ratio = one-row-per-step ms / ms; "
    if op == "sparse_attention" and impl.startswith("pallas[splits="):
        dflt = ms_of.get((op, "pallas[splits=None,stages=2]"), float("nan"))
        return dflt / t, f"default config {dflt:.4f} ms", "ratio = default-config ms / ms; "
    if op.startswith("index_scores[") and impl.startswith("pallas[waves="):
        two = ms_of.get((op, "pallas[waves=2,stages=4]"), float("nan"))
        return two / t, f"2 waves, 4 stages {two:.4f} ms", "ratio = (2 waves, 4 stages) ms / ms; "
    return None, cudnn, ""


if __name__ == "__main__":
    from run_info import help_or_run

    help_or_run(__doc__)
    bench(lambda row: print(json.dumps(row), flush=True))
