"""MSA — MiniMax Sparse Attention, pure-jnp reference (the maths every other layer shares).

Per query token t and KV group g (docs/MSA.md §1):

1. index branch: ``iq = RoPE(norm(x Wiq))`` [Hi heads], ``ik = RoPE(norm(x Wik))`` [one shared head];
2. block scores ``B[g, t, j] = max_{s in block j, s <= t} iq[t, g] . ik[s]`` (fp32, no scale);
3. selection: the query's own block (and ``local_blocks - 1`` before it, and ``init_blocks`` sinks)
   forced, the remaining slots of ``topk`` filled by the highest-scoring visible blocks, ties to the
   lower block id, ``-1`` padding when fewer blocks are visible;
4. attention of the group's query heads over the tokens of the selected blocks (causal inside the
   own block), softmax scale ``1/sqrt(head_dim)``.

Everything is processed in query chunks so that no [T, S] array exists for the whole sequence:
memory is O(chunk * S) for the scores and O(chunk * topk * block) for the gathered keys.
Block selections follow transformers' contract: int32 [B, Hi, T, topk], forced blocks first, then
descending score, ``-1`` right padding.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST
NEG_INF = float("-inf")
FP8 = jnp.float8_e4m3fn
# Largest finite e4m3fn value (448): a cast beyond it gives NaN (the format has no infinity).
FP8_MAX = float(jnp.finfo(FP8).max)


def map_query_chunks(fn: Callable, chunk: int, q_pos: jax.Array, *per_query: jax.Array):
    """Run ``fn(q_pos_chunk, *chunks)`` over chunks of the query axis with ``lax.map``.

    ``q_pos`` [B, T] and each ``per_query`` array [B, T, ...] are split along axis 1 into chunks of
    ``chunk`` rows (the last padded; padding rows get position 0, attend to token 0 only, and are
    dropped). Returns ``(outs, merge)``: ``outs`` is ``fn``'s output pytree with a leading chunk axis,
    and ``merge(y, qaxis)`` folds one output back into [..., T, ...] given the query axis of ``fn``'s
    per-chunk output.
    """
    b, t = q_pos.shape
    c = min(chunk, t)
    n = -(-t // c)
    pad = n * c - t

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, c, *x.shape[2:]), 1, 0)

    outs = jax.lax.map(lambda args: fn(*args), (split(q_pos), *[split(x) for x in per_query]))

    def merge(y, qaxis):
        # y: [n, B, ..., C (at qaxis), ...] -> [B, ..., T, ...]
        y = jnp.moveaxis(y, 0, qaxis)  # [B, ..., n, C, ...]
        y = y.reshape(*y.shape[:qaxis], n * c, *y.shape[qaxis + 2 :])
        return jax.lax.slice_in_dim(y, 0, t, axis=qaxis)

    return outs, merge


def softmax_or_zero(logits: jax.Array) -> jax.Array:
    """Softmax over the last axis; a row with no visible key (e.g. a padded row at position < 0)
    gets all-zero weights, hence a zero output (docs/MSA.md §1.5), instead of NaN."""
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.where(jnp.isfinite(logits).any(-1, keepdims=True), p, 0.0)


def to_e4m3(x: jax.Array) -> jax.Array:
    """``x`` rounded to fp8 e4m3, clipped to the finite range first (e4m3 values stay as they are)."""
    if x.dtype == FP8:
        return x
    return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_e4m3(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Per-row e4m3 quantisation along ``axis``: ``(values, scale)`` with ``values * scale ~ x``.

    ``scale`` is fp32 (``axis`` kept, size 1): the row's largest magnitude over 448, so that it lands
    on e4m3's largest value and the row uses the format's whole range; a row of zeros (or one so small
    that the scale underflows) gets scale 1. ``values`` float8_e4m3fn, the shape of ``x``.
    """
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / FP8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)
    return to_e4m3(x / scale), scale


def fp8_index_operands(iq: jax.Array, ik: jax.Array, keys_fp8: bool = False):
    """The fp8 indexer's operands: ``(qv, qs, kv, ks)``, what :func:`fp8_dot_scores` multiplies and
    what the index-score kernels load (the one place the quantisation is written).

    Each index query row (token, index head) is quantised to e4m3 with its own fp32 scale
    (:func:`quantize_e4m3`), each index key per token likewise, or with ``keys_fp8`` (an fp8 index
    cache, whose keys are e4m3 as stored) taken as stored with scale 1. iq [B, C, Hi, Hx], ik [B, S, Hx]
    -> qv float8_e4m3fn [B, C, Hi, Hx], qs fp32 [B, C, Hi, 1], kv float8_e4m3fn [B, S, Hx], ks fp32 [B, S, 1].
    """
    qv, qs = quantize_e4m3(iq)
    if keys_fp8:
        kv, ks = to_e4m3(ik), jnp.ones((*ik.shape[:2], 1), jnp.float32)
    else:
        kv, ks = quantize_e4m3(ik)
    return qv, qs, kv, ks


