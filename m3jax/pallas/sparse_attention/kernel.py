"""MSA block-sparse attention for prefill in Mosaic GPU: KV-block-major kernel + LSE combine, and the
query-major baseline (docs/KERNELS.md §2.4, §2.5; semantics of :func:`m3jax.msa.sparse_attention`).

KV-block-major (``kv_major_forward``)
    1. :mod:`.csr` inverts ``block_idx`` [B, K, T, topk] into, per KV head, rows (batch, KV block) of
       the query tokens that selected the block, padded to tiles of ``tq = block_m // G`` tokens, and
       cuts each row into work items of ``<= tiles_per_item`` tiles. All on device, static shapes.
    2. A persistent kernel (``plgpu.nd_loop`` over the live work items, grid = SMs x ctas_per_sm)
       loads the item's ``block_size x H`` K and V block ONCE by TMA, then streams its Q tiles past
       it: a tile is ``tq`` query tokens x ``G`` heads of one GQA group = ``block_m`` packed rows
       (M3: 4 tokens x 16 heads = 64 rows per warpgroup MMA), gathered row-group by row-group with
       TMA into a ``q_stages``-deep ring (the item's tokens and mask limits are in SMEM, copied once
       per item), so the next tiles' Q loads overlap this tile's math. One full-tile softmax per
       (tile, block) — each (query, block) pair is met exactly once, so there is no online
       rescaling; the causal mask (own block only) comes from a per-edge limit
       ``q_pos - block * block_size``. The tile writes its normalised partial O (q.dtype), staged in
       its own consumed Q slot, and its natural-log LSE (fp32) with two contiguous TMA stores into
       staging buffers indexed by the padded edge. At 99 KiB (101,376 bytes) of SMEM per CTA two CTAs share an
       SM, so one's softmax overlaps the other's MMAs and copies.
    3. The combine (docs/MSA.md §1.5) merges, per (query, head), the <= topk partials of its valid slots:
       ``O = Σ_j exp(LSE_j - M) O_j / Σ_j exp(LSE_j - M)``. It is an XLA-fused gather + reduce
       (bandwidth-bound; the measured XLA gather+reduce runs at HBM rate, docs/KERNELS.md §1.3).

Query-major (``query_major_forward``), the baseline
    One CTA per (query token, KV head): the G heads of the token are the MMA rows (padded to
    ``block_m`` rows by repeating them), the token's valid block ids are read inside the kernel
    and each block is fetched by TMA into a 2-deep ring, online softmax across blocks. Every query
    re-reads its 16 blocks (~16 FLOP/B, memory/L2-bound), which is what KV-block-major removes.

Numerics: bf16 (or fp16) tensor-core MMAs with fp32 accumulation and fp32 softmax (exp2 with log2 e
folded into the scale). fp32 inputs run "bf16x3" as the decode kernel does (docs/KERNELS.md §1.5):
Q, K and V are split into bf16 ``hi + lo`` parts in XLA (:func:`m3jax.pallas._common.split_parts`),
P in the kernel (``bf16_split_in_kernel``), and each product is three wgmmas (hi.hi + hi.lo + lo.hi,
~2^-16 relative), so fp32 matches the fp32 reference to ~1e-5; their partials are staged in fp32.
The output has q's dtype.

Shapes (:func:`plan_kv_major`, :func:`plan_query_major`; :func:`unsupported_reason` says what is
refused). A token's G heads fill ``gp`` tile rows, G rounded up to a power of two >= 8: the per-token
TMA copies write whole 8-row SMEM tiles, so for G = 1, 2, 4 (or 12, 24, ...) the wrapper pads Q with
zero heads whose outputs are dropped. The kernels' key block ``kb`` divides the MSA block: the block
itself when it is 16, 32 or a multiple of 64 up to 256 and its tiles fit in SMEM, else a smaller
divisor (fp32 at H=128: 64, since hi and lo tiles double the SMEM); a selected block is then split in
XLA into ``block_size // kb`` sub-blocks (those wholly after the query dropped) and the LSE merge
treats them as separate slots. V's SMEM swizzle is ``min(kb, H, 64) * 2`` bytes: the PV wgmma
contracts over the keys and its K step is one swizzle width. Head dims: 16, 32, or multiples of 64 up
to 256.

Hopper -> Blackwell: on ``Target.mma == "tcgen05"`` the KV-major kernel runs :mod:`.blackwell`'s tile
maths (S and O in TMEM through ``plgpu.tcgen05_mma``, 128-row tiles = 8 tokens x 16 heads, P through
SMEM); the CSR, work list, Q ring, staging layout and combine are this file's. Not ported: two
softmax warpgroups ping-ponging on two Q tiles, ``cluster=2`` 256-row tiles with the K/V block
multicast to both, ``tma_gather`` for the ``tq`` per-token Q copies (``plgpu.Layout.TMA_INDICES``),
and the query-major baseline (wgmma only).

The design is memory-bound, not MMA-bound: per (query, KV head, slot) it re-reads the query's
G x H tile and writes + re-reads a G x H bf16 partial, so the bytes moved, not the MMAs, set its
ceiling against cuDNN's dense attention; the item metadata sits in SMEM and the O staging in the Q
ring so that two CTAs share an SM (measured: benchmarks/RESULTS.md#kv-major-attention).

What remains (not done here): bf16 -> fp8 partials (halves the staging traffic), a combine fused
into the kernel's epilogue through cluster/DSMEM for rows whose slots land on one cluster, warp
specialisation (FA3-style producer + two ping-ponging consumers), skipping the combine when a
query has one valid slot, and a query-major variant over the union of neighbouring queries'
blocks for real (local) selection patterns, which needs no staging at all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from m3jax.msa.reference import lse_merge
from m3jax.pallas import _backend  # on_gpu, current_target via the module: tests patch them
from m3jax.pallas._backend import HOPPER, Target, arch_module, mosaic_kernel, pl, plgpu
from m3jax.pallas._common import LOG2E, online_softmax_step, softmax_normalisers, split_parts, swizzle_transforms

from . import blackwell, csr, hopper
from .tile import p_operands, parts

KEY_BLOCKS = (256, 192, 128, 64, 32, 16)  # kernel key blocks: a 128 B swizzle's K step (64) divides them, or 16 / 32
MAX_GROUP_ROWS = 128  # padded G: one token's heads fit a 128-row tile


@dataclasses.dataclass(frozen=True)
class SparseAttentionConfig:
    """Tile configuration (defaults: tuned on Hopper for M3's shapes).

    block_m: packed MMA rows per tile (query tokens x padded GQA heads); a multiple of 64 (raised to
      the padded G when that is larger).
    tiles_per_item: Q tiles per KV-major work item (the K/V block is loaded once per item).
    q_stages: depth of the KV-major kernel's Q-tile ring (>= 2; tiles in flight = q_stages - 1); each
      stage is block_m x H of SMEM per part (16 KiB at M3 shapes) and also stages its tile's O for
      the store (16-bit inputs; fp32 partials have their own tile).
    ctas_per_sm: persistent CTAs per SM for the KV-major kernel (default: as many as fit in SMEM, at
      most 2; 99 KiB per CTA at H=bs=128 with 2 stages, so 2 fit on Hopper, 1 with 3 stages or fp32).
    num_ctas: override of the persistent grid (default: SMs x ctas_per_sm on GPU, 2 in interpret mode).
    p_via_smem: stage P through SMEM for the PV MMA (default: only in interpret mode, whose wgmma
      takes SMEM operands only; on GPU P stays in registers as the wgmma A operand).
    backward_tiles_per_item: Q tiles per work item of the backward kernel (default: half of one
      persistent CTA's share of the tiles, so a long KV-major row is cut across CTAs and its dK / dV
      partials are summed in XLA).
    backward_stages: depth of the backward kernel's Q / dO ring (default: the deepest of 4, 3, 2, 1
      that fits in SMEM).
    backward_warpgroups: consumer warpgroups of the backward kernel, each owning 64 keys of a work
      item's key block (default: 2 where the block and H are multiples of 128 and the inputs 16-bit,
      so a 128-key block is one item whose Q / dO tiles are gathered once; else 1).
    """

    block_m: int = 64
    tiles_per_item: int = 16
    q_stages: int = 2
    ctas_per_sm: int | None = None
    num_ctas: int | None = None
    p_via_smem: bool | None = None
    backward_tiles_per_item: int | None = None
    backward_stages: int | None = None
    backward_warpgroups: int | None = None

    def stage_p(self) -> bool:
        """Feed P to the PV wgmma from SMEM (interpret mode only supports SMEM A operands)."""
        return (not _backend.on_gpu()) if self.p_via_smem is None else self.p_via_smem

    def grid(self, smem_per_cta: int, target: Target = HOPPER) -> int:
        """Persistent CTAs: as many per SM as fit in SMEM (at most 2: the kernel's registers allow two
        128-thread CTAs with S and O accumulators live), unless ``ctas_per_sm``/``num_ctas`` say."""
        if self.num_ctas is not None:
            return self.num_ctas
        if not _backend.on_gpu():
            return 2
        return target.num_sms * (self.ctas_per_sm or max(1, min(2, ctas_fitting(smem_per_cta, target))))


def ctas_fitting(smem_per_cta: int, target: Target) -> int:
    """CTAs whose SMEM fits one SM: ``smem_bytes`` is the per-CTA maximum (227 KiB); the SM has 1 KiB
    more and reserves 1 KiB per CTA."""
    return (target.smem_bytes + 1024) // (smem_per_cta + 1024)


# --------------------------------------------------------------------------------------------
# Plans: tile and SMEM choices as plain Python (unit-tested without running a kernel)
# --------------------------------------------------------------------------------------------


def _kib(n: int) -> int:
    return -(-n // 1024) * 1024


def _n_parts(dtype) -> int:
    """bf16 parts per operand: fp32 runs as bf16 hi + lo."""
    return 2 if jnp.dtype(dtype) == jnp.float32 else 1


def group_rows(g: int) -> int:
    """Tile rows per query token: G rounded up to a power of two >= 8. Each token's Q rows are one TMA
    copy into the tile, which must cover whole 8-row SMEM tiles; a power of two divides the tile."""
    return max(8, 1 << (g - 1).bit_length())


def key_blocks(block_size: int) -> tuple[int, ...]:
    """Kernel key blocks that divide the MSA block, largest first."""
    return tuple(kb for kb in KEY_BLOCKS if block_size % kb == 0)


def pv_swizzle_minor(kb: int, h: int) -> int:
    """V's (and staged P's) SMEM tiles get a ``min(kb, h, 64) * 2``-byte swizzle: the PV wgmma
    contracts over the kb keys in steps of one swizzle width, P and V must share the swizzle, and a
    swizzle is at most one V row (H) wide."""
    return min(kb, h, 64)


@dataclasses.dataclass(frozen=True)
class KVMajorPlan:
    """What :func:`kv_major_forward` runs: G padded to ``gp`` rows per token, ``tq`` tokens per
    ``m``-row tile, ``kb`` keys per kernel block, ``n_parts`` bf16 parts per operand (2 for fp32),
    staged partials in ``stage_dtype``, ``smem`` bytes per CTA and ``ctas`` persistent CTAs."""

    g: int
    gp: int
    m: int
    tq: int
    kb: int
    h: int
    n_parts: int
    stages: int
    tiles_per_item: int
    stage_p: bool
    interpret: bool
    stage_dtype: str
    smem: int
    ctas: int
    mma: str = "wgmma"  # the target's MMA: "tcgen05" runs the Blackwell tile maths (.blackwell)

    @property
    def meta_w(self) -> int:
        return _meta_width(self.tq)


def _meta_width(tq: int) -> int:
    """Int32 metadata entries per tile row: ``tq`` rounded up to 4 (TMA rows are 16-byte multiples)."""
    return tq + (-tq % 4)


def _tile_rows(g: int, cfg: SparseAttentionConfig) -> tuple[int, int]:
    gp = group_rows(g)
    m = max(cfg.block_m, gp)
    return gp, m


def kv_major_smem_bytes(*, m, h, kb, tpi, meta_w, stages, n_parts, stage_p, fp32_out) -> int:
    """SMEM of one KV-major CTA as Mosaic allocates it: Q ring (per part; for 16-bit inputs it also
    stages O), K, V (+P) per part, an fp32 O tile for fp32 partials, then the LSE staging and the
    metadata tile, each rounded up to 1 KiB."""
    tiles = n_parts * (stages * m * h + 2 * kb * h + (m * kb if stage_p else 0)) * 2
    o32 = m * h * 4 if fp32_out else 0
    return tiles + o32 + _kib(4 * m) + _kib(4 * tpi * 2 * meta_w) + 1024  # + barriers


def _plan_rows(n, kh, h, block_size, dtype, cfg: SparseAttentionConfig, target: Target | None):
    """What both plans start from: the shape check (ValueError with the reason), the target, G, the
    padded rows per token ``gp`` and per tile ``m``, and the bf16 parts per operand."""
    reason = shape_reason(n, kh, h, block_size, dtype, cfg)
    if reason:
        raise ValueError(reason)
    g = n // kh
    return (target or _backend.current_target(), g, *_tile_rows(g, cfg), _n_parts(dtype))


def plan_kv_major(*, n: int, kh: int, h: int, block_size: int, dtype, cfg: SparseAttentionConfig,
                  target: Target | None = None) -> KVMajorPlan:
    """Tiles for the KV-major kernel; ValueError (the :func:`unsupported_reason`) if none fit."""
    target, g, gp, m, n_parts = _plan_rows(n, kh, h, block_size, dtype, cfg, target)
    tpi, stages, stage_p = cfg.tiles_per_item, cfg.q_stages, cfg.stage_p()
    kbs = key_blocks(block_size)
    m, stage_p, kbs = arch_module(hopper, blackwell, target.mma).kv_major_tiles(m, stage_p, kbs)
    tq = m // gp
    meta_w = _meta_width(tq)
    for kb in kbs:  # the largest key block whose tiles fit (16-bit: the block itself)
        smem = kv_major_smem_bytes(m=m, h=h, kb=kb, tpi=tpi, meta_w=meta_w, stages=stages, n_parts=n_parts,
                                   stage_p=stage_p, fp32_out=n_parts == 2)
        # fp32 keeps 4 KiB spare: at H=128 its kb=128 plan is exactly the SMEM limit
        if smem <= target.smem_bytes - (4096 if n_parts == 2 else 0):
            stage_dtype = "float32" if n_parts == 2 else jnp.dtype(dtype).name
            return KVMajorPlan(g=g, gp=gp, m=m, tq=tq, kb=kb, h=h, n_parts=n_parts, stages=stages,
                               tiles_per_item=tpi, stage_p=stage_p, interpret=not _backend.on_gpu(),
                               stage_dtype=stage_dtype, smem=smem, ctas=cfg.grid(smem, target), mma=target.mma)
    raise ValueError(f"no KV-major tiles fit in {target.smem_bytes} B of SMEM (H={h}, block {block_size}, "
                     f"{jnp.dtype(dtype).name}, block_m {m}, {stages} Q stages)")


@dataclasses.dataclass(frozen=True)
class QueryMajorPlan:
    """What :func:`query_major_forward` runs: ``gp`` rows per token repeated to ``m`` rows, ``kb`` keys
    per step in a ``stages``-deep K/V ring, ``n_parts`` bf16 parts per operand."""

    g: int
    gp: int
    m: int
    kb: int
    h: int
    n_parts: int
    stages: int
    stage_p: bool
    interpret: bool
    smem: int


def query_major_smem_bytes(*, m, h, kb, stages, n_parts) -> int:
    """Q, the K/V ring and P per part, and the O tile (fp32 for fp32 inputs)."""
    return n_parts * (m * h + 2 * stages * kb * h + m * kb) * 2 + m * h * 2 * n_parts + 1024 + 4 * m


def plan_query_major(*, n: int, kh: int, h: int, block_size: int, dtype, cfg: SparseAttentionConfig,
                     target: Target | None = None) -> QueryMajorPlan:
    """Tiles for the query-major kernel: the largest key block, with two K/V stages when they fit."""
    target, g, gp, m, n_parts = _plan_rows(n, kh, h, block_size, dtype, cfg, target)
    for kb in key_blocks(block_size):
        for stages in (2, 1):  # prefetch block j+1 while computing j when two stages fit
            smem = query_major_smem_bytes(m=m, h=h, kb=kb, stages=stages, n_parts=n_parts)
            if smem <= target.smem_bytes - 8192:
                return QueryMajorPlan(g=g, gp=gp, m=m, kb=kb, h=h, n_parts=n_parts, stages=stages,
                                      stage_p=cfg.stage_p(), interpret=not _backend.on_gpu(), smem=smem)
    raise ValueError(f"no query-major tiles fit in SMEM (H={h}, block {block_size}, {jnp.dtype(dtype).name})")


def shape_reason(n, kh, h, block_size, dtype, cfg: SparseAttentionConfig) -> str | None:
    if n % kh:
        return f"query heads {n} must be a multiple of the KV heads {kh}"
    g = n // kh
    if group_rows(g) > MAX_GROUP_ROWS:
        return f"query heads per KV head G={g} > {MAX_GROUP_ROWS} (one token's heads fill one MMA tile)"
    if (h % 64 and h not in (16, 32)) or h > 256:
        return (f"head_dim {h} must be 16, 32 or a multiple of 64 up to 256 (swizzled rows: a wgmma K step "
                "is one swizzle width; wgmma N <= 256)")
    if not key_blocks(block_size):
        return f"block_size {block_size} must be a multiple of 16 (no kernel key block in {KEY_BLOCKS} divides it)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)):
        return f"dtype {jnp.dtype(dtype).name} is not bf16, fp16 or fp32"
    gp = group_rows(g)
    if cfg.block_m % 64 or max(cfg.block_m, gp) % gp:
        return f"block_m {cfg.block_m} must be a multiple of 64 and of the padded G={gp}"
    if cfg.q_stages < 2:
        return f"q_stages {cfg.q_stages} must be >= 2 (a tile's O is staged in its Q slot while the next loads)"
    return None


def unsupported_reason(*, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype="bfloat16", config: SparseAttentionConfig | None = None,
                       target: Target | None = None, implementation: str = "kv_major") -> str | None:
    """Why the sparse-attention kernel ``implementation`` cannot run these shapes on ``target``
    (default: the device's; None when it can). The default judges the KV-major kernel, the one the
    model runs; the query-major baseline is asked by name. Plain Python."""
    cfg = config or SparseAttentionConfig()
    plans = {"kv_major": plan_kv_major, "query_major": plan_query_major}
    if implementation not in plans:
        raise ValueError(f"unknown sparse-attention kernel {implementation!r}; choose one of {tuple(plans)}")
    try:
        plans[implementation](n=num_heads, kh=num_kv_heads, h=head_dim, block_size=block_size, dtype=dtype,
                              cfg=cfg, target=target)
    except ValueError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------
# XLA-side preparation shared by both kernels
# --------------------------------------------------------------------------------------------


def swizzled_smem(shape, dtype, minor: int | None = None):
    """Swizzled SMEM tile; ``minor`` (default: the row) sets the swizzle width."""
    itemsize = jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=swizzle_transforms(minor or shape[-1], itemsize))


def pad_kv(x, block_size):
    s = x.shape[1]
    pad = -s % block_size
    return x if pad == 0 else jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])


def pad_groups(q, kh: int, gp: int):
    """[B, T, N, H] -> [B, T, K * gp, H]: each group's G heads padded with zero heads to ``gp``."""
    b, t, n, h = q.shape
    g = n // kh
    if g == gp:
        return q
    q = jnp.pad(q.reshape(b, t, kh, g, h), [(0, 0), (0, 0), (0, 0), (0, gp - g), (0, 0)])
    return q.reshape(b, t, kh * gp, h)


def unpad_groups(x, kh: int, g: int):
    """[B, T, K * gp, ...] -> [B, T, K * G, ...] (drops the zero heads of :func:`pad_groups`)."""
    b, t, ngp = x.shape[:3]
    gp = ngp // kh
    if g == gp:
        return x
    x = x.reshape(b, t, kh, gp, *x.shape[3:])[:, :, :, :g]
    return x.reshape(b, t, kh * g, *x.shape[4:])


def split_blocks(block_idx, q_pos, block_size: int, kb: int):
    """Selections in units of ``kb``-key sub-blocks: [B, K, T, topk] -> [B, K, T, topk * r], r =
    block_size // kb. Sub-blocks that start after the query are dropped (-1), so every kept edge has a
    visible key, as the kernels assume; the LSE merge over the sub-blocks is the attention."""
    r = block_size // kb
    if r == 1:
        return block_idx
    sub = block_idx[..., None] * r + jnp.arange(r, dtype=jnp.int32)
    ok = (block_idx[..., None] >= 0) & (sub * kb <= q_pos[:, None, :, None, None])
    return jnp.where(ok, sub, -1).reshape(*block_idx.shape[:-1], -1)


def compute_dtype(q, k, v):
    return jnp.promote_types(jnp.promote_types(q.dtype, k.dtype), v.dtype)


def _prepare(q, k, v, block_idx, q_pos, kh: int, gp: int, block_size: int, kb: int):
    """Kernel operands: Q with padded groups and K/V padded to whole blocks, each as bf16 parts (one
    for 16-bit inputs), and selections in kernel key blocks."""
    cdt = compute_dtype(q, k, v)
    q_parts = split_parts(pad_groups(q.astype(cdt), kh, gp))
    k_parts = split_parts(pad_kv(k, block_size).astype(cdt))
    v_parts = split_parts(pad_kv(v, block_size).astype(cdt))
    q_pos = q_pos.astype(jnp.int32)
    return q_parts, k_parts, v_parts, split_blocks(block_idx.astype(jnp.int32), q_pos, block_size, kb), q_pos


def parts_shape(n_parts: int, shape: tuple) -> tuple:
    """SMEM shape of a tile held as ``n_parts`` bf16 parts: a leading parts axis for fp32 only, so the
    16-bit kernels are the same Mosaic modules as before fp32 support (no size-1 axis to slice)."""
    return shape if n_parts == 1 else (n_parts, *shape)


# --------------------------------------------------------------------------------------------
# KV-block-major forward
# --------------------------------------------------------------------------------------------


def _tile_meta(qtok, qlim, tq: int, tiles_per_item: int):
    """Per-edge query tokens and mask limits [K, E_pad] -> one int32 array
    [K, n_tiles + tiles_per_item, 2, round_up(tq, 4)] (tile, {token, limit}, edge of the tile): an
    item's metadata is one TMA box, rows 16-byte wide, and the tail keeps the fixed-size copy of the
    last item in bounds."""
    kh, e_pad = qtok.shape
    x = jnp.stack([qtok.reshape(kh, e_pad // tq, tq), qlim.reshape(kh, e_pad // tq, tq)], axis=2)
    return jnp.pad(x, [(0, 0), (0, tiles_per_item), (0, 0), (0, _meta_width(tq) - tq)])


def _tile_maths(plan: KVMajorPlan, dtype):
    """(attend, scratch) of the plan's target: :func:`.hopper.tile` (wgmma) or :func:`.blackwell.tile` (tcgen05)."""
    return arch_module(hopper, blackwell, plan.mma).tile(plan, dtype)


def _kv_major_body(plan: KVMajorPlan, dtype):
    """The persistent kernel body (module docstring, step 2) for ``plan``."""
    m, tq, gp, bs, tpi, stages, n_parts = plan.m, plan.tq, plan.gp, plan.kb, plan.tiles_per_item, plan.stages, plan.n_parts
    attend = _tile_maths(plan, dtype)[0]

    def body(*refs):
        items_ref, nitems_ref, meta_ref = refs[:3]
        q_refs = refs[3 : 3 + n_parts]
        k_refs = refs[3 + n_parts : 3 + 2 * n_parts]
        v_refs = refs[3 + 2 * n_parts : 3 + 3 * n_parts]
        o_ref, lse_ref, q_smem, k_smem, v_smem, lse_smem, meta_smem, kv_bar, meta_bar, q_bar, *extra = (
            refs[3 + 3 * n_parts :])
        o32_smem = extra.pop(0) if n_parts == 2 else None  # fp32 partials: their own tile
        p_smem = extra.pop(0) if plan.stage_p else None
        mma_refs = extra  # the tile maths' own scratch (Blackwell: TMEM and its barriers)
        q_rings, k_tiles, v_tiles = parts(q_smem, n_parts), parts(k_smem, n_parts), parts(v_smem, n_parts)
        n_items = nitems_ref[0]

        @plgpu.nd_loop((n_items,), collective_axes="sm")
        def _item(info):
            w = info.index[0]
            hh = items_ref[w, 0]
            bb = items_ref[w, 1]
            blk = items_ref[w, 2]
            t0 = items_ref[w, 3]
            nt = items_ref[w, 4]
            # The item's per-tile query tokens and mask limits come into SMEM with one copy (read
            # from global memory one scalar at a time, they sat on every tile's critical path).
            plgpu.commit_smem()  # the previous item's SMEM reads precede this item's TMA writes
            plgpu.copy_gmem_to_smem(meta_ref.at[hh, pl.ds(t0, tpi)], meta_smem, meta_bar)
            kv_at = (bb, pl.ds(blk * bs, bs), hh)
            for c in range(n_parts):
                plgpu.copy_gmem_to_smem(k_refs[c].at[kv_at], k_tiles[c], kv_bar)
                plgpu.copy_gmem_to_smem(v_refs[c].at[kv_at], v_tiles[c], kv_bar)

            def load_q(tile, slot):
                for i in range(tq):
                    tok = meta_smem[tile, 0, i]
                    for a in range(n_parts):
                        plgpu.copy_gmem_to_smem(q_refs[a].at[bb, tok, pl.ds(hh * gp, gp)],
                                                q_rings[a].at[slot, pl.ds(i * gp, gp)], q_bar.at[slot])

            plgpu.barrier_wait(meta_bar)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last item's O left its ring slot
            for s in range(stages - 1):  # prologue: the ring's first stages-1 tiles in flight
                @pl.when(s < nt)
                def _():
                    load_q(s, s)

            plgpu.barrier_wait(kv_bar)

            @pl.loop(0, nt)
            def _tile(j):
                slot = lax.rem(j, stages)
                ahead = j + stages - 1
                e0 = (t0 + j) * tq
                lims = [meta_smem[j, 1, i] for i in range(tq)]
                need_mask = lims[0] < bs - 1
                for i in range(1, tq):
                    need_mask = need_mask | (lims[i] < bs - 1)
                plgpu.barrier_wait(q_bar.at[slot])

                def tile(masked: bool):
                    def scores_done():
                        # This tile's Q is consumed: its slot will stage this tile's O. The tile
                        # `ahead` reuses the slot of tile j-1, whose O store must have left SMEM
                        # first (and so must the fp32 O tile's).
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                        @pl.when(ahead < nt)
                        def _():
                            load_q(ahead, lax.rem(ahead, stages))

                    o_smem = q_rings[0].at[slot] if o32_smem is None else o32_smem
                    lse_smem[...] = attend([r.at[slot] for r in q_rings], k_tiles, v_tiles, lims if masked else None,
                                           o_smem, p_smem, mma_refs, scores_done)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[hh, pl.ds(e0 * gp, m)])
                    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[hh, pl.ds(e0 * gp, m)])

                pl.when(need_mask)(lambda: tile(True))
                pl.when(jnp.logical_not(need_mask))(lambda: tile(False))

        plgpu.wait_smem_to_gmem(0)

    return body


def kv_major_forward(q_parts, k_parts, v_parts, work: csr.KVMajorWork, *, plan: KVMajorPlan, e_pad: int):
    """Partial outputs per padded edge: (o_stage [K, E_pad*gp, H] in ``plan.stage_dtype``, lse_stage
    [K, E_pad*gp] f32). q_parts: [B, T, K*gp, H] bf16 parts (one for 16-bit inputs), k/v_parts
    [B, S_pad, K, H]."""
    kh = k_parts[0].shape[2]
    dtype = q_parts[0].dtype
    m, h, kb, n_parts = plan.m, plan.h, plan.kb, plan.n_parts
    meta = _tile_meta(work.qtok, work.qlim, plan.tq, plan.tiles_per_item)
    scratch = [
        swizzled_smem(parts_shape(n_parts, (plan.stages, m, h)), dtype),
        swizzled_smem(parts_shape(n_parts, (kb, h)), dtype),
        swizzled_smem(parts_shape(n_parts, (kb, h)), dtype, minor=pv_swizzle_minor(kb, h)),
        plgpu.SMEM((m,), jnp.float32),
        plgpu.SMEM((plan.tiles_per_item, 2, plan.meta_w), jnp.int32),
        plgpu.Barrier(num_arrivals=2 * n_parts),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=plan.tq * n_parts, num_barriers=plan.stages),
    ]
    if n_parts == 2:
        scratch.append(plgpu.SMEM((m, h), jnp.float32))
    if plan.stage_p:
        scratch.append(swizzled_smem(parts_shape(n_parts, (m, kb)), dtype, minor=pv_swizzle_minor(kb, h)))
    scratch += _tile_maths(plan, dtype)[1]
    out_type = (
        jax.ShapeDtypeStruct((kh, e_pad * plan.gp, h), jnp.dtype(plan.stage_dtype)),
        jax.ShapeDtypeStruct((kh, e_pad * plan.gp), jnp.float32),
    )
    call = mosaic_kernel(
        _kv_major_body(plan, dtype),
        interpret=plan.interpret,
        out_type=out_type,
        scratch_types=scratch,
        grid=(plan.ctas,),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
    )
    return call(work.items, work.n_items, meta, *q_parts, *k_parts, *v_parts)


def combine(o_stage, lse_stage, epos, *, n_heads: int, out_dtype, return_lse: bool = False):
    """LSE-combine of the partials (docs/MSA.md §1.5), XLA gather + reduce. Returns [B, T, N, H] (and LSE)."""
    kh, rows, h = o_stage.shape
    g = n_heads // kh
    b, _, t, _ = epos.shape
    o4 = o_stage.reshape(kh, rows // g, g, h)
    l3 = lse_stage.reshape(kh, rows // g, g)
    hi = jnp.arange(kh)[None, :, None, None]
    safe = jnp.maximum(epos, 0)
    lse = jnp.where((epos >= 0)[..., None], l3[hi, safe], -jnp.inf)  # [B, K, T, topk, G]
    part = o4[hi, safe]  # [B, K, T, topk, G, H]; rows of empty slots are masked inside the merge
    out, lse_tot = lse_merge(part, lse, axis=3)  # [B, K, T, G, H], [B, K, T, G]
    out = jnp.moveaxis(out, 1, 2).reshape(b, t, n_heads, h).astype(out_dtype)
    if not return_lse:
        return out
    return out, jnp.moveaxis(lse_tot, 1, 2).reshape(b, t, n_heads)


def kv_major_attention(q, k, v, block_idx, q_pos, *, block_size: int, cfg: SparseAttentionConfig, return_lse=False):
    b, t, n, h = q.shape
    kh = k.shape[2]
    plan = plan_kv_major(n=n, kh=kh, h=h, block_size=block_size, dtype=compute_dtype(q, k, v),
                         cfg=cfg)
    q_parts, k_parts, v_parts, sel, q_pos = _prepare(q, k, v, block_idx, q_pos, kh, plan.gp, block_size, plan.kb)
    nb = k_parts[0].shape[1] // plan.kb
    e_pad, _ = csr.capacities(b, t, kh, nb, sel.shape[-1], plan.tq, plan.tiles_per_item)
    work = csr.build_work(sel, q_pos, num_blocks=nb, block_size=plan.kb, tq=plan.tq, tiles_per_item=plan.tiles_per_item)
    o_stage, lse_stage = kv_major_forward(q_parts, k_parts, v_parts, work, plan=plan, e_pad=e_pad)
    res = combine(o_stage, lse_stage, work.epos, n_heads=kh * plan.gp, out_dtype=q.dtype, return_lse=return_lse)
    if not return_lse:
        return unpad_groups(res, kh, plan.g)
    return unpad_groups(res[0], kh, plan.g), unpad_groups(res[1], kh, plan.g)


# --------------------------------------------------------------------------------------------
# Query-major baseline
# --------------------------------------------------------------------------------------------


def _query_major_body(plan: QueryMajorPlan, dtype):
    m, gp, bs, stages, n_parts = plan.m, plan.gp, plan.kb, plan.stages, plan.n_parts
    scale = (plan.h**-0.5) * LOG2E

    def body(*refs):
        blk_ref, nv_ref, qpos_ref = refs[:3]
        q_refs = refs[3 : 3 + n_parts]
        k_refs = refs[3 + n_parts : 3 + 2 * n_parts]
        v_refs = refs[3 + 2 * n_parts : 3 + 3 * n_parts]
        o_ref, lse_ref, q_smem, k_smem, v_smem, o_smem, lse_smem, q_bar, k_bar, v_bar, *extra = refs[3 + 3 * n_parts :]
        p_smem = extra[0] if plan.stage_p else None
        hh = lax.axis_index("h")
        tt = lax.axis_index("t")
        bb = lax.axis_index("b")
        nv = nv_ref[bb, hh, tt]
        qp = qpos_ref[bb, tt]

        def load_kv(j, slot):
            blk = blk_ref[bb, hh, tt, j]
            at = (bb, pl.ds(blk * bs, bs), hh)
            k_tiles, v_tiles = parts(k_smem.at[slot], n_parts), parts(v_smem.at[slot], n_parts)
            for c in range(n_parts):
                plgpu.copy_gmem_to_smem(k_refs[c].at[at], k_tiles[c], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_refs[c].at[at], v_tiles[c], v_bar.at[slot])

        # The token's gp rows repeated to fill the m-row tile (no uninitialised rows in the MMA).
        q_tiles = parts(q_smem, n_parts)
        for i in range(m // gp):
            for a in range(n_parts):
                plgpu.copy_gmem_to_smem(q_refs[a].at[bb, tt, pl.ds(hh * gp, gp)], q_tiles[a].at[pl.ds(i * gp, gp)],
                                        q_bar)

        @pl.when(nv > 0)
        def _():
            load_kv(0, 0)

        plgpu.barrier_wait(q_bar)

        def step(j, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(j, stages)

            if stages == 2:
                @pl.when(j + 1 < nv)
                def _():
                    load_kv(j + 1, 1 - slot)

            lim = qp - blk_ref[bb, hh, tt, j] * bs
            plgpu.barrier_wait(k_bar.at[slot])
            s = hopper.wgmma_scores(q_tiles, parts(k_smem.at[slot], n_parts), (m, bs), n_parts)
            col = plgpu.broadcasted_iota(jnp.int32, (m, bs), 1, layout=plgpu.Layout.WGMMA)
            s = jnp.where(col <= lim, s * scale, -jnp.inf)
            m_new, alpha, p, l_i = online_softmax_step(s, m_i, l_i)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p_ops = p_operands(p, p_smem, n_parts, dtype)
            plgpu.barrier_wait(v_bar.at[slot])
            # A fresh accumulator + add (rather than ``run_state(ACC.init(acc))``) keeps one code path
            # that GPU interpret mode can run.
            acc = acc + hopper.wgmma_pv(p_ops, parts(v_smem.at[slot], n_parts), (m, plan.h), n_parts)
            if stages == 1:
                @pl.when(j + 1 < nv)
                def _():
                    load_kv(j + 1, 0)
            return acc, m_new, l_i

        m0 = plgpu.layout_cast(jnp.full((m,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l0 = plgpu.layout_cast(jnp.full((m,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        a0 = plgpu.layout_cast(jnp.full((m, plan.h), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        acc, m_i, l_i = lax.fori_loop(0, nv, step, (a0, m0, l0))
        inv, lse = softmax_normalisers(m_i, l_i)
        o_smem[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.float32 if n_parts == 2 else dtype)
        lse_smem[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, gp)], o_ref.at[bb, tt, pl.ds(hh * gp, gp)])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bb, hh, tt])
        plgpu.wait_smem_to_gmem(0)

    return body


def query_major_forward(q_parts, k_parts, v_parts, blocks, n_valid, q_pos, *, plan: QueryMajorPlan):
    """blocks: int32 [B, K, T, topk] with the valid ids first (in ``plan.kb`` units); n_valid [B, K, T].
    Returns (o [B, T, K*gp, H], fp32 for fp32 inputs, lse [B, K, T, gp])."""
    b, t, ngp, h = q_parts[0].shape
    kh = k_parts[0].shape[2]
    dtype = q_parts[0].dtype
    m, kb, n_parts, stages = plan.m, plan.kb, plan.n_parts, plan.stages
    o_dtype = jnp.float32 if n_parts == 2 else dtype
    scratch = [
        swizzled_smem(parts_shape(n_parts, (m, h)), dtype),
        swizzled_smem((stages, *parts_shape(n_parts, (kb, h))), dtype),
        swizzled_smem((stages, *parts_shape(n_parts, (kb, h))), dtype, minor=pv_swizzle_minor(kb, h)),
        plgpu.SMEM((m, h), o_dtype) if n_parts == 2 else swizzled_smem((m, h), dtype),
        plgpu.SMEM((m,), jnp.float32),
        plgpu.Barrier(num_arrivals=(m // plan.gp) * n_parts),
        plgpu.Barrier(num_arrivals=n_parts, num_barriers=stages),
        plgpu.Barrier(num_arrivals=n_parts, num_barriers=stages),
    ] + ([swizzled_smem(parts_shape(n_parts, (m, kb)), dtype, minor=pv_swizzle_minor(kb, h))] if plan.stage_p else [])
    out_type = (
        jax.ShapeDtypeStruct((b, t, ngp, h), o_dtype),
        jax.ShapeDtypeStruct((b, kh, t, m), jnp.float32),
    )
    call = mosaic_kernel(
        _query_major_body(plan, dtype),
        interpret=plan.interpret,
        out_type=out_type,
        scratch_types=scratch,
        grid=(kh, t, b),
        grid_names=("h", "t", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    o, lse = call(blocks, n_valid, q_pos, *q_parts, *k_parts, *v_parts)
    return o, lse[..., : plan.gp]


def query_major_attention(q, k, v, block_idx, q_pos, *, block_size: int, cfg: SparseAttentionConfig, return_lse=False):
    b, t, n, h = q.shape
    kh = k.shape[2]
    plan = plan_query_major(n=n, kh=kh, h=h, block_size=block_size, dtype=compute_dtype(q, k, v),
                            cfg=cfg)
    q_parts, k_parts, v_parts, bi, q_pos = _prepare(q, k, v, block_idx, q_pos, kh, plan.gp, block_size, plan.kb)
    big = jnp.iinfo(jnp.int32).max
    blocks = jnp.sort(jnp.where(bi < 0, big, bi), axis=-1)  # valid ids first (attention is order-free)
    n_valid = (bi >= 0).sum(-1).astype(jnp.int32)
    blocks = jnp.where(blocks == big, 0, blocks)
    o, lse = query_major_forward(q_parts, k_parts, v_parts, blocks, n_valid, q_pos, plan=plan)
    o = unpad_groups(o, kh, plan.g).astype(q.dtype)
    if not return_lse:
        return o
    return o, unpad_groups(jnp.moveaxis(lse, 1, 2).reshape(b, t, kh * plan.gp), kh, plan.g)
