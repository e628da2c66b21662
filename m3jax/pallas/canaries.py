"""The self-check canaries: each Mosaic GPU kernel, at each tile path the model takes, on one tiny case
run through the kernel and through the jnp reference beside it (``m3jax/pallas/<op>/reference.py``),
compared at the kernel's tolerance (docs/MSA.md §4.3).

A canary is a (kernel, path) pair. The path names the tile shape that selects the kernel's code path:
the decode index scoring takes a 64-row MMA with half-lane TMEM reads below block 128 and a 128-row
MMA with N = 8 query rows at block 128 (M3); the prefill index scoring and the KV-major attention
change their MMA shapes and swizzles with the block and the head dim. Paths marked ``m3`` are the
ones M3 (block 128, head dim 128, G 16, 4 index heads) runs. :mod:`m3jax.pallas.verdicts` runs them
(in a worker process with a deadline) and keeps their verdicts.

Each canary also says at which block sizes the model takes its path (:func:`paths_for`), so a canary
that fails at one path keeps the model off that path only: the decode index scoring takes its
M = 128 path exactly where 128 divides the block, the others their block-128 path from block 128 up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.pallas.tolerances import TOL

_PALLAS = Path(__file__).resolve().parent
# Hashed into every verdict's key with the kernel's own files: the backend layer, the shared kernel
# helpers, the tolerance table, the maths the references compute, and this file (the canary cases).
SHARED_SOURCES = (_PALLAS / "_backend.py", _PALLAS / "_common.py", _PALLAS / "tolerances.py",
                  _PALLAS.parent / "msa" / "reference.py", Path(__file__).resolve())

# Canary tolerances: |got - ref| <= tol + tol * |ref| element-wise; None = exact. The bf16 rows of the
# kernel tests' table (m3jax/pallas/tolerances.py, docs/MSA.md §4.3): attention canaries use bf16 inputs
# (the model's dtype). The grouped GEMM's inputs are small integers, so its fp32 sums are exact and both
# sides round them to bf16 identically: any difference is a kernel error, the 1e-2 only absorbs a
# different (valid) rounding of the output.
TOLERANCES: dict[str, float | None] = {
    "index_scores": TOL[("index_scores", "bfloat16")]["atol"],
    "index_scores_fp8": TOL[("index_scores", "bfloat16")]["atol"],  # exact sums (see _index_scores_fp8)
    "index_topk_fused": None,
    "topk_blockmajor": None,
    "topk_rowsplit": None,
    "sparse_attention_kv_major": TOL[("attention", "bfloat16")]["atol"],
    "sparse_attention_query_major": TOL[("attention", "bfloat16")]["atol"],
    "decode_index_scores": TOL[("index_scores", "bfloat16")]["atol"],
    "decode_index_scores_fp8": TOL[("index_scores", "bfloat16")]["atol"],  # exact sums (see _decode_index_scores_fp8)
    "decode_index_scores_registers": TOL[("index_scores", "bfloat16")]["atol"],
    "decode_select_fused": None,
    "decode_select_registers": None,
    "sparse_decode_attention": TOL[("decode_attention", "bfloat16")]["atol"],
    "grouped_matmul": 1e-2,
}


@dataclasses.dataclass(frozen=True)
class Canary:
    """``run() -> (got, ref)``: the kernel's and the reference's outputs on one tiny case at one path."""

    kernel: str
    path: str  # the tile shape that picks the kernel's code path
    run: Callable[[], tuple[jax.Array, jax.Array]]
    sources: tuple[Path, ...]  # files whose contents key the verdict (with SHARED_SOURCES)
    m3: bool = False  # M3's own tile path
    # the block sizes (index_block_size) at which the model takes this path; None: every block size
    at_block: Callable[[int], bool] | None = None
    # why this target has no such path (the model never takes it here: its verdict is "n/a"); None: it has
    unsupported: Callable[[], str | None] | None = None
    # among the longest canaries (several kernel configurations compiled, or a long lowering): a batch of
    # side-by-side workers starts these first, so none is left to start last on a worker that ran others
    # (benchmarks/RESULTS.md#selfcheck-2026-12-07c)
    long: bool = False

    @property
    def name(self) -> str:
        return f"{self.kernel}@{self.path}"

    @property
    def tol(self) -> float | None:
        return TOLERANCES.get(self.kernel)  # a kernel not in the table (a test's) compares exactly


def _normal(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)


def _ints(rng, shape, lo=-3, hi=3, dtype=jnp.bfloat16):
    """Small integers: products and sums are exact in fp32 whatever the accumulation order, so scores
    have exact ties but no near-ties (a kernel and the reference must then pick the same blocks)."""
    return jnp.asarray(rng.integers(lo, hi + 1, shape).astype(np.float32)).astype(dtype)


def _index_inputs(rng, integer=False, hi=2, hx=64, bs=16, t=24, prefix=64, tail=0):
    """A block-aligned prefix then ``t`` queries and ``tail`` keys past the last one (S ragged)."""
    b, s = 1, prefix + t + tail
    make = _ints if integer else _normal
    iq, ik = make(rng, (b, t, hi, hx)), make(rng, (b, s, hx))
    q_pos = (prefix + jnp.arange(t, dtype=jnp.int32))[None]
    return iq, ik, q_pos, bs


def _index_scores(**tile):
    from m3jax.pallas import index_scores as I

    iq, ik, q_pos, bs = _index_inputs(np.random.default_rng(0), **tile)
    return (I.index_block_scores(iq, ik, q_pos, block_size=bs),
            I.index_block_scores(iq, ik, q_pos, block_size=bs, implementation="reference"))


def _index_scores_fp8(hi=2, hx=64, bs=16, t=24, prefix=64, tail=0):
    """The fp8 indexer (``score_dtype="float8_e4m3fn"``): entries in {-1, 0, 1} with a 1 in every row, so
    every row's scale is 1/448 and its e4m3 values 0 or +-448. A score's sum is then k 448^2 with |k| <= Hx,
    exact in fp32 and in an MMA that sums with fewer bits (k 49 < 2^13), and both sides apply the scales by
    the same fp32 multiplies: the kernel must match the reference to rounding."""
    from m3jax.pallas import index_scores as I

    rng = np.random.default_rng(7)
    s = prefix + t + tail
    iq = _ints(rng, (1, t, hi, hx), -1, 1).at[..., 0].set(1)
    ik = _ints(rng, (1, s, hx), -1, 1).at[..., 0].set(1)
    q_pos = (prefix + jnp.arange(t, dtype=jnp.int32))[None]
    kw = dict(block_size=bs, score_dtype="float8_e4m3fn")
    return (I.index_block_scores(iq, ik, q_pos, **kw),
            I.index_block_scores(iq, ik, q_pos, implementation="reference", **kw))


def _index_topk_fused():
    from m3jax.pallas import index_scores as I

    iq, ik, q_pos, bs = _index_inputs(np.random.default_rng(1), integer=True)
    kw = {"block_size": bs, "topk": 3, "local_blocks": 1, "init_blocks": 1}
    return (I.index_select_blocks(iq, ik, q_pos, config=I.IndexScoreConfig(fused_topk=True), **kw),
            I.index_select_blocks(iq, ik, q_pos, implementation="reference", **kw))


def _topk_scores(rng, b, hi, t, nb, bs, q_pos):
    """fp32 integer scores in [-2, 2] (ties) with -inf past each query's own block, as block_scores."""
    return jnp.asarray(_topk_scores_np(rng, b, hi, t, nb, bs, q_pos))


