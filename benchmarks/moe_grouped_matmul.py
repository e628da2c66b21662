"""MoE grouped GEMM at M3 shapes, the two MMA kernel schedules, bf16 and MXFP8 weights: prefill against a
dense ``jnp.dot`` of the same FLOPs, decode against the weight-bytes floor.

Weights: random MXFP8 experts (float8_e4m3fn values + E8M0 scales per 32 inputs) and the same weights
dequantised to bf16, so the bf16 and MXFP8 kernels multiply equal weights (their ratio is the cost of
reading fp8 + converting it in the kernel). Two GEMMs of an expert MLP: gate/up (K = 6144 -> N = 3072)
and down (K = 3072 -> N = 6144), 128 experts.

* Prefill: 8192 tokens x top-4 = 32768 rows (``--tokens``: 4096 is the model's prefill chunk, 16384
  rows) from a random router (sigmoid scores, top-4). Each variant, bf16 and MXFP8 weights: device ms,
  TFLOP/s, ratio to one dense bf16 ``[M, K] x [K, N]`` ``jnp.dot`` of the same FLOPs (cuBLAS through XLA,
  timed in the same process before and after the variants, the faster kept; issue #43's target >= 0.8),
  ratio to the 128 x 256 warp-specialised tile of the same weights (MXFP8's prefill tile; bf16's before
  the 256-row tiles), MXFP8 / bf16 of the same variant (target <= 1.1), and the time of reading every
  expert's weights once at the copy bandwidth (the bytes floor: at 128 rows per expert the bf16 weights'
  floor is above the dense GEMM's time, so no bf16 grouped GEMM reaches 0.8 there; the summary prints
  dense / floor, the most a bytes-bound kernel reaches).
* Decode: 1 and 8 tokens x top-4. Floor = bytes of the experts' weights the rows touch (bf16: 2 bytes,
  MXFP8: 1 + 1/32 per weight) / the device's copy bandwidth (read + write of a 4 GiB elementwise pass,
  same process). Each variant: ms, ms / floor, MXFP8 / bf16 of the same variant, and MXFP8 / the bf16
  default (the MoE layer's bf16 decode config today; target <= 0.6). MXFP8 weights at decode rows run
  the gemv schedule instead (``layer_config``), which has no bf16 counterpart:
  ``benchmarks/mxfp8_gemv.py`` and ``benchmarks/mxfp8_resident.py`` measure it.
* Every result: relative L2 against ``jax.lax.ragged_dot`` on the dequantised weights (at prefill the same
  products one expert at a time, :func:`expert_by_expert`, to fit an H100's memory).

Variants: ``pipeline`` (the one-warpgroup kernel, non-persistent grid; the MoE layer's bf16 config at
decode: block_m 64, block_n 128) and ``ws`` (``warp_specialized``: persistent, TMA producer + two
consumer warpgroups, group-aligned tiles, ``split_k`` for decode; block_m 128, block_n 256 is the
layer's MXFP8 prefill tile); ``ws-rows``: the consumers split the rows,
``wg_split="m"``, in 64-row chunks multiplied only where they hold rows; ``ws-rows bm256 bn128``: the
256-row tiles (``PREFILL_ROWS256``, the layer's bf16 prefill tile: one weight tile per K step
for all of a ~256-row expert's rows, a group's last few rows in a 128-row visit; ``ws-rows bm384 bn128``:
the 384-row tiles, an expert of up to ~380 rows in one visit; ``--cluster`` adds the 256-row tiles
on two-CTA clusters, adjacent N tiles loading their shared lhs tile once by TMA multicast). "(layer)" marks the
variant ``layer_config`` picks for the shape; at decode the first variant is the layer's bf16 config,
the base of the "default" ratios; in ``--dry`` the first of the dry variants. Timing: CUPTI
(``jax.experimental.mosaic.gpu.profiler.measure``, median), wall clock off the GPU.

Prints the tables; writes ``$OUT/moe_grouped_matmul.md`` and ``.json`` (``$OUT`` default benchmarks/out):

    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py            # H200: ~3-4 minutes (~70 kernel compiles)
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --skip-decode   # or in two runs, each ~2 minutes
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --skip-decode --tokens 4096   # the model's prefill chunk
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --skip-decode --cluster   # + the two-CTA cluster variant
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --skip-decode --variants "ws-rows bm256 bn128,ws bm128 bn256"
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --skip-prefill
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --quick    # H200: every prefill variant, 3 decode ones, small shapes, < 1 minute
    PYTHONPATH=. python benchmarks/moe_grouped_matmul.py --dry      # CPU: interpret mode, tiny shapes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.msa_index import _time_ms
from m3jax.pallas.grouped_matmul import (
    GroupedMatmulConfig,
    dequantize_mxfp8,
    grouped_matmul,
    grouped_matmul_mxfp8,
    layer_config,
    mxfp8_unsupported_reason,
    unsupported_reason,
)

WS = "warp_specialized"
M3 = {"tokens": 8192, "topk": 4, "experts": 128, "cases": (("gate/up", 6144, 3072), ("down", 3072, 6144)), "decode": (1, 8)}
QUICK = {"tokens": 512, "topk": 4, "experts": 16, "cases": (("gate/up", 1024, 512),), "decode": (8,)}
DRY = {"tokens": 24, "topk": 2, "experts": 4, "cases": (("gate/up", 128, 256),), "decode": (1,)}


def _cfg(bm, bn, schedule="pipeline", split_k=1, steps=4, wg_split="n", cluster=1):
    return GroupedMatmulConfig(block_m=bm, block_n=bn, schedule=schedule, split_k=split_k, max_concurrent_steps=steps,
                               wg_split=wg_split, cluster=cluster)


# name -> config; at decode the first is the MoE layer's bf16 config (grouped_matmul.layer_config; MXFP8 at
# decode rows runs the gemv schedule, not here); at prefill the table marks the layer's pick per shape
BASE = "ws bm128 bn256"  # the prefill tile the 256-row tiles are compared with (the layer's for MXFP8)
PREFILL = {
    "ws-rows bm256 bn128": _cfg(256, 128, WS, wg_split="m"),
    "ws-rows bm384 bn128": _cfg(384, 128, WS, wg_split="m"),
    BASE: _cfg(128, 256, WS),
    "pipeline bm128 bn128": _cfg(128, 128),
    "pipeline bm64 bn256": _cfg(64, 256),
    "ws bm128 bn128": _cfg(128, 128, WS),
    "ws bm64 bn256": _cfg(64, 256, WS),
    "ws-rows bm128 bn256": _cfg(128, 256, WS, wg_split="m"),
    "ws-rows bm128 bn128": _cfg(128, 128, WS, wg_split="m"),
}
DECODE = {
    "pipeline bm64 bn128 (default)": _cfg(64, 128),
    "ws bm64 bn256 split1": _cfg(64, 256, WS, 1),
    "ws bm64 bn256 split2": _cfg(64, 256, WS, 2),
    "ws bm64 bn256 split4": _cfg(64, 256, WS, 4),
    "ws bm64 bn256 split8": _cfg(64, 256, WS, 8),
    "ws bm64 bn256 split4 8 stages": _cfg(64, 256, WS, 4, steps=8),
}
# --cluster: the 256-row tiles on two-CTA clusters (adjacent N tiles, the lhs tile multicast), not yet run on a GPU
CLUSTER = {"ws-rows bm256 bn128 cluster2": _cfg(256, 128, WS, wg_split="m", cluster=2)}
QUICK_DECODE = {name: DECODE[name] for name in ("pipeline bm64 bn128 (default)", "ws bm64 bn256 split1",
                                                "ws bm64 bn256 split4")}
DRY_PREFILL = {"ws-rows bm256 bn128": _cfg(256, 128, WS, steps=2, wg_split="m"),
               "pipeline bm64 bn128": _cfg(64, 128, steps=2), "ws bm64 bn256": _cfg(64, 256, WS, steps=2),
               "ws-rows bm128 bn128": _cfg(128, 128, WS, steps=2, wg_split="m")}
DRY_DECODE = {"pipeline bm64 bn128": _cfg(64, 128, steps=2), "ws bm64 bn256 split2": _cfg(64, 256, WS, 2, 2)}


def router_group_sizes(tokens: int, topk: int, experts: int, seed: int = 0) -> jax.Array:
    """int32 [experts]: rows per expert from a random sigmoid router's top-k (as m3jax.moe.route)."""
    logits = jax.random.normal(jax.random.key(seed), (tokens, experts), jnp.float32)
    _, ids = jax.lax.top_k(jax.nn.sigmoid(logits), topk)
    return jnp.bincount(ids.reshape(-1), length=experts).astype(jnp.int32)


