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
    index keys) are written at q_pos first and the keys are the cache pages of ``page_table`` (the
    engine passes a prefill chunk only the pages up to its key window), so chunked prefill and
    decode run the same maths as the full forward.
    Returns ([B, T, D], MSA block ids int32 [B, K, T, topk] or None, updated cache or None).
    """
    t = cfg.text
    sparse = t.is_sparse_attention(layer)
    q, k, v, iq, ik = project_qkv(x, lp, angles, t, sparse)
    bs = t.index_block_size
    if kv is not None:
        kv = kv.write(page_table, q_pos, k, v, ik)
        if sparse and cfg.attention_impl == "pallas" and q.shape[1] == 1:
            o, block_idx = _msa_decode_pallas(q, iq, kv, page_table, q_pos, t)
            return jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"]), block_idx, kv
        k, v, ik_all = kv.gather(page_table)
        ik = ik_all if sparse else None

    if sparse and cfg.attention_impl == "pallas":
        from m3jax.sharding import msa_pallas_sharded  # heads split in shard_map under a mesh, else a plain call

        o, block_idx = msa_pallas_sharded(_msa_pallas, q, k, v, iq, ik, q_pos, t)
    elif sparse:
        attend = msa.dense_mask_attention if cfg.attention_impl == "dense_mask" else msa.sparse_attention

        def chunk_fn(qp, qc, iqc):
            sel = msa_select(iqc, ik, qp, t, layer)
            return attend(qc, k, v, sel, qp, bs), sel

        (o, sel), merge = msa.map_query_chunks(chunk_fn, cfg.attention_chunk, q_pos, q, iq)
        o, block_idx = merge(o, 1), merge(sel, 2)
    else:
        o, block_idx = _dense_layer_attention(q, k, v, q_pos, cfg), None
    return jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"]), block_idx, kv


def _dense_layer_attention(q, k, v, q_pos, cfg: M3Config) -> jax.Array:
    """Causal attention of a full-attention layer. Prefill: cuDNN flash attention on the kernels path
    on the GPU, else the key-blocked jnp reference. One query per row (decode) and ``dense_mask``:
    the dense-mask formulation, a single fused pass over the keys."""
    if cfg.attention_impl == "pallas" and jax.default_backend() == "gpu" and q.shape[1] > 1:
        return cudnn_causal_attention(q, k, v, q_pos)
    if cfg.attention_impl == "dense_mask" or q.shape[1] == 1:
        bs = cfg.text.index_block_size
        attend = lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs)  # noqa: E731
    else:
        attend = lambda qp, qc: causal_attention(qc, k, v, qp)  # noqa: E731
    o, merge = msa.map_query_chunks(attend, cfg.attention_chunk, q_pos, q)
    return merge(o, 1)


def cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
    """cuDNN flash attention of queries at q_pos [B, C] over keys [B, S, K, H] (key s at position s).

    cuDNN's causal mask is aligned top-left (query i sees keys <= i), which is wrong for a chunk
    that starts at position > 0, so the causal rule goes in as a boolean mask [B, 1, C, S] that
    jax turns into a bf16 bias (C * S * 2 bytes per sequence; the memory planner counts it).
    cuDNN runs 16-bit inputs only: q, k, v are cast to bf16 (the output keeps q's dtype).
    """
    mask = (jnp.arange(k.shape[1])[None, None, :] <= q_pos[:, :, None])[:, None]
    o = jax.nn.dot_product_attention(
        q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask=mask, implementation="cudnn"
    )
    return o.astype(q.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, key_block: int = 1024) -> jax.Array:
    """Dense causal GQA attention, the reference for the full-attention layers.

    q [B, C, N, H] at positions q_pos [B, C]; k, v [B, S, K, H] (key s at position s). Keys are
    visited in blocks of ``key_block`` with an online softmax (fp32), so memory is O(C * key_block)
    and not O(C * S), and the loop stops after the last block any query can see: keys past the
    chunk (a bucketed cache window, or the causal future of a query chunk) cost nothing. Heads are
    laid out [B, K, G, C, H] before the loop so both products are plain batched matmuls (the
    [B, C, K, G, H] layout ran ~3x slower on the CPU backend). Rows with no visible key give 0.
    """
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    kb = min(key_block, s_len)
    n_blocks = -(-s_len // kb)
    pad = [(0, 0), (0, 0), (0, n_blocks * kb - s_len), (0, 0)]
    qt = jnp.transpose(q.reshape(b, c, kh, g, h), (0, 2, 3, 1, 4)).astype(jnp.float32)  # [B, K, G, C, H]
    kt = jnp.pad(jnp.swapaxes(k, 1, 2), pad)  # [B, K, S_pad, H]
    vt = jnp.pad(jnp.swapaxes(v, 1, 2), pad)
    qp = q_pos[:, None, None, :, None]

    def body(j, carry):
        m, l, acc = carry
        kj = jax.lax.dynamic_slice_in_dim(kt, j * kb, kb, axis=2).astype(jnp.float32)
        vj = jax.lax.dynamic_slice_in_dim(vt, j * kb, kb, axis=2).astype(jnp.float32)
        s = jnp.einsum("bkgch,bksh->bkgcs", qt, kj, precision=msa.HIGHEST) * (h**-0.5)
        s = jnp.where(j * kb + jnp.arange(kb) <= qp, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # all-masked so far: keep exp() finite
        p = jnp.exp(s - m_ref[..., None])
        scale = jnp.exp(m - m_ref)
        acc = acc * scale[..., None] + jnp.einsum("bkgcs,bksh->bkgch", p, vj, precision=msa.HIGHEST)
        return m_new, l * scale + p.sum(-1), acc

    stats = jnp.zeros((b, kh, g, c), jnp.float32)
    visible = jnp.clip(jnp.max(q_pos) // kb + 1, 1, n_blocks)
    m, l, acc = jax.lax.fori_loop(0, visible, body, (stats - jnp.inf, stats, jnp.zeros((b, kh, g, c, h), jnp.float32)))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, c, n, h).astype(q.dtype)


def _msa_pallas(q, k, v, iq, ik, q_pos, cfg: TextConfig):
    """MSA through the Mosaic GPU kernels (m3jax/pallas): index scores, top-k, KV-block-major attention.

    The kernels take the whole query range at once (they tile it themselves); forced-in/out
    interventions are a reference-path feature (refused by ``pallas_unsupported_reason``).
    """
    from m3jax.pallas.index_scores import index_select_blocks
    from m3jax.pallas.sparse_attention import sparse_attention

    bs = cfg.index_block_size
    # Fused scores + top-k entry: the kernel's block-major scores go straight into the top-k kernel,
    # never transposed to [B, Hi, T, nb] (1 GiB per 8K-token chunk at 1M context).
    sel = index_select_blocks(iq, ik, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                              local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks)
    return sparse_attention(q, k, v, sel, q_pos, block_size=bs, implementation="kv_major"), sel


def _msa_decode_pallas(q, iq, kv: LayerCache, page_table, q_pos, cfg: TextConfig):
    """One decode token per sequence through the paged decode kernels (m3jax/pallas/decode): the
    index keys and the selected K/V pages are read in place, the cache is never gathered."""
    from m3jax.pallas.decode import decode_index_scores, sparse_decode_attention
    from m3jax.pallas.topk import select_blocks

    bs = cfg.index_block_size
    seq_lens = q_pos[:, -1] + 1
    scores = decode_index_scores(iq, kv.ik, page_table, seq_lens, block_size=bs)
    # msa_force_in / msa_force_out never reach here (pallas_unsupported_reason refuses them).
    sel = select_blocks(scores, q_pos, block_size=bs, topk=cfg.index_topk_blocks,
                        local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks,
                        implementation="pallas")
    return sparse_decode_attention(q, kv.k, kv.v, page_table, sel, seq_lens, block_size=bs), sel


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


def mlp_block(y: jax.Array, lp: dict, cfg: TextConfig, layer: int, moe_impl: str = "auto") -> jax.Array:
    """Dense SwiGLU-OAI MLP or the MoE block. y: [B, T, D] (already normed)."""
    if cfg.is_moe(layer):
        b, n, d = y.shape
        return moe_sorted(y.reshape(b * n, d), lp["moe"], cfg, impl=moe_impl).reshape(b, n, d)
    return dense_mlp(y, lp["mlp"], cfg)


def decoder_layer(h, lp, angles, q_pos, cfg: M3Config, i: int, kv=None, page_table=None):
    t = cfg.text
    a, block_idx, kv = attention(rms_norm(h, lp["input_norm"], t.rms_norm_eps), lp, angles, q_pos, cfg, i, kv, page_table)
    h = h + a
    return h + mlp_block(rms_norm(h, lp["post_attn_norm"], t.rms_norm_eps), lp, t, i, cfg.moe_impl), block_idx, kv


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