def _topk_scores_np(rng, b, hi, t, nb, bs, q_pos):
    s = rng.integers(-2, 3, (b, hi, t, nb)).astype(np.float32)
    visible = np.arange(nb) <= (np.asarray(q_pos) // bs)[:, None, :, None]
    return np.where(visible, s, -np.inf).astype(np.float32)


def _topk(implementation, b, t, nb, bs, q_pos, topk):
    from m3jax.pallas import topk as K

    scores = _topk_scores(np.random.default_rng(2), b, 2, t, nb, bs, q_pos)
    kw = {"block_size": bs, "topk": topk, "local_blocks": 2, "init_blocks": 1}
    return (K.select_blocks(scores, q_pos, implementation=implementation, **kw),
            K.select_blocks(scores, q_pos, implementation="reference", **kw))


def _topk_blockmajor():
    t, bs = 40, 16
    return _topk("pallas_blockmajor", 1, t, 45, bs, (640 + np.arange(t, dtype=np.int32))[None], 4)


def _topk_rowsplit():
    # 300 blocks: not a multiple of the 128 threads; the second row sees fewer blocks than top-k.
    return _topk("pallas_rowsplit", 2, 1, 300, 4, np.array([[1199], [9]], np.int32), 8)


def _topk_rowsplit_in_place():
    # The decode scoring kernel's rows as the top-k reads them in place (select_blocks_rows): spare rows,
    # NaN and huge values after each row's own block (never written there), per-row factors.
    from m3jax.pallas import topk as K

    rng, bs, nb, q_pos = np.random.default_rng(4), 4, 300, np.array([[1199], [9]], np.int32)
    scores = _topk_scores_np(rng, 2, 2, 1, nb, bs, q_pos)  # numpy: the canary is also traced under jit
    unscale = jnp.asarray(rng.choice([0.5, 1.0, 4.0], (2, 2)).astype(np.float32))
    junk = np.where(rng.random((2, 8, 384)) < 0.5, np.float32(1e30), np.float32(np.nan))
    s = scores.reshape(2, 2, nb)
    junk[:, :2, :nb] = np.where(np.isneginf(s), junk[:, :2, :nb], s)
    kw = {"block_size": bs, "topk": 8, "local_blocks": 2, "init_blocks": 1}
    return (K.select_blocks_rows(jnp.asarray(junk), jnp.asarray(q_pos), unscale, heads=2, num_blocks=nb, **kw),
            _topk_select_reference(jnp.asarray(scores) * unscale[:, :, None, None], q_pos, **kw))


def _topk_select_reference(scores, q_pos, **kw):
    from m3jax.pallas import topk as K

    return K.select_blocks(scores, jnp.asarray(q_pos), implementation="reference", **kw)


def _sparse_attention(implementation, n=16, k=2, h=64, bs=64, t=10, prefix=64, topk=3):
    """N query heads on K KV heads (G = N / K), head dim H; a prefix then ``t`` queries."""
    from m3jax.msa import reference as msa
    from m3jax.pallas.sparse_attention import sparse_attention

    rng = np.random.default_rng(3)
    s = prefix + t
    q, kk, v = _normal(rng, (1, t, n, h)), _normal(rng, (1, s, k, h)), _normal(rng, (1, s, k, h))
    q_pos = (prefix + jnp.arange(t, dtype=jnp.int32))[None]
    scores = msa.block_scores(_normal(rng, (1, t, k, 16), jnp.float32), _normal(rng, (1, s, 16), jnp.float32),
                              q_pos, bs)
    sel = msa.select_blocks(scores, q_pos, block_size=bs, topk=topk)
    args = (q, kk, v, sel, q_pos)
    return (sparse_attention(*args, block_size=bs, implementation=implementation),
            sparse_attention(*args, block_size=bs, implementation="reference"))


def _decode_case(rng, seq_lens, bs=64, kh=2, n=16, h=64, hx=64, q_len=1):
    """Paged decode inputs: a shuffled page table over num_pages = B * max_pages + 2 pages."""
    seq_lens = np.asarray(seq_lens, np.int32)
    b = len(seq_lens)
    max_pages = int(-(-seq_lens.max() // bs))
    num_pages = b * max_pages + 2
    pt = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
    return {"q": _normal(rng, (b, q_len, n, h)), "iq": _normal(rng, (b, q_len, kh, hx)),
            "k": _normal(rng, (num_pages, bs, kh, h)), "v": _normal(rng, (num_pages, bs, kh, h)),
            "ik": _normal(rng, (num_pages, bs, hx)), "pt": jnp.asarray(pt), "sl": jnp.asarray(seq_lens), "bs": bs}


def _decode_index_scores(seq_lens=(100, 200), **tile):
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(4), seq_lens, **tile)
    # bf16 and fp8 e4m3 index-key pages (an fp8 index cache: the kernel converts its pages in SMEM)
    pages = (c["ik"], c["ik"].astype(jnp.float8_e4m3fn))
    runs = [[D.decode_index_scores(c["iq"], ik, c["pt"], c["sl"], block_size=c["bs"], implementation=impl)
             for ik in pages] for impl in ("pallas", "reference")]
    return jnp.stack(runs[0]), jnp.stack(runs[1])


def _decode_index_scores_fp8(seq_lens=(100, 200), **tile):
    """The fp8 indexer's decode scoring (``score_dtype="float8_e4m3fn"``) over fp8 index pages taken as
    stored (scale 1): as :func:`_index_scores_fp8`, entries in {-1, 0, 1} with a 1 in every query row,
    so every query scale is 1/448 and a score's sum k 448 (|k| <= Hx) is exact in the e4m3 MMA and in
    fp32; both sides apply the scales by the same fp32 multiplies."""
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(9), seq_lens, **tile)
    rng = np.random.default_rng(10)
    iq = _ints(rng, c["iq"].shape, -1, 1).at[..., 0].set(1)
    ik = _ints(rng, c["ik"].shape, -1, 1).astype(jnp.float8_e4m3fn)
    kw = dict(block_size=c["bs"], score_dtype="float8_e4m3fn")
    return (D.decode_index_scores(iq, ik, c["pt"], c["sl"], **kw),
            D.decode_index_scores(iq, ik, c["pt"], c["sl"], implementation="reference", **kw))


def _no_fp8_decode_scores() -> str | None:
    """Why this target has no e4m3 x e4m3 decode scoring (tcgen05: Hopper's wgmma path only), or None."""
    from m3jax.pallas.decode import fp8_scores_unsupported_reason

    return fp8_scores_unsupported_reason(jnp.float8_e4m3fn)


def _decode_index_scores_registers(seq_lens=(100, 200), **tile):
    """:func:`_decode_index_scores`'s fp8 pages with ``DecodeScoreConfig(fp8_convert="registers")`` (the
    keys converted in wgmma's register A layout: Hopper on the GPU; interpret mode and tcgen05 convert
    in SMEM), against the same reference."""
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(4), seq_lens, **tile)
    ik, config = c["ik"].astype(jnp.float8_e4m3fn), D.DecodeScoreConfig(fp8_convert="registers")
    return (D.decode_index_scores(c["iq"], ik, c["pt"], c["sl"], block_size=c["bs"], config=config),
            D.decode_index_scores(c["iq"], ik, c["pt"], c["sl"], block_size=c["bs"], implementation="reference"))


