"""Generation at MiniMax-M3's real widths on one GPU: the 1M-token run of ``python -m m3jax.generate``,
per-layer prefill / decode times, and an extrapolation to the 60-layer model on 8 GPUs.

``m3jax/configs/m3_width.json`` is M3 with 3 of its 60 decoder layers (layer 0 full attention + dense MLP,
layers 1-2 MSA + MoE, no vision tower), random bf16 weights. The script

1. runs the generate CLI path (``m3jax.generate.main``) with the kernels attention path (Mosaic GPU
   MSA kernels, cuDNN for the full-attention layer) and reads TTFT, prefill tok/s, decode ms/token
   and peak device memory from its report;
2. times one layer at a time (``jax.block_until_ready`` around each call) on a cache of the full
   context: a prefill chunk at the start, middle and end of the context (its key window bucketed as
   the engine does) and a decode step at the last position;
3. extrapolates to 60 layers (3 full-attention + 57 MSA/MoE) on 8 GPUs and appends a section to
   ``benchmarks/RESULTS.md``.

    PYTHONPATH=. python benchmarks/generate_m3_width.py            # GPU (H200): 1M context
    PYTHONPATH=. python benchmarks/generate_m3_width.py --dry      # CPU: tiny widths end to end (kernels in
                                                                   # interpret mode) + CUDA lowering at M3 shapes

MoE goes through ``M3Config.moe_impl`` ("auto": the Mosaic grouped-GEMM kernel on the GPU where it takes
the shapes); ``jax.lax.ragged_dot`` is dense-emulated on the GPU image (~6 TF/s at 128 experts) and
would dominate the MoE layers' prefill time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp

import m3jax
from m3jax import generate
from m3jax.cache import LayerCache, cache_bytes
from m3jax.config import M3Config, preset
from m3jax.engine import key_window_pages
from m3jax.layers import rope_angles
from m3jax.memory import weight_bytes
from m3jax.model import decoder_layer
from m3jax.params import init_random_on_device

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
FULL_LAYERS, MSA_LAYERS, GPUS = 3, 57, 8
HOP_MS = 0.03  # one [tokens, 6144] bf16 activation hop between pipeline stages over NVLink, decode


def tiny_config() -> M3Config:
    """m3_width's layer layout at widths the kernels accept (G = 8 query heads per KV head, head and
    index dims 64, block 64) and that run in seconds on a CPU."""
    return preset("m3_width").replace_text(
        vocab_size=512, hidden_size=128, num_attention_heads=16, num_key_value_heads=2, head_dim=64, rotary_dim=32,
        intermediate_size=64, dense_intermediate_size=256, shared_intermediate_size=64, num_local_experts=8,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=64, index_block_size=64, index_topk_blocks=2,
    )


def generate_argv(model_args: list[str], ctx: int, chunk: int, new_tokens: int, impl: str) -> list[str]:
    return [*model_args, "--ctx", str(ctx), "--fill", "--max-new-tokens", str(new_tokens), "--temperature", "0",
            "--dtype", "bfloat16", "--attention-impl", impl, "--prefill-chunk", str(chunk)]


def _random_layer_cache(cfg: M3Config, layer: int, ctx: int, dtype) -> tuple[LayerCache, jax.Array]:
    """One layer's cache pages for ``ctx`` tokens with random keys (so MSA selections are not degenerate)."""
    t = cfg.text
    pages = -(-ctx // t.index_block_size)
    ks = jax.random.split(jax.random.key(layer), 3)
    shape = (pages, t.index_block_size, t.num_key_value_heads, t.head_dim)
    draw = jax.jit(lambda key, shape: jax.random.normal(key, shape, dtype), static_argnums=1)
    ik = draw(ks[2], shape[:2] + (t.index_head_dim,)) if t.is_sparse_attention(layer) else None
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


def _timed(step, lp, h, kv, page_table, start, iters: int) -> tuple[float, LayerCache]:
    h_out, kv = step(lp, h, kv, page_table, start)  # compile + first run
    jax.block_until_ready(h_out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        h_out, kv = step(lp, h, kv, page_table, start)
        jax.block_until_ready(h_out)
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[len(ts) // 2], kv


def layer_times(cfg: M3Config, params: dict, ctx: int, chunk: int, iters: int) -> list[dict]:
    """Per layer: prefill chunk ms at the first / middle / last chunk, the whole prefill's seconds
    (trapezoid over the three: a chunk's cost is affine in its key window) and decode ms."""
    t = cfg.text
    max_pages = -(-ctx // t.index_block_size)
    starts = [0, (ctx // 2 // chunk) * chunk, ((ctx - 1) // chunk) * chunk]
    n_chunks = -(-ctx // chunk)
    rows = []
    for i, lp in enumerate(params["text"]["layers"]):
        kv, table = _random_layer_cache(cfg, i, ctx, params["text"]["embed"].dtype)
        step = _layer_step(cfg, i)
        h = (0.5 * jax.random.normal(jax.random.key(100 + i), (1, chunk, t.hidden_size))).astype(kv.k.dtype)
        chunk_ms = []
        for s in starts:
            w = key_window_pages(s + chunk, t.index_block_size, max_pages)
            ms, kv = _timed(step, lp, h, kv, table[:, :w], jnp.int32(s), iters)
            chunk_ms.append(ms)
        decode_ms, kv = _timed(step, lp, h[:, :1], kv, table, jnp.int32(ctx - 1), iters)
        first, mid, last = chunk_ms
        rows.append({
            "layer": i,
            "kind": ("MSA" if t.is_sparse_attention(i) else "full attention")
            + (" + MoE" if t.is_moe(i) else " + dense MLP"),
            "chunk_ms": chunk_ms,
            "prefill_s": n_chunks * (first + 2 * mid + last) / 4 / 1e3,
            "decode_ms": decode_ms,
        })
        print(json.dumps(rows[-1]), flush=True)
        del kv
    return rows


def extrapolate(report: dict, rows: list[dict]) -> dict:
    """60 layers on 8 GPUs, pipeline-parallel: whole layers per GPU, chunks of the one sequence flow
    through the stages. Assumptions (stated in the RESULTS section): each layer runs as measured on
    one GPU (no tensor or expert split, so no scaling loss inside a layer); stages are balanced by
    measured prefill time; activation hops between stages are free in prefill (a [chunk, 6144] bf16
    tile per chunk) and ``HOP_MS`` each in decode; embedding + lm_head ("other") as measured."""
    tm = report["timings"]
    full = next(r for r in rows if r["kind"].startswith("full"))
    msa = [r for r in rows if r["kind"].startswith("MSA")]
    msa_prefill = sum(r["prefill_s"] for r in msa) / len(msa)
    msa_decode = sum(r["decode_ms"] for r in msa) / len(msa)
    other_prefill = max(tm["ttft_s"] - sum(r["prefill_s"] for r in rows), 0.0)
    other_decode = max(tm["decode_ms_per_token"] - sum(r["decode_ms"] for r in rows), 0.0)
    layers_prefill = FULL_LAYERS * full["prefill_s"] + MSA_LAYERS * msa_prefill
    layers_decode = FULL_LAYERS * full["decode_ms"] + MSA_LAYERS * msa_decode
    n_chunks = -(-report["prompt_len"] // report["prefill_chunk"])
    stage_s = max(layers_prefill / GPUS, full["prefill_s"], msa_prefill)  # whole layers: no stage below one
    m3 = preset("minimax_m3")
    m3 = dataclasses.replace(m3, vision=None)
    per_gpu_gib = (weight_bytes(m3, 2) + cache_bytes(m3, 1, report["ctx"])) / GPUS / 2**30
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


def results_section(report: dict, rows: list[dict], ex: dict, command: str, dry: bool) -> str:
    dev = jax.devices()[0]
    tm = report["timings"]
    gib = report["peak_device_memory_bytes"] / 2**30
    widths = "tiny widths (--dry)" if dry else "M3 widths"
    lines = [
        f"## Generation at {widths}, 3 layers, {report['ctx']:,} context — {datetime.date.today()}, "
        f"{dev.device_kind} ({dev.platform}), jax {jax.__version__}",
        "",
        f"Command: `{command}` (runs `python -m m3jax.generate {' '.join(report['argv'])}`)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| prompt tokens | {report['prompt_len']:,} (chunks of {report['prefill_chunk']}) |",
        f"| TTFT | {tm['ttft_s']:.1f} s (compile {tm['compile_s']:.1f} s before, not included) |",
        f"| prefill | {tm['prefill_tok_per_s']:,.0f} tok/s |",
        f"| decode | {tm['decode_ms_per_token']:.2f} ms/token ({tm['decode_steps']} steps) |",
        f"| peak memory | {gib:.1f} GiB ({report['memory_kind']}); plan: {report['memory_plan']} |",
        "",
        "| layer | kind | prefill chunk ms (first / middle / last) | prefill total s | decode ms |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['kind']} | {' / '.join(f'{x:.1f}' for x in r['chunk_ms'])} | "
                     f"{r['prefill_s']:.1f} | {r['decode_ms']:.3f} |")
    lines += [
        "",
        f"Embedding, lm_head and host loop (TTFT or decode minus the layers): {ex['other_prefill_s']:.1f} s prefill, "
        f"{ex['other_decode_ms']:.2f} ms/token decode.",
        "",
        f"Extrapolated to 60 layers ({FULL_LAYERS} full attention + {MSA_LAYERS} MSA/MoE, each at the measured time "
        f"of its kind): one GPU (if it held the model) TTFT {ex['one_gpu_ttft_s']:.0f} s, decode "
        f"{ex['one_gpu_decode_ms']:.1f} ms/token. On {GPUS} GPUs, pipeline-parallel (whole layers per GPU, stages "
        f"balanced by prefill time, chunks of the sequence streamed through the stages, ideal otherwise: no "
        f"tensor/expert split, stage hops free in prefill and {HOP_MS} ms each in decode): TTFT "
        f"{ex['gpus_ttft_s']:.0f} s, decode {ex['gpus_decode_ms']:.1f} ms/token (one sequence gets no decode "
        f"speed-up from a pipeline). Per GPU: {ex['per_gpu_weights_cache_gib']:.0f} GiB of bf16 weights + KV/index "
        f"cache (the 60-layer text model without the vision tower, 1/{GPUS} each) before activations. "
        f"MoE: `moe_impl={report['moe_impl']}` (`auto` = the Mosaic grouped-GEMM kernel on the GPU where it takes "
        f"the shapes, else `jax.lax.ragged_dot`, dense-emulated on the GPU image at ~6 TF/s).",
        "",
    ]
    return "\n".join(lines)


def check_cuda_lowering(ctx: int, chunk: int) -> dict[str, int]:
    """Lower every layer's prefill chunk (last chunk, full key window) and decode step at M3 widths for
    CUDA on this machine; returns the Mosaic GPU custom calls per function. Nothing is allocated.
    The kernels' launcher is told it is on a GPU (off-GPU it would lower GPU interpret mode instead).
    cuDNN attention cannot be lowered without cuDNN present, so the full-attention layer lowers its
    reference path here."""
    from m3jax.pallas import _backend
    from m3jax.pallas.sparse_attention import kernel as sa_kernel
    from m3jax.params import param_specs

    cfg = preset("m3_width").replace(attention_impl="pallas")
    t = cfg.text
    specs = param_specs(cfg)["text"]["layers"]
    bf16 = jnp.bfloat16
    abstract = lambda s: jax.ShapeDtypeStruct(s.shape, s.resolve_dtype(bf16))  # noqa: E731
    pages = -(-ctx // t.index_block_size)
    counts = {}
    with mock.patch.object(_backend, "on_gpu", lambda: True), mock.patch.object(sa_kernel, "on_gpu", lambda: True):
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
    return counts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="CPU, tiny widths; no RESULTS.md unless --results is given")
    ap.add_argument("--ctx", type=int, default=None, help="context (default 1000000; --dry: 1024)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default 4096 (--dry: 256)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--iters", type=int, default=3, help="timed calls per layer measurement (median)")
    ap.add_argument("--attention-impl", default=None,
                    help="default pallas; --dry: reference (the whole model with the kernels in GPU interpret "
                         "mode takes many minutes to compile on a CPU; --dry checks their CUDA lowering instead)")
    ap.add_argument("--results", type=Path, default=None,
                    help=f"section appended here (default {RESULTS}; --dry: none)")
    ap.add_argument("--output-json", type=Path, default=None, help="the generate report + layer times")
    args = ap.parse_args(argv)
    ctx = args.ctx or (1024 if args.dry else 1_000_000)
    chunk = args.prefill_chunk or (256 if args.dry else 4096)
    impl = args.attention_impl or ("reference" if args.dry else "pallas")
    results = args.results or (None if args.dry else RESULTS)
    command = " ".join(["python benchmarks/generate_m3_width.py", *(sys.argv[1:] if argv is None else argv)])

    with tempfile.TemporaryDirectory() as tmp:
        if args.dry:
            cfg = tiny_config()
            m3jax.save_pretrained(m3jax.init_random(cfg, seed=0, dtype="bfloat16"), Path(tmp) / "ckpt")
            model_args = ["--checkpoint", str(Path(tmp) / "ckpt")]
        else:
            cfg = preset("m3_width")
            model_args = ["--config", "m3_width"]
        argv = generate_argv(model_args, ctx, chunk, args.max_new_tokens, impl)
        print("m3jax.generate", " ".join(argv), flush=True)
        report = generate.main([*argv, "--output-json", str(Path(tmp) / "report.json"), "--quiet"])
    report["argv"] = argv
    report["prefill_chunk"] = chunk
    report["moe_impl"] = cfg.moe_impl
    tm = report["timings"]
    print(f"TTFT {tm['ttft_s']:.2f} s, prefill {tm['prefill_tok_per_s']:,.0f} tok/s, decode "
          f"{tm['decode_ms_per_token']:.2f} ms/token, peak memory {report['peak_device_memory_bytes'] / 2**30:.2f} GiB "
          f"({report['memory_kind']})", flush=True)

    cfg = cfg.replace(attention_impl=impl)
    params = init_random_on_device(cfg, seed=0, dtype=jnp.bfloat16)
    rows = layer_times(cfg, params, ctx, chunk, args.iters)
    del params
    ex = extrapolate(report, rows)
    section = results_section(report, rows, ex, command, args.dry)
    print(section)
    if args.dry:
        counts = check_cuda_lowering(1_000_000, 4096)
        print("CUDA lowering at M3 widths, 1M context, chunk 4096 (Mosaic GPU custom calls):", counts)
        missing = [k for k, n in counts.items() if "layer 0" not in k and n == 0]
        if missing:
            raise SystemExit(f"no Mosaic GPU kernel lowered for {missing}")
    if results:
        with open(results, "a") as f:
            f.write("\n" + section)
        print(f"appended to {results}")
    if args.output_json:
        args.output_json.write_text(json.dumps({"report": report, "layers": rows, "extrapolation": ex}, indent=2))


if __name__ == "__main__":
    main()
