"""Generation at MiniMax-M3's real widths on one GPU: the ``python -m m3jax.generate`` run, per-layer
device times next to their floors, decode wall time against device time, and the 60-layer extrapolation.

``m3jax/configs/m3_width.json`` is M3 with 3 of its 60 decoder layers (layer 0 full attention + dense MLP,
layers 1-2 MSA + MoE, no vision tower), random bf16 weights. One command:

1. the generate CLI (``python -m m3jax.generate`` in a process of its own, before this one touches
   the GPU; kernels attention path: Mosaic GPU MSA kernels, cuDNN for the full-attention layer,
   grouped-GEMM MoE) at ``--ctx``, on a compile cache of its own (empty at first): compile, TTFT,
   prefill tok/s, decode ms/token, peak memory, compile-cache hits and exported programs read /
   written, and the process's wall time to its report (``--repeat-generate`` runs the same command
   a second time, in a new process on the same cache: what a second run pays before its first
   token);
2. the device's copy bandwidth (a 4 GiB copy; read + write bytes / time);
3. per layer (one of each kind: layer 2 is layer 1's kind), on a cache of ``--ctx`` random tokens:
   device time (CUPTI kernel time, as ``jax.experimental.mosaic.gpu.profiler.measure`` counts it)
   and wall time of a prefill chunk at the first, middle and last chunk (key window bucketed as
   the engine does) and of a decode step at the last position (with its kernels by device time: where
   the time above the floor goes), and the decode step's bytes floor:
   weights it touches (MoE: the experts a batch of one routes to) + cache it reads, at the copy
   bandwidth;
4. the full-attention prefill chunk at the end of the context against cuDNN's own rate: the chunk
   attention (:func:`m3jax.model.cudnn_causal_attention`) and cuDNN without a mask on the same q, k,
   v (the rate it reaches on this shape), floor = causal FLOPs / that rate;
5. the engine's decode loop (``Engine._decode``, what ``generate`` runs) at B=1 and B=8 and at 1 and
   the default decode steps per call, from position ``ctx - decode_tokens - 1`` of a zero cache:
   wall ms per step against the device time per step (CUPTI over the same loop);
6. the extrapolation to 60 layers (3 full attention + 57 MSA/MoE) from the device times, one GPU and 8
   GPUs pipeline-parallel.

It prints the tables and writes ``$OUT/generate_m3_width_<ctx>[_<field>-<value>].md`` and ``.json`` (``$OUT`` default
benchmarks/out). On one H200 each of these takes under 6 minutes (the 1M one without the CLI part,
which alone takes a few minutes there):

    PYTHONPATH=. python benchmarks/generate_m3_width.py --ctx 131072 --only-generate --repeat-generate
    PYTHONPATH=. python benchmarks/generate_m3_width.py --ctx 131072 --only-decode
    PYTHONPATH=. python benchmarks/generate_m3_width.py --ctx 131072 --skip-generate
    PYTHONPATH=. python benchmarks/generate_m3_width.py --ctx 1000000 --skip-generate
    PYTHONPATH=. python benchmarks/generate_m3_width.py --ctx 1000000 --only-generate
    PYTHONPATH=. python benchmarks/generate_m3_width.py --ctx 1000000 --only-layers --layers 1 \
        [--config-override index_score_dtype=float8_e4m3fn]   # one MSA + MoE layer (the fp8 indexer)
    PYTHONPATH=. python benchmarks/generate_m3_width.py --dry      # CPU: tiny widths end to end (no CUPTI:
                                                                  # device times n/a) + CUDA lowering at M3 shapes

MoE goes through ``M3Config.moe_impl`` ("auto": the Mosaic grouped-GEMM kernel on the GPU where it takes
the shapes); ``jax.lax.ragged_dot`` is dense-emulated on the GPU image (~6 TF/s at 128 experts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

import m3jax
from m3jax import cli
from m3jax.cache import LayerCache, cache_bytes, cached_index_keys, index_page_dtype
from m3jax.config import M3Config, preset
from m3jax.engine import DECODE_STEPS_PER_CALL, Engine, SamplingParams, key_window_pages
from m3jax.layers import rope_angles
from m3jax.memory import weight_bytes
from m3jax.model import causal_attention, cudnn_causal_attention, decoder_layer
from m3jax.msa import kernels as msa_kernels
from m3jax.msa import reference as msa_reference
from m3jax.params import init_random_on_device

FULL_LAYERS, MSA_LAYERS, GPUS = 3, 57, 8
HOP_MS = 0.03  # one [tokens, 6144] bf16 activation hop between pipeline stages over NVLink, decode
GREEDY = SamplingParams(temperature=0.0)


def tiny_config() -> M3Config:
    """m3_width's layer layout at widths the kernels accept (G = 8 query heads per KV head, head and
    index dims 64, block 64) and that run in seconds on a CPU."""
    return preset("m3_width").replace_text(
        vocab_size=512, hidden_size=128, num_attention_heads=16, num_key_value_heads=2, head_dim=64, rotary_dim=32,
        intermediate_size=64, dense_intermediate_size=256, shared_intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=64, index_block_size=64, index_topk_blocks=2,
    )


def generate_argv(model_args: list[str], ctx: int, chunk: int, new_tokens: int, impl: str,
                  overrides: dict | None = None) -> list[str]:
    override = ",".join(f"{k}={v}" for k, v in (overrides or {}).items())
    return [*model_args, "--ctx", str(ctx), "--fill", "--max-new-tokens", str(new_tokens), "--temperature", "0",
            "--dtype", "bfloat16", "--attention-impl", impl, "--prefill-chunk", str(chunk),
            *(["--config-override", override] if override else [])]


def _random_layer_cache(cfg: M3Config, layer: int, ctx: int, dtype) -> tuple[LayerCache, jax.Array]:
    """One layer's cache pages for ``ctx`` tokens with random keys (so MSA selections are not degenerate)."""
    t = cfg.text
    pages = -(-ctx // t.index_block_size)
    ks = jax.random.split(jax.random.key(layer), 3)
    shape = (pages, t.index_block_size, t.num_key_value_heads, t.head_dim)
    draw = jax.jit(lambda key, shape: jax.random.normal(key, shape, dtype), static_argnums=1)
    ik = None
    if t.is_sparse_attention(layer):  # stored as the cache stores them (fp8 under index_cache_dtype)
        ik = cached_index_keys(draw(ks[2], shape[:2] + (t.index_head_dim,)), t, index_page_dtype(t, dtype))
    return LayerCache(draw(ks[0], shape), draw(ks[1], shape), ik), jnp.arange(pages, dtype=jnp.int32)[None]


def _layer_step(cfg: M3Config, layer: int):
    """jitted (layer params, hidden [1, T, D], cache, page table, start) -> (hidden, cache) of one layer."""
    t = cfg.text

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(lp, h, kv, page_table, start):
        positions = start + jnp.arange(h.shape[1], dtype=jnp.int32)[None]
        angles = rope_angles(positions, t.rotary_dim, t.rope_theta)
        h, _, kv = decoder_layer(h, lp, angles, positions, cfg, layer, kv, page_table)
        return h, kv

    return step


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def cupti_kernels(run) -> list[tuple[str, float]]:
    """(kernel name, ms) of every kernel the GPU ran during ``run()`` (waited for), through the CUPTI
    hooks behind ``jax.experimental.mosaic.gpu.profiler.measure``: ``measure`` calls its function twice
    on the same arguments, which a donated KV cache does not allow, so the calls here thread their own
    state. Kernel time only: copies, gaps and launch overhead are what wall time adds."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib

    ext = mosaic_gpu_lib._mosaic_gpu_ext
    ext._cupti_init()
    try:
        jax.block_until_ready(run())
    finally:
        timings = ext._cupti_get_timings(True)
    return list(timings or [])


def timed(call, iters: int, kernels: bool = False) -> dict:
    """``call()`` after one untimed call (compile): wall ms (median of ``iters`` calls, each waited for)
    and device ms per call (CUPTI kernel time over ``iters`` more calls; None off the GPU). ``kernels``:
    also the per-call kernel breakdown, ``[[name, launches, ms], ...]`` by device time (GPU only)."""
    jax.block_until_ready(call())
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        walls.append(time.perf_counter() - t0)
    out = {"wall_ms": 1e3 * sorted(walls)[len(walls) // 2], "device_ms": None}
    if on_gpu():
        launches = cupti_kernels(lambda: [call() for _ in range(iters)])
        out["device_ms"] = sum(ms for _, ms in launches) / iters
        if kernels:
            by_name: dict[str, list] = {}
            for name, ms in launches:
                entry = by_name.setdefault(name, [name, 0, 0.0])
                entry[1] += 1 / iters
                entry[2] += ms / iters
            out["kernels"] = sorted(by_name.values(), key=lambda e: -e[2])
    return out


def best(t: dict) -> float:
    """Device time where there is one (GPU), else wall time."""
    return t["device_ms"] if t["device_ms"] is not None else t["wall_ms"]


def copy_bandwidth(gib: float) -> float:
    """Bytes per second (read + write) of an elementwise pass over ``gib`` GiB of bf16."""
    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    double = jax.jit(lambda x: x * 2)
    ms = best(timed(lambda: double(x), 5))
    return 2 * x.size * 2 / (ms / 1e3)


def decode_bytes(cfg: M3Config, lp: dict, layer: int, pos: int, batch: int = 1) -> dict:
    """Bytes one decode step of ``layer`` must read for ``batch`` tokens at position ~``pos``: its
    weights (routed experts: the expected number of distinct experts ``batch`` tokens pick, top-k each,
    uniform routing) and its cache (full attention: every K/V up to pos; MSA: the index keys up to pos
    and each KV head's selected blocks of K and V)."""
    t = cfg.text
    e = t.num_local_experts
    experts = e * (1 - (1 - t.num_experts_per_tok / e) ** batch)
    weights = 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(lp)[0]:
        routed = path[0].key == "moe" and x.ndim == 3 and x.shape[0] == e
        weights += x.size * x.dtype.itemsize * (experts / e if routed else 1)
    item = lp["attn"]["wk"].dtype.itemsize  # caches are kept in the weights' dtype
    kv_token = 2 * t.num_key_value_heads * t.head_dim * item
    if t.is_sparse_attention(layer):
        cache = pos * t.index_head_dim * item + t.index_topk_blocks * t.index_block_size * kv_token
    else:
        cache = pos * kv_token
    return {"weights": weights, "cache": batch * cache}


def layer_times(cfg: M3Config, params: dict, ctx: int, chunk: int, iters: int, layers: list[int],
                bandwidth: float) -> list[dict]:
    """Per layer: prefill chunk at the first / middle / last chunk, the whole prefill's seconds (trapezoid
    over the three: a chunk's cost is affine in its key window), the decode step at the last position
    and its bytes floor. Times are {"wall_ms", "device_ms"}."""
    t = cfg.text
    dtype = params["text"]["embed"].dtype
    max_pages = -(-ctx // t.index_block_size)
    starts = [0, (ctx // 2 // chunk) * chunk, ((ctx - 1) // chunk) * chunk]
    n_chunks = -(-ctx // chunk)
    rows = []
    for i in layers:
        lp = params["text"]["layers"][i]
        kv, table = _random_layer_cache(cfg, i, ctx, dtype)
        call = _threaded(_layer_step(cfg, i), lp, kv)
        del kv
        h = (0.5 * jax.random.normal(jax.random.key(100 + i), (1, chunk, t.hidden_size))).astype(dtype)
        chunks = []
        for s in starts:
            w = key_window_pages(s + chunk, t.index_block_size, max_pages)
            chunks.append(timed(functools.partial(call, h, table[:, :w], jnp.int32(s)), iters))
        decode = timed(functools.partial(call, h[:, :1], table, jnp.int32(ctx - 1)), iters, kernels=True)
        nbytes = decode_bytes(cfg, lp, i, ctx)
        first, mid, last = (best(c) for c in chunks)
        rows.append({
            "layer": i,
            "kind": ("MSA" if t.is_sparse_attention(i) else "full attention")
            + (" + MoE" if t.is_moe(i) else " + dense MLP"),
            "prefill_chunk": chunks,
            "prefill_s": n_chunks * (first + 2 * mid + last) / 4 / 1e3,
            "decode": decode,
            "decode_bytes": nbytes,
            "decode_floor_ms": 1e3 * (nbytes["weights"] + nbytes["cache"]) / bandwidth,
        })
        print(json.dumps(rows[-1]), flush=True)
        del call
        gc.collect()
    return rows


def _kernel_lines(layers: list[dict], top: int = 12) -> list[str]:
    """Per layer, the kernels of one decode step by device time (the ``top`` largest, then the rest in one
    sum): where a layer's decode time above its bytes floor goes."""
    lines = []
    for r in layers:
        ks = r["decode"].get("kernels")
        if not ks:
            continue
        rest = ks[top:]
        parts = [f"{name[:48]} {ms:.3f} ms" + (f" (x{n:.0f})" if round(n) != 1 else "") for name, n, ms in ks[:top]]
        if rest:
            parts.append(f"{len(rest)} other kernels {sum(e[2] for e in rest):.3f} ms")
        lines += ["", (f"Kernels of one decode step of layer {r['layer']} ({r['kind']}; "
                       f"{sum(e[1] for e in ks):.0f} launches, {r['decode']['device_ms']:.3f} ms): " + "; ".join(parts) + ".")]
    return lines


def generate_run(argv: list[str], env: dict, report: Path) -> dict:
    """One ``python -m m3jax.generate`` process: its report's timings and cache counts, the process's
    wall time, and its time to the first token (that wall time less the decode loop's)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "m3jax.generate", *argv, "--quiet", "--output-json", str(report)],
                   env=env, check=True)
    wall = time.perf_counter() - t0
    r = json.loads(report.read_text())
    tm, cc = r["timings"], r["compile_cache"]
    return {**tm, "cache_hits": cc["hits"], "cache_misses": cc["misses"], "programs_read": cc["aot"]["hits"],
            "programs_written": cc["aot"]["misses"], "process_s": wall,
            "to_first_token_s": wall - tm["decode_ms_per_token"] * tm["decode_steps"] / 1e3,
            "peak_gib": r["peak_device_memory_bytes"] / 2**30, "generated_ids": r["generated_ids"]}


def _threaded(step, lp: dict, kv: LayerCache):
    """call(h, page_table, start) -> hidden: ``step`` of one layer with its donated cache threaded
    through the calls."""
    state = [kv]

    def call(h, page_table, start):
        out, state[0] = step(lp, h, state[0], page_table, start)
        return out

    return call


def rel_err(got: jax.Array, want: jax.Array) -> float:
    """Relative L2 error, in fp32 on the device."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))


def dense_decode_vs_gather(cfg: M3Config, ctx: int, iters: int) -> dict:
    """The full-attention layers' decode attention at position ctx - 1 of one sequence: in place (the
    paged decode attention kernel over every block, what the layer runs) against what it ran before,
    gathering the pages into a contiguous copy and the fp32 dense-mask pass; both timed, and the
    in-place output's error against the fp32 reference on the gathered pages."""
    t = cfg.text
    kv, table = _random_layer_cache(cfg, 0, ctx, jnp.bfloat16)
    q = jax.random.normal(jax.random.key(8), (1, 1, t.num_attention_heads, t.head_dim), jnp.bfloat16)
    pos = jnp.full((1, 1), ctx - 1, jnp.int32)
    in_place = jax.jit(lambda q, kv: msa_kernels.dense_decode(q, kv, table, pos, t))

    @jax.jit
    def gathered(q, kv):
        k, v, _ = kv.gather(table)
        return msa_reference.dense_mask_attention(q, k, v, None, pos, t.index_block_size)

    out = in_place(q, kv)
    k, v, _ = kv.gather(table)
    err = rel_err(out, causal_attention(q, k, v, pos))
    del k, v
    return {"in_place": timed(lambda: in_place(q, kv), iters), "gathered": timed(lambda: gathered(q, kv), iters),
            "rel_err": err}


def full_attention_vs_cudnn(cfg: M3Config, ctx: int, chunk: int, iters: int) -> dict:
    """The full-attention layers' chunk attention for the last whole chunk of the context (queries
    start..start+C-1 over the engine's key window) against cuDNN without a mask on the same q, k, v:
    the rate cuDNN reaches on this shape (its FLOPs / its time) turns the chunk's causal FLOPs into a
    floor. Off the GPU both run through XLA."""
    t = cfg.text
    bs, n, kh, h = t.index_block_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    start = (ctx - chunk) // chunk * chunk
    window = key_window_pages(start + chunk, bs, -(-ctx // bs)) * bs
    ks = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(ks[0], (1, chunk, n, h), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, window, kh, h), jnp.bfloat16) for key in ks[1:])
    pos = (start + jnp.arange(chunk, dtype=jnp.int32))[None]
    impl = "cudnn" if on_gpu() else "xla"
    ours = jax.jit(functools.partial(cudnn_causal_attention, implementation=impl))
    unmasked = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation=impl))
    t_ours = timed(lambda: ours(q, k, v, pos), iters, kernels=True)
    t_unmasked = timed(lambda: unmasked(q, k, v), iters, kernels=True)
    err = rel_err(ours(q, k, v, pos), jax.jit(causal_attention)(q, k, v, pos))
    causal_flops = 4 * n * h * (chunk * start + chunk * (chunk + 1) / 2)
    rate = 4 * n * h * chunk * window / (best(t_unmasked) / 1e3)
    floor_ms = 1e3 * causal_flops / rate
    return {"start": start, "window": window, "ours": t_ours, "cudnn_unmasked": t_unmasked,
            "causal_tflop": causal_flops / 1e12, "cudnn_tflops": rate / 1e12, "floor_ms": floor_ms,
            "ratio": best(t_ours) / floor_ms, "rel_err_vs_fp32_reference": err}


def engine_decode(cfg: M3Config, params: dict, ctx: int, chunk: int, batch: int, tokens: int,
                  steps_per_call: int) -> dict:
    """The engine's decode loop (``Engine._decode``: calls of ``steps_per_call`` steps, tokens read a
    call behind) for ``batch`` rows from position ``ctx - tokens - 1`` of a zero cache (attention time
    does not depend on the values; MSA selections tie, which costs the kernels the same): wall ms per
    step against the device time per step (CUPTI over the same loop) and kernels per step."""
    e = Engine(params, cfg, batch=batch, capacity=ctx, prefill_chunk=chunk, decode_steps_per_call=steps_per_call)
    decode = e._decode_program(GREEDY, False)
    small = e._small_sharding
    pos = jax.device_put(jnp.full((batch,), ctx - tokens - 1, jnp.int32), small)
    zeros = jax.device_put(jnp.zeros((batch,), jnp.int32), small)
    key = jax.device_put(jax.random.key_data(jax.random.key(0)), small)

    def run(n):
        return e._decode(decode, zeros, pos, key, None, batch, n, (), False, None)

    run(steps_per_call + 1)  # one call, warm
    t0 = time.perf_counter()
    _, _, steps = run(tokens)
    wall = 1e3 * (time.perf_counter() - t0) / steps
    row = {"batch": batch, "steps_per_call": steps_per_call, "steps": steps, "wall_ms_per_token": wall,
           "device_ms_per_step": None, "kernels_per_step": None}
    if on_gpu():
        kernels = cupti_kernels(lambda: run(tokens)[0])
        row.update(device_ms_per_step=sum(ms for _, ms in kernels) / steps, kernels_per_step=len(kernels) / steps)
    row["wall_over_device"] = None if row["device_ms_per_step"] is None else wall / row["device_ms_per_step"]
    print(json.dumps(row), flush=True)
    return row


def extrapolate(runs: list[dict], rows: list[dict], decode_rows: list[dict], ctx: int, chunk: int) -> dict:
    """60 layers on 8 GPUs, pipeline-parallel, from the device times: whole layers per GPU, chunks of
    the one sequence flow through the stages. Assumptions (stated in the output): each layer runs as
    measured on one GPU (no tensor or expert split, so no scaling loss inside a layer); stages are
    balanced by prefill time; activation hops between stages are free in prefill (a [chunk, 6144]
    bf16 tile per chunk) and ``HOP_MS`` each in decode; embedding, lm_head and sampling ("other") as
    the B=1 engine step's device time minus its three layers (decode) and the CLI's TTFT minus the
    layers' prefill (prefill; 0 without a CLI run)."""
    full = next(r for r in rows if r["kind"].startswith("full"))
    msa = next(r for r in rows if r["kind"].startswith("MSA"))
    full_dec, msa_dec = best(full["decode"]), best(msa["decode"])
    slice_dec = full_dec + 2 * msa_dec  # m3_width: layer 0 full attention, layers 1-2 MSA
    b1 = next((d for d in decode_rows if d["batch"] == 1 and "error" not in d
               and d["steps_per_call"] == DECODE_STEPS_PER_CALL), None)
    step = None if b1 is None else (b1["device_ms_per_step"] or b1["wall_ms_per_token"])
    other_decode = 0.0 if step is None else max(step - slice_dec, 0.0)
    other_prefill = max(runs[0]["ttft_s"] - full["prefill_s"] - 2 * msa["prefill_s"], 0.0) if runs else 0.0
    layers_prefill = FULL_LAYERS * full["prefill_s"] + MSA_LAYERS * msa["prefill_s"]
    layers_decode = FULL_LAYERS * full_dec + MSA_LAYERS * msa_dec
    n_chunks = -(-ctx // chunk)
    stage_s = max(layers_prefill / GPUS, full["prefill_s"], msa["prefill_s"])  # whole layers: no stage below one
    m3 = dataclasses.replace(preset("minimax_m3"), vision=None)
    per_gpu_gib = (weight_bytes(m3, 2) + cache_bytes(m3, 1, ctx)) / GPUS / 2**30
    return {
        "one_gpu_ttft_s": layers_prefill + other_prefill,
        "one_gpu_decode_ms": layers_decode + other_decode,
        # pipeline fill: the last stage starts GPUS - 1 chunk-steps after the first
        "gpus_ttft_s": stage_s * (n_chunks + GPUS - 1) / n_chunks + other_prefill,
        # one sequence decodes through every stage in turn: no speed-up, plus the hops
        "gpus_decode_ms": layers_decode + other_decode + (GPUS - 1) * HOP_MS,
        "per_gpu_weights_cache_gib": per_gpu_gib,
        "other_prefill_s": other_prefill,
        "other_decode_ms": other_decode,
    }


def _ms(t: dict) -> str:
    dev = "n/a" if t["device_ms"] is None else f"{t['device_ms']:.3f}"
    return f"{dev} ({t['wall_ms']:.3f})"


def _decode_table(rows: list[dict]) -> list[str]:
    lines = ["| decode batch | steps per call | wall ms/step | device ms/step | wall / device | kernels/step |",
             "|---|---|---|---|---|---|"]
    for d in rows:
        if "error" in d:
            lines.append(f"| {d['batch']} | {d['steps_per_call']} | {d['error']} | | | |")
            continue
        dev = "n/a" if d["device_ms_per_step"] is None else f"{d['device_ms_per_step']:.3f}"
        ratio = "n/a" if d["wall_over_device"] is None else f"**{d['wall_over_device']:.2f}**"
        kern = "n/a" if d["kernels_per_step"] is None else f"{d['kernels_per_step']:.0f}"
        lines.append(f"| {d['batch']} | {d['steps_per_call']} | {d['wall_ms_per_token']:.3f} | {dev} | {ratio} | "
                     f"{kern} |")
    return lines


def markdown(res: dict) -> str:
    ctx, gb = res["ctx"], 1e9
    lines = [f"## Generation at {res['widths']}, {ctx:,} context — {res['date']}, {res['device']}, jax {res['jax']}", "",
             f"Command: `{res['command']}`", ""]
    if res.get("config_override"):
        lines += [f"Text-config overrides: `{res['config_override']}`.", ""]
    if res["generate"]:
        lines += [f"`python -m m3jax.generate {' '.join(res['generate_argv'])}`:", "",
                  ("| run (new process) | to first token s | compile s (programs + first decode call) | cache hits "
                   "/ compiled | programs read / exported | TTFT s | prefill tok/s | decode ms/step | peak GiB |"),
                  "|---|---|---|---|---|---|---|---|---|"]
        for n, r in enumerate(res["generate"], 1):
            lines.append(f"| {n} | {r['to_first_token_s']:.1f} | {r['compile_s']:.1f} ({r['programs_s']:.1f} + "
                         f"{r['first_decode_call_s']:.1f}) | {r['cache_hits']} / "
                         f"{r['cache_misses']} | {r['programs_read']} / {r['programs_written']} | {r['ttft_s']:.1f} | "
                         f"{r['prefill_tok_per_s']:,.0f} | {r['decode_ms_per_token']:.2f} | {r['peak_gib']:.1f} |")
        if len(res["generate"]) > 1:  # greedy: the programs read back must give the first run's tokens
            same = all(r["generated_ids"] == res["generate"][0]["generated_ids"] for r in res["generate"])
            lines += ["", f"Greedy tokens of every run equal the first run's: **{same}**."]
        lines.append("")
    if not res.get("layers"):
        return "\n".join(lines + (_decode_table(res["decode"]) + [""] if res.get("decode") else []))
    bw = res["copy_bandwidth"]
    lines += [(f"Copy bandwidth (read + write, same process): {bw / 1e9:,.0f} GB/s. Times: device ms from CUPTI "
               "(wall ms in brackets)."), "",
              ("| layer | kind | prefill chunk first / middle / last | prefill total s | decode | decode floor ms "
               "(weights + cache GB) | decode device / floor |"), "|---|---|---|---|---|---|---|"]
    for r in res["layers"]:
        nb = r["decode_bytes"]
        ratio = "n/a" if r["decode"]["device_ms"] is None else f"{r['decode']['device_ms'] / r['decode_floor_ms']:.2f}"
        lines.append(f"| {r['layer']} | {r['kind']} | {' / '.join(_ms(c) for c in r['prefill_chunk'])} | "
                     f"{r['prefill_s']:.1f} | {_ms(r['decode'])} | {r['decode_floor_ms']:.3f} "
                     f"({nb['weights'] / gb:.2f} + {nb['cache'] / gb:.2f}) | {ratio} |")
    lines += _kernel_lines(res["layers"])
    if "attention" not in res:  # --only-layers
        return "\n".join(lines + [""])
    a = res["attention"]
    lines += ["", (f"Full-attention chunk attention, queries {a['start']:,}..{a['start'] + res['prefill_chunk'] - 1:,} "
                   f"over {a['window']:,} keys: ours {_ms(a['ours'])} ms; cuDNN unmasked on the same q, k, v "
                   f"{_ms(a['cudnn_unmasked'])} ms = {a['cudnn_tflops']:.0f} TF/s; causal work "
                   f"{a['causal_tflop']:.2f} TFLOP -> floor {a['floor_ms']:.2f} ms; ours / floor = "
                   f"**{a['ratio']:.2f}**; ours vs the fp32 reference: relative L2 error "
                   f"{a['rel_err_vs_fp32_reference']:.1e}."), "",
              (f"Full-attention decode attention at position {ctx - 1:,}: pages read in place "
               f"{_ms(res['dense_decode']['in_place'])} ms, gathered + fp32 dense mask (before) "
               f"{_ms(res['dense_decode']['gathered'])} ms; in place vs the fp32 reference: relative L2 error "
               f"{res['dense_decode']['rel_err']:.1e}."), "", *_decode_table(res["decode"])]
    ex = res["extrapolation"]
    lines += ["", (f"Extrapolated from the device times to 60 layers ({FULL_LAYERS} full attention + {MSA_LAYERS} "
              f"MSA/MoE, each at its kind's time; embedding, lm_head and sampling {ex['other_decode_ms']:.2f} ms/token "
              f"and {ex['other_prefill_s']:.1f} s of prefill): one GPU (if it held the model) TTFT "
              f"{ex['one_gpu_ttft_s']:.0f} s, decode {ex['one_gpu_decode_ms']:.1f} ms/token. On {GPUS} GPUs, "
              f"pipeline-parallel (whole layers per GPU, stages balanced by prefill time, chunks streamed through "
              f"the stages, no tensor/expert split, hops free in prefill and {HOP_MS} ms each in decode): TTFT "
              f"{ex['gpus_ttft_s']:.0f} s, decode {ex['gpus_decode_ms']:.1f} ms/token. Per GPU: "
              f"{ex['per_gpu_weights_cache_gib']:.0f} GiB of bf16 weights + KV/index cache before activations."), ""]
    return "\n".join(lines)


def check_cuda_lowering(ctx: int, chunk: int, overrides: dict | None = None) -> dict[str, int]:
    """Lower every layer's prefill chunk (last chunk, full key window) and decode step at M3 widths for
    CUDA on this machine; returns the Mosaic GPU custom calls per function. Nothing is allocated.
    The kernels' launcher is told it is on a GPU (off-GPU it would lower GPU interpret mode instead).
    The full-attention layer's decode reads its pages in place through the decode attention kernel;
    its prefill dispatch sees the CPU backend and lowers the reference path, so its chunk attention
    is lowered on its own with cuDNN (version probe stubbed: no cuDNN here), and counted as cuDNN
    flash-attention calls (3: the diagonal, the prefix's head and its pieces)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from m3jax.pallas import _backend
    from m3jax.params import param_specs

    cfg = cli.apply_overrides(preset("m3_width"), overrides or {}).replace(attention_impl="pallas")
    t = cfg.text
    specs = param_specs(cfg)["text"]["layers"]
    bf16 = jnp.bfloat16
    abstract = lambda s: jax.ShapeDtypeStruct(s.shape, s.resolve_dtype(bf16))
    pages = -(-ctx // t.index_block_size)
    counts = {}
    with mock.patch.object(_backend, "on_gpu", lambda: True):  # the kernels ask through the module
        for i in range(t.num_hidden_layers):
            lp = jax.tree.map(abstract, specs[i], is_leaf=lambda x: hasattr(x, "resolve_dtype"))
            kv_shape = (pages, t.index_block_size, t.num_key_value_heads, t.head_dim)
            ik_shape = (pages, t.index_block_size, t.index_head_dim)
            ik = jax.ShapeDtypeStruct(ik_shape, bf16) if t.is_sparse_attention(i) else None
            kv = LayerCache(jax.ShapeDtypeStruct(kv_shape, bf16), jax.ShapeDtypeStruct(kv_shape, bf16), ik)
            table = jax.ShapeDtypeStruct((1, pages), jnp.int32)
            start = jax.ShapeDtypeStruct((), jnp.int32)
            for name, tokens in (("prefill", chunk), ("decode", 1)):
                h = jax.ShapeDtypeStruct((1, tokens, t.hidden_size), bf16)
                text = _layer_step(cfg, i).trace(lp, h, kv, table, start).lower(lowering_platforms=("cuda",)).as_text()
                counts[f"layer {i} {name}"] = text.count("custom_call @mosaic_gpu")
    window = key_window_pages(((ctx - 1) // chunk + 1) * chunk, t.index_block_size, pages) * t.index_block_size
    q = jax.ShapeDtypeStruct((1, chunk, t.num_attention_heads, t.head_dim), bf16)
    k = jax.ShapeDtypeStruct((1, window, t.num_key_value_heads, t.head_dim), bf16)
    pos = jax.ShapeDtypeStruct((1, chunk), jnp.int32)
    with mock.patch.object(fa, "check_cudnn_version", lambda: 91000):
        text = jax.jit(cudnn_causal_attention).trace(q, k, k, pos).lower(lowering_platforms=("cuda",)).as_text()
    counts["layer 0 prefill attention (cuDNN)"] = text.count("custom_call @__cudnn$fmha")
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="CPU, tiny widths, and the CUDA lowering check")
    ap.add_argument("--ctx", type=int, default=None, help="context (default 131072; --dry: 1024)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 4096 (--dry: 256)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="generate CLI run")
    ap.add_argument("--iters", type=int, default=3, help="timed calls per layer measurement")
    ap.add_argument("--copy-gib", type=float, default=4.0,
                    help="GiB copied to measure the bandwidth (beside the weights: 1 fits an 80 GB card at 1M)")
    ap.add_argument("--layers", default="0,1", help="layers timed one by one (m3_width: 0 full attention, 1-2 MSA)")
    ap.add_argument("--decode-batches", default="1,8", help="batches of the engine decode-loop measurement")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens per engine decode-loop measurement")
    ap.add_argument("--decode-steps-per-call", default=f"1,{DECODE_STEPS_PER_CALL}",
                    help="decode steps per compiled call measured in the engine decode loop (default: 1 and the "
                         "engine's default)")
    ap.add_argument("--attention-impl", default=None,
                    help="default pallas; --dry: reference (the whole model with the kernels in GPU interpret "
                         "mode takes many minutes to compile on a CPU; --dry checks their CUDA lowering instead)")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--skip-generate", action="store_true", help="no generate CLI run")
    part.add_argument("--only-generate", action="store_true", help="the generate CLI run only")
    part.add_argument("--only-decode", action="store_true",
                      help="the engine decode-loop table only (wall / device per batch and steps per call)")
    part.add_argument("--only-layers", action="store_true",
                      help="the per-layer table only (prefill chunks and the decode step of --layers)")
    ap.add_argument("--config-override", type=cli.parse_overrides, default={}, metavar="K=V,...",
                    help=cli.CONFIG_OVERRIDE_HELP + "; applied to every part, and named in the output files")
    ap.add_argument("--repeat-generate", action="store_true",
                    help="run the CLI twice, each in a new process, on one compile cache (empty for the first)")
    args = ap.parse_args(argv)
    ctx = args.ctx or (1024 if args.dry else 131072)
    chunk = args.prefill_chunk or (256 if args.dry else 4096)
    impl = args.attention_impl or ("reference" if args.dry else "pallas")
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    res = {"ctx": ctx, "prefill_chunk": chunk, "attention_impl": impl, "config_override": args.config_override,
           "widths": "tiny widths (--dry)" if args.dry else "M3 widths, 3 layers", "date": str(datetime.date.today()),
           "jax": jax.__version__, "generate": [],
           "command": " ".join(["python benchmarks/generate_m3_width.py", *(sys.argv[1:] if argv is None else argv)])}

    with tempfile.TemporaryDirectory() as tmp:
        if args.dry:
            cfg = cli.apply_overrides(tiny_config(), args.config_override)
            m3jax.save_pretrained(m3jax.init_random(cfg, seed=0, dtype="bfloat16"), Path(tmp) / "ckpt")
            model_args = ["--checkpoint", str(Path(tmp) / "ckpt")]
        else:
            cfg = cli.apply_overrides(preset("m3_width"), args.config_override)
            model_args = ["--config", "m3_width"]
        res["generate_argv"] = generate_argv(model_args, ctx, chunk, args.max_new_tokens, impl, args.config_override)
        env = dict(os.environ, M3JAX_CACHE_DIR=str(Path(tmp) / "cache"))  # empty for the first run
        skip = args.skip_generate or args.only_decode or args.only_layers
        for n in range(0 if skip else 2 if args.repeat_generate else 1):
            res["generate"].append(generate_run(res["generate_argv"], env, Path(tmp) / f"run{n}.json"))
            print(f"generate run {n + 1}: " + json.dumps(res["generate"][-1]), flush=True)
    # Only now does this process take the GPU (JAX preallocates most of its memory): the CLI runs had it.
    dev = jax.devices()[0]
    res["device"] = f"{dev.device_kind} ({dev.platform})"

    if not args.only_generate:
        cfg = cfg.replace(attention_impl=impl)
        params = init_random_on_device(cfg, seed=0, dtype=jnp.bfloat16)
        if not args.only_decode:
            res["copy_bandwidth"] = copy_bandwidth(0.25 if args.dry else args.copy_gib)
            print(f"copy bandwidth {res['copy_bandwidth'] / 1e9:,.0f} GB/s", flush=True)
            layers = [int(x) for x in args.layers.split(",")]
            res["layers"] = layer_times(cfg, params, ctx, chunk, args.iters, layers, res["copy_bandwidth"])
        if not (args.only_decode or args.only_layers):
            res["attention"] = full_attention_vs_cudnn(cfg, ctx, chunk, args.iters)
            res["dense_decode"] = dense_decode_vs_gather(cfg, ctx, args.iters)
        res["decode"] = []
        for b in ([] if args.only_layers else args.decode_batches.split(",")):
            for n in (int(x) for x in args.decode_steps_per_call.split(",")):
                try:
                    res["decode"].append(engine_decode(cfg, params, ctx, chunk, int(b), args.decode_tokens, n))
                except jax.errors.JaxRuntimeError as e:  # B=8 at 1M: 55 GB of cache + the decode transients
                    if "RESOURCE_EXHAUSTED" not in str(e):
                        raise
                    res["decode"].append({"batch": int(b), "steps_per_call": n, "error": "out of device memory"})
                    print(f"decode B={b}: out of device memory", flush=True)
                gc.collect()  # the engine's cache
        del params
        if not (args.only_decode or args.only_layers):
            res["extrapolation"] = extrapolate(res["generate"], res["layers"], res["decode"], ctx, chunk)
    section = markdown(res)
    print(section)
    override = "".join(f"_{k}-{v}" for k, v in args.config_override.items())
    stem = out / f"generate_m3_width_{ctx}{override}{'_dry' if args.dry else ''}"
    stem.with_suffix(".md").write_text(section)
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
    print(f"wrote {stem}.md and .json")
    if args.dry:
        counts = check_cuda_lowering(1_000_000, 4096, args.config_override)
        print("CUDA lowering at M3 widths, 1M context, chunk 4096 (Mosaic GPU custom calls):", counts)
        missing = [k for k, n in counts.items() if k != "layer 0 prefill" and n == 0]
        if missing:
            raise SystemExit(f"no Mosaic GPU kernel lowered for {missing}")
        if counts["layer 0 prefill attention (cuDNN)"] != 3:
            raise SystemExit("the full-attention chunk did not lower to three cuDNN calls (diagonal, the prefix's "
                             "head and its pieces)")


if __name__ == "__main__":
    main()
