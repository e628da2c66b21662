"""What the in-kernel MXFP8 dequantisation costs the grouped GEMM, part by part (GPU).

``grouped_matmul_mxfp8`` converts each fp8 weight tile into a bf16 SMEM tile (``tiles.dequantize_tile``)
in the warpgroups that issue the MMAs, between their MMAs. This runs the MoE layer's routed gate GEMM at
M3 widths (``[rows, 6144] x [128, 6144, 3072]``: a 4,096-token prefill chunk's 16,384 rows, uniform
routing; 1 and 8 decode tokens, which take the gemv schedule and convert no tile) with the layer's configs
(``layer_config``), the prefill's conversion swapped for stand-ins, most of which compute wrong weights, to
see where the time goes:

  shipped        tiles.dequantize_tile on tiles.tile_plan (GROUP_LAYOUT: 4 rows x 8 columns per thread per
                 scale group, the tiles at their widest swizzles), the warp-specialised kernel placing its
                 own warpgroup barriers (persistent.EXPLICIT_BARRIERS)
  auto_barriers  shipped with Pallas's automatic barriers around every SMEM store (the code before
                 2026-12-03, sixteenth session)
  quad_layout    a thread's 4 columns x 8 of every 32 rows (4 scales per group, each over 8 rows), which
                 Mosaic GPU can load and store without bank conflicts only with the fp8 tile swizzled by
                 32 bytes and the MMA's operands by 64
  f32_scale      shipped, the scale applied in float32 then rounded to bf16
  cvt_only       e4m3 -> f16 -> f32 -> bf16 without the scale (wrong weights)
  store_only     a constant bf16 tile written: the SMEM stores and fence alone (wrong weights)
  nothing        no conversion: the MMA reads a stale tile; the loads, pipeline and MMAs alone (wrong weights)

against the bf16 kernel of the same config on the dequantised weights (the baseline, same process).
Device ms from CUPTI; "max |diff|" is against the bf16 kernel (0 or bf16 rounding for the exact
variants). jit caches are cleared between variants: a process otherwise keeps the kernel it traced first.
The bf16 kernel is timed before and after the variants, the faster kept (the GPU's clocks ramp over
the first one).

``--configs`` runs instead the prefill GEMMs (gate, and down: ``[16384, 3072] x [128, 3072, 6144]``) on
the warp-specialised schedule at three CTA tiles, bf16 and MXFP8 (shipped conversion) each: the layer's
``block_m=128, block_n=256`` (consumer accumulators ``[128, 128]``), ``128 x 128`` (``[128, 64]``: half
the accumulator registers; the fp8 tile swizzled by 64 bytes) and ``64 x 256``, with ptxas's report of each
kernel (registers per thread, spilled bytes, and whether it serialized the wgmmas for lack of registers,
its message C7511), read from Mosaic GPU's dumps (``MOSAIC_GPU_DUMP_PTXAS``, set before the first compile).
Each kernel is timed in ``ROUNDS`` rounds taken in turns with the other kind's, its fastest kept.

    PYTHONPATH=. python benchmarks/mxfp8_dequant.py [--configs]     # one H200: about a minute each
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_m3_width import best, on_gpu, timed
from run_info import header, run_info

from m3jax.pallas._backend import plgpu, tiled_layout
from m3jax.pallas.grouped_matmul import (
    GroupedMatmulConfig,
    grouped_matmul,
    grouped_matmul_mxfp8,
    kernel,
    layer_config,
    persistent,
    reference,
    tiles,
)

LAYOUT = plgpu.Layout.WGMMA_8BIT
EXPERTS, D, F = 128, 6144, 3072
ITERS = 10  # calls per device-time measurement
ROUNDS = 3  # --configs: measurements per kernel, taken in turns with the other kind's


def _cvt_only(q_smem, s_smem, w_smem, group):
    q = plgpu.load(q_smem, layout=tiles.tile_plan(q_smem.shape[1]).layout)
    w_smem[...] = q.astype(jnp.float16).astype(jnp.float32).astype(w_smem.dtype)
    plgpu.commit_smem()


def _store_only(q_smem, s_smem, w_smem, group):
    w_smem[...] = plgpu.layout_cast(jnp.full(q_smem.shape, 1.0, w_smem.dtype), LAYOUT)
    plgpu.commit_smem()


def _nothing(q_smem, s_smem, w_smem, group):
    pass


# 4 rows x 32 columns per warp access: whole 32-byte fp8 rows (32-byte swizzle) and 64-byte bf16 rows
# (64-byte swizzle) are the only conflict-free pair for it
QUAD_PLAN = tiles.TilePlan(tiled_layout(((4, 128), (4, 32), (4,)), warp_dims=(-4,), lane_dims=(-3, -2)),
                           (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(32)),
                           (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64)))

SHIPPED = {"dequantize_tile": tiles.dequantize_tile, "tile_plan": tiles.tile_plan, "explicit_barriers": True}
VARIANTS = {"shipped": {},
            "auto_barriers": {"explicit_barriers": False},
            "quad_layout": {"tile_plan": lambda cols: QUAD_PLAN},
            "f32_scale": {"dequantize_tile": functools.partial(tiles.dequantize_tile, scale_dtype=jnp.float32)},
            "cvt_only": {"dequantize_tile": _cvt_only}, "store_only": {"dequantize_tile": _store_only},
            "nothing": {"dequantize_tile": _nothing}}


def _use(variant: dict) -> None:
    """The shipped kernels with ``variant``'s parts swapped in (module attributes the kernels read)."""
    parts = {**SHIPPED, **variant}
    persistent.dequantize_tile = kernel.dequantize_tile = parts["dequantize_tile"]
    tiles.tile_plan = parts["tile_plan"]
    persistent.EXPLICIT_BARRIERS = parts["explicit_barriers"]
    jax.clear_caches()