def _rel_l2(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def random_mxfp8(g: int, k: int, n: int, seed: int = 1):
    """fp8 values over e4m3's range and E8M0 exponents 2^-10..2^-6 (outputs of order 10 for unit rows)."""
    kv, ks = jax.random.split(jax.random.key(seed))
    values = jnp.clip(16 * jax.random.normal(kv, (g, k, n), jnp.float32), -448, 448).astype(jnp.float8_e4m3fn)
    scales = jax.random.randint(ks, (g, k // 32, n), 117, 122).astype(jnp.uint8)
    return values, scales


def copy_bandwidth(gib: float, iters: int) -> float:
    """Bytes per second (read + write) of an elementwise pass over ``gib`` GiB of bf16."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    ms = _time_ms(jax.jit(lambda x: x * 2), x, iters=iters)
    return 2 * x.nbytes / (ms / 1e3)


def _variant(lhs, values, scales, w_bf16, gs, cfg, iters: int, ref) -> dict:
    """bf16 and MXFP8 times of one config (None where the config does not take the shape)."""
    m, k = lhs.shape
    g, _, n = values.shape
    out = {}
    runs = {"bf16": (unsupported_reason(m, k, n, g, cfg),
                     jax.jit(lambda a, w, s, cfg=cfg: grouped_matmul(a, w, s, config=cfg)), (lhs, w_bf16, gs)),
            "mxfp8": (mxfp8_unsupported_reason(m, k, n, g, scales.shape[1], cfg),
                      jax.jit(lambda a, v, c, s, cfg=cfg: grouped_matmul_mxfp8(a, v, c, s, config=cfg)),
                      (lhs, values, scales, gs))}
    for name, (reason, f, args) in runs.items():
        if reason:
            out[name] = {"ms": None, "note": reason}
            continue
        try:
            ms = _time_ms(f, *args, iters=iters)
            out[name] = {"ms": ms, "rel_l2": _rel_l2(f(*args), ref)}
        except Exception as e:  # noqa: BLE001  (a variant that fails on this device is reported, not fatal)
            out[name] = {"ms": None, "note": f"failed: {type(e).__name__}: {str(e)[:120]}"}
        print(f"    {name}: {out[name]}", flush=True)
    return out


@jax.jit
def expert_by_expert(lhs, w, gs):
    """``jax.lax.ragged_dot(lhs, w, gs)`` in fp32, one expert's dense product at a time (rows of other
    experts masked, rows past the sum zero). At M3's prefill widths XLA's GPU ragged_dot ran out of an
    H100's memory next to the benchmark's weights (benchmarks/RESULTS.md#gmm-rows256); this keeps one
    [M, N] product live."""
    row_expert = jnp.searchsorted(jnp.cumsum(gs), jnp.arange(lhs.shape[0]), side="right")

    def one(out, expert_w):
        e, we = expert_w
        prod = jnp.dot(lhs, we, preferred_element_type=jnp.float32)
        return jnp.where((row_expert == e)[:, None], prod, out), None

    out = jnp.zeros((lhs.shape[0], w.shape[2]), jnp.float32)
    return jax.lax.scan(one, out, (jnp.arange(w.shape[0]), w))[0]


def bench_prefill(shape, variants, iters: int, bandwidth: float) -> list[dict]:
    gs = router_group_sizes(shape["tokens"], shape["topk"], shape["experts"])
    m, g = shape["tokens"] * shape["topk"], shape["experts"]
    rows = []
    for case, k, n in shape["cases"]:
        values, scales = random_mxfp8(g, k, n)
        w = jax.jit(lambda v, s: dequantize_mxfp8(v, s, jnp.bfloat16))(values, scales)
        lhs = jax.random.normal(jax.random.key(2), (m, k), jnp.float32).astype(jnp.bfloat16)
        dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        dense_ms = _time_ms(dense, lhs, w[0], iters=iters)
        ref = expert_by_expert(lhs, w, gs)
        # every expert's weights read once (each has rows at these sizes)
        floor = {"bf16": 1e3 * g * k * n * 2 / bandwidth, "mxfp8": 1e3 * g * k * n * (1 + 1 / 32) / bandwidth}
        layer = {"bf16": layer_config(m, k, n, g), "mxfp8": layer_config(m, k, n, g, scales.shape[1])}
        print(f"prefill {case}: M={m} K={k} N={n} G={g}, dense {dense_ms:.3f} ms, weights floor bf16 "
              f"{floor['bf16']:.3f} / mxfp8 {floor['mxfp8']:.3f} ms", flush=True)
        case_rows = []
        for name, cfg in variants.items():
            print(f"  {name}", flush=True)
            case_rows.append({"case": case, "m": m, "k": k, "n": n, "g": g, "variant": name, "floor_ms": floor,
                              "layer": [kind for kind, c in layer.items() if c == cfg], "flops": 2 * m * k * n,
                              **_variant(lhs, values, scales, w, gs, cfg, iters, ref)})
        # the dense GEMM again after the kernels (clocks ramped up by then): the faster of the two
        dense_ms = min(dense_ms, _time_ms(dense, lhs, w[0], iters=iters))
        print(f"  dense again: {dense_ms:.3f} ms (the faster of the two runs)", flush=True)
        rows += [dict(r, dense_ms=dense_ms) for r in case_rows]
        del values, scales, w, lhs, ref
    return rows


def bench_decode(shape, variants, iters: int, bandwidth: float) -> list[dict]:
    g = shape["experts"]
    rows = []
    for case, k, n in shape["cases"]:
        values, scales = random_mxfp8(g, k, n)
        w = jax.jit(lambda v, s: dequantize_mxfp8(v, s, jnp.bfloat16))(values, scales)
        for tokens in shape["decode"]:
            gs = router_group_sizes(tokens, shape["topk"], g, seed=tokens)
            m = tokens * shape["topk"]
            touched = int(np.count_nonzero(np.asarray(gs)))
            floor = {"bf16": 1e3 * touched * k * n * 2 / bandwidth,
                     "mxfp8": 1e3 * touched * k * n * (1 + 1 / 32) / bandwidth}
            lhs = jax.random.normal(jax.random.key(3), (m, k), jnp.float32).astype(jnp.bfloat16)
            ref = jax.lax.ragged_dot(lhs, w, gs, preferred_element_type=jnp.float32)
            print(f"decode {case}: {tokens} token(s), {touched} experts, floor bf16 {floor['bf16']:.4f} ms "
                  f"mxfp8 {floor['mxfp8']:.4f} ms", flush=True)
            for name, cfg in variants.items():
                print(f"  {name}", flush=True)
                rows.append({"case": case, "tokens": tokens, "m": m, "k": k, "n": n, "experts": touched,
                             "variant": name, "floor_ms": floor,
                             **_variant(lhs, values, scales, w, gs, cfg, iters, ref)})
        del values, scales, w
    return rows


def _f(x, fmt=".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ratio(a, b) -> float | None:
    return None if a is None or b is None else a / b


def summary(prefill: list[dict], decode: list[dict]) -> dict:
    """The numbers that decide the defaults and the targets, per case (best variant of each kind)."""
    out = {}
    for case in sorted({r["case"] for r in prefill}):
        rs = [r for r in prefill if r["case"] == case]

        def best(kind, schedule, rs=rs):
            c = [(r[kind]["ms"], r["variant"]) for r in rs if r[kind]["ms"] is not None
                 and r["variant"].startswith(schedule)]
            return min(c) if c else (None, None)

        b_old, b_new, m_old, m_new = best("bf16", "pipeline"), best("bf16", "ws"), best("mxfp8", "pipeline"), best(
            "mxfp8", "ws")
        best_bf16 = min(x for x in (b_old[0], b_new[0]) if x is not None)
        dense = rs[0]["dense_ms"]
        rows256 = next((r for r in rs if r["variant"] == "ws-rows bm256 bn128"), None)
        base = next((r for r in rs if r["variant"] == BASE), None)
        ms = lambda r, kind: None if r is None else r[kind]["ms"]  # noqa: E731
        out[f"prefill {case}"] = {
            "bf16 vs dense: pipeline / ws (target >= 0.8)": [_ratio(dense, b_old[0]), _ratio(dense, b_new[0])],
            "bf16 best variants": [b_old[1], b_new[1]],
            "mxfp8 / best bf16: pipeline / ws (target <= 1.1)": [_ratio(m_old[0], best_bf16), _ratio(m_new[0], best_bf16)],
            "mxfp8 best variants": [m_old[1], m_new[1]],
            "vs dense, bf16 / mxfp8: 256-row tiles": [_ratio(dense, ms(rows256, "bf16")),
                                                      _ratio(dense, ms(rows256, "mxfp8"))],
            f"vs dense, bf16 / mxfp8: {BASE}": [_ratio(dense, ms(base, "bf16")), _ratio(dense, ms(base, "mxfp8"))],
            f"256-row tiles / {BASE}, bf16 / mxfp8": [_ratio(ms(rows256, "bf16"), ms(base, "bf16")),
                                                      _ratio(ms(rows256, "mxfp8"), ms(base, "mxfp8"))],
            "dense / weights floor, bf16 / mxfp8 (the most vs dense a bytes-bound kernel reaches)": [
                _ratio(dense, rs[0]["floor_ms"]["bf16"]), _ratio(dense, rs[0]["floor_ms"]["mxfp8"])],
        }
    for key in sorted({(r["case"], r["tokens"]) for r in decode}):
        rs = [r for r in decode if (r["case"], r["tokens"]) == key]
        default_bf16 = rs[0]["bf16"]["ms"]
        c = [(r["mxfp8"]["ms"], r["variant"]) for r in rs if r["mxfp8"]["ms"] is not None]
        b = [(r["bf16"]["ms"], r["variant"]) for r in rs if r["bf16"]["ms"] is not None]
        out[f"decode {key[0]} {key[1]} token(s)"] = {
            "best mxfp8": min(c) if c else None, "best bf16": min(b) if b else None,
            "best mxfp8 / default bf16 (target <= 0.6)": _ratio(min(c)[0], default_bf16) if c else None,
            "best mxfp8 / mxfp8 floor": _ratio(min(c)[0], rs[0]["floor_ms"]["mxfp8"]) if c else None,
        }
    return out


def markdown(res: dict) -> str:
    lines = [f"# MoE grouped GEMM, {res['mode']}: {res['device']}, jax {res['jax']}, {res['date']}", "",
             (f"Command: `{res['command']}`. Copy bandwidth (read + write): {res['bandwidth'] / 1e9:,.0f} GB/s. "
             "bf16 = the MXFP8 weights dequantised (equal weights); ms = device time (CUPTI) on the GPU."), "",
             "## Prefill", "",
             ("vs dense = dense ms / variant ms (>= 0.8 is issue #43's target); vs base = variant ms / the same "
              f"weights' `{BASE}` ms; floor = every expert's weights read once at the copy bandwidth; (layer) = "
              "`layer_config`'s pick for the shape and weights."), "",
             ("| case | variant | bf16 ms | bf16 TFLOP/s | bf16 vs dense | bf16 vs base | mxfp8 ms | mxfp8 vs dense | "
              "mxfp8 vs base | mxfp8 / bf16 | rel L2 bf16 / mxfp8 | notes |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["case"], r["m"]): r for r in res["prefill"] if r["variant"] == BASE}
    for r in res["prefill"]:
        b, x, d = r["bf16"], r["mxfp8"], r["dense_ms"]
        b0 = base.get((r["case"], r["m"]))
        bb, bx = (None if b0 is None else b0[kind]["ms"] for kind in ("bf16", "mxfp8"))
        tf = None if b["ms"] is None else r["flops"] / b["ms"] / 1e9
        fl = r["floor_ms"]
        name = r["variant"] + "".join(f" (layer, {kind})" for kind in r["layer"])
        lines.append(
            f"| {r['case']} M={r['m']} K={r['k']} N={r['n']} G={r['g']} (dense {d:.3f} ms; floor bf16 "
            f"{fl['bf16']:.3f} / mxfp8 {fl['mxfp8']:.3f} ms) | {name} | {_f(b['ms'])} | {_f(tf, '.0f')} | "
            f"{_f(_ratio(d, b['ms']), '.2f')} | "
            f"{_f(_ratio(b['ms'], bb), '.2f')} | {_f(x['ms'])} | {_f(_ratio(d, x['ms']), '.2f')} | "
            f"{_f(_ratio(x['ms'], bx), '.2f')} | {_f(_ratio(x['ms'], b['ms']), '.2f')} | "
            f"{_f(b.get('rel_l2'), '.1e')} / {_f(x.get('rel_l2'), '.1e')} | {b.get('note', '')} {x.get('note', '')} |")
    lines += ["", "## Decode", "",
              ("| case | variant | bf16 ms | bf16 / floor | mxfp8 ms | mxfp8 / floor | mxfp8 / bf16 | mxfp8 / default bf16 | "
              "rel L2 bf16 / mxfp8 | notes |"), "|---|---|---|---|---|---|---|---|---|---|"]
    default = {}
    for r in res["decode"]:
        default.setdefault((r["case"], r["tokens"]), r["bf16"]["ms"])
        b, x, fl = r["bf16"], r["mxfp8"], r["floor_ms"]
        lines.append(
            f"| {r['case']} {r['tokens']} token(s), {r['experts']} experts (floor bf16 {fl['bf16']:.4f} / mxfp8 "
            f"{fl['mxfp8']:.4f} ms) | {r['variant']} | {_f(b['ms'], '.4f')} | {_f(_ratio(b['ms'], fl['bf16']), '.2f')} | "
            f"{_f(x['ms'], '.4f')} | {_f(_ratio(x['ms'], fl['mxfp8']), '.2f')} | {_f(_ratio(x['ms'], b['ms']), '.2f')} | "
            f"{_f(_ratio(x['ms'], default[(r['case'], r['tokens'])]), '.2f')} | "
            f"{_f(b.get('rel_l2'), '.1e')} / {_f(x.get('rel_l2'), '.1e')} | {b.get('note', '')} {x.get('note', '')} |")
    lines += ["", "## Summary", "", "```", json.dumps(res["summary"], indent=1, default=str), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="every variant at small shapes (GPU correctness check)")
    mode.add_argument("--dry", action="store_true", help="CPU smoke run: interpret mode, tiny shapes")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"prefill tokens (x top-4 rows; default {M3['tokens']} at M3 shapes; 4096: the model's "
                         "prefill chunk)")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--cluster", action="store_true",
                    help="also the 256-row tiles on two-CTA clusters (lhs tile by TMA multicast), last")
    ap.add_argument("--variants", default=None,
                    help="comma-separated prefill variant names to run (default: all); e.g. "
                         f"'ws-rows bm256 bn128,{BASE}'")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args(argv)
    if args.dry:
        shape, pre, dec, iters, name, gib = DRY, DRY_PREFILL, DRY_DECODE, 1, "dry", 1 / 64
    elif args.quick:
        shape, pre, dec, iters, name, gib = QUICK, PREFILL, QUICK_DECODE, 3, "quick", 1.0
    else:
        shape, pre, dec, iters, name, gib = M3, PREFILL, DECODE, args.iters, "M3 shapes", 4.0
    if args.tokens:
        shape = dict(shape, tokens=args.tokens)
    if args.cluster:
        pre = {**pre, **CLUSTER}
    if args.variants:
        names = [v.strip() for v in args.variants.split(",")]
        unknown = [v for v in names if v not in pre]
        if unknown:
            raise SystemExit(f"unknown prefill variants {unknown}; known: {list(pre)}")
        pre = {v: pre[v] for v in names}
    bandwidth = copy_bandwidth(gib, iters=max(iters, 3))
    print(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s", flush=True)
    prefill = [] if args.skip_prefill else bench_prefill(shape, pre, iters, bandwidth)
    decode = [] if args.skip_decode else bench_decode(shape, dec, iters, bandwidth)
    res = {"mode": name, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "command": "python benchmarks/moe_grouped_matmul.py" + "".join(" " + a for a in sys.argv[1:]),
           "bandwidth": bandwidth, "prefill": prefill, "decode": decode}
    res["summary"] = summary(prefill, decode)
    md = markdown(res)
    print(md)
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    stem = {"dry": "moe_grouped_matmul_dry", "quick": "moe_grouped_matmul_quick"}.get(name, "moe_grouped_matmul")
    stem += "_decode" if args.skip_prefill else "_prefill" if args.skip_decode else ""
    stem += f"_{args.tokens}" if args.tokens else ""
    (out / f"{stem}.md").write_text(md)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    return res


if __name__ == "__main__":
    main()
