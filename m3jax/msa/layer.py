"""One MSA attention layer as the model runs it: the choice between the reference and the kernels.

``cfg.attention_impl`` picks the path: ``"reference"`` (pure jnp, query chunks of
``cfg.attention_chunk``), ``"dense_mask"`` (the dense-mask formulation, for tiny tests) or
``"pallas"`` (the Mosaic GPU kernels of :mod:`m3jax.msa.kernels`, heads split over the active mesh).
The projections (q/k/v and the index branch) are the model's; this module takes them as arrays.
"""

from __future__ import annotations

import functools
import warnings

import jax

from m3jax.cache import LayerCache, cached_block_scores, cached_index_keys
from m3jax.config import M3Config, TextConfig
from m3jax.msa import kernels, reference
from m3jax.msa import parallel
from m3jax.msa.parallel import msa_decode_sharded, msa_pallas_sharded
from m3jax.sharding import MODEL


def forced_blocks(cfg: TextConfig, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``msa_force_in`` / ``msa_force_out`` block ids of ``layer``."""
    return (tuple(b for l, b in cfg.msa_force_in if l == layer), tuple(b for l, b in cfg.msa_force_out if l == layer))


def scores(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, cfg: TextConfig) -> jax.Array:
    """Index block scores of one query chunk: fp32 [B, K, C, nb] (see :func:`reference.block_scores`), from
    the index keys as the cache holds them (``cfg.index_cache_dtype``), in ``cfg.index_score_dtype``."""
    return cached_block_scores(iq, ik, q_pos, cfg)


def select_from_scores(block_scores: jax.Array, q_pos: jax.Array, cfg: TextConfig, layer: int) -> jax.Array:
    """Top-k selection with the config's MSA knobs and ``layer``'s interventions: int32 [B, K, C, topk]."""
    force_in, force_out = forced_blocks(cfg, layer)
    return reference.select_blocks(
        block_scores, q_pos, block_size=cfg.index_block_size, topk=cfg.index_topk_blocks,
        local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks, force_in=force_in, force_out=force_out,
    )


def select(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, cfg: TextConfig, layer: int) -> jax.Array:
    """Block selection of one query chunk (iq [B, C, K, Hx], ik [B, S, Hx]): int32 [B, K, C, topk]."""
    return select_from_scores(scores(iq, ik, q_pos, cfg), q_pos, cfg, layer)


def attention(q, k, v, iq, ik, q_pos, cfg: M3Config, layer: int):
    """MSA of queries q [B, T, N, H] (index queries iq [B, T, K, Hx]) at q_pos [B, T] over keys
    k/v [B, S, K, H] and index keys ik [B, S, Hx] (key s at position s).

    Returns (o [B, T, N, H] in q.dtype, block ids int32 [B, K, T, topk]).
    """
    t = cfg.text
    if cfg.attention_impl == "pallas":
        force_in, force_out = forced_blocks(t, layer)
        kernel = functools.partial(kernels.prefill, force_in=force_in, force_out=force_out)
        return msa_pallas_sharded(kernel, q, k, v, iq, cached_index_keys(ik, t, iq.dtype), q_pos, t)
    attend = reference.dense_mask_attention if cfg.attention_impl == "dense_mask" else reference.sparse_attention

    def chunk_fn(qp, qc, iqc):
        sel = select(iqc, ik, qp, t, layer)
        return attend(qc, k, v, sel, qp, t.index_block_size), sel

    (o, sel), merge = reference.map_query_chunks(chunk_fn, cfg.attention_chunk, q_pos, q, iq)
    return merge(o, 1), merge(sel, 2)


def context_parallel(cfg: M3Config, kv: LayerCache, page_table, q) -> bool:
    """Whether MSA over the paged cache (a prefill chunk, or a decode step the decode kernels do not take)
    runs context parallel over the page-split cache (:func:`paged_attention`) instead of gathering the
    key window: under a mesh model axis > 1 whose pages split, by the traffic rule of
    :func:`m3jax.msa.parallel.prefill_context_parallel`. A cache whose pages do not split gathers, with
    one warning naming why."""
    n = parallel.axis_size(None, MODEL)
    if cfg.attention_impl == "dense_mask" or n == 1:  # "auto" unresolved runs the reference, as attention()
        return False
    reason = parallel.context_split_reason(kv, n)
    if reason is not None:
        warnings.warn(f"MSA over the paged cache not context parallel over {n} devices (the key window is "
                      f"gathered): {reason}", stacklevel=2)
        return False
    window = page_table.shape[0] * page_table.shape[1] * kv.k.shape[1]
    return parallel.prefill_context_parallel(cfg.text, n, queries=q.shape[0] * q.shape[1], window_tokens=window,
                                             q_bytes=q.dtype.itemsize, kv_bytes=kv.k.dtype.itemsize)


def paged_attention(q, iq, kv: LayerCache, page_table, q_pos, cfg: M3Config, layer: int):
    """MSA of q [B, T, N, H] (iq [B, T, K, Hx]) at q_pos over the cache pages of ``page_table`` (the new
    keys written), context parallel over the mesh (:func:`m3jax.msa.parallel.msa_prefill_sharded`):
    the kernels on the kernels path, the jnp maths in ``attention_chunk`` query chunks on the reference
    path. Returns (o [B, T, N, H], block ids int32 [B, K, T, topk])."""
    force_in, force_out = forced_blocks(cfg.text, layer)
    impl = "pallas" if cfg.attention_impl == "pallas" else "reference"
    return parallel.msa_prefill_sharded(q, iq, kv, page_table, q_pos, cfg.text, implementation=impl,
                                        query_chunk=cfg.attention_chunk, force_in=force_in, force_out=force_out)


def decode_in_place(cfg: M3Config, n_queries: int) -> bool:
    """Whether this step reads the paged cache in place (the decode kernels; :func:`decode`, and
    :func:`dense_decode` on the full-attention layers) instead of gathering it (then the prefill
    kernels run on the gathered cache: block sizes the decode kernels cannot take)."""
    return cfg.attention_impl == "pallas" and n_queries == 1 and kernels.decode_unsupported_reason(cfg.text) is None


def dense_decode(q, kv: LayerCache, page_table, q_pos, cfg: M3Config):
    """One token per sequence of a full-attention layer against its paged cache, read in place (under a
    mesh context parallel over the page-split cache, :func:`m3jax.msa.parallel.dense_decode_sharded`)."""
    return parallel.dense_decode_sharded(kernels.dense_decode, q, kv, page_table, q_pos, cfg.text)


def decode(q, iq, kv: LayerCache, page_table, q_pos, cfg: M3Config, layer: int):
    """One token per sequence against the paged cache, read in place: (o [B, 1, N, H], block ids).
    Under a mesh the kernels run context parallel over the page-split cache (msa.parallel)."""
    force_in, force_out = forced_blocks(cfg.text, layer)
    return msa_decode_sharded(kernels.decode, q, iq, kv, page_table, q_pos, cfg.text, force_in=force_in,
                              force_out=force_out)
