"""Test-only jnp prototypes of MSA over a mesh: context-parallel MSA over a block-striped context
with the block scores and softmax written inline (:func:`context_parallel_msa`, :func:`split_context`)
and a head-parallel wrapper around an unmodified attention kernel (:func:`head_parallel`). They check
the ideas behind :mod:`m3jax.msa.parallel` independently of its code (tests/multidevice/sharding_checks.py).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from m3jax.mesh_axes import MODEL, ShardingRuleError
from m3jax.msa.parallel import global_topk
from m3jax.msa.reference import lse_merge


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
        sel = global_topk(scores, gid, q_pos, n, block_size=block_size, topk=topk, local_blocks=local_blocks,
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


