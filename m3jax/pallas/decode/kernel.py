"""MSA decode kernels in Mosaic GPU: paged index-block scoring and sparse paged attention.

Cache layout (one page = one MSA block of ``block_size`` tokens):
``k_pages``/``v_pages`` [num_pages, block_size, K, H], ``ik_pages`` [num_pages, block_size, Hx],
``page_table`` int32 [B, max_pages] (logical block j of sequence b is physical page
``page_table[b, j]``), ``seq_lens`` int32 [B] counting the Q new tokens; query i of Q sits at
position ``seq_lens[b] - Q + i``.

1. :func:`.hopper.decode_index_scores` (docs/KERNELS.md §2.2, "AB-swapped"): one CTA per (request, context
   split). The ``block_size`` index keys of a page are the wgmma **M** side (A operand straight from
   the TMA-loaded SMEM page), the few ``Hi * Q`` query rows are the **N** side (padded to the wgmma
   granularity of 8, B operand = the query tile, loaded once, K-major). Each CTA owns a contiguous
   range of logical pages (``num_splits`` is static, so the grid is shape-static / graph-stable) and
   only visits pages that hold tokens (``cdiv(seq_len, block_size)``); an ``emit_pipeline`` keeps
   ``stages`` page loads in flight (physical page read from ``page_table`` inside the index map).
   Per page: the ``[block_size, N]`` fp32 accumulator is masked causally (key position <= query
   position), max-reduced over the key axis, and the ``[N]`` row goes to an SMEM score tile that is
   transposed and written back by TMA (:func:`score_pipeline`): the output is one row per query row,
   read in place by the row-split top-k (``decode_score_select``), which takes the never-written pages
   without tokens as -inf (``decode_index_scores`` sets them to -inf in XLA). Memory-bound: the
   index-key scan is the only large read.
   fp8 e4m3 index pages (``index_cache_dtype="float8_e4m3fn"``) are TMA-loaded as fp8 (half the
   bytes) and converted in SMEM, 64 rows at a time through registers, into one page of the query's
   16-bit type that the MMA reads as its A operand (:func:`convert_page`; exact: every e4m3 value is
   a bf16 and an f16). ``DecodeScoreConfig.fp8_convert="registers"`` skips that SMEM round trip on
   Hopper: the page is loaded into wgmma's register A layout, converted there and fed to the wgmma
   from registers (:func:`page_registers`); tcgen05 takes A from SMEM or TMEM only and the
   interpreter has no register-A wgmma, so those run the SMEM path (:func:`keys_in_registers`).
   ``DecodeScoreConfig.fp8_mma="float16"`` meets the keys in f16 instead (one conversion per key pair
   instead of three, the bf16 query scaled into f16's range per row); ``benchmarks/decode_fp8_index.py``
   measures which is faster (benchmarks/RESULTS.md#decode-fp8-index). Under the fp8 indexer
   (``score_dtype="float8_e4m3fn"``, :func:`score_operands`) nothing is converted: the query rows are
   e4m3 too and the page as loaded is the wgmma's A operand (Hopper only).
2. :func:`.hopper.sparse_decode_attention` (docs/KERNELS.md §2.6): one CTA per (request, KV head, split of the
   selected pages). The group's ``G`` query heads times the ``Q`` tokens are packed as wgmma rows
   (padded to 64). The Q tokens' selections are merged into a **union** of distinct pages with a
   per-page token bitmask (built in XLA from the tiny ``block_idx`` tensor), so a page selected by
   several draft tokens is read once (the verify-as-decode fix, docs/KERNELS.md §2.6 item 2). Pages are loaded
   by TMA through the page table (``emit_pipeline``), online softmax in fp32 (exp2, log2 e folded in
   the scale), masked by token bitmask and ``key pos <= query pos`` (which implies ``< seq_len``).
   Each split writes a normalised fp32 partial output (its real query rows only) and its natural-log
   LSE; the LSE merge of docs/MSA.md §1.5 runs in XLA (tiny: ``splits x rows x H``). Rows without any
   visible key give 0.
   The pipeline length is static (``ceil(Q * topk / splits)`` union entries per split): with a
   dynamic step count ``emit_pipeline`` puts the (acc, m, l) register carries in a while loop, which
   Mosaic GPU (jax 0.11.2) cannot lower. Padding entries (the union is shorter than ``Q * topk`` when
   tokens share pages) have id -1 and token bits 0, load the request's first page and change
   nothing -- but they cost a page load + MMAs each; for Q = 1 the union is full and nothing is
   wasted.
3. :func:`.hopper.decode_select_blocks` (docs/KERNELS.md §2.2, "Fused selection"): item 1's grid and
   page pipeline, and each CTA also selects into the split's top-k lists, which the pipeline carries
   (:data:`SELECT_LANES` lanes, one per query row; ``topk.select``'s insertion and forced
   priorities), so the selection runs while the next pages load. Threshold insertion: a page's
   ``[N]`` block-max row is compared, in its own layout (whole in every warp, so the vote needs no
   SMEM and no barrier), with the lists' k-th values; only when some row beats its k-th value or
   the page can carry a forced priority (``topk.select.may_force``) does the row go through an SMEM
   stage into the lists' layout and get inserted, the new k-th values coming back the same way.
   Each CTA writes its lists and :func:`merge_candidates` takes the global top-k of the
   ``splits * k`` candidates with the top-k kernel (the reference's order, ties included). The
   merge is a second launch: Mosaic GPU in jax 0.11.2 has no cross-CTA hand-off that interpret
   mode runs (GMEM atomics return nothing; global semaphores need ``pl.get_global``, which the
   interpreter cannot run). Hopper only: on tcgen05 targets
   :func:`m3jax.pallas.decode.decode_select_blocks` runs item 1's Blackwell kernel and the top-k kernel.

fp32 inputs: Hopper wgmma would run fp32 as TF32 (10-bit mantissa, ~1e-3 error). To keep fp32 at
reference accuracy the wrappers split fp32 operands into bf16 pieces (``_common.bf16_split``): the
attention kernel issues three bf16 wgmmas per product (hi*hi + hi*lo + lo*hi, ~2^-16 relative error),
the index-score kernel six over three pieces (fp32 accuracy: its scores decide the selection); 16-bit
inputs use one wgmma. (The split costs one extra XLA pass over the fp32 cache: fp32 is a test path, the serving
cache is bf16.)

Per architecture (:mod:`.hopper`: wgmma; :mod:`.blackwell`: tcgen05; picked by
:func:`m3jax.pallas._backend.arch_module`): this file holds the plan and launch both share. What changes on Blackwell (``Target.BLACKWELL``): the wgmma calls become ``plgpu.tcgen05_mma`` with
the accumulators in TMEM (index scoring: the [block_size, N] score tile lives in TMEM and the block
max is a TMEM load-with-reduce on SM103); the attention's P operand is written to TMEM instead of
registers; ``tma_gather`` lets one indexed TMA fetch all selected pages of a split instead of one
copy per page; ``cluster=2`` pairs CTAs on a 256-row tile for Q*G > 128. Both kernels have their
port (:mod:`.blackwell`: TMEM score tiles with a plain TMEM load + max; the attention's S and O in
TMEM, P through SMEM); both share this file's plan and launch pieces (``score_*``: operands, chunks,
stages, pipeline, result; ``attention_*``: plan, refs, call, with ``kv_pipeline``, ``visible_keys``,
``store_split``). Tile sizes and stage counts come from :class:`DecodeScoreConfig` /
:class:`SparseDecodeConfig`; ``Target`` supplies ``num_sms`` (split counts) and ``smem_bytes``
(stages that fit). The algorithm is unchanged.


Remaining work: docs/KERNELS.md §2.6.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.msa.reference import lse_merge, quantize_e4m3
from m3jax.pallas._common import LOG2E, split_parts, split_products, swizzle_transforms
from m3jax.pallas._backend import Target, current_target, interprets, mosaic_kernel, pl, plgpu
from m3jax.pallas import topk as topk_kernels

FP8 = jnp.float8_e4m3fn  # index-key pages of an fp8 index cache (index_cache_dtype)
FP8_SCORES = "float8_e4m3fn"  # the fp8 indexer's score_dtype (index_score_dtype)
# The fused selection's register lists: one lane per query row (h * Q + t) in a warpgroup-wide vector.
SELECT_LANES = 128


@dataclasses.dataclass(frozen=True)
class DecodeScoreConfig:
    """Tiling of :func:`.hopper.decode_index_scores` and of the fused selection
    (:func:`.hopper.decode_select_blocks`, which also takes ``fp8_mma``).

    num_splits: CTAs per request along the context (None: ``waves`` waves over the SMs, rounded down
      to whole CTAs per request; the scores kernel splits further to keep its SMEM score tile within
      32 KiB). For the fused selection fewer splits also mean fewer candidates to merge
      (``splits * topk`` per row).
    waves: None picks by the pages: 1 for 16-bit pages at every batch (their page buffers leave room
      for one CTA per SM, so a second wave only adds a prologue and a tail; at batch 8 the floored
      single wave leaves 4 of 132 SMs idle and is still the faster); 2 for fp8 pages (two CTAs share
      an SM and the second hides the first's conversions). Measured in
      benchmarks/RESULTS.md#decode-2026-12-06e and #decode-2026-12-06-h200.
    stages: page loads in flight per CTA (``emit_pipeline`` max_concurrent_steps).
    fp8_mma: the 16-bit type fp8 pages meet a bf16 query in. ``"bfloat16"``: the query as is, the
      keys converted e4m3 -> f16 -> bf16 (three conversions per pair of keys; exact products).
      ``"float16"``: the keys e4m3 -> f16 (one conversion per pair) and the query scaled per row by a
      power of two into f16's range (max |q| in [2^14, 2^15)), the scores scaled back after; only
      elements below 2^-31 of their row's max can round (far below the fp32 accumulation's own
      error). fp32 queries always meet bf16 keys (their three bf16 pieces); f16 queries f16 keys.
    fp8_convert: where fp8 pages become those 16-bit keys. ``"smem"``: into an SMEM page the wgmma
      reads as its A operand (:func:`convert_page`). ``"registers"``: loaded from the TMA'd page
      straight into wgmma's register A layout, converted there and fed to the wgmma from registers
      (:func:`page_registers`): no SMEM write, no fence, and no SMEM page for the converted keys
      (room for more page loads in flight where SMEM limits ``stages``). Hopper on the GPU only
      (:func:`keys_in_registers`); interpret mode (no register-A wgmma) and tcgen05 (A from SMEM or
      TMEM only) run ``"smem"``. The fp8 indexer's e4m3 x e4m3 MMA converts nothing, so neither applies.
    """

    num_splits: int | None = None
    stages: int = 4
    waves: int | None = None
    fp8_mma: str = "bfloat16"
    fp8_convert: str = "smem"

    def __post_init__(self):
        if self.fp8_convert not in ("smem", "registers"):
            raise ValueError(f"fp8_convert={self.fp8_convert!r} must be 'smem' or 'registers'")

    def splits(self, batch: int, max_pages: int, target: Target, fp8_pages: bool) -> int:
        if self.num_splits is not None:
            return max(1, min(self.num_splits, max_pages))
        waves = self.waves if self.waves is not None else 2 if fp8_pages else 1
        return max(1, min(max_pages, waves * target.num_sms // batch))


@dataclasses.dataclass(frozen=True)
class SparseDecodeConfig:
    """Tiling of :func:`.hopper.sparse_decode_attention`.

    num_splits: splits of a request's union of selected pages (None: ~1 wave over the SMs, at least
      one page per split).
    stages: K/V page pairs in flight per CTA (reduced automatically to fit SMEM).
    kv_tile: keys per pipeline step (a divisor of the page, multiple of 64). None: whole pages when
      two of them fit in SMEM, else half / quarter pages (fp32 inputs with block 256).
    """

    num_splits: int | None = None
    stages: int = 2
    kv_tile: int | None = None

    def splits(self, batch: int, kv_heads: int, union_len: int, target: Target) -> int:
        if self.num_splits is not None:
            return max(1, min(self.num_splits, union_len))
        return max(1, min(union_len, -(-target.num_sms // (batch * kv_heads))))


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# --------------------------------------------------------------------------------------------------
# 1. index scores
# --------------------------------------------------------------------------------------------------


# What both MMA variants of the decode index scoring share (this Hopper kernel and the Blackwell one in
# .blackwell): shape checks, the context split, the operands, the SMEM budget, the CTA's prologue
# (query tile in, its page range), the page pipeline and the result's layout.


def score_shapes(iq, ik_pages, page_table, block_size: int, tiles: str):
    """(b, q, hi, hx, num_pages, bs, max_pages) of a decode scoring call, checked."""
    b, q, hi, hx = iq.shape
    num_pages, bs, hx2 = ik_pages.shape
    if bs != block_size or hx2 != hx:
        raise ValueError(f"ik_pages {ik_pages.shape} does not match block_size={block_size}, Hx={hx}")
    if bs % 64 or bs > 256:
        raise ValueError(f"block_size={bs} must be a multiple of 64 and <= 256 ({tiles})")
    if hx % 64:
        raise ValueError(f"index head dim {hx} must be a multiple of 64")
    return b, q, hi, hx, num_pages, bs, page_table.shape[1]


def score_chunks(config: DecodeScoreConfig, b: int, max_pages: int, cols: int | None,
                 fp8_pages: bool) -> tuple[int, int]:
    """(pages per CTA, CTAs per request): the scores kernel's per-CTA SMEM score tile (chunk x cols
    fp32) is kept to 32 KiB, so large batches split the context further; ``cols=None`` (the fused
    selection, whose SMEM rows do not grow with the chunk): the config's splits."""
    splits = config.splits(b, max_pages, current_target(), fp8_pages)
    if cols is None:
        return -(-max_pages // splits), splits
    splits = max(splits, -(-max_pages // max(4, 32768 // (4 * cols) // 4 * 4)))
    # The tile goes out transposed (:func:`score_pipeline`): its rows are ``chunk`` fp32 pages long, and a
    # TMA row is a multiple of 16 bytes.
    chunk = round_up(-(-max_pages // splits), 4)
    return chunk, -(-max_pages // chunk)


def score_operands(iq, ik_pages, config: DecodeScoreConfig, score_dtype: str = "bfloat16"):
    """Query rows n = h * Q + q (the output reshapes to [Hi, Q] for free), not padded (the kernel's
    TMA copy fills the query tile's rows past Hi * Q with zeros, :func:`score_prologue`), and
    the key pages flattened to rows; fp32 in three bf16 pieces (fp32 accuracy: these scores decide
    the selection, see _common.bf16_split). fp8 e4m3 pages stay fp8, one piece: the kernel converts
    each page to the query's 16-bit type in SMEM (:func:`convert_page`, exact), so only an fp32 query
    is split; a bf16 query becomes f16 under ``config.fp8_mma == "float16"``. The fp8 indexer
    (``score_dtype="float8_e4m3fn"``, fp8 pages taken as stored): each query row quantised to e4m3
    with its scale (``msa.reference.quantize_e4m3``, as the reference does), met by the pages as they
    are (e4m3 x e4m3, no conversion), its scales the per-row factors. Returns (query parts [B, Hi * Q,
    Hx] each, key parts, per-row factors fp32 [B, Hi * Q] that undo the query's scaling, or None)."""
    b, q, hi, hx = iq.shape
    # [B, Q, Hi, Hx] -> [B, Hi * Q, Hx]: a bitcast at Q = 1. A pad to the MMA tile here would be one
    # more XLA launch before every decode step's scoring kernel.
    rows = jnp.transpose(iq, (0, 2, 1, 3)).reshape(b, hi * q, hx)
    if score_dtype == FP8_SCORES:
        if ik_pages.dtype != FP8:
            raise ValueError(f"the fp8 indexer's decode scoring reads fp8 index pages (index_cache_dtype="
                             f"'float8_e4m3fn'), got {ik_pages.dtype} pages")
        qv, qs = quantize_e4m3(rows)
        return (qv,), (ik_pages.reshape(-1, hx),), qs[..., 0]
    if ik_pages.dtype != FP8:
        q_parts = split_parts(rows.astype(jnp.promote_types(iq.dtype, ik_pages.dtype)), 3)
        k_parts = split_parts(ik_pages.astype(q_parts[0].dtype if len(q_parts) == 1 else jnp.float32), 3)
        return q_parts, tuple(kp.reshape(-1, hx) for kp in k_parts), None
    if config.fp8_mma not in ("bfloat16", "float16"):
        raise ValueError(f"fp8_mma={config.fp8_mma!r} must be 'bfloat16' or 'float16'")
    unscale = None
    if rows.dtype == jnp.bfloat16 and config.fp8_mma == "float16":
        # max |row| = f 2^e, f in [0.5, 1): times 2^(15 - e) it lies in [2^14, 2^15) (f16's max is
        # 65504); zero (padding) rows give e = 0; the clip keeps 2^(15 - e) finite for tiny rows.
        _, e = jnp.frexp(jnp.max(jnp.abs(rows.astype(jnp.float32)), axis=-1))
        e = jnp.clip(e, -110, 128)
        rows = (rows.astype(jnp.float32) * jnp.ldexp(jnp.float32(1), 15 - e)[..., None]).astype(jnp.float16)
        unscale = jnp.ldexp(jnp.float32(1), e - 15)
    elif rows.dtype not in (jnp.bfloat16, jnp.float16):
        rows = rows.astype(jnp.float32)
    return split_parts(rows, 3), (ik_pages.reshape(-1, hx),), unscale


def score_products(n_q: int, n_k: int) -> tuple[tuple[int, int], ...]:
    """(key piece, query piece) MMAs per page: the split products of equally split operands; an fp8
    page is one exact piece, so it meets every query piece once."""
    return split_products(n_q) if n_k == n_q else tuple((0, c) for c in range(n_q))


def page_transforms(k_parts, hx: int, transforms):
    """SMEM layout of the TMA-loaded key pages: the MMA operand's for 16-bit pages; fp8 pages (read
    by :func:`convert_page`, :func:`page_registers` or, under the fp8 indexer, the MMA itself) the
    widest swizzle their 1-byte rows allow."""
    return swizzle_transforms(min(hx, 128), 1) if k_parts[0].dtype == FP8 else transforms


def _converts(q_parts, k_parts) -> bool:
    """Whether fp8 pages are converted to the query's 16-bit type (in SMEM or in registers): not when
    the query is e4m3 too (the fp8 indexer's e4m3 x e4m3 MMA reads the page as loaded)."""
    return k_parts[0].dtype == FP8 and q_parts[0].dtype != FP8


def _smem_page(q_parts, k_parts, registers: bool) -> bool:
    """Whether a scoring kernel converts its pages into an SMEM page (:func:`convert_page`): fp8 pages
    met by a 16-bit query (:func:`_converts`) not taken to the MMA from ``registers``."""
    return _converts(q_parts, k_parts) and not registers


def score_stages(config: DecodeScoreConfig, chunk: int, q_parts, k_parts, n_pad: int, hx: int, bs: int,
                 tile: tuple[int, int] | None = None, extra: int = 0, registers: bool = False) -> int:
    """Page buffers that fit next to the query tile, the fp32 score tile (``tile`` rows x columns,
    default chunk x n_pad), ``extra`` bytes of the variant's own and (fp8 pages converted in SMEM, not
    in ``registers``) the converted page (fp32: 3 bf16 parts per page; fp8: 1 byte per key element)."""
    page_bytes = sum(jnp.dtype(kp.dtype).itemsize for kp in k_parts) * bs * hx
    convert = bs * hx * 2 if _smem_page(q_parts, k_parts, registers) else 0
    rows, cols = tile or (chunk, n_pad)
    fixed = len(q_parts) * n_pad * hx * 2 + rows * cols * 4 + convert + extra + 4096
    return max(1, min(config.stages, chunk, (current_target().smem_bytes - fixed) // page_bytes))


def score_scratch(q_parts, k_parts, n_pad: int, hx: int, bs: int, tile: tuple[int, int], transforms,
                  registers: bool = False) -> list:
    """The scratch every variant starts with: query tile, fp32 score tile (``tile``: the scores
    kernels' ``(chunk, score_tile_cols)``, :func:`score_pipeline`), the query tile's barrier and, for fp8 pages
    converted in SMEM (not in ``registers``), the page converted to the query's type (the MMA's key
    operand)."""
    dtype = q_parts[0].dtype
    convert = [plgpu.SMEM((bs, hx), dtype, transforms=transforms)] if _smem_page(q_parts, k_parts, registers) else []
    return [
        plgpu.SMEM((len(q_parts), n_pad, hx), dtype, transforms=transforms),
        plgpu.SMEM(tile, jnp.float32),
        plgpu.Barrier(num_arrivals=len(q_parts)),
        *convert,
    ]


def convert_page(src, dst) -> None:
    """fp8 e4m3 key page (SMEM) -> ``dst``'s 16-bit type (SMEM), 64 rows at a time (64 x Hx / 128
    threads in registers), fenced for the MMA that reads it. Through f16: Mosaic converts e4m3 to f16
    with one ``cvt`` per pair on any ptxas, to bf16 directly only with PTX ISA >= 9.2; every e4m3
    value is exact in f16 and in bf16, so the keys the MMA sees are the cache's."""
    for r in range(0, src.shape[0], 64):
        x = plgpu.load(src.at[pl.ds(r, 64)], layout=plgpu.Layout.WGMMA_8BIT)  # 4-byte loads
        dst[pl.ds(r, 64)] = x.astype(jnp.float16).astype(dst.dtype)
    plgpu.commit_smem()


def keys_in_registers(config: DecodeScoreConfig, q_parts, k_parts, interpret: bool | None) -> bool:
    """Whether fp8 pages reach the MMA from registers (``config.fp8_convert == "registers"``,
    :func:`page_registers`) rather than converted in SMEM (:func:`convert_page`): only pages that are
    converted at all (:func:`_converts`; the fp8 indexer's e4m3 x e4m3 MMA reads the page as loaded),
    only for wgmma (tcgen05 takes A from SMEM or TMEM) compiled for the GPU (the interpreter has no
    register-A wgmma). The one place the scoring kernels choose."""
    return (_converts(q_parts, k_parts) and config.fp8_convert == "registers" and current_target().mma == "wgmma"
            and not interprets(interpret))


def page_registers(src, dtype):
    """fp8 e4m3 key page (SMEM, [bs, Hx]) -> ``dtype`` registers in the wgmma A operand's layout
    (``Layout.WGMMA``: each 64-row group is one wgmma's M; the warpgroup holds the whole page, bs x
    Hx / 128 elements a thread). Through f16 and exact, as :func:`convert_page`; nothing is written
    back to SMEM."""
    # 2-byte loads straight into the A layout: a 4-byte load (Layout.WGMMA_UPCAST_2X) plus Mosaic's
    # relayout to WGMMA compiles to more SASS instructions per page (shuffles and permutes, ptxas 13.0)
    x = plgpu.load(src, layout=plgpu.Layout.WGMMA)
    return x.astype(jnp.float16).astype(dtype)


def score_prologue(refs, n_q: int, n_k: int, chunk: int, bs: int, n_io: int = 1, registers: bool = False):
    """Unpack a scoring kernel's refs, copy the query tile in and find this CTA's pages.

    refs: q parts, k parts, page table, seq lens, ``n_io`` more (the scores kernel: its output; the
    fused selection: its inputs and outputs), then :func:`score_scratch` and the variant's own scratch.
    Returns (q_smem, k_gmem, pt_gmem, out_gmem, score_smem, mma_keys, [variant scratch], bi, seq_len,
    first page, live steps), ``out_gmem`` the one extra ref or the tuple of ``n_io``;
    ``mma_keys(page refs)`` gives the MMA's key operands of a loaded page (fp8: the page converted,
    in SMEM -- the caller's MMAs must be done with the previous one -- or with ``registers`` a
    register array, :func:`keys_in_registers`)."""
    q_gmem = refs[:n_q]
    k_gmem = refs[n_q : n_q + n_k]
    pt_gmem, len_gmem = refs[n_q + n_k : n_q + n_k + 2]
    io = refs[n_q + n_k + 2 : n_q + n_k + 2 + n_io]
    out_gmem = io[0] if n_io == 1 else tuple(io)
    q_smem, score_smem, q_bar, *own = refs[n_q + n_k + 2 + n_io :]
    converted = own.pop(0) if _smem_page(q_gmem, k_gmem, registers) else None

    def mma_keys(k_smems):
        if registers:
            return (page_registers(k_smems[0], q_smem.dtype),)
        if converted is None:
            return k_smems
        convert_page(k_smems[0], converted)
        return (converted,)

    bi = lax.axis_index("b")
    seq_len = len_gmem[bi]
    first = lax.axis_index("s") * chunk
    live_pages = (seq_len + bs - 1) // bs
    steps = jnp.clip(jnp.minimum(live_pages, first + chunk) - first, 0, chunk)
    n_pad, n_rows = q_smem.shape[1], q_gmem[0].shape[1]
    for p in range(n_q):
        # The tile's rows past the Hi * Q query rows are out of the source's bounds: TMA fills them
        # with zeros (score columns no one reads, never NaN), so no padded copy of the query is made.
        if n_rows == n_pad:
            plgpu.copy_gmem_to_smem(q_gmem[p].at[bi], q_smem.at[p], q_bar)
        else:
            plgpu.copy_gmem_to_smem(q_gmem[p].at[bi, pl.ds(0, n_pad)], q_smem.at[p], q_bar,
                                    oob_mode=plgpu.OOBFillMode.ZEROS)
    plgpu.barrier_wait(q_bar)
    return q_smem, k_gmem, pt_gmem, out_gmem, score_smem, mma_keys, own, bi, seq_len, first, steps


def stream_pages(page_step, k_gmem, pt_gmem, bi, first, steps, page_shape: tuple[int, int], transforms,
                 stages: int, init_carry=None):
    """Stream this CTA's live pages through ``page_step`` (TMA ring of ``stages``; with ``init_carry``
    the step carries it and its final value is returned), its generic SMEM writes committed after."""

    def page_of(i):
        return (pt_gmem[bi, first + i], 0)

    carry = plgpu.emit_pipeline(
        page_step,
        grid=(steps,),
        in_specs=[plgpu.BlockSpec(page_shape, page_of, transforms=transforms) for _ in k_gmem],
        max_concurrent_steps=stages,
        init_carry=init_carry,
    )(*k_gmem)
    plgpu.commit_smem()
    return carry


def score_pipeline(page_step, k_gmem, pt_gmem, out_gmem, score_smem, bi, first, steps, chunk: int,
                    page_shape: tuple[int, int], transforms, stages: int):
    """Stream this CTA's live pages through ``page_step`` (:func:`stream_pages`; page ``i``'s block-max
    row goes to row ``i`` of the ``[chunk, cols]`` score tile, :func:`store_page_scores`), then store the
    tile transposed, at its pages of the query rows: the output is row-major per query row
    (:func:`score_out_shape`), the layout the row-split top-k kernel reads, so no XLA transpose runs
    between the two. The transposition is one load of the tile's transposed view (one element per
    thread and step, in pieces of whole elements per thread of the warpgroup: :func:`score_tile_pieces`)
    into row-major tiles in the page buffers' SMEM, free after the pipeline;
    a column of the tile (one query row) cannot be stored on its own, as Mosaic GPU vectorises only a
    unit-stride dimension."""
    stream_pages(page_step, k_gmem, pt_gmem, bi, first, steps, page_shape, transforms, stages)
    cols, n_out = score_smem.shape[1], out_gmem.shape[1]
    pieces = score_tile_pieces(chunk)

    def transpose(*rows_smems):
        for (p0, w), rows_smem in zip(pieces, rows_smems):
            layout = plgpu.Layout.WG_STRIDED((cols, w), 1)
            rows_smem[...] = plgpu.load(score_smem.at[pl.ds(p0, w)].transpose((1, 0)), layout=layout)
        plgpu.commit_smem()
        for (p0, w), rows_smem in zip(pieces, rows_smems):
            plgpu.copy_smem_to_gmem(rows_smem.at[pl.ds(0, n_out)], out_gmem.at[bi, :, pl.ds(first + p0, w)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(transpose, *(plgpu.SMEM((cols, w), jnp.float32) for _, w in pieces))


def score_tile_pieces(chunk: int) -> tuple[tuple[int, int], ...]:
    """(first page, pages) of each transposed piece of a chunk's score tile: at most 256 pages (a TMA
    box's limit per dimension) and whole elements per thread of a warpgroup (16-page multiples, the
    tile being ``n_pad`` wide, a multiple of 8). A chunk that is not a multiple of 16 ends with its
    last 16 pages, which overlap the piece before: both store the same values. A chunk below 16
    pages is one piece, its tile widened instead (:func:`score_tile_cols`)."""
    if chunk < 16:
        return ((0, chunk),)
    whole = chunk // 16 * 16
    pieces = tuple((p0, min(256, whole - p0)) for p0 in range(0, whole, 256))
    return pieces + (((chunk - 16, 16),) if chunk % 16 else ())


def score_tile_cols(n_pad: int, chunk: int) -> int:
    """Columns of the scores kernels' SMEM tile: the ``n_pad`` query rows; below 16 pages a chunk's
    tile is widened to whole elements per thread of a warpgroup (:func:`score_tile_pieces`)."""
    return n_pad if chunk >= 16 else round_up(n_pad, 128 // math.gcd(chunk, 128))


def store_page_scores(score_smem, i, row) -> None:
    """Page ``i``'s block-max row ``[n_pad]`` into row ``i`` of the score tile (columns past n_pad: no query row)."""
    if row.shape[0] == score_smem.shape[1]:
        score_smem[i] = row
    else:
        score_smem[i, pl.ds(0, row.shape[0])] = row


def score_out_shape(b: int, n_pad: int, splits: int, chunk: int) -> jax.ShapeDtypeStruct:
    """The scores kernels' output, fp32 ``[B, n_pad, pages]``: row ``h * Q + t`` of request ``b`` holds
    its block maxima in block order. The pages are rounded up to whole 128-block rows of the top-k
    kernel (:func:`m3jax.pallas.topk.rowsplit.select_blocks_rows`); blocks no CTA visited (past the
    request's live pages) are never written and hold anything."""
    return jax.ShapeDtypeStruct((b, n_pad, round_up(splits * chunk, 128)), jnp.float32)


def score_result(out, seq_lens, bs: int, bhq: tuple[int, int, int], max_pages: int, unscale=None):
    """Kernel rows [B, n_pad, pages] -> fp32 [B, Hi, Q, max_pages], times ``unscale`` [B, Hi * Q] when the
    query was scaled (positive, so they commute with the block max, rounding included: powers of two
    exactly, the fp8 indexer's row scales as the reference's product of each score and its row's
    scale). Pages no CTA visited (no tokens) were never written: -inf them here."""
    b, hi, q = bhq
    out = out[:, : hi * q, :max_pages]
    if unscale is not None:
        out = out * unscale[:, :, None]
    live = (seq_lens.astype(jnp.int32)[:, None] + bs - 1) // bs
    out = jnp.where((jnp.arange(max_pages)[None, :] < live)[:, None, :], out, -jnp.inf)
    return out.reshape(b, hi, q, max_pages)


def merge_candidates(vals: jax.Array, ids: jax.Array, bhq: tuple[int, int, int], topk: int) -> jax.Array:
    """The global top-k from the context splits' lists (the fused selection's output).

    vals fp32 / ids int32 [B, splits, kc, lanes]: split s's ``kc`` best ranked values of row (lane)
    n and their block ids, descending, ties to the lower id, ``(-inf, -1)`` when empty. Every block
    of the global top-k is in its split's top-k, so the union of the lists holds it. Laid out split
    after split, equal values sit in increasing block id (a split's ids are below the next split's),
    so the top-k of the ``splits * kc`` candidates by value with ties to the lower position is the
    reference's selection in the reference's order. That top-k runs in the top-k kernel
    (:func:`m3jax.pallas.topk.select_blocks`; the row-split kernel at decode's row counts, one CTA per
    row): its positions are the candidates' "block ids", and ``local_blocks=0``, no sinks and no
    interventions force none of them (the values already carry the forced priorities; ranking them
    again changes nothing); XLA's ``lax.top_k`` on a few long rows takes several times the
    kernel's time (benchmarks/RESULTS.md, the decode table's ``topk(select_blocks)`` rows).
    Returns int32 [B, Hi, Q, topk], ``-1`` past the visible blocks."""
    b, hi, q = bhq
    splits, kc = vals.shape[1], vals.shape[2]
    n = splits * kc

    def by_row(x):  # [B, splits, kc, lanes] -> [B, Hi, Q, splits * kc]
        return jnp.transpose(x[..., : hi * q].reshape(b, n, hi * q), (0, 2, 1)).reshape(b, hi, q, n)

    # block_size 1 and every row at the last position: all candidates visible, none forced
    pos = topk_kernels.select_blocks(by_row(vals), jnp.full((b, q), n - 1, jnp.int32), block_size=1, topk=topk,
                                     local_blocks=0)
    sel = jnp.take_along_axis(by_row(ids), jnp.maximum(pos, 0), axis=-1)
    return jnp.where(pos < 0, -1, sel).astype(jnp.int32)


def union_pages(block_idx: jax.Array):
    """Distinct selected blocks per (request, KV head) with the bitmask of the tokens that selected
    them, for Q > 1 tokens a request (one token's list is used as it stands: :func:`attention_plan`).

    Args:
      block_idx: int32 [B, K, Q, topk] logical block ids (-1 empty).
    Returns:
      (logical [B, K, U], token_bits [B, K, U], count [B, K]) with U = Q * topk; the first ``count``
      entries are the distinct valid blocks (in first-selection order), the rest are padding
      (logical -1, bits 0). The physical pages are looked up in the kernel (:func:`kv_pipeline`).
    """
    b, kh, q, topk = block_idx.shape
    u = q * topk
    flat = block_idx.reshape(b, kh, u).astype(jnp.int32)
    valid = flat >= 0
    eq = (flat[..., :, None] == flat[..., None, :]) & valid[..., :, None] & valid[..., None, :]
    e = jnp.arange(u)
    first = valid & ~jnp.any(eq & (e[None, :] < e[:, None]), axis=-1)
    token = e // topk
    tok_hit = jnp.zeros((b, kh, u), jnp.int32)
    for t in range(q):  # bit t: token t selected this block
        hit_t = jnp.any(eq & (token == t)[None, None, None, :], axis=-1)
        tok_hit = tok_hit | (hit_t.astype(jnp.int32) << t)
    order = jnp.argsort(jnp.where(first, e, u + e), axis=-1)
    logical = jnp.take_along_axis(jnp.where(first, flat, -1), order, axis=-1)
    bits = jnp.take_along_axis(jnp.where(first, tok_hit, 0), order, axis=-1)
    return logical, bits, jnp.sum(first, axis=-1).astype(jnp.int32)


@dataclasses.dataclass
class AttentionPlan:
    """What both sparse decode attention kernels (wgmma here, tcgen05 in :mod:`.blackwell`) run on:
    shapes, the padded union of selected pages, the operands split into 16-bit parts, the K/V tile
    and pipeline depth."""

    b: int
    nq: int
    n: int
    h: int
    kh: int
    g: int
    bs: int
    rows: int  # nq * g query rows of a KV head, row r = t * G + g_head
    m_pad: int  # rows padded to the MMA's M tile
    splits: int
    chunk: int  # union entries per split
    kv_tile: int
    sub: int  # K/V tiles per page
    steps: int
    stages: int
    scale: float  # softmax scale with log2(e) folded in (exp2)
    dtype: jnp.dtype  # the 16-bit type of the MMAs
    transforms: tuple
    q_parts: tuple
    k_parts: tuple
    v_parts: tuple
    logical: jax.Array  # [B, K, splits * chunk] union entries' block ids, -1 padding
    page_table: jax.Array  # int32 [B, max_pages]: the kernels look the physical pages up themselves
    bits: jax.Array  # [B, K, splits * chunk] token bitmasks; for Q = 1 ``logical`` again (the bit is id >= 0)

    @property
    def n_parts(self) -> int:
        return len(self.q_parts)

    @property
    def prods(self) -> tuple[tuple[int, int], ...]:
        return split_products(self.n_parts)


def attention_plan(q, k_pages, v_pages, page_table, block_idx, block_size: int, config: SparseDecodeConfig,
                    m_tile: int, max_kv_tile: int = 256) -> AttentionPlan:
    b, nq, n, h = q.shape
    num_pages, bs, kh, h2 = k_pages.shape
    g = n // kh
    topk = block_idx.shape[-1]
    if bs != block_size or h2 != h or n % kh:
        raise ValueError(f"shapes q {q.shape}, k_pages {k_pages.shape}, block_size={block_size}")
    if bs % 64 or bs > 256:
        raise ValueError(f"block_size={bs} must be a multiple of 64 and <= 256 (the MMA's N)")
    if h % 64 or h > 256:
        raise ValueError(f"head dim {h} must be a multiple of 64 and <= 256")
    if nq > 32:
        raise ValueError("at most 32 query tokens per request (token bitmask is int32)")
    rows = nq * g
    m_pad = round_up(rows, m_tile)
    target = current_target()
    u = nq * topk
    splits = config.splits(b, kh, u, target)
    chunk = -(-u // splits)
    splits = -(-u // chunk)  # no split made only of padding entries

    # Static pipeline length: every split walks exactly ``chunk`` entries (a dynamic step count puts
    # the (acc, m, l) vector carries in a while loop, which Mosaic GPU cannot lower). Padding
    # entries (beyond ``count`` or beyond U) have block id -1 and token bits 0: every score is
    # masked, they load the request's first page and change nothing.
    pad = [(0, 0), (0, 0), (0, splits * chunk - u)]
    if nq == 1:
        # One token's list as it stands, empty slots (-1) where they are: a selection never lists a
        # block twice. Its token bit is "id >= 0" (visible_keys) and the kernel looks the pages up
        # (kv_pipeline), so no XLA op runs between the top-k and this kernel at M3's splits. At a
        # full-attention layer's U (every visible block, 8,192 at 1M) union_pages' O(U^2) comparison
        # and sort took 18 % of the decode step (benchmarks/RESULTS.md#m3-width-1m-2026-12-06d).
        logical = bits = jnp.pad(block_idx.reshape(b, kh, u).astype(jnp.int32), pad, constant_values=-1)
    else:
        logical, bits, _ = union_pages(block_idx)
        logical, bits = jnp.pad(logical, pad, constant_values=-1), jnp.pad(bits, pad)
    # rows r = t * G + g_head, [B, K, q_tile_rows, H]: zero-padded only up to whole 8-row SMEM tiles (the
    # TMA copy fills that many rows of the M_pad-row tile; the rows below are never written, and the
    # scores of every row past ``rows`` are masked). For one token of M3 (16 rows) nothing is padded,
    # so no XLA launch precedes the kernel.
    q_rows = jnp.transpose(q.reshape(b, nq, kh, g, h), (0, 2, 1, 3, 4)).reshape(b, kh, rows, h)
    q_rows = jnp.pad(q_rows, [(0, 0), (0, 0), (0, round_up(rows, 8) - rows), (0, 0)])
    cdt = jnp.promote_types(jnp.promote_types(q.dtype, k_pages.dtype), v_pages.dtype)
    q_parts = split_parts(q_rows.astype(cdt))
    k_parts = split_parts(k_pages.astype(cdt))
    v_parts = split_parts(v_pages.astype(cdt))
    k_parts = tuple(x.reshape(num_pages * bs, kh, h) for x in k_parts)
    v_parts = tuple(x.reshape(num_pages * bs, kh, h) for x in v_parts)
    n_parts = len(q_parts)
    dtype = q_parts[0].dtype
    itemsize = jnp.dtype(dtype).itemsize
    transforms = swizzle_transforms(128 // itemsize, itemsize)

    def fitting_stages(tile):  # K/V tile pairs that fit next to the Q, P and output tiles
        fixed = n_parts * m_pad * (h + tile) * itemsize + m_pad * h * 4 + 4 * m_pad + 4096
        return (target.smem_bytes - fixed) // (2 * n_parts * tile * h * itemsize)

    # A page is loaded as bs // kv_tile sub-tiles when whole pages do not double-buffer in SMEM
    # (fp32 inputs = 2 bf16 parts, block 256).
    tiles = [t for t in (bs, bs // 2, bs // 4) if t % 64 == 0 and bs % t == 0 and t <= max_kv_tile]
    kv_tile = next((t for t in tiles if fitting_stages(t) >= min(2, chunk * (bs // t))), tiles[-1])
    if config.kv_tile is not None:
        if config.kv_tile % 64 or bs % config.kv_tile or config.kv_tile > max_kv_tile:
            raise ValueError(f"kv_tile={config.kv_tile} must be a multiple of 64 dividing block_size={bs}, "
                             f"at most {max_kv_tile}")
        kv_tile = config.kv_tile
    sub = bs // kv_tile
    steps = chunk * sub
    stages = max(1, min(config.stages, steps, fitting_stages(kv_tile)))
    return AttentionPlan(b, nq, n, h, kh, g, bs, rows, m_pad, splits, chunk, kv_tile, sub, steps, stages,
                          (h**-0.5) * LOG2E, dtype, transforms, q_parts, k_parts, v_parts, logical,
                          page_table.astype(jnp.int32), bits)


def attention_refs(plan: AttentionPlan, refs):
    """The kernel's refs by name: (q, k, v part lists, logical, page table, bits, seq_lens, o, lse, scratch)."""
    n = plan.n_parts
    q_gmem, k_gmem, v_gmem = refs[:n], refs[n : 2 * n], refs[2 * n : 3 * n]
    return (q_gmem, k_gmem, v_gmem, *refs[3 * n : 3 * n + 6], refs[3 * n + 6 :])


def cta_start(plan: AttentionPlan, q_gmem, q_smem, q_bar, len_gmem):
    """This CTA's (batch, KV head, split) ids, its sequence length and first union entry; its Q rows
    loaded into the first rows of the M_pad-row SMEM tile (the rest keep whatever they held: their
    scores are masked, so their P rows are 0)."""
    bi = lax.axis_index("b")
    hk = lax.axis_index("k")
    si = lax.axis_index("s")
    seq_len = len_gmem[bi]
    q_tile_rows = plan.q_parts[0].shape[2]
    for p in range(plan.n_parts):
        plgpu.copy_gmem_to_smem(q_gmem[p].at[bi, hk], q_smem.at[p, pl.ds(0, q_tile_rows)], q_bar)
    plgpu.barrier_wait(q_bar)
    return bi, hk, si, seq_len, si * plan.chunk


def softmax_start(plan: AttentionPlan, rows_layout):
    """Running max (-inf) and sum (0) per query row, in ``rows_layout``."""
    m0 = plgpu.layout_cast(jnp.full((plan.m_pad,), -jnp.inf, jnp.float32), rows_layout)
    l0 = plgpu.layout_cast(jnp.full((plan.m_pad,), 0.0, jnp.float32), rows_layout)
    return m0, l0


def step_operands(plan: AttentionPlan, kv_and_carry):
    """A pipeline step's (K part tiles, V part tiles, carry)."""
    n = plan.n_parts
    return kv_and_carry[:n], kv_and_carry[n : 2 * n], kv_and_carry[2 * n]


def store_split(plan: AttentionPlan, fill_o, lse, o_gmem, lse_gmem, bi, hk, si) -> None:
    """This split's normalised output and LSE to GMEM by TMA; ``fill_o(o_smem)`` writes the output
    into the fp32 [M_pad, H] staging tile, of which only the ``rows`` real query rows are stored (a
    quarter of the tile for M3's 16 heads per group: the merge reads what is written)."""

    def store(o_smem, lse_smem):
        fill_o(o_smem)
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, plan.rows)], o_gmem.at[bi, hk, si])
        plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[bi, hk, si])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(store, plgpu.SMEM((plan.m_pad, plan.h), jnp.float32), plgpu.SMEM((plan.m_pad,), jnp.float32))


def visible_keys(plan: AttentionPlan, layout, i, first, seq_len, log_gmem, bits_gmem, bi, hk):
    """[M_pad, kv_tile] bool in ``layout``: which scores of pipeline step ``i`` count (the token selected
    the page, key position <= query position, a real row)."""
    shape = (plan.m_pad, plan.kv_tile)
    e = first + lax.div(i, plan.sub)
    key0 = lax.rem(i, plan.sub) * plan.kv_tile  # first key of this sub-tile within its page
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + key0
    tok = lax.div(row, plan.g)
    q_pos = seq_len - plan.nq + tok
    blk = log_gmem[bi, hk, e]
    picked = blk >= 0 if plan.nq == 1 else (jnp.right_shift(bits_gmem[bi, hk, e], tok) & 1) == 1
    return picked & (col + blk * plan.bs <= q_pos) & (row < plan.rows)


def kv_pipeline(plan: AttentionPlan, page_step, k_gmem, v_gmem, log_gmem, pt_gmem, bi, hk, first, init_carry):
    """The K/V tiles of this split's union entries through SMEM (TMA via the page table: an empty
    entry, id -1, loads the request's first page, whose scores are all masked)."""

    def kv_page(i):  # block index in units of kv_tile rows of the [num_pages * bs, H] view
        page = pt_gmem[bi, jnp.maximum(log_gmem[bi, hk, first + lax.div(i, plan.sub)], 0)]
        return (page * plan.sub + lax.rem(i, plan.sub), 0)

    spec = plgpu.BlockSpec((plan.kv_tile, plan.h), kv_page, transforms=plan.transforms)
    return plgpu.emit_pipeline(
        page_step,
        grid=(plan.steps,),
        in_specs=[spec] * (2 * plan.n_parts),
        max_concurrent_steps=plan.stages,
        init_carry=init_carry,
    )(*(x.at[:, hk] for x in k_gmem), *(x.at[:, hk] for x in v_gmem))


def attention_call(plan: AttentionPlan, body, scratch: list, seq_lens, interpret, return_lse, out_dtype):
    """Launch ``body`` over (B, K, splits), merge the splits' partials, back to [B, Q, N, H] (+ LSE)."""
    b, kh, nq, g, h, rows = plan.b, plan.kh, plan.nq, plan.g, plan.h, plan.rows
    kern = mosaic_kernel(
        body,
        interpret=interpret,
        out_type=(
            jax.ShapeDtypeStruct((b, kh, plan.splits, rows, h), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, plan.splits, plan.m_pad), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(b, kh, plan.splits),
        grid_names=("b", "k", "s"),
    )
    o_part, lse_part = kern(*plan.q_parts, *plan.k_parts, *plan.v_parts, plan.logical, plan.page_table, plan.bits,
                            seq_lens.astype(jnp.int32))
    out, lse = combine_splits(o_part, lse_part[..., :rows])  # [B, K, rows, H], [B, K, rows]
    out = jnp.transpose(out.reshape(b, kh, nq, g, h), (0, 2, 1, 3, 4)).reshape(b, nq, plan.n, h)
    out = out.astype(out_dtype)
    if not return_lse:
        return out
    lse = jnp.transpose(lse.reshape(b, kh, nq, g), (0, 2, 1, 3)).reshape(b, nq, plan.n)
    return out, lse


def combine_splits(o_part: jax.Array, lse_part: jax.Array):
    """LSE merge over axis 2 (the key-range splits) of normalised partials; all -inf rows give 0 / -inf."""
    return lse_merge(o_part, lse_part, axis=2, unroll=True)
