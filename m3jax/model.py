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


def attention(
    x: jax.Array,
    lp: dict,
    angles: jax.Array,
    q_pos: jax.Array,
    cfg: M3Config,
    sparse: bool,
    kv: LayerCache | None = None,
    page_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, LayerCache | None]:
    """One attention block. x: [B, T, D] (already normed) at positions q_pos [B, T].

    Without a cache the keys are these T tokens (key s at position s). With ``kv`` the new K/V (and
    index keys) are written at q_pos first and the keys are the sequence's whole cache, so chunked
    prefill and decode run the same maths as the full forward.
    Returns ([B, T, D], MSA block ids int32 [B, K, T, topk] or None, updated cache or None).
    """
    t = cfg.text
    p = lp["attn"]
    q = _qk_heads(x, p["wq"], p["q_norm"], angles, t.rms_norm_eps)
    k = _qk_heads(x, p["wk"], p["k_norm"], angles, t.rms_norm_eps)
    v = jnp.einsum("btd,dkh->btkh", x, p["wv"])
    iq = ik = None
    if sparse:
        iq, ik = index_branch(x, lp["index"], angles, t)
    if kv is not None:
        kv = kv.write(page_table, q_pos, k, v, ik)
        k, v, ik_all = kv.gather(page_table)
        ik = ik_all if sparse else None
    bs = t.index_block_size

    if sparse:
        attend = msa.dense_mask_attention if cfg.attention_impl == "dense_mask" else msa.sparse_attention

        def chunk_fn(qp, qc, iqc):
            sel = msa.select_blocks(
                msa.block_scores(iqc, ik, qp, bs),
                qp,
                block_size=bs,
                topk=t.index_topk_blocks,
                local_blocks=t.index_local_blocks,
                init_blocks=t.index_init_blocks,
            )
            return attend(qc, k, v, sel, qp, bs), sel

        (o, sel), merge = msa.map_query_chunks(chunk_fn, cfg.attention_chunk, q_pos, q, iq)
        o, block_idx = merge(o, 1), merge(sel, 2)
    else:
        o, merge = msa.map_query_chunks(
            lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs), cfg.attention_chunk, q_pos, q
        )
        o, block_idx = merge(o, 1), None
    return jnp.einsum("btnh,nhd->btd", o, p["wo"]), block_idx, kv


def decoder_layer(h, lp, angles, q_pos, cfg: M3Config, i: int, kv=None, page_table=None):
    t = cfg.text
    x = rms_norm(h, lp["input_norm"], t.rms_norm_eps)
    a, block_idx, kv = attention(x, lp, angles, q_pos, cfg, t.is_sparse_attention(i), kv, page_table)
    h = h + a
    y = rms_norm(h, lp["post_attn_norm"], t.rms_norm_eps)
    if t.is_moe(i):
        b, n, d = y.shape
        f = moe_sorted(y.reshape(b * n, d), lp["moe"], t).reshape(b, n, d)
    else:
        f = dense_mlp(y, lp["mlp"], t)
    return h + f, block_idx, kv


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