def weights(d: int, f: int, experts: int = EXPERTS):
    """Random MXFP8 expert weights ``[experts, d, f]`` (values, E8M0 scales) and their bf16 dequantisation."""
    values = (jax.random.normal(jax.random.key(0), (experts, d, f)) * 64).astype(jnp.float8_e4m3fn)
    scales = jax.random.randint(jax.random.key(1), (experts, d // 32, f), 110, 125).astype(jnp.uint8)
    return values, scales, reference.dequantize_mxfp8(values, scales).astype(jnp.bfloat16)


def routed_rows(m: int, d: int, experts: int = EXPERTS):
    """(group sizes int32 [experts], bf16 lhs [m, d]): uniform random routing past ``experts`` rows, else
    each row its own expert."""
    if m > experts:
        sizes = jnp.bincount(jax.random.randint(jax.random.key(3), (m,), 0, experts), length=experts)
    else:
        sizes = jnp.zeros((experts,), jnp.int32).at[jnp.arange(m) * 7 % experts].add(1)
    return sizes.astype(jnp.int32), (0.5 * jax.random.normal(jax.random.key(9), (m, d))).astype(jnp.bfloat16)


def gemm_row(label: str, m: int, values, scales, w_bf16, variants=tuple(VARIANTS)) -> dict:
    """The routed gate GEMM of ``m`` rows: the bf16 kernel, then each of ``variants`` of the MXFP8 one."""
    sizes, x = routed_rows(m, D)
    cb, cm = layer_config(m, D, F, EXPERTS), layer_config(m, D, F, EXPERTS, D // 32)
    fb = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, config=cb))
    # bf16 before and after the variants, the faster kept: the first kernel a process times can run
    # while the GPU's clocks still ramp (1.63 ms first against 1.50 later, H200, 2026-12-03)
    first = best(timed(lambda: fb(x, w_bf16, sizes), ITERS))
    want = fb(x, w_bf16, sizes).astype(jnp.float32)
    row = {"gemm": label, "bf16_config": str(cb), "mxfp8_config": str(cm)}
    for name in variants:
        _use(VARIANTS[name])
        fm = jax.jit(lambda x, v, sc, s: grouped_matmul_mxfp8(x, v, sc, s, config=cm))
        ms = best(timed(lambda fm=fm: fm(x, values, scales, sizes), ITERS))
        err = float(jnp.max(jnp.abs(fm(x, values, scales, sizes).astype(jnp.float32) - want)))
        row[name] = {"ms": ms, "max_abs_diff": err}
    _use(VARIANTS["shipped"])
    row["bf16_ms"] = base = min(first, best(timed(lambda: fb(x, w_bf16, sizes), ITERS)))
    for name in variants:
        row[name]["ratio"] = row[name]["ms"] / base
    print(json.dumps(row), flush=True)
    return row


TILES = {"128 x 256 (layer)": GroupedMatmulConfig(block_m=128, block_n=256, schedule="warp_specialized"),
         "128 x 128": GroupedMatmulConfig(block_m=128, block_n=128, schedule="warp_specialized"),
         "64 x 256": GroupedMatmulConfig(block_m=64, block_n=256, schedule="warp_specialized")}


def _ptxas(dump: Path, seen: set) -> str:
    """ptxas's report of the kernels compiled since the last call (the dumps not in ``seen``)."""
    notes = []
    for f in sorted(set(dump.glob("*.ptxas")) - seen):
        seen.add(f)
        text = f.read_text()
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores", text)
        notes.append(f"{regs.group(1) if regs else '?'} regs, spill {spill.group(1) if spill else 0} B"
                     + (", wgmma serialized (C7511)" if "C7511" in text else ""))
    return "; ".join(notes)


def tile_rows(dump: Path, m: int = 16384, d: int = D, f: int = F, experts: int = EXPERTS) -> list[dict]:
    """The prefill GEMMs (``m`` rows over ``experts``, ``d -> f`` and ``f -> d``) per warp-specialised CTA
    tile, bf16 and MXFP8, with ptxas's reports (none where nothing was dumped)."""
    seen: set = set(dump.glob("*.ptxas"))
    rows = []
    for label, d, f in (("gate", d, f), ("down", f, d)):
        values, scales, w_bf16 = weights(d, f, experts)
        sizes, x = routed_rows(m, d, experts)
        want = None
        for tile, cfg in TILES.items():
            row = {"gemm": f"prefill {label}, {m} x {d} x {f}", "tile": tile}
            calls = {}
            for kind in ("bf16", "mxfp8"):
                if kind == "bf16":
                    fn = jax.jit(lambda x, w, s, cfg=cfg: grouped_matmul(x, w, s, config=cfg))
                    calls[kind] = lambda fn=fn: fn(x, w_bf16, sizes)
                else:
                    fn = jax.jit(lambda x, v, sc, s, cfg=cfg: grouped_matmul_mxfp8(x, v, sc, s, config=cfg))
                    calls[kind] = lambda fn=fn: fn(x, values, scales, sizes)
                got = calls[kind]().astype(jnp.float32)  # compiled here: its ptxas report is the newest
                want = got if want is None else want
                row[kind] = {"max_abs_diff": float(jnp.max(jnp.abs(got - want))), "ptxas": _ptxas(dump, seen)}
            # the two kernels timed in turns, each's fastest round kept: clocks and neighbours drift
            # over a process by more than the difference between them
            rounds = [{kind: best(timed(call, ITERS)) for kind, call in calls.items()} for _ in range(ROUNDS)]
            for kind in calls:
                row[kind]["rounds_ms"] = [r[kind] for r in rounds]
                row[kind]["ms"] = min(row[kind]["rounds_ms"])
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def tile_markdown(rows: list[dict]) -> list[str]:
    lines = ["", "Warp-specialised schedule; device ms; ratio = MXFP8 / the fastest bf16 tile of that GEMM; "
             "ptxas: bf16 / MXFP8 kernel", "",
             "| GEMM | tile | bf16 | MXFP8 | ratio | max abs diff | ptxas |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fastest = min(q["bf16"]["ms"] for q in rows if q["gemm"] == r["gemm"])
        lines.append(f"| {r['gemm']} | {r['tile']} | {r['bf16']['ms']:.3f} | {r['mxfp8']['ms']:.3f} | "
                     f"{r['mxfp8']['ms'] / fastest:.2f} | {r['mxfp8']['max_abs_diff']:g} | "
                     f"{r['bf16']['ptxas']} / {r['mxfp8']['ptxas']} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", action="store_true", help="instead: the prefill GEMMs by warp-specialised CTA tile, with ptxas's reports")
    args = ap.parse_args()
    if not on_gpu():
        sys.exit("benchmarks/mxfp8_dequant.py measures GPU kernels: run it on a GPU")
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    info = run_info("mxfp8_dequant.py")
    if args.configs:
        # read by Mosaic GPU at its first compile: before any kernel of this process. It dumps more than
        # ptxas's report (MLIR, PTX), so into a temporary directory, removed at the end.
        dump = Path(tempfile.mkdtemp(prefix="mosaic_dump_"))
        os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(dump))
        try:
            lines = ["Prefill GEMMs by CTA tile", "", header(info)] + tile_markdown(rows := tile_rows(dump))
        finally:
            shutil.rmtree(dump)
        print("\n".join(lines))
        (out / "mxfp8_dequant_tiles.md").write_text("\n".join(lines) + "\n")
        (out / "mxfp8_dequant_tiles.json").write_text(json.dumps({"run": info, "rows": rows}, indent=1))
        return
    values, scales, w_bf16 = weights(D, F)
    # decode rows run the gemv schedule, which converts no tile: the shipped kernel only
    rows = [gemm_row("prefill, 16,384 rows", 16384, values, scales, w_bf16)]
    rows += [gemm_row(label, m, values, scales, w_bf16, ("shipped",))
             for label, m in (("decode, 1 token", 4), ("decode, 8 tokens", 32))]
    title = "MXFP8 grouped GEMM, in-kernel dequantisation by part; device ms (ratio to bf16)"
    lines = [title, "", header(info), "", "| GEMM | bf16 | " + " | ".join(VARIANTS) + " |", "|---" * (len(VARIANTS) + 2) + "|"]
    for r in rows:
        cells = [f"{r[v]['ms']:.3f} ({r[v]['ratio']:.2f})" if v in r else "" for v in VARIANTS]
        lines.append(f"| {r['gemm']} | {r['bf16_ms']:.3f} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    (out / "mxfp8_dequant.md").write_text("\n".join(lines) + "\n")
    (out / "mxfp8_dequant.json").write_text(json.dumps({"run": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