def fp8_dot_scores(iq: jax.Array, ik: jax.Array, keys_fp8: bool = False) -> jax.Array:
    """Index dot products as an fp8 x fp8 product (the fp8 indexer): fp32 [B, Hi, C, S].

    The operands of :func:`fp8_index_operands`: the e4m3 products are exact in fp32, summed in fp32,
    then scaled by the query row's scale and then by the key's (the kernels apply them in this order).
    iq [B, C, Hi, Hx], ik [B, S, Hx].
    """
    qv, qs, kv, ks = fp8_index_operands(iq, ik, keys_fp8)
    s = jnp.einsum("bchx,bsx->bhcs", qv.astype(jnp.float32), kv.astype(jnp.float32), precision=HIGHEST)
    return s * jnp.moveaxis(qs, 2, 1) * ks[:, None, None, :, 0]


def block_scores(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, block_size: int, *,
                 score_dtype: str = "bfloat16", keys_fp8: bool = False) -> jax.Array:
    """Max-pooled index scores.

    Args:
      iq: [B, C, Hi, Hx] index queries (post norm + RoPE).
      ik: [B, S, Hx] index keys; key s sits at absolute position s.
      q_pos: [B, C] absolute query positions.
      score_dtype: ``"bfloat16"`` (the dot products of the inputs as given, in fp32: the model as
        released) or ``"float8_e4m3fn"`` (:func:`fp8_dot_scores`, with ``keys_fp8``).
    Returns:
      fp32 [B, Hi, C, nb], nb = ceil(S / block_size); blocks wholly in the future are -inf.
    """
    s_len = ik.shape[1]
    nb = -(-s_len // block_size)
    if score_dtype == "float8_e4m3fn":
        s = fp8_dot_scores(iq, ik, keys_fp8)
    elif score_dtype != "bfloat16":
        raise ValueError(f"block_scores: score_dtype={score_dtype!r}; choose 'bfloat16' or 'float8_e4m3fn'")
    else:
        s = jnp.einsum("bchx,bsx->bhcs", iq.astype(jnp.float32), ik.astype(jnp.float32), precision=HIGHEST)
    future = jnp.arange(s_len)[None, None, None, :] > q_pos[:, None, :, None]
    s = jnp.where(future, NEG_INF, s)
    s = jnp.pad(s, [(0, 0), (0, 0), (0, 0), (0, nb * block_size - s_len)], constant_values=NEG_INF)
    return s.reshape(*s.shape[:3], nb, block_size).max(axis=-1)


def causal_block_mass(q: jax.Array, k: jax.Array, q_pos: jax.Array, block_size: int, num_blocks: int) -> jax.Array:
    """The main branch's causal attention mass per key block, averaged over each KV group's heads: the
    indexer objective's target before it is restricted to a support (:mod:`m3jax.indexer_objective`).

    Args:
      q: [B, C, N, H] queries; k: [B, S, K, H] keys (key s at position s); q_pos: int [B, C].
      num_blocks: nb >= ceil(S / block_size) (blocks past S get 0).
    Returns:
      fp32 [B, K, C, nb]: ``mass[b, g, t, j]`` = mean over the group's heads of the softmax weight
      (scale 1/sqrt(H), keys s <= q_pos) on the keys of block j; rows with no visible key are 0.
    """
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    qg = q.reshape(b, c, kh, n // kh, h).astype(jnp.float32)
    logits = jnp.einsum("bckgh,bskh->bkgcs", qg, k.astype(jnp.float32), precision=HIGHEST) * h**-0.5
    causal = (jnp.arange(s_len)[None, None, :] <= q_pos[:, :, None])[:, None, None]
    p = softmax_or_zero(jnp.where(causal, logits, NEG_INF))
    p = jnp.pad(p, [(0, 0)] * 4 + [(0, num_blocks * block_size - s_len)])
    return p.reshape(*p.shape[:4], num_blocks, block_size).sum(-1).mean(2)  # [B, K, C, nb]


# Forced blocks outrank every score: real scores are dot products of RMS-normed vectors, far below 1e38.
FORCED_BASE = 1e38
FORCED_STEP = 1e36


def forced_priority(dist, j, *, local_blocks: int, init_blocks: int, force_in: tuple[int, ...] = ()):
    """Priority of block ``j`` at distance ``dist = own_block - j`` from the query's own block.

    > 0 for forced blocks, ordered own (``1 + local_blocks``) > own-1 > ... > ``init_blocks`` sinks
    (0.5) > ``force_in`` blocks (0.25); 0 for blocks that compete on their score. Blocks after the own
    block (``dist < 0``) are never forced. Broadcasts over any shapes, and is written with
    element-wise ops only so the top-k kernels run the same function on their register vectors.
    """
    past = dist >= 0
    local = past & (dist < local_blocks)
    prio = jnp.where(local, (1.0 + local_blocks) - dist.astype(jnp.float32), 0.0)
    if init_blocks:
        prio = jnp.where(local, prio, jnp.where(past & (j < init_blocks), 0.5, 0.0))
    for b in force_in:
        prio = jnp.where((prio == 0) & past & (j == b), 0.25, prio)
    return prio


def forced_out(scores, dist, j, force_out: tuple[int, ...] = ()):
    """``scores`` with the ``force_out`` blocks at -inf (never selected) unless a block is the query's
    own (``dist == 0``); element-wise ops only, like :func:`forced_priority`."""
    for b in force_out:
        scores = jnp.where((j == b) & (dist != 0), NEG_INF, scores)
    return scores


def rank_scores(scores, prio):
    """The value top-k ranks: forced blocks (``prio > 0``) get huge finite values in priority order,
    the rest their score; -0.0 becomes +0.0 so that equal scores tie (and go to the lower id)."""
    ranked = jnp.where(prio > 0, FORCED_BASE + prio * FORCED_STEP, scores)
    return jnp.where(ranked == 0, 0.0, ranked)


def lse_merge(o_parts, lse_parts, *, axis: int | None = None, axis_name: str | None = None, unroll: bool = False):
    """Merge softmax-normalised partial attention outputs by their log-sum-exps.

    The parts lie along array axis ``axis`` of ``lse_parts`` [..., P, ...] and ``o_parts``
    [..., P, ..., H] (same leading shape plus the head dim), or, with ``axis_name``, one part per
    device of that ``shard_map`` axis (reduced by pmax / psum). A part with no key has LSE -inf.
    ``unroll`` (with ``axis``): the max and the sums over P as elementwise ops on the P slices, in
    part order, instead of reductions; for a few parts (a decode step's splits) XLA then runs the
    merge with the output's transpose and cast in two launches, where the reductions took three
    (benchmarks/RESULTS.md#decode-2026-12-06e).
    Returns fp32 (o [..., H], lse) without the P axis; a row whose parts are all empty gives o = 0
    and lse = -inf.
    """
    if axis_name is not None:
        vmax, vsum = (lambda x, ax: jax.lax.pmax(x, axis_name)), (lambda x, ax: jax.lax.psum(x, axis_name))
    elif unroll:
        if axis is None:
            raise ValueError("lse_merge: unroll needs the parts' axis")

        def parts(x, ax):
            return [jax.lax.slice_in_dim(x, i, i + 1, axis=ax % x.ndim) for i in range(x.shape[ax])]

        vmax = lambda x, ax: functools.reduce(jnp.maximum, parts(x, ax))  # noqa: E731
        vsum = lambda x, ax: functools.reduce(jnp.add, parts(x, ax))  # noqa: E731
    else:
        vmax = lambda x, ax: jnp.max(x, axis=ax, keepdims=True)  # noqa: E731
        vsum = lambda x, ax: jnp.sum(x, axis=ax, keepdims=True)  # noqa: E731
    o_axis = axis if axis is None or axis >= 0 else axis - 1  # o_parts has the head dim after the parts
    m = vmax(lse_parts, axis)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_parts - m_safe)  # an empty part weighs 0
    z = vsum(w, axis)
    o_parts = jnp.where((w > 0)[..., None], o_parts.astype(jnp.float32), 0.0)  # empty parts may be unwritten
    num = vsum(w[..., None] * o_parts, o_axis)
    o = num / jnp.where(z > 0, z, 1.0)[..., None]
    lse = jnp.where(z > 0, m_safe + jnp.log(jnp.where(z > 0, z, 1.0)), NEG_INF)
    if axis_name is None:
        o, lse = jnp.squeeze(o, o_axis), jnp.squeeze(lse, axis)
    return o, lse


def select_blocks(
    scores: jax.Array,
    q_pos: jax.Array,
    *,
    block_size: int,
    topk: int,
    local_blocks: int = 1,
    init_blocks: int = 0,
    force_in: tuple[int, ...] = (),
    force_out: tuple[int, ...] = (),
) -> jax.Array:
    """Top-k block ids per (batch, index head, query).

    Args:
      scores: fp32 [B, Hi, C, nb] from :func:`block_scores` (-inf for invisible blocks).
      q_pos: [B, C] absolute positions.
      force_in / force_out: research interventions — block ids always selected when visible (after
        the forced local/init blocks) / never selected unless the local/init rules force them.
    Returns:
      int32 [B, Hi, C, topk]: forced blocks first (own block, then the ``local_blocks - 1`` before
      it, then ``init_blocks`` sinks), then visible blocks by descending score, ties to the lower id;
      ``-1`` after the last valid entry.
    """
    nb = scores.shape[-1]
    own = (q_pos // block_size)[:, None, :, None]
    j = jnp.arange(nb)[None, None, None, :]
    prio = forced_priority(own - j, j, local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in)
    ranked = rank_scores(forced_out(scores, own - j, j, force_out), prio)
    k = min(topk, nb)
    vals, idx = jax.lax.top_k(ranked, k)
    idx = jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)
    if k < topk:
        idx = jnp.pad(idx, [(0, 0)] * 3 + [(0, topk - k)], constant_values=-1)
    return idx


def sparse_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, block_idx: jax.Array, q_pos: jax.Array, block_size: int,
    return_lse: bool = False,
):
    """Attention of each query over the tokens of its group's selected blocks (gathered, no mask over S).

    Args:
      q: [B, C, N, H]; k, v: [B, S, K, H] (key s at position s); block_idx: int32 [B, K, C, topk]
      (-1 = empty slot); q_pos: [B, C].
    Returns:
      [B, C, N, H] in q.dtype; softmax in fp32, scale 1/sqrt(H). With ``return_lse`` also the
      natural-log LSE fp32 [B, C, N] of the scaled logits over the visible selected keys (-inf when none).
    """
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    nb = -(-s_len // block_size)
    pad = nb * block_size - s_len

    def blocks(x):  # [B, S, K, H] -> [B, K, nb, bs, H]
        x = jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])
        return jnp.moveaxis(x.reshape(b, nb, block_size, kh, h), 3, 1)

    safe = jnp.maximum(block_idx, 0)
    bi = jnp.arange(b)[:, None, None, None]
    gi = jnp.arange(kh)[None, :, None, None]
    kg = blocks(k)[bi, gi, safe]  # [B, K, C, topk, bs, H]
    vg = blocks(v)[bi, gi, safe]
    qg = q.reshape(b, c, kh, g, h)
    logits = jnp.einsum("bckgh,bkctsh->bkgcts", qg.astype(jnp.float32), kg.astype(jnp.float32), precision=HIGHEST)
    logits = logits * (h**-0.5)
    kpos = block_idx[..., None] * block_size + jnp.arange(block_size)  # [B, K, C, topk, bs]
    ok = (block_idx[..., None] >= 0) & (kpos <= q_pos[:, None, :, None, None])
    logits = jnp.where(ok[:, :, None], logits, NEG_INF).reshape(*logits.shape[:4], -1)  # [B, K, G, C, topk*bs]
    p = softmax_or_zero(logits).reshape(b, kh, g, c, -1, block_size)
    out = jnp.einsum("bkgcts,bkctsh->bckgh", p, vg.astype(jnp.float32), precision=HIGHEST)
    out = out.reshape(b, c, n, h).astype(q.dtype)
    if not return_lse:
        return out
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, K, G, C]
    return out, jnp.moveaxis(lse, 3, 1).reshape(b, c, n)


