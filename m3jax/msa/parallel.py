"""MSA over a device mesh: the kernels with query heads split, and context-parallel MSA.

docs/SHARDING.md has the strategy for MiniMax-M3 on 8 GPUs. The mesh axes and the rule table are
:mod:`m3jax.sharding`'s; everything here is an explicit ``jax.shard_map`` region.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m3jax.cache import LayerCache, cached_block_scores
from m3jax.config import M3Config
from m3jax.msa.kernels import unsupported_reason
from m3jax.msa.reference import forced_out, forced_priority, lse_merge, rank_scores
from m3jax.sharding import DATA, MODEL, ShardingRuleError


def head_parallel(kernel: Callable, mesh, *, q_axes: int = 2, kv_axes: int | None = 2, axis: str = MODEL) -> Callable:
    """Run an attention kernel ``kernel(q, k, v, *rest)`` (q [B, T, N, H], k/v [B, S, K, H]) inside
    ``jax.shard_map`` with heads split over ``axis``: each device runs the unmodified (e.g. Pallas)
    kernel on its N / n query heads. KV heads are split with them when n divides K, else every device
    keeps the KV heads of its query heads' groups (a slice of the replicated K/V).
    Extra arguments (block ids [B, K, T, topk], positions) follow the KV heads or are replicated.
    """
    n = mesh.shape[axis]

    def call(q, k, v, block_idx, *rest):
        nh, kh = q.shape[q_axes], k.shape[2]
        if nh % n:
            raise ShardingRuleError(f"{nh} query heads do not split over {n} devices")
        g = nh // kh
        split_kv = kh % n == 0
        qspec = P(*([None] * q_axes + [axis]))

        def body(q_l, k_l, v_l, b_l, *r):
            if not split_kv:  # the KV groups of this device's query heads (one group when n >= K)
                me = jax.lax.axis_index(axis)
                per = nh // n
                g0 = me * per // g
                ng = max(1, per // g)
                k_l = jax.lax.dynamic_slice_in_dim(k_l, g0, ng, axis=2)
                v_l = jax.lax.dynamic_slice_in_dim(v_l, g0, ng, axis=2)
                b_l = jax.lax.dynamic_slice_in_dim(b_l, g0, ng, axis=1)
            return kernel(q_l, k_l, v_l, b_l, *r)

        kv_spec = P(None, None, axis) if split_kv else P()
        b_spec = P(None, axis) if split_kv else P()
        return jax.shard_map(
            body, mesh=mesh, in_specs=(qspec, kv_spec, kv_spec, b_spec) + (P(),) * len(rest), out_specs=qspec,
            check_vma=False,
        )(q, k, v, block_idx, *rest)

    return call


def _global_topk(scores, gid, q_pos, n: int, *, block_size: int, topk: int, local_blocks: int, init_blocks: int,
                 axis: str, force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = ()) -> jax.Array:
    """The single-device block selection from each device's scores of its own blocks (inside ``shard_map``).

    scores fp32 [B, Hi, C, nb_loc] (-inf where no key is visible) of the local blocks whose global ids
    are ``gid`` [nb_loc]. Each device ranks its blocks as :func:`m3jax.msa.reference.select_blocks`
    does (forced own / local / sink blocks first, by global id), keeps its top-k, all-gathers the n * k
    (score, id) candidates, and takes the global top-k with ties to the lower block id (candidates
    sorted by id before ``top_k``). Returns int32 [B, Hi, C, topk], -1 padded, equal on every device.
    """
    own = (q_pos // block_size)[:, None, :, None]
    j = gid[None, None, None, :]
    prio = forced_priority(own - j, j, local_blocks=local_blocks, init_blocks=init_blocks, force_in=force_in)
    ranked = rank_scores(forced_out(scores, own - j, j, force_out), prio)
    vals, li = jax.lax.top_k(ranked, min(topk, scores.shape[-1]))
    ids = gid[li]
    all_vals = jnp.moveaxis(jax.lax.all_gather(vals, axis), 0, -2).reshape(*vals.shape[:3], -1)
    all_ids = jnp.moveaxis(jax.lax.all_gather(ids, axis), 0, -2).reshape(*ids.shape[:3], -1)
    order = jnp.argsort(all_ids, axis=-1)
    all_vals = jnp.take_along_axis(all_vals, order, -1)
    all_ids = jnp.take_along_axis(all_ids, order, -1)
    if all_vals.shape[-1] < topk:  # fewer blocks than k in the whole context: pad with empty slots
        pad = [(0, 0)] * 3 + [(0, topk - all_vals.shape[-1])]
        all_vals, all_ids = jnp.pad(all_vals, pad, constant_values=-jnp.inf), jnp.pad(all_ids, pad)
    gv, gi = jax.lax.top_k(all_vals, topk)
    return jnp.where(gv == -jnp.inf, -1, jnp.take_along_axis(all_ids, gi, -1)).astype(jnp.int32)


def context_parallel_msa(
    q: jax.Array, iq: jax.Array, k_local: jax.Array, v_local: jax.Array, ik_local: jax.Array, q_pos: jax.Array,
    mesh, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0, axis: str = MODEL,
) -> jax.Array:
    """MSA over a context split block-striped over ``axis`` (logical block j on device j % n).

    q [B, C, N, H] and iq [B, C, Hi, Hx] are replicated (the query chunk); ``k_local``/``v_local``
    [n, B, S/n, K, H] and ``ik_local`` [n, B, S/n, Hx] hold each device's blocks (leading axis sharded).
    Per device: block-max index scores of the local blocks -> local top-k candidates (forced blocks
    ranked as :func:`m3jax.msa.reference.select_blocks` does) -> all-gather of n * topk candidates -> global
    top-k (ties to the lower block id) -> attention over the selected blocks that are local, with its
    log-sum-exp -> merge of the n partials by LSE (pmax, psum). Equals ``msa.sparse_attention`` with
    ``msa.select_blocks`` on the unsplit context. Returns ([B, C, N, H] in q.dtype, block ids
    int32 [B, Hi, C, topk] in select_blocks' order).
    """
    n = mesh.shape[axis]
    neg = float("-inf")

    def body(q, iq, k, v, ik, q_pos):
        k, v, ik = k[0], v[0], ik[0]
        me = jax.lax.axis_index(axis)
        b, c, nh, h = q.shape
        s_loc, kh = k.shape[1], k.shape[2]
        nb_loc = s_loc // block_size
        gid = jnp.arange(nb_loc) * n + me  # global block id of each local block
        kpos = (gid[:, None] * block_size + jnp.arange(block_size)).reshape(-1)  # [S_loc]
        # 1. local block-max index scores (fp32, -inf for future keys), as msa.block_scores
        s = jnp.einsum("bchx,bsx->bhcs", iq.astype(jnp.float32), ik.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
        s = jnp.where(kpos[None, None, None, :] > q_pos[:, None, :, None], neg, s)
        scores = s.reshape(*s.shape[:3], nb_loc, block_size).max(-1)  # [B, Hi, C, nb_loc]
        # 2-3. local ranking, global top-k from the devices' candidates
        sel = _global_topk(scores, gid, q_pos, n, block_size=block_size, topk=topk, local_blocks=local_blocks,
                           init_blocks=init_blocks, axis=axis)  # [B, Hi, C, topk]
        # 4. attention over the selected blocks this device holds, with the partial LSE
        mine = (sel >= 0) & (sel % n == me)
        lidx = jnp.where(mine, sel // n, 0)
        kb = jnp.moveaxis(k.reshape(b, nb_loc, block_size, kh, h), 3, 1)  # [B, K, nb, bs, H]
        vb = jnp.moveaxis(v.reshape(b, nb_loc, block_size, kh, h), 3, 1)
        bi = jnp.arange(b)[:, None, None, None]
        gi_ = jnp.arange(kh)[None, :, None, None]
        kg, vg = kb[bi, gi_, lidx], vb[bi, gi_, lidx]  # [B, K, C, topk, bs, H]
        g = nh // kh
        qg = q.reshape(b, c, kh, g, h)
        logits = jnp.einsum("bckgh,bkctsh->bkgcts", qg.astype(jnp.float32), kg.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) * (h**-0.5)
        pos = sel[..., None] * block_size + jnp.arange(block_size)
        ok = mine[..., None] & (pos <= q_pos[:, None, :, None, None])
        logits = jnp.where(ok[:, :, None], logits, neg).reshape(b, kh, g, c, -1)
        m_loc = jnp.max(logits, -1, keepdims=True)
        m_safe = jnp.where(jnp.isfinite(m_loc), m_loc, 0.0)
        p = jnp.exp(logits - m_safe)
        l_loc = p.sum(-1, keepdims=True)
        o_loc = jnp.einsum("bkgcx,bkcxh->bkgch", p, vg.reshape(b, kh, c, -1, h).astype(jnp.float32),
                           precision=jax.lax.Precision.HIGHEST) / jnp.where(l_loc > 0, l_loc, 1.0)
        lse = jnp.where(l_loc > 0, m_safe + jnp.log(jnp.where(l_loc > 0, l_loc, 1.0)), neg)[..., 0]  # [B, K, G, C]
        # 5. merge the devices' partials by LSE
        out, _ = lse_merge(o_loc, lse, axis_name=axis)  # [B, K, G, C, H]
        return jnp.moveaxis(out, 3, 1).reshape(b, c, nh, h).astype(q.dtype), sel

    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(P(), P(), P(axis), P(axis), P(axis), P()),
        out_specs=(P(), P()), check_vma=False,
    )(q, iq, k_local, v_local, ik_local, q_pos)


def split_context(x: jax.Array, n: int, block_size: int) -> jax.Array:
    """[B, S, ...] -> [n, B, S/n, ...]: block j to device j % n (the layout of the striped cache)."""
    b, s = x.shape[:2]
    nb = s // block_size
    x = x.reshape(b, nb // n, n, block_size, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(n, b, s // n, *x.shape[4:])


def msa_pallas_split_reason(cfg: M3Config | object, n: int) -> str | None:
    """Why the MSA kernels cannot run head-split over ``n`` devices (None when they can).

    Each device gets N / n query heads: whole KV groups when n divides K (K / n groups each, KV and
    index heads split with them), or N / n heads of one group when K divides n (that group's KV head
    and index head only). The per-device head counts (G' = min(G, N / n) query heads per group) must
    pass :func:`m3jax.msa.kernels.unsupported_reason`.
    """
    t = getattr(cfg, "text", cfg)
    nh, kh, hi = t.num_attention_heads, t.num_key_value_heads, t.index_n_heads
    if hi != kh:
        return f"index heads {hi} != KV heads {kh} (the selection is per KV group)"
    if nh % n:
        return f"{nh} query heads do not split over {n} devices"
    if kh % n and n % kh:
        return f"{kh} KV groups do not split over {n} devices, nor {n} devices over them"
    per = nh // n
    groups = max(1, kh // n)
    local = dataclasses.replace(t, num_attention_heads=per, num_key_value_heads=groups, index_n_heads=groups)
    reason = unsupported_reason(local)
    return None if reason is None else f"{per} query heads per device: {reason}"


def msa_pallas_sharded(kernel: Callable, q, k, v, iq, ik, q_pos, cfg, *, mesh=None, axis: str = MODEL):
    """Run the MSA Pallas path ``kernel(q, k, v, iq, ik, q_pos, cfg) -> (o, block_idx)``
    (:func:`m3jax.msa.kernels.prefill`: index kernel + top-k + sparse attention) inside
    ``jax.shard_map`` over ``axis``.

    q [B, T, N, H], k/v [B, S, K, H], iq [B, T, K, Hx] (one index head per KV group), ik [B, S, Hx],
    q_pos [B, T]. Query heads are split over ``axis`` (out: [B, T, N, H] head-split, the layout ``wo``
    contracts). When n divides K, KV heads and index heads are split with them; when K divides n
    (M3: 4 KV heads on 8), K/V and iq enter replicated and each device slices its own group's KV head
    and index head, so the n / K devices of one group compute that group's selection redundantly
    (the index kernel is per (token, index head) row: every device gets the single-device selection,
    bit for bit). The shared index key ik and q_pos are replicated. The batch is split over ``data``
    when that axis divides it. Returns (o, block_idx int32 [B, K, T, topk]).

    No active mesh (and none given): ``kernel`` is called as is. When the per-device head counts do
    not fit the kernels (:func:`msa_pallas_split_reason`), every device runs the whole kernel on all
    heads (replicated, with a warning): correct, no memory or time saved.
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        return kernel(q, k, v, iq, ik, q_pos, cfg)
    n = mesh.shape[axis]
    nh, kh = q.shape[2], k.shape[2]
    bax = batch_axis(mesh, q.shape[0])
    rep = P(bax)
    reason = msa_pallas_split_reason(cfg, n)
    if reason is not None:
        warnings.warn(f"MSA Pallas kernels replicated over the {n}-device {axis!r} axis: {reason}", stacklevel=2)
        return jax.shard_map(lambda *a: kernel(*a, cfg), mesh=mesh, in_specs=(rep,) * 6, out_specs=(rep, rep),
                             check_vma=False)(q, k, v, iq, ik, q_pos)
    split_kv = kh % n == 0
    g = nh // kh

    def body(q_, k_, v_, iq_, ik_, qp_):
        if not split_kv:  # n / K devices per group: this device's group (KV head + index head)
            grp = jax.lax.axis_index(axis) * (nh // n) // g
            k_, v_, iq_ = (jax.lax.dynamic_slice_in_dim(x, grp, 1, axis=2) for x in (k_, v_, iq_))
        return kernel(q_, k_, v_, iq_, ik_, qp_, cfg)

    heads = P(bax, None, axis)
    kv = heads if split_kv else rep
    o, sel = jax.shard_map(
        body, mesh=mesh, in_specs=(heads, kv, kv, kv, rep, rep), out_specs=(heads, P(bax, axis)), check_vma=False,
    )(q, k, v, iq, ik, q_pos)
    return o, (sel if split_kv else sel[:, :: n // kh])  # one row per group (the n / K copies are equal)


def context_split_reason(kv: LayerCache, n: int, *, index: bool = True) -> str | None:
    """Why attention over the paged cache ``kv`` cannot run context parallel over ``n`` devices (None
    when it can): the pages must split evenly (the striped cache of
    :func:`m3jax.sharding.init_sharded_cache`), and MSA needs its index-key pages (``index``)."""
    if index and kv.ik is None:
        return "no index-key pages (not an MSA layer)"
    if kv.k.shape[0] % n:
        return f"{kv.k.shape[0]} cache pages do not split over {n} devices (use m3jax.sharding.init_sharded_cache)"
    return None


def axis_size(mesh, axis: str) -> int:
    """Size of ``axis`` in ``mesh`` (default: the active one); 1 when there is none."""
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or axis not in mesh.axis_names:
        return 1
    return mesh.shape[axis]


def batch_axis(mesh, batch: int) -> str | None:
    """The mesh axis a batch of ``batch`` sequences splits over inside these shard_maps: ``data`` when it
    is > 1 and divides the batch, else none (each data replica then computes every sequence)."""
    nd = mesh.shape.get(DATA, 1)
    return DATA if nd > 1 and batch % nd == 0 else None


def _pad_window(page_table: jax.Array, n: int) -> tuple[jax.Array, int]:
    """The page table padded to a multiple of n logical blocks (the pad lies beyond every query, so
    nothing reads it), and the blocks per device."""
    w = page_table.shape[1]
    nb_loc = -(-w // n)
    return jnp.pad(page_table, [(0, 0), (0, nb_loc * n - w)]), nb_loc


def _local_pages(page_table: jax.Array, me, n: int, per: int) -> jax.Array:
    """Device ``me``'s page table: on the striped cache logical block j' * n + me is its local block j',
    at local page ``page_table[:, j' * n + me] - me * per`` (per = pages per device)."""
    b, w = page_table.shape
    return jnp.clip(page_table.reshape(b, w // n, n)[:, :, me] - me * per, 0, per - 1)


def _local_length(pos: jax.Array, me, n: int, block_size: int) -> jax.Array:
    """Keys of device ``me``'s blocks that a query at ``pos`` sees: its local blocks before the query's
    own block whole, and the own block (on device own % n) up to ``pos``. In the device's contiguous
    local key order these are exactly keys 0 .. length-1, so a kernel's causal mask with this length
    (or local query position length - 1) is the global causal mask."""
    own = pos // block_size
    whole = jnp.maximum(own - me + n - 1, 0) // n
    return whole * block_size + jnp.where(own % n == me, pos % block_size + 1, 0)


def prefill_context_parallel(cfg, n: int, *, queries: int, window_tokens: int, q_bytes: int, kv_bytes: int) -> bool:
    """The rule between the two ways an MSA prefill chunk runs over the page-split cache on ``n`` devices.

    Context parallel (:func:`msa_prefill_sharded`) moves the chunk's queries to the keys: every device
    receives all query heads (q all-gathered, ``queries * N * H`` values) and the fp32 partial outputs
    are all-reduced by the LSE merge (``queries * N * H * 4`` bytes, twice over the ring). Head-split over
    a gathered window (:func:`msa_pallas_sharded`; the XLA-partitioned reference) moves the keys to the
    queries: every device receives the window's K, V and index keys. Compute never favours the
    gathered window (context parallel scores each key once over all devices; head split scores it on
    n / K devices when K < n, twice for M3 on 8) and neither does memory (a gathered window per device
    against 1/n of it), so the traffic decides: context parallel once the window's keys outweigh the
    queries. For M3 in BF16 that is a window of >= 35.6 x the chunk (>= 292K tokens at 8192-token chunks):
    the early chunks of a long prompt stay head-split, where the query exchange would cost more than
    the window it avoids gathering."""
    t = getattr(cfg, "text", cfg)
    gathered = window_tokens * (2 * t.num_key_value_heads * t.head_dim + t.index_head_dim) * kv_bytes
    exchanged = queries * t.num_attention_heads * t.head_dim * (q_bytes + 2 * 4)
    return n > 1 and gathered >= exchanged


def msa_prefill_sharded(q, iq, kv: LayerCache, page_table, q_pos, cfg, *, implementation: str = "pallas",
                        query_chunk: int | None = None, force_in=(), force_out=(), mesh=None, axis: str = MODEL):
    """MSA of a query chunk over the page-striped cache, context parallel over ``axis`` (docs/SHARDING.md).

    q [B, C, N, H] and iq [B, C, Hi, Hx] at q_pos [B, C] (all heads on every device; the batch split
    over ``data`` where :func:`batch_axis` says so, as in every function here); ``kv`` the layer's
    pages as :func:`m3jax.sharding.init_sharded_cache` splits them (device d holds pages
    [d * P/n, (d + 1) * P/n) and logical block j of every sequence lives on device j % n); page_table
    [B, W] the chunk's key window (the new keys already written). Per device: its own pages of the
    window gathered into a local contiguous K/V / index-key copy (W / n blocks; nothing crosses
    devices); index scores of the local blocks with the local causal mask (:func:`_local_length`);
    local top-k ranked by global block id and the global top-k of all devices' candidates
    (:func:`_global_topk`: the single-device selection); sparse attention over the selected blocks this
    device holds, with its LSE; :func:`m3jax.msa.reference.lse_merge` of the n partials.

    ``implementation``: ``"pallas"`` (the index-score and KV-major sparse attention kernels, over the
    whole chunk: they tile it themselves) or ``"reference"`` (the jnp maths in query chunks of
    ``query_chunk``, so no [C, S / n] score matrix of the whole chunk exists). Returns (o [B, C, N, H]
    in q.dtype, the same on every device of ``axis``; block ids int32 [B, Hi, C, topk] in select_blocks'
    order).
    """
    from m3jax.msa import reference
    from m3jax.pallas.index_scores import index_block_scores
    from m3jax.pallas.sparse_attention import sparse_attention

    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    n = mesh.shape[axis]
    t = getattr(cfg, "text", cfg)
    bs = t.index_block_size
    per = kv.k.shape[0] // n
    page_table, nb_loc = _pad_window(page_table, n)
    kernels = implementation == "pallas"

    def attend(qp, q_, iq_, k_loc, v_loc, ik_loc, me):
        lq = _local_length(qp, me, n, bs) - 1  # local position of the last visible local key (-1: none)
        if kernels:
            scores = index_block_scores(iq_, ik_loc, lq, block_size=bs)
        else:
            scores = cached_block_scores(iq_, ik_loc, lq, t)  # in t.index_score_dtype
        # a query that sees no local key scores -inf everywhere (the kernel may leave such rows unwritten)
        scores = jnp.where(lq[:, None, :, None] >= 0, scores, -jnp.inf)
        gid = jnp.arange(nb_loc) * n + me  # global block id of each local block
        sel = _global_topk(scores, gid, qp, n, block_size=bs, topk=t.index_topk_blocks,
                           local_blocks=t.index_local_blocks, init_blocks=t.index_init_blocks, axis=axis,
                           force_in=force_in, force_out=force_out)
        local_sel = jnp.where((sel >= 0) & (sel % n == me), sel // n, -1)
        lq = jnp.maximum(lq, 0)  # a query with no local key has no local block selected either
        if kernels:
            o, lse = sparse_attention(q_, k_loc, v_loc, local_sel, lq, block_size=bs, implementation="kv_major",
                                      return_lse=True)
        else:
            o, lse = reference.sparse_attention(q_, k_loc, v_loc, local_sel, lq, bs, return_lse=True)
        o, _ = lse_merge(o, lse, axis_name=axis)
        return o.astype(q_.dtype), sel

    def body(q_, iq_, k_, v_, ik_, pt_, qp_):
        me = jax.lax.axis_index(axis)
        lpt = _local_pages(pt_, me, n, per)
        local = lambda pages: pages[lpt].reshape(q_.shape[0], nb_loc * bs, *pages.shape[2:])  # noqa: E731
        # fp8 index pages (index_cache_dtype) are upcast (exact), as the single-device path does
        k_loc, v_loc, ik_loc = local(k_), local(v_), local(ik_).astype(iq_.dtype)
        if kernels or query_chunk is None or query_chunk >= q_.shape[1]:
            return attend(qp_, q_, iq_, k_loc, v_loc, ik_loc, me)
        (o, sel), merge = reference.map_query_chunks(
            lambda qp, qc, iqc: attend(qp, qc, iqc, k_loc, v_loc, ik_loc, me), query_chunk, qp_, q_, iq_)
        return merge(o, 1), merge(sel, 2)

    pages, rows = P(axis), P(batch_axis(mesh, q.shape[0]))
    return jax.shard_map(
        body, mesh=mesh, in_specs=(rows, rows, pages, pages, pages, rows, rows), out_specs=(rows, rows),
        check_vma=False,
    )(q, iq, kv.k, kv.v, kv.ik, page_table, q_pos)


def msa_decode_sharded(kernel: Callable, q, iq, kv: LayerCache, page_table, q_pos, cfg, *, force_in=(), force_out=(),
                       mesh=None, axis: str = MODEL):
    """One MSA decode token per sequence through the paged decode kernels, context parallel over ``axis``.

    ``kernel(q, iq, kv, page_table, q_pos, cfg, force_in=, force_out=) -> (o, block ids)`` is the
    single-device path (:func:`m3jax.msa.kernels.decode`): it runs as is with no active mesh, a model
    axis of 1, or a cache whose pages do not split (then with a warning naming the reason; XLA gathers
    the pages to feed it).

    Under a mesh the cache is the page-striped one of :func:`m3jax.sharding.init_sharded_cache`: device
    d holds the contiguous physical pages [d * P/n, (d + 1) * P/n) and logical block j of every
    sequence lives on device j % n, so device d's blocks j' * n + d form a local page table
    ``page_table[:, d::n] - d * P/n``. Each device runs both decode kernels on its own pages only:
    index scores of its blocks (the kernels' causal mask reads a local length: the local blocks below
    the query's own block are whole, the own block, on device own % n, is cut at the query's slot),
    local top-k ranked by global block id and the global top-k from all devices' candidates
    (:func:`_global_topk`, the single-device selection), sparse attention over the selected blocks it
    holds with its log-sum-exp, and the LSE merge of the n partials
    (:func:`m3jax.msa.reference.lse_merge` over the axis). Only the [B, Hi, n * topk] candidates and
    the [B, 1, N, H] partial outputs cross devices; the cache is never gathered. q and iq enter
    replicated (a few KB per token); all query heads run on every device. Returns (o [B, 1, N, H]
    replicated, block ids int32 [B, Hi, 1, topk]).
    """
    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    plain = lambda: kernel(q, iq, kv, page_table, q_pos, cfg, force_in=force_in, force_out=force_out)  # noqa: E731
    if mesh is None or mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return plain()
    n = mesh.shape[axis]
    reason = context_split_reason(kv, n)
    if reason is not None:
        warnings.warn(f"MSA decode kernels not context parallel over the {n}-device {axis!r} axis: {reason}",
                      stacklevel=2)
        return plain()
    from m3jax.pallas.decode import decode_index_scores, sparse_decode_attention

    t = getattr(cfg, "text", cfg)
    bs = t.index_block_size
    per = kv.k.shape[0] // n
    page_table, nb_loc = _pad_window(page_table, n)
    pos = q_pos[:, -1]

    def body(q_, iq_, k_, v_, ik_, pt_, pos_):
        me = jax.lax.axis_index(axis)
        local_pt = _local_pages(pt_, me, n, per)
        gid = jnp.arange(nb_loc) * n + me  # global block id of each local block
        local_len = _local_length(pos_, me, n, bs)
        # fp8 index pages (index_cache_dtype) go in as stored: the kernel converts them in SMEM
        scores = decode_index_scores(iq_, ik_, local_pt, local_len, block_size=bs)  # [B, Hi, 1, nb_loc]
        sel = _global_topk(scores, gid, pos_[:, None], n, block_size=bs, topk=t.index_topk_blocks,
                           local_blocks=t.index_local_blocks, init_blocks=t.index_init_blocks, axis=axis,
                           force_in=force_in, force_out=force_out)
        local_sel = jnp.where((sel >= 0) & (sel % n == me), sel // n, -1)
        o, lse = sparse_decode_attention(q_, k_, v_, local_pt, local_sel, local_len, block_size=bs, return_lse=True)
        o, _ = lse_merge(o, lse, axis_name=axis)
        return o.astype(q_.dtype), sel

    pages, rows = P(axis), P(batch_axis(mesh, q.shape[0]))
    return jax.shard_map(
        body, mesh=mesh, in_specs=(rows, rows, pages, pages, pages, rows, rows), out_specs=(rows, rows),
        check_vma=False,
    )(q, iq, kv.k, kv.v, kv.ik, page_table, pos)


def dense_decode_sharded(kernel: Callable, q, kv: LayerCache, page_table, q_pos, cfg, *, mesh=None, axis: str = MODEL):
    """One decode token per sequence of a full-attention layer over its page-striped cache, context
    parallel over ``axis``: each device runs the paged decode attention kernel over every visible block
    it holds (its local page table and length, as :func:`msa_decode_sharded`) with its log-sum-exp, and
    the n partials are merged by :func:`m3jax.msa.reference.lse_merge`. Only the [B, 1, N, H] partial
    outputs cross devices; the layer's K/V is never gathered (3 layers x 2 GB per token for M3 at 1M).

    ``kernel(q, kv, page_table, q_pos, cfg) -> o`` (:func:`m3jax.msa.kernels.dense_decode`) runs as is
    with no mesh, a model axis of 1, or pages that do not split (then with a warning; XLA gathers).
    Returns o [B, 1, N, H] replicated.
    """
    n = axis_size(mesh, axis)
    if n == 1:
        return kernel(q, kv, page_table, q_pos, cfg)
    reason = context_split_reason(kv, n, index=False)
    if reason is not None:
        warnings.warn(f"full-attention decode not context parallel over the {n}-device {axis!r} axis: {reason}",
                      stacklevel=2)
        return kernel(q, kv, page_table, q_pos, cfg)
    from m3jax.pallas.decode import sparse_decode_attention

    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    t = getattr(cfg, "text", cfg)
    bs = t.index_block_size
    per = kv.k.shape[0] // n
    page_table, nb_loc = _pad_window(page_table, n)
    kh = kv.k.shape[2]

    def body(q_, k_, v_, pt_, pos_):
        me = jax.lax.axis_index(axis)
        local_len = _local_length(pos_, me, n, bs)
        blocks = jnp.arange(nb_loc, dtype=jnp.int32)[None]
        sel = jnp.where(blocks * bs < local_len[:, None], blocks, -1)  # every local block with a visible key
        sel = jnp.broadcast_to(sel[:, None, None], (q_.shape[0], kh, 1, nb_loc))
        o, lse = sparse_decode_attention(q_, k_, v_, _local_pages(pt_, me, n, per), sel, local_len,
                                         block_size=bs, return_lse=True)
        o, _ = lse_merge(o, lse, axis_name=axis)
        return o.astype(q_.dtype)

    pages, rows = P(axis), P(batch_axis(mesh, q.shape[0]))
    return jax.shard_map(body, mesh=mesh, in_specs=(rows, pages, pages, rows, rows), out_specs=rows, check_vma=False)(
        q, kv.k, kv.v, page_table, q_pos[:, -1])