def _decode_select(seq_lens, fp8_convert: str, tile: dict):
    """The fused decode selection over bf16 and fp8 e4m3 index-key pages (or, ``fp8_convert="registers"``,
    the fp8 pages only: bf16 pages convert nothing), two context splits, against the reference."""
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(7), seq_lens, **tile)
    rng = np.random.default_rng(8)
    # small-integer index queries and keys: exact scores with ties, so the ids (and their order) must match
    iq, ik = _ints(rng, c["iq"].shape, -1, 1), _ints(rng, c["ik"].shape, -1, 1)
    kw = {"block_size": c["bs"], "topk": 6, "local_blocks": 1, "init_blocks": 1, "force_in": (2,), "force_out": (1,)}
    pages = [ik.astype(jnp.float8_e4m3fn)] if fp8_convert == "registers" else [ik, ik.astype(jnp.float8_e4m3fn)]
    config = D.DecodeScoreConfig(num_splits=2, fp8_convert=fp8_convert)
    runs = [[D.decode_select_blocks(iq, p, c["pt"], c["sl"], implementation=impl, config=config, **kw) for p in pages]
            for impl in ("pallas", "reference")]
    return jnp.stack(runs[0]), jnp.stack(runs[1])


def _decode_select_fused(seq_lens=(100, 900), **tile):
    return _decode_select(seq_lens, "smem", tile)


