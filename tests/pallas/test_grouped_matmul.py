"""Grouped matmul (MoE ragged dot): Mosaic GPU kernel vs ``jax.lax.ragged_dot``, its tile schedule,
the MoE layer with moe_impl="pallas" vs "ragged_dot", and the CUDA lowering at M3 shapes. The kernel
bodies run for both schedules (``GroupedMatmulConfig.schedule``): the one-warpgroup pipeline and the
persistent warp-specialised kernel (in interpret mode a warpgroup is one thread, so a missing
warpgroup barrier between producer and consumers would only show on a GPU).

Off-GPU the kernel runs in Mosaic GPU interpret mode with the race detector on (``mosaic_kernel``).
Shapes are tiny (K = N = 128, 64-row tiles) to keep the file fast on a CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.pallas import _backend
from m3jax.pallas.grouped_matmul import (
    GroupedMatmulConfig,
    grouped_matmul,
    grouped_matmul_mxfp8,
    grouped_matmuls,
    grouped_matmuls_mxfp8,
    mxfp8_unsupported_reason,
    persistent,
    tile_schedule,
    unsupported_reason,
)
from m3jax.pallas.grouped_matmul import reference as gmm_reference
from tests.conftest import assert_close

CFG = GroupedMatmulConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2)
WS = GroupedMatmulConfig(block_m=64, block_n=128, max_concurrent_steps=2, schedule="warp_specialized")
# the consumers split the 128 rows (64 each, skipping a half without the visit's rows)
WS_ROWS = GroupedMatmulConfig(block_m=128, block_n=128, max_concurrent_steps=2, schedule="warp_specialized",
                              wg_split="m")
# 256-row tiles: each consumer holds two 64-row chunks (consumer w chunks w and w + 2), each multiplied
# only where it holds rows of the visit: one weight tile per K step serves up to 256 of an expert's rows
WS_ROWS256 = GroupedMatmulConfig(block_m=256, block_n=128, max_concurrent_steps=2, schedule="warp_specialized",
                                 wg_split="m")
# 384-row tiles: three 64-row chunks per consumer (192 accumulator registers), an expert of up to ~380 rows
# in one visit
WS_ROWS384 = dataclasses.replace(WS_ROWS256, block_m=384)
SCHEDULES = {"pipeline": CFG, "warp_specialized": WS, "warp_specialized_rows": WS_ROWS,
             "warp_specialized_rows256": WS_ROWS256}
# groups over several 256-row visits: a group of 300 rows from row 5 (its second visit holds rows of
# the first chunk only: consumer 1 idle), one of 130 rows in three chunks straddling two 256-row tiles,
# empty groups, and rows past the sum
MULTI_VISIT = (600, [5, 300, 0, 130, 70, 0, 40])

# name -> (M, group sizes): rows sorted by group, sum <= M.
PATTERNS = {
    "empty_groups": (120, [0, 30, 0, 0, 50, 40]),
    "group_larger_than_tile": (180, [10, 150, 20]),
    "all_rows_one_group": (130, [0, 0, 130, 0]),
    "sum_below_m": (150, [20, 30, 25]),
}


def _inputs(m, k, n, sizes, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    rhs = jax.random.normal(k2, (len(sizes), k, n), jnp.float32).astype(dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


def _check(lhs, rhs, gs, cfg=CFG, out_dtype=None):
    got = grouped_matmul(lhs, rhs, gs, config=cfg, out_dtype=out_dtype)
    ref = jax.lax.ragged_dot(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    assert not _backend.interpret_races_found()
    want = jnp.dtype(out_dtype or lhs.dtype)
    assert got.shape == ref.shape and got.dtype == want
    got = np.asarray(got, np.float32)
    total = int(np.sum(gs))
    assert not np.any(got[total:]), "rows past sum(group_sizes) must be zero"
    assert_close(got, ref, "bfloat16" if lhs.dtype == jnp.bfloat16 else "float32", "grouped_matmul vs ragged_dot")


@pytest.mark.parametrize("m,sizes,bm", [
    (120, [0, 30, 0, 0, 50, 40], 64), (180, [10, 150, 20], 64), (150, [20, 30, 25], 128),
    (7, [3, 0, 2], 64), (300, [0] * 5, 128), (256, [64, 64, 64, 64], 64),
    # decode: 4 rows of a token's 4 experts among 128 groups: 4 visits, not one per group
    (4, [0] * 9 + [1] + [0] * 40 + [1, 1] + [0] * 75 + [1], 64),
])
def test_tile_schedule_covers_each_row_once(m, sizes, bm):
    # Machine: any: host-side planning, no kernel runs
    sched = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), m, bm))
    # a visit per tile, and one more per boundary inside a tile between groups with rows (the zero group too)
    assert sched.shape == (-(-m // bm) + min(len(sizes) + 1, m) - 1, 4)
    ends = np.cumsum(sizes)
    owner = np.full(m, len(sizes))  # the zero group past the sum
    for g, (s, e) in enumerate(zip(ends - sizes, ends)):
        owner[s:e] = g
    seen = np.zeros(m, int)
    for g, tile, lo, hi in sched:
        if hi <= lo:
            continue
        assert tile * bm <= lo < hi <= min(tile * bm + bm, m)
        assert (owner[lo:hi] == g).all()
        seen[lo:hi] += 1
    assert (seen == 1).all()


@pytest.mark.parametrize("m,sizes,bm", [
    (120, [0, 30, 0, 0, 50, 40], 64), (180, [10, 150, 20], 64), (150, [20, 30, 25], 128),
    (7, [3, 0, 2], 64), (300, [0] * 5, 128), (256, [64, 64, 64, 64], 64), (200, [5, 70, 0, 60, 40], 128),
])
def test_aligned_schedule_covers_each_row_once(m, sizes, bm):
    # the warp-specialised schedule: tiles start at a multiple of 8 inside or just before the group
    # Machine: any: host-side planning, no kernel runs
    sched, live = (np.asarray(x) for x in persistent.aligned_schedule(jnp.asarray(sizes, jnp.int32), m, bm))
    ends = np.cumsum(sizes)
    owner = np.full(m, len(sizes))  # the zero group past the sum
    for g, (s, e) in enumerate(zip(ends - sizes, ends)):
        owner[s:e] = g
    seen = np.zeros(m, int)
    for v, (g, row0, lo, hi) in enumerate(sched):
        assert (hi > lo) == (v < live[0]), "the live visits come first"
        if hi <= lo:
            continue
        assert row0 % 8 == 0 and row0 <= lo < hi <= min(row0 + bm, m)
        assert (owner[lo:hi] == g).all()
        seen[lo:hi] += 1
    assert (seen == 1).all()
    per_group = np.bincount(sched[: live[0], 0], minlength=len(sizes) + 1)
    covered = np.append(sizes, m - sum(sizes))
    assert (per_group <= -(-(covered + 7) // bm)).all(), "a group's tiles are its rows', not the straddled tiles'"


# every pattern and dtype on the pipeline, every pattern on the warp-specialised schedule, and fp32
# (the same kernel on K-concatenated bf16 pieces) with rows past the sum and a 128-row tile with an idle
# consumer on the row split (test_two_n_tiles_128_row_tiles_fp32_out has its straddling groups)
KERNEL_CASES = ([(p, d, "pipeline") for d in (jnp.bfloat16, jnp.float32) for p in PATTERNS]
                + [(p, jnp.bfloat16, "warp_specialized") for p in PATTERNS]
                + [("sum_below_m", jnp.float32, "warp_specialized_rows")]
                + [(p, jnp.bfloat16, "warp_specialized_rows256") for p in PATTERNS]
                + [("sum_below_m", jnp.float32, "warp_specialized_rows256")])


@pytest.mark.parametrize("pattern,dtype,schedule", KERNEL_CASES)
def test_kernel_matches_ragged_dot(pattern, dtype, schedule):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    m, sizes = PATTERNS[pattern]
    _check(*_inputs(m, 128, 128, sizes, dtype), cfg=SCHEDULES[schedule])


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_two_n_tiles_128_row_tiles_fp32_out(schedule):
    # block_m 128 (tiles straddling several groups), 2 N tiles (warp-specialised: one CTA N tile of
    # 256, two consumers of 128 columns or of 64 rows), three K steps, bf16 in / fp32 out.
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    lhs, rhs, gs = _inputs(200, 192, 256, [5, 70, 0, 60, 40], jnp.bfloat16, seed=1)
    cfg = GroupedMatmulConfig(block_m=128, block_n=128, max_concurrent_steps=3)
    if schedule == "warp_specialized_rows256":  # 2 N tiles of 128, consumers of 128 rows
        cfg = dataclasses.replace(WS_ROWS256, max_concurrent_steps=3)
    elif schedule != "pipeline":
        cfg = GroupedMatmulConfig(block_m=128, block_n=256, max_concurrent_steps=3, schedule="warp_specialized",
                                  wg_split="m" if schedule == "warp_specialized_rows" else "n")
    _check(lhs, rhs, gs, cfg=cfg, out_dtype=jnp.float32)


@pytest.mark.parametrize("schedule", ["pipeline", "warp_specialized", "warp_specialized_rows256"])
def test_fewer_rows_than_a_tile_single_k_step(schedule):
    # M < block_m (padded), K = block_k (one pipeline step, no delayed release).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    _check(*_inputs(40, 64, 128, [10, 25], jnp.bfloat16, seed=2), cfg=SCHEDULES[schedule])


@pytest.mark.parametrize("dtype,cluster", [(jnp.bfloat16, 1), (jnp.float32, 1), (jnp.bfloat16, 2)])
def test_256_row_tiles_over_several_visits(dtype, cluster):
    # MULTI_VISIT on the 256-row tiles: 2 N tiles, 2 K steps; bf16 and fp32 (three bf16 pieces along K);
    # cluster 2: the N tiles' CTAs share the lhs tile (TMA multicast on the GPU: interpret mode copies the
    # whole tile into each CTA, so there this checks the item split and the cluster barriers' count)
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    m, sizes = MULTI_VISIT
    _check(*_inputs(m, 128, 256, sizes, dtype, seed=9), cfg=dataclasses.replace(WS_ROWS256, cluster=cluster))


@pytest.mark.parametrize("m,sizes", [MULTI_VISIT, (600, [10, 450, 0, 100])])
def test_384_row_tiles(m, sizes):
    # The 384-row tiles: MULTI_VISIT (every group in one visit; the 130-row group's tile clamped to lhs's
    # end, so its rows start in a later chunk), and a 450-row group (a 384-row visit, then a short one of
    # 66 rows); 2 N tiles, 2 K steps, bf16 in / fp32 out. Each consumer waits for as many MMA groups as it
    # issued (one to three chunks with rows).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    _check(*_inputs(m, 128, 256, sizes, jnp.bfloat16, seed=11), cfg=WS_ROWS384, out_dtype=jnp.float32)


def test_split_k_decode_rows():
    # decode-like: a few rows per expert, K split in two (fp32 partials summed outside), K / 2 = 2 steps
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    _check(*_inputs(12, 256, 128, [1, 0, 3, 2, 0, 4], jnp.bfloat16, seed=7),
           cfg=GroupedMatmulConfig(block_m=64, block_n=128, max_concurrent_steps=2, schedule="warp_specialized",
                                   split_k=2))


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_gradients_match_ragged_dot(schedule):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    cfg = SCHEDULES[schedule]
    lhs, rhs, gs = _inputs(96, 128, 128, [40, 0, 50], jnp.float32, seed=3)
    ct = jax.random.normal(jax.random.key(4), (96, 128), jnp.float32)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b) * ct)

    # fp32 products at full precision on both sides: XLA's default on the GPU rounds them to TF32
    # (3e-4 here on the H200), which the CPU does not.
    with jax.default_matmul_precision("highest"):
        got = jax.grad(loss(lambda a, b: grouped_matmul(a, b, gs, config=cfg)), argnums=(0, 1))(lhs, rhs)
        ref = jax.grad(loss(lambda a, b: jax.lax.ragged_dot(a, b, gs)), argnums=(0, 1))(lhs, rhs)
    assert not _backend.interpret_races_found()
    for g, r in zip(got, ref):
        assert_close(g, r, "float32", "grouped_matmul gradient")


def test_refuses_unsupported_shapes_and_auto_falls_back(monkeypatch):
    # Machine: any: config checks, and the choice with on_gpu patched to a stand-in GPU (on a real GPU its canary
    # runs)
    from m3jax import moe

    lhs, rhs, gs = _inputs(64, 96, 128, [64], jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of block_k"):
        grouped_matmul(lhs, rhs, gs)
    with pytest.raises(ValueError, match="multiple of block_n"):
        grouped_matmul(*_inputs(64, 128, 192, [64], jnp.bfloat16))
    assert "registers" in unsupported_reason(256, 128, 256, 2, GroupedMatmulConfig(block_m=128, block_n=256))
    ws = GroupedMatmulConfig(block_m=128, block_n=256, schedule="warp_specialized")
    assert unsupported_reason(256, 128, 256, 2, ws) is None  # two consumers of 128 columns each
    assert "registers" in unsupported_reason(256, 128, 512, 2, GroupedMatmulConfig(
        block_m=128, block_n=512, schedule="warp_specialized"))
    assert "split_k" in unsupported_reason(256, 128, 256, 2, GroupedMatmulConfig(split_k=2))
    assert "split_k * block_k" in unsupported_reason(256, 192, 256, 2, GroupedMatmulConfig(
        block_n=256, schedule="warp_specialized", split_k=2))
    # consumers of 64 fp8 columns: the fp8 tile takes a 64-byte swizzle
    assert mxfp8_unsupported_reason(256, 128, 256, 2, 4, GroupedMatmulConfig(block_n=128, schedule="warp_specialized")) is None
    with _backend.lowering_for(_backend.BLACKWELL):
        assert "Hopper only" in unsupported_reason(256, 128, 256, 2, ws)
    rows = GroupedMatmulConfig(block_m=128, block_n=256, schedule="warp_specialized", wg_split="m")
    assert unsupported_reason(256, 128, 256, 2, rows) is None  # two consumers of 64 x 256
    assert mxfp8_unsupported_reason(256, 128, 256, 2, 4, rows) is None  # each converts the whole tile
    assert "block_m=128, 256 or 384" in unsupported_reason(256, 128, 256, 2, GroupedMatmulConfig(
        block_m=64, block_n=256, schedule="warp_specialized", wg_split="m"))
    rows256 = GroupedMatmulConfig(block_m=256, block_n=128, schedule="warp_specialized", wg_split="m")
    assert unsupported_reason(256, 128, 256, 2, rows256) is None  # two consumers of 128 x 128
    assert mxfp8_unsupported_reason(256, 128, 256, 2, 4, rows256) is None
    assert "registers" in unsupported_reason(256, 128, 256, 2, dataclasses.replace(rows256, block_n=256))
    rows384 = dataclasses.replace(rows256, block_m=384)
    assert unsupported_reason(256, 128, 256, 2, rows384) is None  # two consumers of 192 x 128
    assert "more than 192 registers" in unsupported_reason(256, 128, 256, 2, dataclasses.replace(rows384, block_n=256))
    assert "wg_split='m'" in unsupported_reason(256, 128, 256, 2, dataclasses.replace(rows256, wg_split="n"))
    assert "wg_split='m'" in unsupported_reason(256, 128, 256, 2, dataclasses.replace(rows384, wg_split="n"))
    assert "256, 384: schedule='warp_specialized'" in unsupported_reason(256, 128, 256, 2,
                                                                        GroupedMatmulConfig(block_m=256))
    pair = dataclasses.replace(rows256, cluster=2)
    assert unsupported_reason(256, 128, 256, 2, pair) is None  # two N tiles of 128: one cluster's
    assert "multiple of cluster=2" in unsupported_reason(256, 128, 384, 2, pair)
    assert "must be 1 or 2" in unsupported_reason(256, 128, 256, 2, dataclasses.replace(pair, cluster=4))
    assert "no clusters" in unsupported_reason(256, 128, 256, 2, GroupedMatmulConfig(cluster=2))

    monkeypatch.setattr(_backend, "on_gpu", lambda: True)
    ok_x, ok_w = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
    assert moe.resolve_moe_impl("auto", ok_x, ok_w) == "pallas"
    assert moe.resolve_moe_impl("auto", ok_x.astype(jnp.float32), ok_w.astype(jnp.float32)) == "pallas"  # fp32-exact
    with pytest.warns(RuntimeWarning, match="multiple of block_k"):
        assert moe.resolve_moe_impl("auto", lhs, rhs) == "ragged_dot"  # K = 96
    assert moe.resolve_moe_impl("ragged_dot", ok_x, ok_w) == "ragged_dot"
    with pytest.raises(ValueError, match="moe_impl='pallas' cannot run"):
        moe.resolve_moe_impl("pallas", lhs, rhs)


def test_moe_layer_pallas_matches_ragged_dot():
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.moe import moe_sorted
    from m3jax.params import init_random
    from tests.conftest import tiny_config

    # Expert dims that the kernel tiles take: D = F = 128; 6 experts, top-3, 41 tokens -> 123 rows.
    cfg = tiny_config(hidden_size=128, intermediate_size=128, shared_intermediate_size=128)
    p = init_random(cfg, seed=5, dtype=jnp.bfloat16, scale=0.3)["text"]["layers"][1]["moe"]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(41, 128)), jnp.bfloat16)
    got = moe_sorted(x, p, cfg.text, impl="pallas")
    ref = moe_sorted(x, p, cfg.text, impl="ragged_dot")
    assert not _backend.interpret_races_found()
    assert got.dtype == jnp.bfloat16
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16", "MoE pallas vs ragged_dot")


@pytest.mark.parametrize("kind", ["pipeline_bf16", "pipeline_fp32", "gemv_mxfp8"])
def test_row_groups_match_per_row_products(kind):
    # RowGroups: row r times group ids[r], the rows in no order, a group repeated and others unused; against
    # numpy's product of each row with its own weight (the reference too: it sorts, runs ragged_dot and puts
    # the rows back). gemv: gate and up in one launch over 10-step K parts
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.pallas.grouped_matmul import RowGroups, dequantize_mxfp8

    # pipeline: 11 rows, which grouped_matmul pads to 16 for its store (the padding rows in no visit)
    ids = jnp.asarray([5, 2, 5, 0, 3] + ([1, 5, 2, 0, 0, 4] if kind.startswith("pipeline") else []), jnp.int32)
    m, g, dtype = ids.shape[0], 6, jnp.float32 if kind == "pipeline_fp32" else jnp.bfloat16
    if kind == "gemv_mxfp8":
        k, n = 640, 256
        lhs = _inputs(m, k, n, [0] * g, dtype, seed=12)[0]
        weights = (_mxfp8_weights(g, k, n, seed=13), _mxfp8_weights(g, k, n, seed=14))
        cfg = GroupedMatmulConfig(block_m=64, block_n=256, schedule="gemv", split_k=1)
        call = lambda ids: grouped_matmuls_mxfp8(lhs, weights, RowGroups(ids), config=cfg)  # noqa: E731
        got = jax.jit(call)(ids)
        ref = gmm_reference.grouped_matmuls_mxfp8(lhs, weights, RowGroups(ids))
        ws = [dequantize_mxfp8(v, s) for v, s in weights]
    else:
        lhs, rhs, _ = _inputs(m, 128, 256, [0] * g, dtype, seed=12)
        call = lambda ids: grouped_matmul(lhs, rhs, RowGroups(ids), config=CFG)  # noqa: E731
        got = (jax.jit(call)(ids),)
        ref = (gmm_reference.grouped_matmul(lhs, rhs, RowGroups(ids)),)
        ws = [rhs]
    # the kernels read the ids themselves: no XLA op builds a schedule from them before the launch
    jaxpr = jax.make_jaxpr(call)(ids).jaxpr
    assert set(_readers(jaxpr, set(jaxpr.invars))) == {"mpmd_map"}
    assert not _backend.interpret_races_found()
    for out, want, w in zip(got, ref, ws):
        per_row = np.einsum("mk,mkn->mn", np.asarray(lhs, np.float64), np.asarray(w, np.float64)[np.asarray(ids)])
        assert out.dtype == dtype and out.shape == per_row.shape
        name = "float32" if dtype == jnp.float32 else "bfloat16"
        assert_close(np.asarray(want, np.float32), per_row, name, "reference's per-row groups vs numpy")
        assert_close(np.asarray(out, np.float32), per_row, name, f"{kind} per-row groups vs numpy")
    with pytest.raises(ValueError, match="group_sizes.ids"):
        grouped_matmul(lhs[:, :128], jnp.zeros((g, 128, 256), dtype), RowGroups(ids[:-1]), config=CFG)
    with pytest.raises(ValueError, match="per-row groups"):
        grouped_matmul(lhs[:, :128], jnp.zeros((g, 128, 256), dtype), RowGroups(ids), config=WS)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_row_groups_over_several_weight_arrays(dtype):
    # rhs as a tuple of arrays whose groups follow one another (a decode token's routed and shared expert): the
    # same rows as the one concatenated array, through each array's copy of the main loop; and two such weights
    # in one launch (grouped_matmuls: gate and up); their gradients are the reference's
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.pallas.grouped_matmul import RowGroups

    ids = jnp.asarray([5, 2, 6, 0, 3, 1, 6], jnp.int32)
    lhs, rhs, _ = _inputs(ids.shape[0], 128, 128, [0] * 7, dtype, seed=21)
    parts = (rhs[:4], rhs[4:6], rhs[6:])
    got = jax.jit(lambda ids: grouped_matmul(lhs, parts, RowGroups(ids), config=CFG))(ids)
    whole = grouped_matmul(lhs, rhs, RowGroups(ids), config=CFG)
    assert not _backend.interpret_races_found()
    per_row = np.einsum("mk,mkn->mn", np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)[np.asarray(ids)])
    name = "float32" if dtype == jnp.float32 else "bfloat16"
    assert_close(np.asarray(got, np.float32), per_row, name, "weight arrays' per-row groups vs numpy")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(whole, np.float32))
    ref = gmm_reference.grouped_matmul(lhs, parts, RowGroups(ids))
    assert_close(np.asarray(ref, np.float32), per_row, name, "reference's weight arrays vs numpy")

    # linear losses: the cotangents do not depend on the forward, so the gradients test the VJP alone (the
    # kernel's fp32 products differ from the reference's in their last bits: checked above)
    ct = [jax.random.normal(jax.random.key(22 + i), got.shape, jnp.float32) for i in range(2)]

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, RowGroups(ids)).astype(jnp.float32) * ct[0])

    with jax.default_matmul_precision("highest"):  # the cotangent products at fp32 on the GPU too
        d_got = jax.grad(loss(lambda a, b, gs: grouped_matmul(a, b, gs, config=CFG)), argnums=(0, 1))(lhs, parts)
        d_ref = jax.grad(loss(gmm_reference.grouped_matmul), argnums=(0, 1))(lhs, parts)
    for a, b in zip(jax.tree.leaves(d_got), jax.tree.leaves(d_ref)):
        assert_close(np.asarray(a, np.float32), np.asarray(b, np.float32), name, "weight arrays' gradient")
    # several such weights times the same rows, one launch: each as its own call
    other = tuple(jnp.flip(r, axis=2) for r in parts)
    both = jax.jit(lambda ids: grouped_matmuls(lhs, (parts, other), RowGroups(ids), config=CFG))(ids)
    assert not _backend.interpret_races_found()
    np.testing.assert_array_equal(np.asarray(both[0], np.float32), np.asarray(got, np.float32))
    np.testing.assert_array_equal(np.asarray(both[1], np.float32),
                                  np.asarray(grouped_matmul(lhs, other, RowGroups(ids), config=CFG), np.float32))
    with jax.default_matmul_precision("highest"):
        d_both = jax.grad(lambda a: sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(
            grouped_matmuls(a, (parts, other), RowGroups(ids), config=CFG), ct)))(lhs)
        d_want = jax.grad(lambda a: sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(
            gmm_reference.grouped_matmuls(a, (parts, other), RowGroups(ids)), ct)))(lhs)
    assert_close(np.asarray(d_both, np.float32), np.asarray(d_want, np.float32), name, "several weights' gradient")
    with pytest.raises(ValueError, match="different shapes"):
        grouped_matmuls(lhs, (parts, parts[:2]), RowGroups(ids), config=CFG)
    with pytest.raises(ValueError, match="needs per-row groups"):
        grouped_matmul(lhs, parts, jnp.asarray([1, 1, 1, 1, 1, 1, 1], jnp.int32), config=CFG)
    with pytest.raises(ValueError, match=r"rhs\[1\]"):
        grouped_matmul(lhs, (rhs[:4], rhs[4:, :64]), RowGroups(ids), config=CFG)


@pytest.mark.parametrize("weights", ["bfloat16", "bfloat16_narrow_shared", "mxfp8"])
def test_moe_decode_token_skips_the_sort(monkeypatch, weights):
    # one token: its experts' rows go to the kernels in slot order (RowGroups), expert_order never runs;
    # against the sorted ragged_dot path on the same (dequantised) weights. bf16: two launches, gate and up
    # together, the shared expert riding along (the router's slot 0) where its widths are the experts' (else XLA's)
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    import m3jax.moe as moe
    import m3jax.pallas.grouped_matmul as gmm
    from m3jax.layers import dequantize_tree
    from m3jax.params import init_random_on_device
    from tests.conftest import tiny_config

    shared = 128 if weights == "bfloat16_narrow_shared" else 256
    cfg = tiny_config(hidden_size=256, intermediate_size=256, shared_intermediate_size=shared, num_local_experts=6,
                      num_experts_per_tok=3)
    p = init_random_on_device(cfg, seed=8, dtype=jnp.bfloat16, scale=0.3,
                              weights="mxfp8" if weights == "mxfp8" else "dequantize")["text"]["layers"][1]["moe"]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(1, 256)), jnp.bfloat16)
    ref = moe.moe_sorted(x, dequantize_tree(p, jnp.bfloat16), cfg.text, impl="ragged_dot")
    seen = []
    for name in ("grouped_matmul", "grouped_matmuls", "gemv_launch_mxfp8"):
        call = getattr(gmm, name)
        monkeypatch.setattr(gmm, name, lambda *a, call=call, name=name, **kw: seen.append((name, a))
                            or call(*a, **kw))
    monkeypatch.setattr(moe, "expert_order", lambda *a: pytest.fail("one decode token needs no sort"))
    got = moe.moe_sorted(x, p, cfg.text, impl="pallas")
    assert not _backend.interpret_races_found()
    assert seen and all(isinstance(a[2] if len(a) > 2 else a[0][0][2], gmm.RowGroups) for _, a in seen)
    if weights != "mxfp8":  # per launch: the weights, as arrays or (routed, shared) pairs
        launched = [(name, [len(w) if isinstance(w, tuple) else 1 for w in (a[1] if name == "grouped_matmuls"
                                                                            else (a[1],))]) for name, a in seen]
        rides = shared == 256
        assert launched == [("grouped_matmuls", [2 if rides else 1] * 2), ("grouped_matmul", [2 if rides else 1])]
        assert seen[0][1][2].ids.shape == (cfg.text.num_experts_per_tok + rides,)
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16", f"{weights} MoE decode token")


def test_m3config_moe_impl_is_validated_and_not_serialised():
    # Machine: any: argument / config checks, no kernel runs
    from m3jax.config import UnsupportedConfigError, config_to_hf
    from tests.conftest import tiny_config

    cfg = tiny_config().replace(moe_impl="pallas")
    assert "moe_impl" not in str(config_to_hf(cfg))
    with pytest.raises(UnsupportedConfigError, match="moe_impl"):
        tiny_config().replace(moe_impl="megablox")


M3_CONFIGS = {  # per schedule: the prefill tile and the decode tile
    "pipeline": (GroupedMatmulConfig(), GroupedMatmulConfig(block_m=64)),
    "warp_specialized": (GroupedMatmulConfig(block_n=256, schedule="warp_specialized"),
                         GroupedMatmulConfig(block_m=64, block_n=256, schedule="warp_specialized", split_k=4)),
    "warp_specialized_rows": (GroupedMatmulConfig(block_n=256, schedule="warp_specialized", wg_split="m"),),
    "warp_specialized_rows256": (GroupedMatmulConfig(block_m=256, block_n=128, schedule="warp_specialized",
                                                     wg_split="m"),),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_cuda_at_m3_shapes(dtype, schedule):
    # M3 expert GEMM (gate/up): 8192 tokens x top-4 rows, D = 6144 -> F = 3072, 128 experts. Lowered
    # for CUDA on the CPU (Pallas -> Mosaic GPU custom call); no GPU needed, nothing compiled.
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    args = (jax.ShapeDtypeStruct((32768, 6144), dtype), jax.ShapeDtypeStruct((128, 6144, 3072), dtype),
            jax.ShapeDtypeStruct((128,), jnp.int32))
    cfg = M3_CONFIGS[schedule][0]
    f = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, config=cfg, interpret=False))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    if dtype == jnp.bfloat16:  # the backward (forward output unused under grad of a sum): d lhs kernel
        grad = jax.jit(jax.grad(lambda a, b, s: jnp.sum(grouped_matmul(a, b, s, config=cfg, interpret=False)),
                                argnums=(0, 1)))
        text = grad.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


def _readers(jaxpr, tracked: set) -> list[str]:
    """The primitives that read the variables ``tracked`` of ``jaxpr`` or values computed from them, looking
    through calls (``jit``, ``custom_vjp_call``, ...) into their jaxprs; a Mosaic GPU kernel (``mpmd_map``)
    ends the chain."""
    names = []
    for eqn in jaxpr.eqns:
        hit = [i for i, v in enumerate(eqn.invars) if isinstance(v, jax.extend.core.Var) and v in tracked]
        if not hit:
            continue
        subs = [sub for value in eqn.params.values() for sub in (value if isinstance(value, (list, tuple)) else [value])
                if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr))]
        if eqn.primitive.name == "mpmd_map" or not subs:
            names.append(eqn.primitive.name)
            tracked = tracked | set(eqn.outvars)
            continue
        inner = getattr(subs[0], "jaxpr", subs[0])
        names += _readers(inner, {inner.invars[i] for i in hit})
    return names


def _mxfp8_weights(g, k, n, seed=0):
    """Random fp8 values over e4m3's range and E8M0 exponents around 2^0; a few all-zero blocks with
    exponent 0, as ``quantize_mxfp8`` writes them (2^-127 is subnormal: XLA:CPU flushes it to zero)."""
    r = np.random.default_rng(seed)
    values = (r.normal(size=(g, k, n)) * 60).astype(jnp.float8_e4m3fn)
    scales = r.integers(118, 132, size=(g, k // 32, n)).astype(np.uint8)
    scales[0, 0, :5] = 0
    values[0, :32, :5] = 0
    return jnp.asarray(values), jnp.asarray(scales)


def _check_mxfp8(lhs, values, scales, gs, cfg=CFG, traced_sizes=False):
    # traced_sizes: group sizes as a jit argument, as the MoE layer passes them (eager, they are constants)
    call = lambda gs: grouped_matmul_mxfp8(lhs, values, scales, gs, config=cfg)
    got = jax.jit(call)(gs) if traced_sizes else call(gs)
    ref = gmm_reference.grouped_matmul_mxfp8(lhs, values, scales, gs)
    assert not _backend.interpret_races_found()
    assert got.dtype == lhs.dtype and got.shape == ref.shape
    got = np.asarray(got, np.float32)
    assert not np.any(got[int(np.sum(gs)):]), "rows past sum(group_sizes) must be zero"
    # bf16: the dequantised weights are exact in bf16, so only the summation order and the output
    # rounding differ; fp32: three bf16 pieces of lhs, fp32-exact
    assert_close(got, ref, "bfloat16" if lhs.dtype == jnp.bfloat16 else "float32", "grouped_matmul_mxfp8 vs reference")


@pytest.mark.parametrize("dtype,schedule,n", [(jnp.bfloat16, "pipeline", 128), (jnp.float32, "pipeline", 128),
                                              (jnp.bfloat16, "warp_specialized", 256),
                                              (jnp.bfloat16, "warp_specialized", 128)])
def test_mxfp8_kernel_matches_dequantised_reference(dtype, schedule, n):
    # the fp8 tiles dequantised in the kernel (two scale rows per 64-deep K step, two K steps, tiles
    # straddling groups, empty groups); warp-specialised: each consumer dequantises its n / 2 columns
    # (64 of them: the fp8 tile swizzled by 64 bytes)
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    m, sizes = PATTERNS["empty_groups"]
    cfg = GroupedMatmulConfig(block_m=64, block_n=n, max_concurrent_steps=2, schedule=schedule)
    lhs, _, gs = _inputs(m, 128, n, sizes, dtype)
    _check_mxfp8(lhs, *_mxfp8_weights(len(sizes), 128, n), gs, cfg=cfg)


@pytest.mark.parametrize("block_m,cluster", [(256, 1), (256, 2), (384, 1)])
def test_mxfp8_256_row_tiles_match_dequantised_reference(block_m, cluster):
    # MULTI_VISIT on the 256- and 384-row tiles with MXFP8 weights: each consumer converts the whole fp8
    # tile (all 128 columns) into its own bf16 tiles, and a consumer without rows in a visit converts none
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    m, sizes = MULTI_VISIT
    lhs, _, gs = _inputs(m, 128, 256, sizes, jnp.bfloat16, seed=10)
    cfg = dataclasses.replace(WS_ROWS256, block_m=block_m, cluster=cluster)
    _check_mxfp8(lhs, *_mxfp8_weights(len(sizes), 128, 256, seed=11), gs, cfg=cfg, traced_sizes=True)


@pytest.mark.parametrize("schedule,n", [("pipeline", 128), ("warp_specialized", 256),
                                        ("warp_specialized_rows256", 128)])
def test_mxfp8_tile_dequantisation_is_exact(schedule, n):
    # the in-kernel conversion gives the MMA exactly the bf16 weights of the dequantise-on-load path: the
    # MXFP8 kernel equals the bf16 kernel of the same config (same MMAs, same order) on those weights,
    # bit for bit, over a wide spread of scales (2^-27 .. 2^12)
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    m, sizes = PATTERNS["group_larger_than_tile"]
    cfg = (WS_ROWS256 if schedule == "warp_specialized_rows256"
           else GroupedMatmulConfig(block_m=64, block_n=n, max_concurrent_steps=2, schedule=schedule))
    lhs, _, gs = _inputs(m, 128, n, sizes, jnp.bfloat16, seed=5)
    values, _ = _mxfp8_weights(len(sizes), 128, n, seed=6)
    scales = jnp.asarray(np.random.default_rng(7).integers(100, 140, size=(len(sizes), 128 // 32, n)), jnp.uint8)
    got = grouped_matmul_mxfp8(lhs, values, scales, gs, config=cfg)
    dequantised = gmm_reference.dequantize_mxfp8(values, scales).astype(jnp.bfloat16)
    want = grouped_matmul(lhs, dequantised, gs, config=cfg)
    assert not _backend.interpret_races_found()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_mxfp8_split_k_decode_rows():
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    lhs, _, gs = _inputs(9, 256, 256, [2, 0, 1, 0, 5], jnp.bfloat16, seed=8)
    cfg = GroupedMatmulConfig(block_m=64, block_n=256, max_concurrent_steps=2, schedule="warp_specialized", split_k=2)
    _check_mxfp8(lhs, *_mxfp8_weights(len(gs), 256, 256, seed=2), gs, cfg=cfg)


@pytest.mark.parametrize("dtype,m,sizes,split,k", [
    # visits of 1, 2, 3-4 and 5-8 rows (each of the four row bodies), empty groups, a row past the sum
    (jnp.bfloat16, 20, [1, 0, 2, 3, 0, 7, 5], 2, 256),
    # fp32 lhs (fp32 arithmetic, no bf16 pieces); a group of 11 rows in two visits, one group of 4
    (jnp.float32, 15, [11, 0, 4], 1, 256),
    # a K part of 10 steps over the pipeline's 4 slots, each slot refilled while others are read (M3's
    # parts are 12 steps): the refill must wait for every warp's reads of the slot
    (jnp.bfloat16, 6, [2, 0, 4], 1, 640),
])
def test_mxfp8_gemv_matches_dequantised_reference(dtype, m, sizes, split, k):
    # the decode GEMV: CUDA-core FMAs over fp8 rows, scales applied per 32-row partial sum; two N tiles,
    # several K steps per part
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    lhs, _, gs = _inputs(m, k, 512, sizes, dtype, seed=3)
    cfg = GroupedMatmulConfig(block_m=64, block_n=256, schedule="gemv", split_k=split)
    # traced group sizes: every row body the rows allow is built (constant ones build those the
    # schedule needs: test_gemv_launch_of_several_problems_matches_one_call_each)
    _check_mxfp8(lhs, *_mxfp8_weights(len(sizes), k, 512, seed=4), gs, cfg=cfg, traced_sizes=True)


@pytest.mark.parametrize("schedule", ["gemv", "pipeline"])
def test_mxfp8_several_weights_match_one_call_each(schedule):
    # an MLP's gate and up: one launch on the gemv schedule (each weight its own visits, K parts and
    # output), one call per weight on the MMA schedules; each equal to its own dequantised reference
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    m, sizes = 11, [3, 0, 6, 1]
    lhs, _, gs = _inputs(m, 256, 256, sizes, jnp.bfloat16, seed=5)
    n = 256 if schedule == "gemv" else 128
    cfg = GroupedMatmulConfig(block_m=64, block_n=n, schedule=schedule, split_k=2 if schedule == "gemv" else 1)
    weights = tuple(_mxfp8_weights(len(sizes), 256, 256, seed=s) for s in (6, 7, 8))
    _check_several(lhs, weights, gs, cfg)
    with pytest.raises(ValueError, match="different shapes"):
        grouped_matmuls_mxfp8(lhs, (weights[0], _mxfp8_weights(len(sizes), 256, 512)), gs, config=cfg)


def _check_several(lhs, weights, gs, cfg):
    got = grouped_matmuls_mxfp8(lhs, weights, gs, config=cfg)
    assert not _backend.interpret_races_found()
    assert len(got) == len(weights)
    for ref, out in zip(grouped_matmuls_mxfp8(lhs, weights, gs, implementation="reference"), got):
        assert out.dtype == lhs.dtype and out.shape == ref.shape
        assert not np.any(np.asarray(out, np.float32)[int(np.sum(gs)):]), "rows past sum(group_sizes) must be zero"
        assert_close(np.asarray(out, np.float32), ref, "bfloat16", "grouped_matmuls_mxfp8 vs reference")


@pytest.mark.parametrize("dtype,m,k,widths", [
    # three widths (two of one shape: one problem of two weights) in one launch; K = 640 in parts of 5
    # steps, more than the pipeline's slots
    (jnp.bfloat16, 1, 640, (512, 256, 512, 768)),
    # the row bodies for 4-5 and 8 rows; fp32 lhs and out in fp32 arithmetic (the products of bf16
    # weights exact in fp32)
    (jnp.bfloat16, 5, 128, (256, 512)),
    (jnp.float32, 8, 128, (256,)),
])
def test_dense_gemvs_match_reference(dtype, m, k, widths):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.pallas.grouped_matmul import dense_gemvs

    rng = np.random.default_rng(11)
    lhs = jnp.asarray(rng.normal(size=(m, k)), dtype)
    ws = tuple(jnp.asarray(rng.normal(size=(k, n)) / 8, jnp.bfloat16) for n in widths)
    got = dense_gemvs(lhs, ws)
    assert not _backend.interpret_races_found()
    for out, want in zip(got, dense_gemvs(lhs, ws, implementation="reference")):
        assert out.dtype == dtype and out.shape == want.shape
        assert_close(np.asarray(out, np.float32), np.asarray(want, np.float32),
                     "bfloat16" if dtype == jnp.bfloat16 else "float32", "dense_gemvs vs reference")


def test_dense_gemvs_refuse_what_they_cannot_take():
    # Machine: any (the checks run before any kernel)
    from m3jax.pallas.grouped_matmul import dense_gemvs

    x, w = jnp.ones((2, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16)
    for lhs, weight, what in ((x, w[:, :128], "N=128"), (jnp.ones((9, 128), jnp.bfloat16), w, "M=9"),
                              (x, w.astype(jnp.float32), "float32"), (x, w[:96], "K")):
        with pytest.raises(ValueError, match=what):
            dense_gemvs(lhs, (w, weight))


def test_linears_run_the_bf16_decode_projections_in_one_launch(monkeypatch):
    # m3jax.moe.linears(dense_gemv=True): the bf16 weights the gemv takes at decode rows go in one
    # dense_gemvs launch whatever their widths; a width it refuses (N = 128: the index k), one past
    # DENSE_GEMV_MAX_N and more rows than DENSE_GEMV_ROWS (raised here to 3, then below) as XLA dots;
    # each output the weight's product
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    import m3jax.pallas.grouped_matmul as gmm
    from m3jax import moe
    from m3jax.moe import linears

    monkeypatch.setattr(moe, "DENSE_GEMV_ROWS", 3)
    monkeypatch.setattr(moe, "DENSE_GEMV_MAX_N", 512)

    launches, launch = [], gmm.dense_gemvs
    monkeypatch.setattr(gmm, "dense_gemvs", lambda lhs, ws, **kw: launches.append([w.shape for w in ws])
                        or launch(lhs, ws, **kw))
    rng = np.random.default_rng(12)
    ws = tuple(jnp.asarray(rng.normal(size=s) / 16, jnp.bfloat16)
               for s in ((256, 4, 128), (256, 2, 128), (256, 2, 128), (256, 128), (256, 1024)))
    for rows, want_launches in ((3, [[(256, 512), (256, 256), (256, 256)]]), (4, [])):
        launches.clear()
        x = jnp.asarray(rng.normal(size=(1, rows, 256)), jnp.bfloat16)
        got = linears(x, ws, "pallas", dense_gemv=True)
        assert launches == want_launches
        for w, out in zip(ws, got):
            want = jnp.tensordot(x, w, axes=1, precision=jax.lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)
            assert out.shape == want.shape
            assert_close(np.asarray(out, np.float32), np.asarray(want), "bfloat16", "linears vs tensordot")
    launches.clear()
    linears(jnp.ones((1, 2, 256), jnp.bfloat16), ws, "pallas")
    assert launches == []  # dense_gemv off: XLA's dots
    assert not _backend.interpret_races_found()


def test_gemv_launch_of_several_problems_matches_one_call_each():
    # a decode step's routed gate + up (groups, rows sorted by group) and shared expert (one group, a
    # constant schedule) in one launch: each problem its own K, N, split and rows; the same values as
    # its own launch (same kernel body and K split), and its dequantised reference
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.pallas.grouped_matmul import gemv_launch_mxfp8

    lhs_a, _, gs_a = _inputs(9, 256, 256, [2, 0, 5, 1], jnp.bfloat16, seed=13)
    lhs_b = jnp.asarray(np.random.default_rng(14).normal(size=(3, 128)), jnp.bfloat16)
    gs_b = np.full((1,), 3, np.int32)
    wa = tuple(_mxfp8_weights(4, 256, 256, seed=s) for s in (15, 16))
    wb = (_mxfp8_weights(1, 128, 512, seed=17),)
    cfg = lambda split: GroupedMatmulConfig(block_m=64, block_n=256, schedule="gemv", split_k=split)
    problems = ((lhs_a, wa, gs_a, cfg(2)), (lhs_b, wb, gs_b, cfg(1)))
    got = gemv_launch_mxfp8(problems)
    assert not _backend.interpret_races_found()
    refs = gemv_launch_mxfp8(problems, implementation="reference")
    for (lhs, weights, gs, c), outs, ref in zip(problems, got, refs):
        alone = grouped_matmuls_mxfp8(lhs, weights, gs, config=c)
        assert len(outs) == len(weights) == len(ref)
        for out, one, want in zip(outs, alone, ref):
            assert out.shape == want.shape and out.dtype == lhs.dtype
            np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(one, np.float32))
            assert_close(np.asarray(out, np.float32), want, "bfloat16", "gemv launch vs reference")
    with pytest.raises(ValueError, match="gemv schedule"):
        gemv_launch_mxfp8(((lhs_a, wa, gs_a, CFG),))


def _moe_decode_case(tokens):
    from m3jax.params import init_random_on_device
    from tests.conftest import tiny_config

    cfg = tiny_config(hidden_size=256, intermediate_size=256, shared_intermediate_size=256, num_local_experts=4,
                      num_experts_per_tok=2)
    p = init_random_on_device(cfg, seed=7, dtype=jnp.bfloat16, scale=0.3, weights="mxfp8")["text"]["layers"][1]["moe"]
    x = jnp.asarray(np.random.default_rng(2).normal(size=(tokens, 256)), jnp.bfloat16)
    return cfg, p, x


def _is_shared(problem):  # the shared expert's problem: one group, its size known when tracing
    return isinstance(problem[2], np.ndarray) and problem[2].shape == (1,)


def test_moe_decode_shares_gemv_launches_with_the_shared_expert(monkeypatch):
    # decode rows with every MoE weight MXFP8: routed and shared gate + up in one launch, then both downs
    # (two launches of two problems, the shared expert's first at several tokens); the same values as
    # separate launches at the same K splits, and close to the block on the dequantised weights
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    import m3jax.moe as moe
    import m3jax.pallas.grouped_matmul as gmm
    from m3jax.layers import dequantize_tree

    cfg, p, x = _moe_decode_case(3)
    launches, launch = [], gmm.gemv_launch_mxfp8
    monkeypatch.setattr(gmm, "gemv_launch_mxfp8", lambda problems, **kw: launches.append(problems) or launch(problems, **kw))
    got = moe.moe_sorted(x, p, cfg.text, impl="pallas")
    assert [len(pr) for pr in launches] == [2, 2] and all(_is_shared(pr[0]) for pr in launches)
    # apart: the shared expert's two GEMM launches of its own, at the splits it had in the shared launches
    lead = {len(pr[0][1]): pr[0][3] for pr in launches}  # weights in the launch (gate + up: 2, down: 1) -> config
    monkeypatch.setattr(moe, "_gemv_configs", lambda *a: None)
    monkeypatch.setattr(moe, "_dense_kernel_config", lambda impl, rows, one, weights=1: lead[weights])
    apart = moe.moe_sorted(x, p, cfg.text, impl="pallas")
    assert len(launches) == 2
    assert not _backend.interpret_races_found()
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(apart, np.float32))
    ref = moe.moe_sorted(x, dequantize_tree(p, jnp.bfloat16), cfg.text, impl="ragged_dot")
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16", "MXFP8 MoE decode vs dequantised")


@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_decode_orders_the_shared_expert_by_token_count(monkeypatch, tokens):
    # one token: the shared expert follows the routed experts at the K split it has alone; several: it
    # leads each launch, split to at most one CTA per SM (gemv.leading_split). Launches run on the
    # reference (the kernel is the test above); the order must not change the values
    # Machine: any: launches on the jnp reference; the order is host-side
    import m3jax.moe as moe
    import m3jax.pallas.grouped_matmul as gmm
    from m3jax.pallas.grouped_matmul import gemv

    cfg, p, x = _moe_decode_case(tokens)
    launches, launch = [], gmm.gemv_launch_mxfp8
    monkeypatch.setattr(gmm, "gemv_launch_mxfp8", lambda problems, **kw: launches.append(problems) or launch(
        problems, implementation="reference", **kw))
    got = moe.moe_sorted(x, p, cfg.text, impl="pallas")
    assert [len(pr) for pr in launches] == [2, 2]
    for problems, weights in zip(launches, (2, 1)):
        shared = problems[0] if tokens > 1 else problems[1]
        assert _is_shared(shared) and not _is_shared(problems[1 if tokens > 1 else 0])
        k, n = shared[0].shape[1], shared[1][0][0].shape[2]
        alone = gemv.decode_split(tokens, k, n, 1, weights)
        assert shared[3].split_k == (gemv.leading_split(k, n, weights) if tokens > 1 else alone)
    monkeypatch.setattr(moe, "_shared_leads", lambda configs, t, ps: (configs, False))
    last = moe.moe_sorted(x, p, cfg.text, impl="pallas")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(last, np.float32))


def test_gemv_builds_only_the_row_bodies_its_visits_can_run():
    # a body is a copy of the pipeline to lower and compile: with constant group sizes (a dense weight)
    # only those the schedule's visits need, with traced ones those of at most M rows
    # Machine: any: host-side planning, no kernel runs
    from m3jax.pallas.grouped_matmul import gemv

    w = _mxfp8_weights(1, 256, 256, seed=1)
    bodies = lambda sizes, m: gemv._plan(gemv.Problem(sizes, m, jnp.ones((m, 256), jnp.bfloat16), (w,), 1))["bodies"]
    assert bodies(np.array([1], np.int32), 1) == (1,)
    assert bodies(np.array([3], np.int32), 3) == (4,)
    assert bodies(np.array([19], np.int32), 19) == (4, 8)  # visits of 8, 8 and 3 rows
    assert bodies(np.array([2, 0, 5], np.int32), 7) == (2, 8)
    seen = []
    for m in (1, 4, 5, 32):
        jax.jit(lambda sizes, m=m: seen.append(bodies(sizes, m)) or sizes)(jnp.array([m], jnp.int32))
    assert seen == [(1,), (1, 2, 4), (1, 2, 4, 8), (1, 2, 4, 8)]


@pytest.mark.parametrize("k,n,weights", [(6144, 3072, 2), (3072, 6144, 1), (256, 256, 2), (192, 2560, 1), (4096, 65536, 1)])
def test_leading_split_keeps_one_cta_per_sm(k, n, weights):
    # the largest split that divides K in block_k steps and keeps weights x N tiles x split CTAs within
    # the SMs; 1 where even that is more CTAs than SMs
    # Machine: any: host-side planning, no kernel runs (the current target's SM count)
    from m3jax.pallas.grouped_matmul import gemv

    sms = _backend.current_target().num_sms
    tiles = weights * (n // gemv.BLOCK_N)
    split = gemv.leading_split(k, n, weights)
    valid = [s for s in gemv.SPLITS if k % (s * gemv.BLOCK_K) == 0]
    assert split in valid
    assert tiles * split <= sms or split == valid[0]
    assert all(tiles * s > sms for s in valid if s > split)


@pytest.mark.parametrize("m,sizes", [(20, [1, 0, 2, 3, 0, 7, 5]), (30, [17, 0, 0, 9]), (3, [0, 0, 0])])
def test_gemv_schedule_covers_each_row_once(m, sizes):
    # Machine: any: host-side planning, no kernel runs
    from m3jax.pallas.grouped_matmul import gemv

    sched = np.asarray(gemv.schedule(jnp.asarray(sizes, jnp.int32), m))
    assert sched.shape == (gemv.visits_bound(m, len(sizes)), 3)
    seen = np.zeros(m, int)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for grp, lo, hi in sched:
        assert 0 <= hi - lo <= gemv.ROWS
        if hi > lo:
            assert starts[grp] <= lo and hi <= starts[grp + 1]
            seen[lo:hi] += 1
    np.testing.assert_array_equal(seen, np.arange(m) < sum(sizes))


def test_deal_visits_matches_numpy():
    # the schedules' visits dealt to groups (the group lookup one compare-and-sum fusion): group against
    # NumPy's binary search, ordinal and liveness against dealing them one by one, on counts with empty
    # groups (repeated running sums) and visits past the last group
    # Machine: any: jnp against numpy, no kernel
    from m3jax.pallas.grouped_matmul.tiles import deal_visits

    rng = np.random.default_rng(7)
    for g in (1, 5, 128):
        count = (rng.integers(0, 3, g) * (rng.random(g) < 0.6)).astype(np.int32)
        cum = np.cumsum(count)
        n = int(cum[-1]) + 4
        grp, ordinal, live = (np.asarray(a) for a in deal_visits(jnp.asarray(count), n))
        np.testing.assert_array_equal(grp, np.minimum(np.searchsorted(cum, np.arange(n), side="right"), g - 1))
        dealt = [(i, j) for i in range(g) for j in range(count[i])]
        np.testing.assert_array_equal(live, np.arange(n) < len(dealt))
        np.testing.assert_array_equal(np.stack([grp, ordinal], 1)[live], np.asarray(dealt, np.int32).reshape(-1, 2))


@pytest.mark.parametrize("target", ["HOPPER", "BLACKWELL"])
def test_mxfp8_gemv_lowers_for_cuda_at_m3_shapes(target):
    # one decode token's routed gate (4 rows in 4 of 128 experts) and the shared expert's down projection
    # (one group): no MMA, so one kernel for sm_90a and sm_100a
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    from m3jax.pallas.grouped_matmul import layer_config

    for m, g, k, n in ((4, 128, 6144, 3072), (1, 1, 3072, 6144)):
        args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((g, k // 32, n), jnp.uint8), jax.ShapeDtypeStruct((g,), jnp.int32))
        with _backend.lowering_for(getattr(_backend, target)):
            cfg = layer_config(m, k, n, g, k // 32)
            assert cfg.schedule == "gemv"
            f = jax.jit(lambda a, b, c, s, cfg=cfg: grouped_matmul_mxfp8(a, b, c, s, config=cfg))
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


def test_mxfp8_reference_is_the_checkpoint_dequantisation():
    # Machine: any: jnp references only
    from m3jax.checkpoint import dequantize_mxfp8

    values, scales = _mxfp8_weights(2, 64, 96, seed=1)
    got = gmm_reference.dequantize_mxfp8(values, scales)
    for e in range(2):  # the checkpoint's [out, in] layout is ours transposed
        want = dequantize_mxfp8(np.asarray(values[e]).T, np.asarray(scales[e]).T)
        np.testing.assert_array_equal(np.asarray(got[e]).T, want)
    assert "whole number" in mxfp8_unsupported_reason(64, 128, 128, 2, 3)
    assert "must divide block_k" in mxfp8_unsupported_reason(64, 256, 128, 2, 2)  # groups of 128 inputs
    assert "multiple of 8" in mxfp8_unsupported_reason(64, 128, 128, 2, 32)  # groups of 4 inputs


@pytest.mark.parametrize("schedule", ["pipeline", "warp_specialized", "warp_specialized_rows256"])
def test_mxfp8_lowers_for_cuda_at_m3_shapes(schedule):
    # M3's expert down projection (F = 3072 -> D = 6144) for a 4096-token prefill chunk, and decode rows
    # (64-row tiles): fp8 tiles + scale rows by TMA, dequantised in registers, wgmma (sm_90a).
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    configs = list(zip((16384, 32), M3_CONFIGS[schedule]))
    if schedule == "warp_specialized":  # consumers of 64 fp8 columns (64-byte swizzle)
        configs.append((16384, GroupedMatmulConfig(block_n=128, schedule="warp_specialized")))
    if schedule == "warp_specialized_rows256":  # and on two-CTA clusters (the lhs tile multicast)
        configs.append((16384, dataclasses.replace(M3_CONFIGS[schedule][0], cluster=2)))
    for m, cfg in configs:
        args = (jax.ShapeDtypeStruct((m, 3072), jnp.bfloat16), jax.ShapeDtypeStruct((128, 3072, 6144), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((128, 96, 6144), jnp.uint8), jax.ShapeDtypeStruct((128,), jnp.int32))
        with _backend.lowering_for(_backend.HOPPER):
            f = jax.jit(lambda a, b, c, s, cfg=cfg: grouped_matmul_mxfp8(a, b, c, s, config=cfg))
            text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("custom_call @mosaic_gpu") == 1


def test_moe_layer_with_mxfp8_experts_pallas_matches_dequantised():
    # the MoE block on MXFP8 params (param_specs(cfg, "mxfp8")): routed experts through the MXFP8 kernel,
    # the shared expert too (m3jax.moe.linear: 20 rows); against the same weights dequantised and ragged_dot
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.layers import MXFP8Weight, dequantize_tree
    from m3jax.moe import moe_sorted
    from m3jax.params import init_random_on_device
    from tests.conftest import tiny_config

    cfg = tiny_config(hidden_size=128, intermediate_size=128, shared_intermediate_size=128, num_local_experts=3,
                      num_experts_per_tok=2)  # few experts: each interpreted visit costs
    p = init_random_on_device(cfg, seed=6, dtype=jnp.bfloat16, scale=0.3, weights="mxfp8")["text"]["layers"][1]["moe"]
    assert isinstance(p["gate"], MXFP8Weight) and isinstance(p["shared"]["down"], MXFP8Weight)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(20, 128)), jnp.bfloat16)
    got = moe_sorted(x, p, cfg.text, impl="pallas")
    ref = moe_sorted(x, dequantize_tree(p, jnp.bfloat16), cfg.text, impl="ragged_dot")
    assert not _backend.interpret_races_found()
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16", "MXFP8 MoE pallas vs dequantised")


def _count_mxfp8_kernel_calls(monkeypatch) -> list:
    """Every MXFP8 kernel product the model asks for: (lhs shape, values shape, weights in that call)."""
    import m3jax.pallas.grouped_matmul as gmm

    calls, one, several = [], gmm.grouped_matmul_mxfp8, gmm.grouped_matmuls_mxfp8

    def counted(lhs, values, *args, **kw):
        calls.append((lhs.shape, values.shape, 1))
        return one(lhs, values, *args, **kw)

    def counted_several(lhs, weights, *args, **kw):
        calls.extend((lhs.shape, w[0].shape, len(weights)) for w in weights)
        return several(lhs, weights, *args, **kw)

    monkeypatch.setattr(gmm, "grouped_matmul_mxfp8", counted)
    monkeypatch.setattr(gmm, "grouped_matmuls_mxfp8", counted_several)
    return calls


def test_linear_mxfp8_takes_the_kernel_at_decode_rows(monkeypatch):
    # the MXFP8 matmuls outside the routed experts (m3jax.moe.linear): the kernel with one group up to
    # MXFP8_KERNEL_MAX_ROWS rows, the weight dequantised at use past them and on "ragged_dot"; "auto"
    # takes the kernel on a GPU (where its canary passed) and dequantises off it (this test runs on
    # both); every way the dequantised weight's product (bf16 accumulation-order tolerance)
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU; what "auto" picks branches on the
    # backend (the kernel on a GPU, dequantised off it)
    from m3jax.layers import MXFP8Weight, dequantize
    from m3jax.moe import MXFP8_KERNEL_MAX_ROWS, linear

    calls = _count_mxfp8_kernel_calls(monkeypatch)
    r = np.random.default_rng(3)
    v2, s2 = _mxfp8_weights(1, 256, 256, seed=4)
    weights = {  # x's trailing shape, the weight, in_axes: a [D, F] MLP weight, wq [D, N, H], wo [N, H, D]
        "mlp": ((256,), MXFP8Weight(v2[0], s2[0]), 1),
        "wq": ((256,), MXFP8Weight(v2[0].reshape(256, 4, 64), s2[0].reshape(8, 4, 64)), 1),
        "wo": ((4, 64), MXFP8Weight(v2[0].reshape(4, 64, 256), s2[0].reshape(4, 2, 256)), 2),
    }
    for name, (trail, w, in_axes) in weights.items():
        for rows, impl, kernel in ((3, "pallas", True), (MXFP8_KERNEL_MAX_ROWS + 1, "pallas", False),
                                   (3, "ragged_dot", False), (3, "auto", _backend.on_gpu())):
            x = jnp.asarray(r.normal(size=(1, rows, *trail)), jnp.bfloat16)
            before = len(calls)
            got = linear(x, w, impl, in_axes=in_axes)
            assert (len(calls) > before) == kernel, (name, rows, impl)
            want = jnp.tensordot(x, dequantize(w, jnp.bfloat16), axes=in_axes)
            assert got.shape == want.shape == (1, rows, *w.values.shape[in_axes:])
            assert_close(got.astype(jnp.float32), want.astype(jnp.float32), "bfloat16", f"linear {name} {rows} {impl}")
    assert not _backend.interpret_races_found()
    with pytest.raises(ValueError, match="not its last input axis"):  # wo contracted over its first axis only
        linear(jnp.ones((2, 4), jnp.bfloat16), weights["wo"][1], "pallas", in_axes=1)


def test_linears_mxfp8_one_launch_per_shape(monkeypatch):
    # m3jax.moe.linears: MXFP8 weights of one shape at decode rows as one kernel call (the gemv's
    # several-weight launch), a weight of another shape or a bf16 one on its own; each the dequantised
    # weight's product
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.layers import MXFP8Weight, dequantize
    from m3jax.moe import linears

    calls = _count_mxfp8_kernel_calls(monkeypatch)
    (va, sa), (vb, sb) = (_mxfp8_weights(1, 256, 256, seed=s) for s in (9, 10))
    a, b = MXFP8Weight(va[0], sa[0]), MXFP8Weight(vb[0], sb[0])
    x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 3, 256)), jnp.bfloat16)
    dense = jnp.asarray(np.random.default_rng(5).normal(size=(256, 64)), jnp.bfloat16)
    for ws, fused in (((a, b), 2), ((a, b, a), 3), ((a, dense), None)):
        before = len(calls)
        got = linears(x, ws, "pallas")
        assert [c[2] for c in calls[before:]] == ([fused] * fused if fused else [1])
        for w, out in zip(ws, got):
            want = jnp.tensordot(x, dequantize(w, jnp.bfloat16) if isinstance(w, MXFP8Weight) else w, axes=1)
            assert_close(out.astype(jnp.float32), want.astype(jnp.float32), "bfloat16", "linears vs dequantised")
    assert not _backend.interpret_races_found()


def test_gemv_schedule_is_a_constant_for_a_dense_weight(monkeypatch):
    # a dense weight's one group (m3jax.moe.linears) is known when tracing: the gemv's visit schedule is
    # computed then (in numpy), not by kernels of the program; routed experts' traced group sizes keep it
    # traced
    # Machine: any: host-side planning, no kernel runs
    from m3jax.layers import MXFP8Weight
    from m3jax.moe import grouped_matmuls, linears
    from m3jax.pallas.grouped_matmul import gemv

    traced = []

    def recorded(f):
        def run(*args):
            out = f(*args)
            traced.append(isinstance(out, jax.core.Tracer))
            return out
        return run

    monkeypatch.setattr(gemv, "schedule", recorded(gemv.schedule))
    monkeypatch.setattr(gemv, "one_group_schedule", recorded(gemv.one_group_schedule))
    (va, sa), (vb, sb) = (_mxfp8_weights(2, 256, 256, seed=s) for s in (11, 12))
    x = jnp.asarray(np.random.default_rng(6).normal(size=(3, 256)), jnp.bfloat16)
    jax.jit(lambda x: linears(x, (MXFP8Weight(va[0], sa[0]), MXFP8Weight(vb[0], sb[0])), "pallas"))(x)
    ws = (MXFP8Weight(va, sa), MXFP8Weight(vb, sb))
    jax.jit(lambda x, sizes: grouped_matmuls(x, ws, sizes, "pallas"))(x, jnp.array([1, 2], jnp.int32))
    assert traced == [False, True]


def test_dense_layer_decode_step_with_mxfp8_weights(monkeypatch):
    # a decode token through layer 0 (full attention + dense MLP) with every matmul weight MXFP8 and
    # moe_impl="pallas": q/k/v/o and the MLP through the kernel; against the layer on the same weights
    # dequantised, moe_impl="ragged_dot"
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.layers import dequantize_tree, rope_angles
    from m3jax.model import decoder_layer
    from m3jax.params import init_random_on_device
    from tests.conftest import tiny_config

    calls = _count_mxfp8_kernel_calls(monkeypatch)
    cfg = tiny_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      dense_intermediate_size=256, num_hidden_layers=1, layer_types=("full_attention",),
                      mlp_layer_types=("dense",)).replace(moe_impl="pallas")  # layer 0 alone: no MoE weights to draw
    lp = init_random_on_device(cfg, seed=2, dtype=jnp.bfloat16, scale=0.3, weights="mxfp8")["text"]["layers"][0]
    h = jnp.asarray(np.random.default_rng(5).normal(size=(1, 1, 256)), jnp.bfloat16)
    pos = jnp.zeros((1, 1), jnp.int32)
    angles = rope_angles(pos, cfg.text.rotary_dim, cfg.text.rope_theta)
    got = decoder_layer(h, lp, angles, pos, cfg, 0)[0]
    assert len(calls) == 7  # wq, wk, wv, wo, gate, up, down
    assert [c[2] for c in calls].count(2) == 4  # k and v, gate and up: a call each
    ref = decoder_layer(h, dequantize_tree(lp, jnp.bfloat16), angles, pos, cfg.replace(moe_impl="ragged_dot"), 0)[0]
    assert len(calls) == 7
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16", "MXFP8 dense layer, kernel vs dequantised")


def test_layer_config_per_regime(monkeypatch):
    # Machine: any: host-side config choice for the current target (Hopper off the GPU and on the H200)
    from m3jax.pallas.grouped_matmul import kernel, layer_config

    # Hopper's choice (kernel.LAYER_SCHEDULE): warp-specialised prefill at any row count, bf16 on the
    # 256-row tiles (consumers split rows) below 224 rows per expert and the 384-row tiles from there,
    # MXFP8 on 128 x 256 (consumers split N); pipelined decode in 64-row tiles
    rows256 = GroupedMatmulConfig(block_m=256, block_n=128, schedule="warp_specialized", wg_split="m")
    rows384 = dataclasses.replace(rows256, block_m=384)
    wide = GroupedMatmulConfig(block_m=128, block_n=256, schedule="warp_specialized")
    assert (kernel.PREFILL_ROWS256, kernel.PREFILL_ROWS384, kernel.PREFILL_128X256) == (rows256, rows384, wide)
    # the 4096- and 8192-token chunks' rows (top-4), and either side of 224 rows per expert
    for m, rows in ((16384, rows256), (224 * 128 - 1, rows256), (224 * 128, rows384), (32768, rows384)):
        assert layer_config(m, 6144, 3072, 128) == layer_config(m, 3072, 6144, 128) == rows
        assert layer_config(m, 6144, 3072, 128, 192) == layer_config(m, 3072, 6144, 128, 96) == wide
    # N = 384 fits 128-column tiles only: bf16 keeps the 256-row tiles, MXFP8 falls back to the pipeline
    assert layer_config(16384, 6144, 384, 128) == rows256
    assert layer_config(16384, 6144, 384, 128, 192) == GroupedMatmulConfig(block_m=128)
    assert layer_config(4, 6144, 3072, 128) == GroupedMatmulConfig(block_m=64)
    # MXFP8 at decode rows (<= 64, <= 8 per group on average): the gemv schedule, K split into parts of
    # 768 rows or more parts where too few CTAs would run (gemv.decode_split)
    sms = _backend.current_target().num_sms
    one_token = layer_config(4, 6144, 3072, 128, 192)
    assert (one_token.schedule, one_token.block_n, one_token.split_k) == ("gemv", 256, 8)
    assert layer_config(64, 3072, 6144, 128, 96) == GroupedMatmulConfig(block_m=64, block_n=256, schedule="gemv",
                                                                        split_k=4)
    shared = layer_config(1, 3072, 6144, 1, 96)  # one group: 24 N tiles, split until 2 CTAs per SM (or 32)
    assert shared.schedule == "gemv" and 24 * shared.split_k >= min(2 * sms, 24 * 32)
    assert layer_config(1, 192, 6144, 1, 6).split_k == 1  # K = 3 x 64 splits in no power of 2
    # the weights sharing a launch count: gate and up of the shared expert are 2 x 12 N tiles
    pair = layer_config(1, 6144, 3072, 1, 192, weights=2)
    assert 24 * pair.split_k >= min(2 * sms, 24 * 32) > 24 * pair.split_k // 2
    assert layer_config(1, 6144, 3072, 1, 192).split_k == 2 * pair.split_k or pair.split_k == 32
    # past the gemv's rows: the MMA kernels, split over K on the warp-specialised schedule where the
    # pipeline's CTAs (min(m, g) x N / 128) are fewer than the SMs, into enough parts for two work items per SM
    sixteen = layer_config(16, 6144, 3072, 1, 192)  # a dense weight's 16 rows: 24 pipeline CTAs
    assert (sixteen.schedule, sixteen.block_n) == ("warp_specialized", 256)
    assert 12 * sixteen.split_k >= 2 * sms > 12 * sixteen.split_k // 2 or sixteen.split_k == 16
    assert layer_config(65, 6144, 3072, 128, 192) == GroupedMatmulConfig(block_m=64)  # 65 x 24 CTAs fill it
    assert layer_config(4, 128, 128, 128, 4) == GroupedMatmulConfig(block_m=64)  # N = 128: no gemv tile
    with _backend.interpret_as(_backend.BLACKWELL):  # Hopper only: the pipeline's tcgen05 variant instead
        assert layer_config(32768, 6144, 3072, 128) == GroupedMatmulConfig(block_m=128)
    monkeypatch.setattr(kernel, "LAYER_SCHEDULE", {"prefill": "warp_specialized", "decode": "warp_specialized"})
    decode = layer_config(4, 3072, 6144, 128)
    assert (decode.schedule, decode.block_m, decode.split_k) == ("warp_specialized", 64, kernel.DECODE_SPLIT_K)
    assert layer_config(4, 128, 256, 128).split_k == 2  # K = 128 takes two 64-deep parts at most
    assert layer_config(4, 128, 128, 128).schedule == "pipeline"  # N = 128 is no multiple of block_n = 256


def test_moe_layer_warp_specialized_matches_ragged_dot(monkeypatch):
    # the MoE block on MXFP8 experts with the layer's configs switched to the warp-specialised schedule:
    # 8 tokens x top-2 over 3 experts is the decode regime (split-K), the shared expert one group of 8 rows.
    # The block's params are built here (a whole random model takes ~10 s to initialise on a CPU).
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    from m3jax.layers import MXFP8Weight, dequantize_tree
    from m3jax.moe import moe_sorted
    from m3jax.pallas.grouped_matmul import kernel
    from tests.conftest import tiny_config

    monkeypatch.setattr(kernel, "LAYER_SCHEDULE", {"prefill": "warp_specialized", "decode": "warp_specialized"})
    monkeypatch.setattr(kernel, "DECODE_SPLIT_K", 2)  # fewer interpreted CTAs
    cfg = tiny_config(hidden_size=256, intermediate_size=256, shared_intermediate_size=256, num_local_experts=3,
                      num_experts_per_tok=2)
    r = np.random.default_rng(3)

    def mx(*lead, seed):  # one random expert, repeated; exponents lowered so that few gates hit the clamp
        values, scales = _mxfp8_weights(1, 256, 256, seed=seed)
        scales = jnp.where(scales[0] > 0, scales[0] - 12, 0).astype(jnp.uint8)
        return MXFP8Weight(jnp.broadcast_to(values[0], (*lead, 256, 256)), jnp.broadcast_to(scales, (*lead, 8, 256)))

    p = {"router": jnp.asarray(r.normal(size=(256, 3)), jnp.float32), "router_bias": jnp.zeros((3,), jnp.float32),
         "gate": mx(3, seed=1), "up": mx(3, seed=2), "down": mx(3, seed=3),
         "shared": {"gate": mx(seed=4), "up": mx(seed=5), "down": mx(seed=6)}}
    x = jnp.asarray(r.normal(size=(8, 256)), jnp.bfloat16)
    got = moe_sorted(x, p, cfg.text, impl="pallas")
    ref = moe_sorted(x, dequantize_tree(p, jnp.bfloat16), cfg.text, impl="ragged_dot")
    assert not _backend.interpret_races_found()
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), "bfloat16", "MoE warp-specialised vs ragged_dot")


@pytest.mark.parametrize("m", [1, 5, 8, 9, 17, 64])
def test_one_group_schedule_is_the_traced_one(m):
    # a dense weight's schedule is built in numpy when tracing (a forked staging child runs nothing on a
    # device): the same visits as the schedule of group sizes [m]
    # Machine: any (numpy and XLA on the default device)
    from m3jax.pallas.grouped_matmul import gemv

    np.testing.assert_array_equal(gemv.one_group_schedule(m), np.asarray(gemv.schedule(jnp.asarray([m]), m)))


def test_msa_layer_decode_projections_share_one_dense_gemv(monkeypatch):
    # a decode token's projections on an MSA layer with bf16 weights and moe_impl="pallas": k, v and the
    # index q (256 columns each) in one dense_gemvs launch; q (1,024 columns, past DENSE_GEMV_MAX_N here)
    # and the index k (64: narrower than the gemv's tile) as XLA dots; each normed and rotated output
    # equal to the XLA path's within bf16 rounding
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    import m3jax.pallas.grouped_matmul as gmm
    from m3jax import moe
    from m3jax.layers import rope_angles
    from m3jax.model import project_qkv
    from m3jax.params import init_random_on_device
    from tests.conftest import tiny_config

    monkeypatch.setattr(moe, "DENSE_GEMV_MAX_N", 512)
    launches, launch = [], gmm.dense_gemvs
    monkeypatch.setattr(gmm, "dense_gemvs", lambda lhs, ws, **kw: launches.append([w.shape for w in ws])
                        or launch(lhs, ws, **kw))
    cfg = tiny_config(hidden_size=256, num_attention_heads=16, num_key_value_heads=4, head_dim=64, rotary_dim=32,
                      index_n_heads=4, index_head_dim=64, num_hidden_layers=2,
                      layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "dense"))
    lp = init_random_on_device(cfg, seed=3, dtype=jnp.bfloat16, scale=0.3)["text"]["layers"][1]
    x = jnp.asarray(np.random.default_rng(7).normal(size=(1, 1, 256)), jnp.bfloat16)
    pos = jnp.full((1, 1), 37, jnp.int32)
    angles = rope_angles(pos, cfg.text.rotary_dim, cfg.text.rope_theta)
    got = project_qkv(x, lp, angles, cfg.text, True, "pallas")
    assert launches == [[(256, 256)] * 3]
    assert not _backend.interpret_races_found()
    want = project_qkv(x, lp, angles, cfg.text, True, "ragged_dot")
    for name, g, w in zip(("q", "k", "v", "iq", "ik"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert_close(np.asarray(g, np.float32), np.asarray(w, np.float32), "bfloat16", f"{name}: gemv vs XLA")
