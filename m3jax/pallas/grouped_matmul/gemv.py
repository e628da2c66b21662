"""MXFP8 grouped GEMV for decode: ``GroupedMatmulConfig(schedule="gemv")``, same contract as :mod:`.kernel`;
and the bf16 dense GEMVs of a decode step's attention projections (:func:`dense_problems`).

At decode a group (an expert, or the one group of a dense weight) has a few rows, so the MMA kernels'
64-row tiles are almost empty and their time goes to converting every fp8 weight tile into a bf16 SMEM
tile for the MMA (``benchmarks/mxfp8_dequant.py``: with that conversion removed they already run as fast
as bf16; with it the scales cost most, a thread building one scale per 2 weights in the MMA layout).
This kernel multiplies on the CUDA cores instead, in fp32, and never forms the bf16 tile:

* Layout. A thread owns 2 adjacent output columns of a ``block_n = 256`` column tile and walks K
  row by row: one 2-byte load of its fp8 pair, one e4m3x2 -> f16x2 conversion, two f16 -> f32
  conversions, then one FMA per lhs row. The E8M0 scale multiplies the 32-row partial sums once per
  scale group (a power of two: ``sum_k 2^e q_k x_k = 2^e sum_k q_k x_k`` up to rounding order), so a
  weight costs a few instructions rather than the MMA path's conversion and SMEM round trip.
* Rows. The schedule (:func:`schedule`) cuts each group's rows into visits of at most ``ROWS = 8``
  from its first row; a visit's body is specialised for 1, 2, 4 or 8 rows (the smallest that holds
  them; its lhs rows past the visit's are multiplied and not stored). Only the bodies some visit can
  run are built: those the visits need where the schedule is a constant (a dense weight), those of at
  most M rows where it is traced (which cuts the MoE block's compile time:
  benchmarks/RESULTS.md#gemv-figures). The lhs rows (fp32: bf16
  activations upcast exactly, fp32 ones taken as they are, so an fp32 model gets fp32 arithmetic)
  come in by TMA beside the weight tile and are read as SMEM scalars.
* Grid. One CTA (one warpgroup) per (weight, visit, N tile, K part): the static visit bound is
  ``cdiv(M, 8) + min(G, M)`` (at most M groups have rows), dead visits exit at once. K is split
  (``split_k``, from :func:`decode_split`) into parts of ``MIN_K_PART`` rows, or more parts where
  that leaves SMs without CTAs; several CTAs share an SM (small SMEM), so enough weight bytes are in
  flight to stream near the bandwidth floor; the parts are fp32 partials ``[weights, split_k, M, N]``
  that XLA sums. Several weights of one shape times the same rows (an MLP's gate and up) share the
  launch, its schedule, lhs and sums (:func:`kernel_call`); several such problems, each its own rows,
  groups and split, share a launch as consecutive CTA ranges (:func:`kernel_calls`: a decode step's
  shared expert beside its routed experts; a problem of several-row visits leads, split by
  :func:`leading_split`).
* Pipeline. ``plgpu.emit_pipeline`` over the K part in ``block_k = 64`` row steps, unswizzled TMA
  tiles (the loads are row vectors, no MMA reads them), the accumulators carried in registers.

* bf16 dense weights. A problem's weights may be bf16 ``(values,)`` of one group of every row, with no
  scales: a thread's bf16 pair converted to fp32 and FMAd into the accumulators. At most ``ROWS`` rows,
  one visit, so each weight is read once. A decode step's narrow attention projections run as one launch
  (:func:`m3jax.moe.linears` says which), where XLA gave each its own split-K pair of launches
  (benchmarks/RESULTS.md#dense-gemv).

No MMA, so the same code runs on Hopper and Blackwell. Forward only, like the MXFP8 MMA kernels.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from m3jax.pallas._backend import current_target, mosaic_kernel, pl, plgpu
from m3jax.pallas.grouped_matmul.tiles import RowGroups, deal_visits, e8m0_scale, group_rows

ROWS = 8  # lhs rows of one visit (fp32 accumulators per thread: 2 per row)
ROW_BODIES = (1, 2, 4, 8)  # a visit runs the body for the smallest of these that holds its rows
BLOCK_N = 256  # 128 threads x 2 columns; also the widest TMA box
BLOCK_K = 64
STAGES = 4
MIN_K_PART = 768  # K rows per CTA at least (12 pipeline steps), where K allows splitting
CTAS_PER_SM = 2  # and at least this many CTAs per SM over the groups that can have rows
SPLITS = (1, 2, 4, 8, 16, 32)
ROWS_PER_ITER = 4  # K rows per iteration of the loop over a scale group's rows
_COLS = plgpu.Layout.WG_STRIDED((BLOCK_N,), 2)  # thread t: columns 2t, 2t + 1


def _zeros(n: int) -> tuple:
    return tuple(plgpu.layout_cast(jnp.zeros((BLOCK_N,), jnp.float32), _COLS) for _ in range(n))


def schedule(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32 [cdiv(m, ROWS) + min(G, m), 3]: per visit (group, lo, hi), rows ``[lo, hi)`` of one group
    (at most ROWS of them), group by group; dead visits have ``lo == hi``."""
    g = group_sizes.shape[0]
    starts, ends = group_rows(group_sizes, m)
    grp, ordinal, live = deal_visits((ends - starts + ROWS - 1) // ROWS, visits_bound(m, g))
    lo = starts[grp] + ordinal * ROWS
    hi = jnp.minimum(lo + ROWS, ends[grp])
    zero = jnp.zeros_like(grp)
    return jnp.stack([grp, jnp.where(live, lo, zero), jnp.where(live, hi, zero)], axis=1)


def one_group_schedule(m: int) -> np.ndarray:
    """:func:`schedule` of one group of all ``m`` rows (a dense weight), in numpy: a program staged in a
    forked child (m3jax.aot) is traced without running anything on a device, which
    ``jax.ensure_compile_time_eval`` would do on the GPU."""
    lo = np.arange(visits_bound(m, 1), dtype=np.int32) * ROWS
    live = lo < m
    return np.stack([np.zeros_like(lo), np.where(live, lo, 0), np.where(live, np.minimum(lo + ROWS, m), 0)], axis=1)


def _one_group_of_all(group_sizes, m: int) -> bool:
    return isinstance(group_sizes, np.ndarray) and group_sizes.shape == (1,) and int(group_sizes[0]) == m


def _runs_body(rows, n_rows: int):
    """Whether a visit of ``rows`` rows runs the body for ``n_rows`` (the smallest of ROW_BODIES that
    holds them); ``rows`` a scalar or an array of them."""
    return (rows > n_rows // 2) & (rows <= n_rows)


def visits_bound(m: int, g: int) -> int:
    return -(-m // ROWS) + min(g, m)


def _k_splits(k: int) -> list[int]:
    """The splits of SPLITS that cut K into whole BLOCK_K steps, ascending; [1] where none does (the
    schedule then refuses K: :func:`unsupported_reason`)."""
    return [s for s in SPLITS if k % (s * BLOCK_K) == 0] or [1]


def decode_split(m: int, k: int, n: int, g: int, weights: int = 1) -> int:
    """The K split (a power of two, K a multiple of split x BLOCK_K): as large as leaves each CTA at least
    MIN_K_PART rows of K, and larger where that gives fewer than CTAS_PER_SM CTAs per SM over the groups
    that can have rows (``min(m, g)``) and the ``weights`` sharing the launch (:func:`kernel_call`). Chosen by
    ``benchmarks/mxfp8_gemv.py`` and ``mxfp8_resident.py``: the routed GEMMs are fastest near 768 K rows
    per CTA, and the shared expert's one group needs the larger split to fill the SMs
    (benchmarks/RESULTS.md#gemv-figures)."""
    splits = _k_splits(k)
    by_k = [s for s in splits if s == 1 or k // s >= MIN_K_PART][-1]
    want = CTAS_PER_SM * current_target().num_sms
    tiles = weights * min(m, g) * (n // BLOCK_N)
    by_ctas = next((s for s in splits if tiles * s >= want), splits[-1])
    return max(by_k, by_ctas)


def leading_split(k: int, n: int, weights: int = 1) -> int:
    """The K split of a one-group problem that leads a launch (first in :func:`kernel_calls`' grid) beside a
    larger problem: the largest that keeps its CTAs (``weights`` x N tiles x split) at most one per SM.

    Why: a visit of several rows is bound by instruction issue, not memory (the 8-row body issues 28
    instructions per K row, the 1-row body about 7), so such CTAs are best spread one per SM, each
    beside memory-bound CTAs of the other problem for the whole launch; split to fill the SMs
    (:func:`decode_split`) they queue several per SM, and last in the grid they run alone at its end
    (benchmarks/RESULTS.md#gemv-figures)."""
    splits = _k_splits(k)
    tiles = weights * (n // BLOCK_N)
    fits = [s for s in splits if tiles * s <= current_target().num_sms]
    return fits[-1] if fits else splits[0]


def unsupported_reason(m: int, k: int, n: int, g: int, k_groups: int, config) -> str | None:
    """Why this schedule cannot take ``[m, k] x (values [g, k, n], scales [g, k_groups, n])``."""
    if g < 1 or m < 1:
        return f"empty problem (M={m}, G={g})"
    if config.block_n != BLOCK_N or config.block_k != BLOCK_K:
        return f"block_n={config.block_n}, block_k={config.block_k}: the gemv schedule runs {BLOCK_N} x {BLOCK_K}"
    if n % BLOCK_N:
        return f"N={n} must be a multiple of {BLOCK_N}"
    if config.cluster != 1:
        return f"cluster={config.cluster}: the gemv schedule runs no clusters"
    if config.split_k < 1 or k % (config.split_k * BLOCK_K):
        return f"K={k} must be a multiple of split_k * block_k = {config.split_k} * {BLOCK_K}"
    group = k // k_groups
    if BLOCK_K % group or group % ROWS_PER_ITER:
        return f"scale group of {group} inputs must divide block_k={BLOCK_K} and be a multiple of {ROWS_PER_ITER}"
    return None


def dense_unsupported_reason(m: int, k: int, n: int, dtype) -> str | None:
    """Why the schedule cannot take ``[m, k] x`` a bf16 dense weight ``[k, n]`` (:func:`dense_problems`)."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"weight dtype {jnp.dtype(dtype)}: the dense gemv takes bfloat16 weights"
    if not 1 <= m <= ROWS:
        # one visit streams the weight once; more rows would stream it once per ROWS rows
        return f"M={m} rows: the dense gemv takes 1 to {ROWS}"
    if n % BLOCK_N:
        return f"N={n} must be a multiple of {BLOCK_N}"
    if k % BLOCK_K:
        return f"K={k} must be a multiple of {BLOCK_K}"
    return None


def dense_problems(lhs, weights) -> list[tuple[Problem, list[int]]]:
    """bf16 dense weights ``[K, N_i]`` times the rows ``lhs [m, K]`` as one :class:`Problem` per distinct
    shape (each split by :func:`decode_split` for its tiles), with the indices into ``weights`` it holds."""
    m = lhs.shape[0]
    by_shape: dict[tuple, list[int]] = {}
    for i, w in enumerate(weights):
        by_shape.setdefault(w.shape, []).append(i)
    sizes = np.full((1,), m, np.int32)  # one group of every row, known when tracing: a constant schedule
    problems = []
    for (k, n), idx in by_shape.items():
        split = decode_split(m, k, n, 1, len(idx))
        problems.append((Problem(sizes, m, lhs, tuple((weights[i].reshape(1, k, n),) for i in idx), split), idx))
    return problems


def kernel_call(group_sizes, m: int, lhs, weights, *, out_dtype, config, interpret=None) -> tuple:
    """One ``[m, N]`` per ``(values, scales)`` of ``weights`` (all of one shape): rows ``[0, m)`` of
    ``ragged_dot(lhs [m, K], dequantize(values, scales), group_sizes)``, rows past ``sum(group_sizes)`` zero.
    ``values`` float8_e4m3fn [G, K, N], ``scales`` uint8 [G, K / group, N].

    Several weights (an MLP's gate and up) run as one launch over the same schedule, lhs and K split: one
    set of the XLA index, pad and K-part-sum work for all of them (benchmarks/RESULTS.md#gemv-figures)."""
    return kernel_calls([Problem(group_sizes, m, lhs, tuple(weights), config.split_k)], out_dtype=out_dtype,
                        interpret=interpret)[0]


class Problem(NamedTuple):
    """One grouped GEMV of a launch: ``lhs [m, K]`` (rows ``[0, m)`` sorted by group, or any order with
    ``group_sizes`` a :class:`.tiles.RowGroups`) times each weight of ``weights`` (one shape and kind): MXFP8
    ``(values [G, K, N], scales [G, K / group, N])`` or bf16 ``(values [G, K, N],)``; K split in ``split_k``."""

    group_sizes: jax.Array
    m: int
    lhs: jax.Array
    weights: tuple
    split_k: int


def kernel_calls(problems, *, out_dtype, interpret=None) -> tuple:
    """Per :class:`Problem`, the tuple of :func:`kernel_call`'s outputs, all problems in one launch.

    A launch streams its weights near the bandwidth floor once enough CTAs are in flight; a small problem
    alone (a decode step's shared expert: one group, short K parts) spends most of its launch filling and
    draining the pipeline. Its CTAs beside a larger problem's (the routed experts' GEMMs of the same
    step) keep the memory system busy through both. Each problem keeps its own schedule, lhs, split and
    outputs; the grid is their CTA ranges one after another, in the order given
    (benchmarks/RESULTS.md#gemv-figures)."""
    plans, operands, out_types = [], [], []
    for pr in problems:
        plan = _plan(pr)
        plans.append(plan)
        operands += [plan["sched"], plan["x"], *(a for w in pr.weights for a in w)]
        out_types.append(jax.ShapeDtypeStruct((plan["n_weights"], pr.split_k, plan["m8"], plan["n"]), jnp.float32))
    sizes = [plan["n_weights"] * plan["per_weight"] for plan in plans]

    def body(*refs):
        ins, outs = refs[: len(operands)], refs[len(operands):]
        pid = lax.axis_index("t")
        start, at = 0, 0
        for plan, size, out_ref in zip(plans, sizes, outs):
            n_in = 2 + (1 + plan["scaled"]) * plan["n_weights"]
            mine = ins[at: at + n_in]
            pl.when((pid >= start) & (pid < start + size))(
                functools.partial(_problem_body, plan, pid - start, mine[0], mine[1], mine[2:], out_ref))
            start, at = start + size, at + n_in

    kern = mosaic_kernel(body, interpret=interpret, out_type=tuple(out_types), grid=(sum(sizes),), grid_names=("t",))
    parts = kern(*operands)
    results = []
    for pr, plan, part in zip(problems, plans, parts):
        out = jnp.where(plan["covered"][:, None], part[:, :, : pr.m].sum(1), 0).astype(out_dtype)
        results.append(tuple(out[w] for w in range(plan["n_weights"])))
    return tuple(results)


def _plan(pr: Problem) -> dict:
    """What a problem's CTAs need to know, and its operands built by XLA (schedule, padded fp32 lhs)."""
    k = pr.lhs.shape[1]
    values0 = pr.weights[0][0]
    n = values0.shape[2]
    scaled = len(pr.weights[0]) == 2  # MXFP8 (values, scales); bf16 weights come as (values,)
    split = pr.split_k
    n_tiles = n // BLOCK_N
    # group sizes known when tracing (a dense weight's one group, m3jax.moe.linears) give a constant
    # schedule: no index kernels before the launch
    per_row = isinstance(pr.group_sizes, RowGroups)
    if _one_group_of_all(pr.group_sizes, pr.m):
        sched, covered = one_group_schedule(pr.m), np.ones((pr.m,), bool)
    elif per_row:  # visit r is row r, its group read from the ids in the kernel: no op before the launch
        sched, covered = pr.group_sizes.ids.astype(jnp.int32), np.ones((pr.m,), bool)
    else:
        with jax.ensure_compile_time_eval():
            sched = schedule(jnp.asarray(pr.group_sizes), pr.m)
            covered = jnp.arange(pr.m) < jnp.max(sched[:, 2])  # rows some visit writes: below the last live visit's end
    # the row bodies some visit can run, the others never built (each is a copy of the pipeline to lower
    # and compile): for a traced schedule those of at most m rows, for a constant one (a dense weight at
    # decode) those its visits need
    bodies = (1,) if per_row else tuple(n for n in ROW_BODIES if n // 2 < pr.m)
    if not per_row and not isinstance(sched, jax.core.Tracer):
        rows = np.diff(np.asarray(sched)[:, 1:], axis=1)
        bodies = tuple(n for n in ROW_BODIES if np.any(_runs_body(rows, n)))
    # lhs rows: a visit's TMA box of up to ROWS rows starts at its first row, inside the padding; the
    # row counts are multiples of 8 (the TMA's 8-row tiling, as for the MMA kernels' stores)
    m8 = -(-pr.m // 8) * 8
    return {"n": n, "group": k // pr.weights[0][1].shape[1] if scaled else BLOCK_K, "scaled": scaled,
            "n_weights": len(pr.weights), "split": split,
            "k_part": k // split, "per_visit": n_tiles * split, "per_weight": sched.shape[0] * n_tiles * split,
            "steps": max(1, min(STAGES, k // split // BLOCK_K)), "m8": m8, "sched": sched, "covered": covered,
            "bodies": bodies, "per_row": per_row,
            "x": jnp.pad(pr.lhs.astype(jnp.float32), ((0, m8 + ROWS - pr.m), (0, 0)))}


def _problem_body(plan: dict, pid, sched_ref, x_ref, w_refs, out_ref) -> None:
    """The CTA ``pid`` of one problem's range: its (weight, visit, N tile, K part)."""
    split, bn, bk, group, k_part = plan["split"], BLOCK_N, BLOCK_K, plan["group"], plan["k_part"]
    per_visit, per_weight = plan["per_visit"], plan["per_weight"]
    wi, pid = lax.div(pid, per_weight), lax.rem(pid, per_weight)
    v, rest = lax.div(pid, per_visit), lax.rem(pid, per_visit)
    ni, ks = lax.div(rest, split), lax.rem(rest, split)
    if plan["per_row"]:
        grp, lo, hi = sched_ref[v], v, v + 1
    else:
        grp, lo, hi = (sched_ref[v, i] for i in range(3))
    col0, k0 = ni * bn, ks * k_part
    rows = hi - lo

    def visit(w, n_rows):
        scaled = plan["scaled"]
        q_ref = w_refs[(1 + scaled) * w]

        def k_rows(q_smem, x_smem, k_first, i, part):
            # ROWS_PER_ITER K rows per iteration: fully unrolled, the Mosaic GPU layout inference takes
            # minutes over the thousands of ops
            part = list(part)
            for u in range(ROWS_PER_ITER):
                kr = k_first + i * ROWS_PER_ITER + u
                q = plgpu.load(q_smem.at[kr], layout=_COLS)
                q = (q.astype(jnp.float16) if scaled else q).astype(jnp.float32)  # e4m3 converts through f16
                part = [p + q * x_smem[r, kr] for r, p in enumerate(part)]
            return tuple(part)

        def step(_, q_smem, *rest):
            if not scaled:  # bf16: no scale groups, the step's rows straight into the accumulators
                x_smem, acc = rest
                acc = lax.fori_loop(0, bk // ROWS_PER_ITER, functools.partial(k_rows, q_smem, x_smem, 0), acc)
            else:
                s_smem, x_smem, acc = rest
                acc = list(acc)
                for j in range(bk // group):
                    part = lax.fori_loop(0, group // ROWS_PER_ITER,
                                         functools.partial(k_rows, q_smem, x_smem, j * group), _zeros(n_rows))
                    scale = e8m0_scale(plgpu.load(s_smem.at[j], layout=_COLS).astype(jnp.int32))
                    acc = [a + p * scale for a, p in zip(acc, part)]
            # The pipeline refills this step's slots by TMA as soon as the step returns, issued by one
            # thread: every warp's reads of them must be done first (a warpgroup barrier, with the fence
            # that orders them before the async proxy's writes). Without it a K part of more steps than
            # stages raced in interpret mode's race detector.
            plgpu.commit_smem()
            return tuple(acc)

        in_specs = [plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0)),
                    *([plgpu.BlockSpec((bk // group, bn), lambda kk: (kk, 0))] if scaled else []),
                    plgpu.BlockSpec((n_rows, bk), lambda kk: (0, kk))]
        scales = ((w_refs[2 * w + 1].at[grp, pl.ds(k0 // group, k_part // group), pl.ds(col0, bn)],) if scaled
                  else ())
        operands = (q_ref.at[grp, pl.ds(k0, k_part), pl.ds(col0, bn)], *scales,
                    x_ref.at[pl.ds(lo, n_rows), pl.ds(k0, k_part)])
        acc = plgpu.emit_pipeline(step, grid=(k_part // bk,), in_specs=in_specs, max_concurrent_steps=plan["steps"],
                                  init_carry=_zeros(n_rows))(*operands)

        def store(o_smem):
            for r in range(n_rows):
                o_smem[r] = acc[r]
            plgpu.commit_smem()
            for r in range(n_rows):
                pl.when(r < rows)(lambda r=r: plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(r, 1)], out_ref.at[w, ks, pl.ds(lo + r, 1), pl.ds(col0, bn)]))
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(store, plgpu.SMEM((n_rows, bn), jnp.float32))

    for w in range(plan["n_weights"]):
        for n_rows in plan["bodies"]:
            pl.when((wi == w) & _runs_body(rows, n_rows))(functools.partial(visit, w, n_rows))