def _decode_select_registers(seq_lens=(100, 900), **tile):
    return _decode_select(seq_lens, "registers", tile)


def _sparse_decode_attention(seq_lens=(100, 200), **tile):
    from m3jax.msa import reference as msa
    from m3jax.pallas import decode as D

    c = _decode_case(np.random.default_rng(5), seq_lens, **tile)
    bs = c["bs"]
    q_pos = D.query_positions(c["sl"], 1)
    scores = D.decode_index_scores(c["iq"], c["ik"], c["pt"], c["sl"], block_size=bs, implementation="reference")
    sel = msa.select_blocks(scores, q_pos, block_size=bs, topk=2)
    args = (c["q"], c["k"], c["v"], c["pt"], sel, c["sl"])
    return (D.sparse_decode_attention(*args, block_size=bs),
            D.sparse_decode_attention(*args, block_size=bs, implementation="reference"))


def _grouped_matmul(mx: bool):
    from m3jax.pallas.grouped_matmul import (
        PREFILL_128X256,
        PREFILL_ROWS256,
        PREFILL_ROWS384,
        GroupedMatmulConfig,
        RowGroups,
        dense_gemvs,
        grouped_matmul,
        grouped_matmul_mxfp8,
        grouped_matmuls,
        layer_config,
    )

    # 6 experts, empty groups, rows past sum(group_sizes); K = 128, N = 256. The bf16 kernel (``mx``
    # False) or the MXFP8 variant (weights="mxfp8"; the same ints as fp8, E8M0 scales 2^-1..2^1: exact
    # products), with the default tiles and with the warp-specialised prefill tiles where the target takes
    # them (385 rows > 64 per expert: the MoE layer's prefill config, the 256- or 384-row tiles in bf16 and
    # 128 x 256 in MXFP8, and the others), so its verdict covers what prefill runs whichever the layer
    # picks; MXFP8 also on 5 decode rows with the layer's decode config (the gemv schedule, split over K,
    # as for a decode step's routed experts and the shared expert), bf16 also on the gemv's dense weights
    # (5 rows, two widths: a decode step's attention projections); both on one decode token's per-row groups
    # (bf16: two weights of two arrays each in one launch, as m3jax.moe._token_mlps runs the gate and up of the
    # routed and shared experts; MXFP8: the gemv). Two canaries, not one: each compiles
    # several configurations, and side by side the longer of the two ends well before the one did
    # (benchmarks/RESULTS.md#selfcheck-2026-12-07c).
    rng = np.random.default_rng(6)
    m, k, n, g = 385, 128, 256, 6
    lhs, rhs = _ints(rng, (m, k)), _ints(rng, (g, k, n))
    gs = jnp.asarray([0, 130, 0, 0, 170, 60], jnp.int32)
    fp8, scales = rhs.astype(jnp.float8_e4m3fn), jnp.asarray(rng.integers(126, 129, (g, k // 32, n)), jnp.uint8)

    def run(**kw):
        return grouped_matmul_mxfp8(lhs, fp8, scales, gs, **kw) if mx else grouped_matmul(lhs, rhs, gs, **kw)

    want = run(implementation="reference")
    layer = layer_config(m, k, n, g, k // 32 if mx else None)
    prefill = ([PREFILL_128X256, PREFILL_ROWS256, *([] if mx else [PREFILL_ROWS384])]
               if layer.schedule == "warp_specialized" else [layer])  # Hopper's
    configs = list(dict.fromkeys([GroupedMatmulConfig(), *prefill]))
    got, ref = [run(config=c) for c in configs], [want] * len(configs)
    token = RowGroups(jnp.asarray([5, 1, 4, 0, 2], jnp.int32))  # slot 0 the last group, as the shared expert
    if not mx:  # the bf16 dense gemv (a decode step's attention projections): two widths in one launch
        dense = (rhs[1], jnp.concatenate([rhs[4], rhs[0]], axis=1))
        got += list(dense_gemvs(lhs[:5], dense))
        ref += list(dense_gemvs(lhs[:5], dense, implementation="reference"))
        pair = ((rhs[:5], rhs[5:]), (rhs[:5, :, ::-1], rhs[5:, :, ::-1]))
        got += list(grouped_matmuls(lhs[:5], pair, token, config=layer_config(5, k, n, g)))
        ref += list(grouped_matmuls(lhs[:5], pair, token, implementation="reference"))
    if mx:
        dec, dec_gs = lhs[:5], jnp.asarray([0, 2, 0, 0, 3, 0], jnp.int32)
        for groups in (dec_gs, token):
            got.append(grouped_matmul_mxfp8(dec, fp8, scales, groups, config=layer_config(5, k, n, g, k // 32)))
            ref.append(grouped_matmul_mxfp8(dec, fp8, scales, groups, implementation="reference"))
    return jnp.concatenate([x.ravel() for x in got]), jnp.concatenate([x.ravel() for x in ref])


def _dirs(*ops: str) -> tuple[Path, ...]:
    return tuple(sorted(p for op in ops for p in (_PALLAS / op).glob("*.py")))


# M3's tiles: block 128, head dim and index head dim 128, G 16 query heads per KV head, 4 index heads.
_M3_DECODE = {"bs": 128, "kh": 1, "n": 16, "h": 128, "hx": 128}
_SMALL, _LARGE = (lambda bs: bs < 128), (lambda bs: bs >= 128)  # a kernel's block-64 and block-128 paths
# the decode scoring's paths: 64-row page tiles unless the block is a multiple of 128 (block 192: three)
_DEC_M64, _DEC_M128 = (lambda bs: bs % 128 != 0), (lambda bs: bs % 128 == 0)
_IDX, _TOPK, _ATT, _DEC, _GMM = (_dirs("index_scores", "topk"), _dirs("topk"), _dirs("sparse_attention"),
                                 _dirs("decode"), _dirs("grouped_matmul"))

CANARIES: dict[str, Canary] = {
    c.name: c for c in (
        Canary("index_scores", "b16-hx64", _index_scores, _IDX, at_block=_SMALL),
        Canary("index_scores", "b128-hx128", lambda: _index_scores(hi=4, hx=128, bs=128, t=8, prefix=256, tail=9),
               _IDX, m3=True, at_block=_LARGE),
        Canary("index_topk_fused", "b16-hx64", _index_topk_fused, _IDX),
        # the fp8 indexer's e4m3 x e4m3 path (TextConfig.index_score_dtype="float8_e4m3fn"), the same two tiles
        Canary("index_scores_fp8", "b16-hx64", _index_scores_fp8, _IDX, at_block=_SMALL),
        Canary("index_scores_fp8", "b128-hx128",
               lambda: _index_scores_fp8(hi=4, hx=128, bs=128, t=8, prefix=256, tail=9), _IDX, m3=True,
               at_block=_LARGE),
        Canary("topk_blockmajor", "rows40", _topk_blockmajor, _TOPK),
        Canary("topk_rowsplit", "rows1", _topk_rowsplit, _TOPK, m3=True),
        Canary("topk_rowsplit", "in-place", _topk_rowsplit_in_place, _TOPK, m3=True, long=True),
        Canary("sparse_attention_kv_major", "b64-h64-g8", lambda: _sparse_attention("kv_major"), _ATT, at_block=_SMALL),
        Canary("sparse_attention_kv_major", "b128-h128-g16",
               lambda: _sparse_attention("kv_major", n=16, k=1, h=128, bs=128, t=8, prefix=256, topk=2), _ATT, m3=True,
               at_block=_LARGE),
        Canary("sparse_attention_query_major", "b64-h64-g8", lambda: _sparse_attention("query_major"), _ATT),
        # M = 64 with half-lane TMEM reads and 32-byte swizzles (block 64), M = 128 with N = 8 (M3)
        Canary("decode_index_scores", "b64-m64", _decode_index_scores, _DEC, at_block=_DEC_M64),
        Canary("decode_index_scores", "b128-m128-n8",
               lambda: _decode_index_scores((100, 300), bs=128, kh=4, hx=128), _DEC, m3=True,
               at_block=_DEC_M128),
        # the fp8 indexer's e4m3 x e4m3 decode scoring (TextConfig.index_score_dtype="float8_e4m3fn" over
        # an fp8 index cache; Hopper only, "n/a" on tcgen05), the same two tiles
        Canary("decode_index_scores_fp8", "b64-m64", _decode_index_scores_fp8, _DEC, at_block=_DEC_M64,
               unsupported=_no_fp8_decode_scores),
        Canary("decode_index_scores_fp8", "b128-m128-n8",
               lambda: _decode_index_scores_fp8((100, 300), bs=128, kh=4, hx=128), _DEC, m3=True,
               at_block=_DEC_M128, unsupported=_no_fp8_decode_scores),
        # fp8 pages converted in registers (opt-in: DecodeScoreConfig(fp8_convert="registers"); the model
        # does not take it, so these verdicts keep nothing off the default SMEM conversion), both tiles
        Canary("decode_index_scores_registers", "b64-m64", _decode_index_scores_registers, _DEC,
               at_block=_DEC_M64),
        Canary("decode_index_scores_registers", "b128-m128-n8",
               lambda: _decode_index_scores_registers((100, 300), bs=128, kh=4, hx=128), _DEC, m3=True,
               at_block=_DEC_M128),
        # the fused decode selection (opt-in: TextConfig.msa_decode_select="fused"), the same two tiles
        Canary("decode_select_fused", "b64-m64", _decode_select_fused, _DEC, at_block=_DEC_M64),
        Canary("decode_select_fused", "b128-m128-n8", lambda: _decode_select_fused((100, 1500), bs=128, kh=4, hx=128),
               _DEC, m3=True, at_block=_DEC_M128, long=True),
        Canary("decode_select_registers", "b64-m64", _decode_select_registers, _DEC, at_block=_DEC_M64),
        Canary("decode_select_registers", "b128-m128-n8",
               lambda: _decode_select_registers((100, 1500), bs=128, kh=4, hx=128), _DEC, m3=True,
               at_block=_DEC_M128),
        Canary("sparse_decode_attention", "b64-h64-g8", _sparse_decode_attention, _DEC, at_block=_SMALL),
        Canary("sparse_decode_attention", "b128-h128-g16", lambda: _sparse_decode_attention((100, 300), **_M3_DECODE),
               _DEC, m3=True, at_block=_LARGE, long=True),
        Canary("grouped_matmul", "bf16", lambda: _grouped_matmul(False), _GMM, m3=True, long=True),
        Canary("grouped_matmul", "mxfp8", lambda: _grouped_matmul(True), _GMM, m3=True, long=True),
    )
}
KERNELS = tuple(dict.fromkeys(c.kernel for c in CANARIES.values()))

# What the model runs (m3jax.msa.kernels): prefill = index scores + block-major top-k + KV-major
# attention; in-place decode = decode index scores + either top-k kernel + sparse decode attention.
MSA_PREFILL_KERNELS = ("index_scores", "topk_blockmajor", "sparse_attention_kv_major")
FP8_INDEXER_PREFILL_KERNELS = ("index_scores_fp8",)  # and, under the fp8 indexer, its score kernel
MSA_DECODE_KERNELS = ("decode_index_scores", "topk_rowsplit", "topk_blockmajor", "sparse_decode_attention")
FP8_INDEXER_DECODE_KERNELS = ("decode_index_scores_fp8",)  # and, under the fp8 indexer, its e4m3 scoring


def of_kernel(kernel: str) -> list[Canary]:
    """Every canary of one kernel (each of its paths)."""
    return [c for c in CANARIES.values() if c.kernel == kernel]


def paths_for(kernel: str, block_size: int | None = None) -> list[Canary]:
    """The canaries of the path(s) the model takes through ``kernel`` at ``block_size`` (every path when
    it is None: a caller that does not know its block)."""
    return [c for c in of_kernel(kernel) if block_size is None or c.at_block is None or c.at_block(block_size)]


# ---- comparison -------------------------------------------------------------------------------------


def compare(got, ref, tol: float | None) -> tuple[bool, float, str | None]:
    """(passed, max error, why not). Float outputs: -inf where the reference is -inf, finite values
    within ``tol``; ids (``tol`` None): equal entries (max error = how many differ)."""
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False, float("inf"), f"output {got.dtype}{list(got.shape)} != reference {ref.dtype}{list(ref.shape)}"
    if tol is None:
        bad = int((got != ref).sum())
        return bad == 0, float(bad), None if bad == 0 else f"{bad} of {ref.size} entries differ"
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if not np.array_equal(np.isneginf(g), np.isneginf(r)):
        return False, float("inf"), "-inf entries differ from the reference"
    fin = np.isfinite(r)
    if not np.isfinite(g[fin]).all():
        return False, float("inf"), "non-finite output where the reference is finite"
    diff = np.abs(g[fin] - r[fin])
    err = float(diff.max()) if diff.size else 0.0
    ok = bool((diff <= tol + tol * np.abs(r[fin])).all())
    return ok, err, None if ok else f"max |error| {err:.3g} over atol = rtol = {tol:g}"
