"""MiniMax-M3 forward pass: pure functions over the parameter tree of :mod:`m3jax.params`.

Reads top to bottom as the architecture (docs/ARCHITECTURE.md §1):

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
import numpy as np
from jax.sharding import NamedSharding

from m3jax import sharding
from m3jax.cache import LayerCache, PagedCache
from m3jax.config import M3Config, TextConfig
from m3jax.layers import apply_rope, matmul_precision, rms_norm, rope_angles
from m3jax.moe import dense_mlp, dequantize_layer, linear, linears, moe_sorted
from m3jax.msa import kernels as msa_kernels, layer as msa_layer, reference as msa
from m3jax.pallas import verdicts
from m3jax.vision import Grid, encode_media


def check_input_ids(input_ids, t: TextConfig, name: str = "input_ids") -> np.ndarray:
    """``input_ids`` as a host int32 [B, T] array (a 1-D sequence is B = 1), checked before anything runs:
    integers, at least one token, ids in ``[0, vocab_size)`` (an embedding lookup clamps an id outside,
    so a bad id would give a wrong answer, not an error), at most ``max_position_embeddings`` tokens.
    ValueError naming ``name``."""
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise ValueError(f"{name} must be an integer [B, T] array, got {ids.dtype} {ids.shape}")
    if ids.size == 0:
        raise ValueError(f"{name} of shape {ids.shape}: need at least one sequence of at least one token")
    bad = (ids < 0) | (ids >= t.vocab_size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: token id {int(ids[where])} at {where} is out of range [0, {t.vocab_size})")
    if ids.shape[1] > t.max_position_embeddings:
        raise ValueError(f"{name}: sequence of {ids.shape[1]} tokens exceeds max_position_embeddings="
                         f"{t.max_position_embeddings}")
    return ids.astype(np.int32)


def _norm_rope(parts: list, angles: jax.Array, eps: float) -> list:
    """Per-head Gemma RMSNorm, then partial RoPE, of projected heads: ``parts`` is a list of (y [B, T,
    heads, H], norm weight [H]). The heads of one size are concatenated and normed and rotated together,
    then split back: the same maths head by head, and a decode step runs one norm and one RoPE launch for
    q, k and the index q/k instead of one each (benchmarks/RESULTS.md#decode-launches-2026-12-07)."""
    out = [None] * len(parts)
    for size in dict.fromkeys(y.shape[-1] for y, _ in parts):
        idx = [i for i, (y, _) in enumerate(parts) if y.shape[-1] == size]
        heads = [parts[i][0].shape[2] for i in idx]
        y = jnp.concatenate([parts[i][0] for i in idx], axis=2)
        w = jnp.concatenate([jnp.broadcast_to(parts[i][1], (n, size)) for i, n in zip(idx, heads)])
        done = apply_rope(rms_norm(y, w, eps), angles)
        for i, piece in zip(idx, jnp.split(done, np.cumsum(heads)[:-1].tolist(), axis=2)):
            out[i] = piece
    return out


def _index_parts(iq: jax.Array, ik: jax.Array, p: dict) -> list:
    """The MSA index q [B, T, Hi, Hx] and k [B, T, Hx] projections with their norm weights, for
    :func:`_norm_rope` (k as one head)."""
    return [(iq, p["q_norm"]), (ik[:, :, None], p["k_norm"])]


def index_branch(x: jax.Array, p: dict, angles: jax.Array, cfg: TextConfig,
                 impl: str = "ragged_dot") -> tuple[jax.Array, jax.Array]:
    """MSA index q/k. x: [B, T, D] -> iq [B, T, Hi, Hx], ik [B, T, Hx] (post norm and RoPE).
    ``impl``: MXFP8 weights' matmuls (:func:`m3jax.moe.linear`)."""
    iq, ik = _norm_rope(_index_parts(*linears(x, (p["wq"], p["wk"]), impl), p), angles, cfg.rms_norm_eps)
    return iq, ik[:, :, 0]


def project_qkv(x: jax.Array, lp: dict, angles: jax.Array, cfg: TextConfig, sparse: bool, impl: str = "ragged_dot"):
    """q [B,T,N,H], k, v [B,T,K,H] (q/k normed and rotated) and, on MSA layers, iq [B,T,Hi,Hx], ik [B,T,Hx].
    ``impl``: the matmuls' kernels (:func:`m3jax.moe.linears`)."""
    p, ip = lp["attn"], lp["index"] if sparse else None
    # every projection of x in one linears call, so that a decode step shares launches among them: the
    # dense gemv's one launch for the bf16 weights it takes, one per shape for MXFP8 weights
    q, k, v, *index = linears(x, (p["wq"], p["wk"], p["wv"], *((ip["wq"], ip["wk"]) if sparse else ())), impl,
                              dense_gemv=True)
    parts = [(q, p["q_norm"]), (k, p["k_norm"]), *(_index_parts(*index, ip) if sparse else [])]
    q, k, *index = _norm_rope(parts, angles, cfg.rms_norm_eps)
    iq, ik = (index[0], index[1][:, :, 0]) if sparse else (None, None)
    return q, k, v, iq, ik


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
    decode run the same maths as the full forward; :func:`m3jax.msa.layer.attend` picks how the pages
    are read.
    Returns ([B, T, D], MSA block ids int32 [B, K, T, topk] or None, updated cache or None).
    """
    t = cfg.text
    sparse = t.is_sparse_attention(layer)
    q, k, v, iq, ik = project_qkv(x, lp, angles, t, sparse, cfg.moe_impl)

    if kv is not None:
        kv = kv.write(page_table, q_pos, k, v, ik)
    o, block_idx = msa_layer.attend(q, k, v, iq, ik, q_pos, cfg, layer, kv, page_table, full=_dense_layer_attention)
    return linear(o, lp["attn"]["wo"], cfg.moe_impl, in_axes=2), block_idx, kv  # [B, T, N, H] @ wo [N, H, D]


def _dense_layer_attention(q, k, v, q_pos, cfg: M3Config) -> jax.Array:
    """Causal attention of a full-attention layer over contiguous keys, as ``cfg``'s MSA variant says
    (:attr:`m3jax.msa.layer.Variant.dense`). Prefill: cuDNN flash attention (``"flash"``) on the GPU for
    16-bit models, else the key-blocked jnp reference. One query per row (decode) and ``"dense_mask"``:
    the dense-mask formulation, a single fused pass over the keys."""
    dense = msa_layer.variant(cfg).dense
    # cuDNN runs 16-bit inputs only: an fp32 model keeps the exact jnp path (layers.matmul_precision)
    fast = dense == "flash" and jax.default_backend() == "gpu" and q.dtype != jnp.float32
    if fast and q.shape[1] > 1:
        return cudnn_causal_attention(q, k, v, q_pos)
    if dense == "dense_mask" or q.shape[1] == 1:
        bs = cfg.text.index_block_size
        attend = lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs)  # noqa: E731
    else:
        attend = lambda qp, qc: causal_attention(qc, k, v, qp)  # noqa: E731
    o, merge = msa.map_query_chunks(attend, cfg.attention_chunk, q_pos, q)
    return merge(o, 1)


# Keys per unmasked piece of a chunk's prefix (cudnn_causal_attention): cuDNN's PADDING mask (a key
# length) runs below its unmasked rate, so the prefix is cut into unmasked pieces of this many keys, and
# only the remainder (fewer) takes the key length; each piece is long enough to keep cuDNN at its rate
# and its copy and merge small beside it (benchmarks/RESULTS.md#chunk-pieces).
PREFIX_PIECE = 131072


def cudnn_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                           implementation: str | None = "cudnn", piece: int = PREFIX_PIECE) -> jax.Array:
    """Flash attention (cuDNN) of a chunk of queries over its prefix and itself, without a mask.

    q [B, C, N, H] at consecutive positions q_pos[b] = start_b + 0..C-1; keys k, v [B, S, K, H]
    (key s at position s, S >= C). cuDNN's causal rule is aligned top-left (query i sees keys <= i)
    and a boolean mask becomes a dense [C, S] bias with no tile skipped, so the attention is split
    into parts merged by their log-sum-exps (:func:`msa.lse_merge`):

    * the diagonal, the C keys from s0, causally (C x C: top-left is the right alignment). s0 = start,
      except where the chunk runs past the key window (the last chunk, padded, at the capacity): there
      s0 = S - C, the queries are shifted down by d = start - s0 rows for the diagonal (row i + d sees
      diagonal keys <= i + d, i.e. positions <= start + i) and shifted back; the rows that wrap round
      are padding at positions >= S;
    * the prefix, keys [0, s0), unmasked: ``n = s0 // piece`` pieces of ``piece`` keys ending at s0
      (keys [s0 - (j + 1) piece, s0 - j piece), in a loop of n steps: each piece's keys are copied, a
      small cost beside its attention), then the head [0, s0 - n piece) as one call over the first
      ``min(piece, S)`` keys with ``key_value_seq_lengths`` (cuDNN stops there). A row of the batch with
      fewer pieces than another drops the extra ones' parts.

    ``implementation``: "cudnn" (GPU; q, k, v run as bf16, the output keeps q's dtype) or
    None / "xla" (any backend, inputs' dtype: the CPU tests check it against :func:`causal_attention`).
    ``piece``: keys per unmasked prefix piece (static). Forward only (:func:`_forward_only`).
    """
    c, s_len = q.shape[1], k.shape[1]
    if s_len < c:
        raise ValueError(f"{s_len} keys for a chunk of {c} queries")
    if piece < 1:
        raise ValueError(f"piece={piece}: need at least one key per prefix piece")
    q, k, v = _forward_only(q, k, v)
    start = q_pos[:, 0].astype(jnp.int32)
    s0 = jnp.minimum(start, s_len - c)
    d = (start - s0)[:, None]
    rows = jnp.arange(c)[None]

    def take_rows(x, idx):  # x [B, C or S, ...] -> rows idx [B, n] of axis 1
        return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)

    def merge(a, b):  # two (o fp32, lse fp32) parts -> one
        return msa.lse_merge(jnp.stack([a[0], b[0]], axis=-2), jnp.stack([a[1], b[1]], axis=-1), axis=-1)

    key_rows = s0[:, None] + rows
    o_diag, lse_diag = _attention_with_lse(take_rows(q, (rows - d) % c), take_rows(k, key_rows),
                                           take_rows(v, key_rows), implementation, causal=True)
    out = (take_rows(o_diag, (rows + d) % c).astype(jnp.float32), take_rows(lse_diag, (rows + d) % c))

    # The head: an empty one (s0 a multiple of the piece) still gets one key, so no backend sees a zero
    # length; its LSE is dropped.
    width = min(piece, s_len)
    n = s0 // width
    head = s0 - n * width
    o_head, lse_head = _attention_with_lse(q, k[:, :width], v[:, :width], implementation, causal=False,
                                           kv_len=jnp.maximum(head, 1))
    out = merge(out, (o_head.astype(jnp.float32), jnp.where((head > 0)[:, None, None], lse_head, msa.NEG_INF)))

    def body(j, acc):  # piece j: keys [s0 - (j + 1) width, s0 - j width), unmasked
        first = jnp.maximum(s0 - (j + 1) * width, 0)[:, None] + jnp.arange(width)[None]
        o_j, lse_j = _attention_with_lse(q, take_rows(k, first), take_rows(v, first), implementation, causal=False)
        return merge(acc, (o_j.astype(jnp.float32), jnp.where((j < n)[:, None, None], lse_j, msa.NEG_INF)))

    if width <= s_len - c:  # else s0 <= S - C < width: no piece, and no call compiled for one
        out = jax.lax.fori_loop(0, jnp.max(n), body, out)
    return out[0].astype(q.dtype)


def _attention_with_lse(q, k, v, implementation: str | None, *, causal: bool, kv_len=None):
    """softmax(q k^T / sqrt(H)) v and its fp32 natural-log LSE [B, T, N] (GQA, keys unexpanded).

    On cuDNN the LSE comes from the private ``fused_attention_stablehlo.dot_product_attention``:
    ``jax.nn.dot_product_attention(return_residual=True)`` casts it to the output dtype (bf16 here),
    whose 8-bit mantissa puts an error of ~1e-2 on each part's weight. The XLA path returns it in the
    inputs' dtype (fp32 for fp32 inputs)."""
    b, t, _, h = q.shape
    lengths = None if kv_len is None else (jnp.full((b,), t, jnp.int32), kv_len.astype(jnp.int32))
    if implementation == "cudnn":
        from jax._src.cudnn import fused_attention_stablehlo as fa

        mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK if kv_len is None else fa.MaskType.PADDING
        bf = lambda x: x.astype(jnp.bfloat16)
        o, lse = fa.dot_product_attention(bf(q), bf(k), bf(v), None, None, *(lengths or (None, None)),
                                          scale=h**-0.5, mask_type=mask, return_residual=True)
        return o, jnp.swapaxes(lse, 1, 2)  # cuDNN's residual is [B, N, T]
    o, lse = jax.nn.dot_product_attention(q, k, v, is_causal=causal, key_value_seq_lengths=None if kv_len is None
                                          else lengths[1], implementation=implementation, return_residual=True)
    return o, lse.astype(jnp.float32)


@jax.custom_vjp
def _forward_only(q, k, v):
    """The identity on :func:`cudnn_causal_attention`'s inputs, with its gradient refused: both
    backends drop the LSE's cotangent (cuDNN's VJP ignores it, XLA's path stops it), so a gradient
    through the LSE merge would be silently wrong. Nothing differentiates the full-attention layers
    through this path (training attends through its own hook, m3jax.train)."""
    return q, k, v


def _forward_only_bwd(_, g):
    raise NotImplementedError("cudnn_causal_attention is forward only (its parts' LSEs carry no gradient); "
                              "differentiate through causal_attention or msa.dense_mask_attention instead")


_forward_only.defvjp(lambda q, k, v: ((q, k, v), None), _forward_only_bwd)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, key_block: int = 1024) -> jax.Array:
    """Dense causal GQA attention, the reference for the full-attention layers.

    q [B, C, N, H] at positions q_pos [B, C]; k, v [B, S, K, H] (key s at position s). Keys are
    visited in blocks of ``key_block`` with an online softmax (fp32), so memory is O(C * key_block)
    and not O(C * S), and the loop stops after the last block any query can see: keys past the
    chunk (a bucketed cache window, or the causal future of a query chunk) cost nothing. Heads are
    laid out [B, K, G, C, H] before the loop so both products are plain batched matmuls (on the CPU
    backend the faster of the two layouts). Rows with no visible key give 0.
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
    _, l, acc = jax.lax.fori_loop(0, visible, body, (stats - jnp.inf, stats, jnp.zeros((b, kh, g, c, h), jnp.float32)))
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, c, n, h).astype(q.dtype)


def mlp_block(y: jax.Array, lp: dict, cfg: TextConfig, layer: int, moe_impl: str = "auto") -> jax.Array:
    """Dense SwiGLU-OAI MLP or the MoE block. y: [B, T, D] (already normed)."""
    if cfg.is_moe(layer):
        b, n, d = y.shape
        return moe_sorted(y.reshape(b * n, d), lp["moe"], cfg, impl=moe_impl).reshape(b, n, d)
    return dense_mlp(y, lp["mlp"], cfg, moe_impl)


def check_kernels_ahead(cfg: M3Config, *, wait: bool = True) -> list[verdicts.Verdict] | verdicts.Background:
    """The self-check verdicts of every kernel this model can take on this GPU (the MSA kernels when
    ``cfg.attention_impl`` is "auto" or "pallas", the grouped GEMM when an MoE layer's ``moe_impl`` is
    not "ragged_dot"), those missing run now in one batch of side-by-side workers
    (:func:`m3jax.pallas.verdicts.check_kernels`). The kernel choices made while tracing then read
    verdicts: without this, the first program's trace waited for the grouped GEMM's canaries and a
    decode program's for the decode kernels', one worker after the other. [] off the GPU. ``wait=False``:
    the missing ones run in the background (:class:`m3jax.pallas.verdicts.Background`, to be confirmed)."""
    t = cfg.text
    kernels: dict[str, int | None] = {}
    if cfg.attention_impl in ("auto", "pallas"):
        kernels.update(dict.fromkeys(msa_kernels.canary_kernels(t), t.index_block_size))
    if cfg.moe_impl != "ragged_dot" and any(t.is_moe(i) for i in range(t.num_hidden_layers)):
        kernels["grouped_matmul"] = None
    return verdicts.check_kernels(kernels, wait=wait)


def decoder_layer(h, lp, angles, q_pos, cfg: M3Config, i: int, kv=None, page_table=None, attend=None,
                  observe_mlp_input=None, mlp=None):
    """One decoder layer: h + attn(norm(h)), then + mlp_or_moe(norm(.)). h: [B, T, D].

    ``attend(x, lp, angles, q_pos, cfg, layer) -> (out [B, T, D], aux)`` replaces the attention block
    (training adds the indexer loss, the probe its metrics); by default it is :func:`attention` and
    aux the MSA block ids (None on dense layers). ``observe_mlp_input(y)`` sees the MLP's normed input
    (the probe routes it); its result is returned as ``(aux, observed)``. ``mlp(y, lp, cfg, layer) ->
    [B, T, D]`` replaces the MLP / MoE block (:func:`mlp_block`, with the same ``lp``: a dense MLP's
    MXFP8 weights dequantised where ``attend`` is given, the MoE's kept MXFP8). Returns (h, aux, kv).
    """
    t = cfg.text
    dtype = lp["input_norm"].dtype  # the model's; MXFP8 weights are fp8 + scales
    if attend is not None:  # a hook reads the attention weights as arrays (MoE weights stay MXFP8)
        lp = dequantize_layer(lp, dtype)
    with matmul_precision(dtype):  # fp32 weights: fp32 matmuls on the GPU too
        x = rms_norm(h, lp["input_norm"], t.rms_norm_eps)
        if attend is None:
            a, aux, kv = attention(x, lp, angles, q_pos, cfg, i, kv, page_table)
        else:
            a, aux = attend(x, lp, angles, q_pos, cfg, i)
        h = h + a
        y = rms_norm(h, lp["post_attn_norm"], t.rms_norm_eps)
        if observe_mlp_input is not None:
            aux = (aux, observe_mlp_input(y))
        out = mlp_block(y, lp, t, i, cfg.moe_impl) if mlp is None else mlp(y, lp, cfg, i)
        return h + out, aux, kv


def text_hidden(
    params: dict,
    inputs_embeds: jax.Array,
    positions: jax.Array,
    cfg: M3Config,
    cache: PagedCache | None = None,
    page_table: jax.Array | None = None,
    attend=None,
) -> tuple[jax.Array, dict[int, jax.Array], PagedCache | None]:
    """Decoder stack up to the final norm. inputs_embeds: [B, T, D]; positions: int [B, T].

    ``cache`` (with the ``page_table`` rows of these B sequences) is read and updated; ``attend`` is
    :func:`decoder_layer`'s hook. Returns (hidden [B, T, D], {layer: aux} for the layers whose aux is
    not None — by default the MSA layers' block ids int32 [B, K, T, topk] —, cache).
    """
    t = cfg.text
    p = params["text"]
    angles = rope_angles(positions, t.rotary_dim, t.rope_theta)
    h = inputs_embeds
    per_layer = {}
    new_layers = []
    for i, lp in enumerate(p["layers"]):
        kv = None if cache is None else cache.layers[i]
        with jax.named_scope(f"layer_{i}"):
            h, aux, kv = decoder_layer(h, lp, angles, positions, cfg, i, kv, page_table, attend)
        new_layers.append(kv)
        if aux is not None:
            per_layer[i] = aux
    if cache is not None:
        cache = PagedCache(new_layers, cache.page_table)
    return rms_norm(h, p["final_norm"], t.rms_norm_eps), per_layer, cache


def lm_head(params: dict, h: jax.Array) -> jax.Array:
    """[..., D] -> fp32 logits [..., V]."""
    w = params["text"]["lm_head"]
    with matmul_precision(w.dtype):
        return jnp.einsum("...d,dv->...v", h, w).astype(jnp.float32)


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


def sharded_forward(params: dict, input_ids, cfg: M3Config, mesh, rules=sharding.RULES):
    """Text forward (logits [B, T, V] fp32) as one ``jax.jit`` with in/out shardings from the rules."""
    ids = jnp.asarray(input_ids, jnp.int32)
    batch = NamedSharding(mesh, sharding.spec_for(("batch", "seq"), ids.shape, mesh, rules))
    logits = NamedSharding(mesh, sharding.spec_for(("batch", "seq", "act_vocab"), ids.shape + (cfg.text.vocab_size,),
                                                   mesh, rules))
    fn = jax.jit(
        lambda p, i: multimodal_forward(p, i, None, None, cfg, None, None),
        in_shardings=(sharding.param_shardings(cfg, mesh, rules, sharding.weights_of(params)), batch),
        out_shardings=(logits, None),
    )
    with jax.set_mesh(mesh):
        return fn(params, jax.device_put(ids, batch))
