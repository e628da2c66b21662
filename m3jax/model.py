"""MiniMax-M3 forward pass: pure functions over the parameter tree of :mod:`m3jax.params`.

Reads top to bottom as the architecture (spec ARCHITECTURE.md §1):

    h = embed[input_ids]  (vision tokens scattered over the image / video placeholder rows)
    for each layer: h += attn(rms_norm(h)); h += mlp_or_moe(rms_norm(h))
    logits = rms_norm(h) @ lm_head

Attention layers are dense causal GQA or MSA (index branch -> block top-k -> sparse attention);
MLP layers are the dense SwiGLU-OAI MLP or the MoE block. Shapes: B batch, T tokens, D hidden,
N / K query / KV heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax import msa
from m3jax.cache import LayerCache, PagedCache
from m3jax.config import M3Config, TextConfig
from m3jax.layers import apply_rope, rms_norm, rope_angles
from m3jax.moe import dense_mlp, moe_sorted
from m3jax.vision import Grid, encode_media


def _qk_heads(x, w, norm_w, angles, eps):
    """Project [B, T, D] @ [D, heads, H], per-head Gemma RMSNorm, then partial RoPE."""
    y = jnp.einsum("btd,dnh->btnh", x, w)
    return apply_rope(rms_norm(y, norm_w, eps), angles)


def index_branch(x: jax.Array, p: dict, angles: jax.Array, cfg: TextConfig) -> tuple[jax.Array, jax.Array]:
    """MSA index q/k. x: [B, T, D] -> iq [B, T, Hi, Hx], ik [B, T, Hx] (post norm and RoPE)."""
    iq = _qk_heads(x, p["wq"], p["q_norm"], angles, cfg.rms_norm_eps)
    ik = _qk_heads(x, p["wk"][:, None, :], p["k_norm"], angles, cfg.rms_norm_eps)[:, :, 0]
    return iq, ik


def project_qkv(x: jax.Array, lp: dict, angles: jax.Array, cfg: TextConfig, sparse: bool):
    """q [B,T,N,H], k, v [B,T,K,H] (q/k normed and rotated) and, on MSA layers, iq [B,T,Hi,Hx], ik [B,T,Hx]."""
    p = lp["attn"]
    q = _qk_heads(x, p["wq"], p["q_norm"], angles, cfg.rms_norm_eps)
    k = _qk_heads(x, p["wk"], p["k_norm"], angles, cfg.rms_norm_eps)
    v = jnp.einsum("btd,dkh->btkh", x, p["wv"])
    iq, ik = index_branch(x, lp["index"], angles, cfg) if sparse else (None, None)
    return q, k, v, iq, ik


def msa_select(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, cfg: TextConfig, layer: int) -> jax.Array:
    """Block selection of one query chunk with the config's MSA knobs (block, top-k, forced blocks,
    and the per-layer force-in / force-out interventions). Returns int32 [B, K, C, topk]."""
    return msa.select_blocks(
        msa.block_scores(iq, ik, q_pos, cfg.index_block_size),
        q_pos,
        block_size=cfg.index_block_size,
        topk=cfg.index_topk_blocks,
        local_blocks=cfg.index_local_blocks,
        init_blocks=cfg.index_init_blocks,
        force_in=tuple(b for l, b in cfg.msa_force_in if l == layer),
        force_out=tuple(b for l, b in cfg.msa_force_out if l == layer),
    )


def attention(
    x: jax.Array,
    lp: dict,
    angles: jax.Array,
    q_pos: jax.Array,
    cfg: M3Config,
    layer: int,
    kv: LayerCache | None = None,
    page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, LayerCache | None]:
    """Attention block of ``layer``. x: [B, T, D] (already normed) at positions q_pos [B, T].

    Without a cache the keys are these T tokens (key s at position s). With ``kv`` the new K/V (and
    index keys) are written at q_pos first and the keys are the sequence's whole cache, so chunked
    prefill and decode run the same maths as the full forward.
    Returns ([B, T, D], MSA block ids int32 [B, K, T, topk] or None, updated cache or None).
    """
    t = cfg.text
    sparse = t.is_sparse_attention(layer)
    q, k, v, iq, ik = project_qkv(x, lp, angles, t, sparse)
    if kv is not None:
        kv = kv.write(page_table, q_pos, k, v, ik)
        k, v, ik_all = kv.gather(page_table)
        ik = ik_all if sparse else None
    bs = t.index_block_size

    if sparse and cfg.attention_impl == "pallas":
        o, block_idx = _msa_pallas(q, k, v, iq, ik, q_pos, t)
    elif sparse:
        attend = msa.dense_mask_attention if cfg.attention_impl == "dense_mask" else msa.sparse_attention

        def chunk_fn(qp, qc, iqc):
            sel = msa_select(iqc, ik, qp, t, layer)
            return attend(qc, k, v, sel, qp, bs), sel

        (o, sel), merge = msa.map_query_chunks(chunk_fn, cfg.attention_chunk, q_pos, q, iq)
        o, block_idx = merge(o, 1), merge(sel, 2)
    else:
        o, merge = msa.map_query_chunks(
            lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs), cfg.attention_chunk, q_pos, q
        )
        o, block_idx = merge(o, 1), None
    return jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"]), block_idx, kv


def _msa_pallas(q, k, v, iq, ik, q_pos, cfg: TextConfig):
    """MSA through the Mosaic GPU kernels (m3jax/pallas): index scores, top-k, KV-block-major attention.

    The kernels take the whole query range at once (they tile it themselves); forced-in/out
    interventions are a reference-path feature (refused by ``pallas_unsupported_reason``).
    """
    from m3jax.pallas.index_scores import index_block_scores
    from m3jax.pallas.sparse_attention import sparse_attention
    from m3jax.pallas.topk import select_blocks

    bs = cfg.index_block_size
    scores = index_block_scores(iq, ik, q_pos, block_size=bs)
    sel = select_blocks(scores, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                        local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
    return sparse_attention(q, k, v, sel, q_pos, block_size=bs, implementation="kv_major"), sel


def pallas_unsupported_reason(cfg: TextConfig) -> str | None:
    """Why the MSA kernels cannot run this config (None when they can)."""
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    if g % 8:
        return f"query heads per KV head = {g} must be a multiple of 8 (GQA rows packed into wgmma tiles)"
    if cfg.head_dim % 64 or cfg.index_head_dim % 64:
        return f"head_dim {cfg.head_dim} and index_head_dim {cfg.index_head_dim} must be multiples of 64"
    if cfg.index_block_size % 64 or cfg.index_block_size > 256:
        return f"index_block_size {cfg.index_block_size} must be 64, 128, 192 or 256"
    if cfg.msa_force_in or cfg.msa_force_out:
        return "msa_force_in / msa_force_out interventions run on the reference path only"
    return None


def mlp_block(y: jax.Array, lp: dict, cfg: TextConfig, layer: int) -> jax.Array:
    """Dense SwiGLU-OAI MLP or the MoE block. y: [B, T, D] (already normed)."""
    if cfg.is_moe(layer):
        b, n, d = y.shape
        return moe_sorted(y.reshape(b * n, d), lp["moe"], cfg).reshape(b, n, d)
    return dense_mlp(y, lp["mlp"], cfg)


def decoder_layer(h, lp, angles, q_pos, cfg: M3Config, i: int, kv=None, page_table=None):
    t = cfg.text
    a, block_idx, kv = attention(rms_norm(h, lp["input_norm"], t.rms_norm_eps), lp, angles, q_pos, cfg, i, kv, page_table)
    h = h + a
    return h + mlp_block(rms_norm(h, lp["post_attn_norm"], t.rms_norm_eps), lp, t, i), block_idx, kv


def text_hidden(
    params: dict,
    inputs_embeds: jax.Array,
    positions: jax.Array,
    cfg: M3Config,
    cache: PagedCache | None = None,
    page_table: jax.Array | None = None,
) -> tuple[jax.Array, dict[int, jax.Array], PagedCache | None]:
    """Decoder stack up to the final norm. inputs_embeds: [B, T, D]; positions: int [B, T].

    ``cache`` (with the ``page_table`` rows of these B sequences) is read and updated.
    Returns (hidden [B, T, D], {layer: int32 [B, K, T, topk]} for MSA layers, cache).
    """
    t = cfg.text
    p = params["text"]
    angles = rope_angles(positions, t.rotary_dim, t.rope_theta)
    h = inputs_embeds
    selections = {}
    new_layers = []
    for i, lp in enumerate(p["layers"]):
        kv = None if cache is None else cache.layers[i]
        with jax.named_scope(f"layer_{i}"):
            h, block_idx, kv = decoder_layer(h, lp, angles, positions, cfg, i, kv, page_table)
        new_layers.append(kv)
        if block_idx is not None:
            selections[i] = block_idx
    if cache is not None:
        cache = PagedCache(new_layers, cache.page_table)
    return rms_norm(h, p["final_norm"], t.rms_norm_eps), selections, cache


def lm_head(params: dict, h: jax.Array) -> jax.Array:
    """[..., D] -> fp32 logits [..., V]."""
    return jnp.einsum("...d,dv->...v", h, params["text"]["lm_head"]).astype(jnp.float32)


def text_forward(
    params: dict, inputs_embeds: jax.Array, positions: jax.Array, cfg: M3Config
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """Decoder stack without a cache: fp32 logits [B, T, V] and the MSA selections."""
    h, selections, _ = text_hidden(params, inputs_embeds, positions, cfg)
    return lm_head(params, h), selections


def scatter_media(embeds: jax.Array, input_ids: jax.Array, token_id: int, features: jax.Array) -> jax.Array:
    """Replace, in row-major order, the rows of ``embeds`` whose id is ``token_id`` by ``features``."""
    mask = (input_ids == token_id).reshape(-1)
    order = jnp.clip(jnp.cumsum(mask) - 1, 0, features.shape[0] - 1)
    flat = embeds.reshape(-1, embeds.shape[-1])
    flat = jnp.where(mask[:, None], features.astype(flat.dtype)[order], flat)
    return flat.reshape(embeds.shape)


def multimodal_forward(
    params: dict,
    input_ids: jax.Array,
    pixel_values: jax.Array | None,
    pixel_values_videos: jax.Array | None,
    cfg: M3Config,
    image_grid: Grid | None,
    video_grid: Grid | None,
) -> tuple[jax.Array, dict[int, jax.Array]]:
    """input_ids [B, T] (+ optional media) -> (logits [B, T, V] fp32, MSA block ids per layer).

    Positions are plain 0..T-1 for every token, vision tokens included (M3 has no M-RoPE).
    """
    embeds = params["text"]["embed"][input_ids]
    if pixel_values is not None:
        _, tokens = encode_media(pixel_values, image_grid, params, cfg)
        embeds = scatter_media(embeds, input_ids, cfg.image_token_id, tokens)
    if pixel_values_videos is not None:
        _, tokens = encode_media(pixel_values_videos, video_grid, params, cfg)
        embeds = scatter_media(embeds, input_ids, cfg.video_token_id, tokens)
    b, n = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    return text_forward(params, embeds, positions, cfg)


forward_jit = jax.jit(multimodal_forward, static_argnames=("cfg", "image_grid", "video_grid"))