def dense_mask_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, block_idx: jax.Array | None, q_pos: jax.Array, block_size: int
) -> jax.Array:
    """Causal attention over all S keys with an optional block-selection mask ([C, S] per chunk).

    ``block_idx=None`` is plain causal attention (the dense layers). With ``block_idx`` it is the
    dense-mask formulation of MSA: mask[g, t, s] = (s <= t) & selected[g, t, s // block_size].
    Shapes as :func:`sparse_attention`.
    """
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    qg = q.reshape(b, c, kh, g, h)
    logits = jnp.einsum("bckgh,bskh->bkgcs", qg.astype(jnp.float32), k.astype(jnp.float32), precision=HIGHEST)
    logits = logits * (h**-0.5)
    kpos = jnp.arange(s_len)
    ok = (kpos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, C, S]
    if block_idx is not None:
        nb = -(-s_len // block_size)
        hit = jax.nn.one_hot(block_idx, nb + 1, dtype=jnp.bool_)[..., :nb]  # -1 -> no column
        selected = hit.any(axis=-2)  # [B, K, C, nb]
        ok = ok & jnp.repeat(selected, block_size, axis=-1)[..., :s_len]
    logits = jnp.where(ok[:, :, None], logits, NEG_INF)
    p = softmax_or_zero(logits)
    out = jnp.einsum("bkgcs,bskh->bckgh", p, v.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(b, c, n, h).astype(q.dtype)
