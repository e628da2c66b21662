"""Look inside MSA: per layer and KV group, which blocks are selected and what that costs.

``probe(model, input_ids)`` runs the forward pass one layer at a time (each layer jitted, query
rows streamed in chunks of ``query_chunk``, so no [T, T] matrix exists for more than one chunk of
one layer) and records, for every MSA layer:

* ``block_indices`` int32 [B, K, T, topk] — the selections (same contract as ``forward``);
* ``recall`` fp32 [B, N, T] — share of the *dense* softmax mass of each query head that falls
  inside its group's selected blocks (1.0 = the selection loses nothing);
* ``output_error`` fp32 [B, T] — ||o_sparse - o_dense|| / ||o_dense|| of the attention output;
* ``margin`` fp32 [B, K, T] — score of the last block that made it minus the best block that did
  not (NaN when every visible block fits), i.e. how close the selection is to flipping;
* ``block_scores`` fp32 [B, K, T, nb] when ``keep_scores=True``;

and for every MoE layer ``experts`` int32 [B, T, k] (routed expert ids). Cross-group and
cross-layer Jaccard overlap and distance-from-query histograms are computed from the selections.
The residual stream is the model's own (same functions), so ``result.logits`` equals
``m3jax.forward``'s. Interventions are config fields, e.g.
``model.config.replace_text(index_topk_blocks=8)``, ``msa_force_in=((layer, block),)``, or a layer
switched to dense by editing ``layer_types`` (:func:`with_dense_layers`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.cache import cached_index_keys
from m3jax.config import FULL_ATTENTION, M3Config
from m3jax.layers import rms_norm, rope_angles
from m3jax.model import attention, decoder_layer, lm_head, project_qkv, text_hidden
from m3jax.moe import route
from m3jax.msa import kernels
from m3jax.msa import layer as msa_layer
from m3jax.msa import reference as msa
from m3jax.msa.compare import SelectionDiff, compare_selections, selection_margin, summation_bound
from m3jax.sharding import use_mesh


@dataclasses.dataclass
class LayerProbe:
    layer: int
    block_indices: np.ndarray | None = None
    recall: np.ndarray | None = None
    output_error: np.ndarray | None = None
    margin: np.ndarray | None = None
    block_scores: np.ndarray | None = None
    experts: np.ndarray | None = None


@dataclasses.dataclass
class ProbeResult:
    logits: np.ndarray  # fp32 [B, T, V]
    layers: dict[int, LayerProbe]
    block_size: int

    @property
    def msa_layers(self) -> list[int]:
        return [i for i, p in self.layers.items() if p.block_indices is not None]

    def jaccard_groups(self, layer: int) -> np.ndarray:
        """[K, K] mean Jaccard overlap of the selected-block sets of two KV groups (over batch, queries)."""
        sel = self.layers[layer].block_indices
        k = sel.shape[1]
        out = np.ones((k, k))
        for a in range(k):
            for b in range(a + 1, k):
                out[a, b] = out[b, a] = _mean_jaccard(sel[:, a], sel[:, b])
        return out

    def jaccard_layers(self) -> tuple[list[int], np.ndarray]:
        """(MSA layers, [L, L] mean Jaccard overlap of the same (batch, group, query) rows across layers)."""
        layers = self.msa_layers
        out = np.ones((len(layers), len(layers)))
        for a in range(len(layers)):
            for b in range(a + 1, len(layers)):
                out[a, b] = out[b, a] = _mean_jaccard(
                    self.layers[layers[a]].block_indices, self.layers[layers[b]].block_indices
                )
        return layers, out

    def distance_histogram(self, layer: int) -> np.ndarray:
        """counts[d] = selected blocks at distance d = own block - block (0 = the query's own block)."""
        sel = self.layers[layer].block_indices
        t = sel.shape[2]
        own = (np.arange(t) // self.block_size)[None, None, :, None]
        d = np.broadcast_to(own, sel.shape) - sel
        return np.bincount(d[sel >= 0].ravel(), minlength=int(own.max()) + 1)

    def summary(self) -> list[dict]:
        """One row per MSA layer: mean recall, mean and max output error, median margin."""
        rows = []
        for i in self.msa_layers:
            p = self.layers[i]
            rows.append({
                "layer": i,
                "recall_mean": float(np.mean(p.recall)),
                "recall_min": float(np.min(p.recall)),
                "output_error_mean": float(np.mean(p.output_error)),
                "output_error_max": float(np.max(p.output_error)),
                "margin_median": float(np.nanmedian(p.margin)) if np.isfinite(p.margin).any() else float("nan"),
            })
        return rows


def _mean_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows (all axes but the last) of |A ∩ B| / |A ∪ B| of the valid (>= 0) ids."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    vals = []
    for x, y in zip(a2, b2):
        sx, sy = set(x[x >= 0].tolist()), set(y[y >= 0].tolist())
        vals.append(len(sx & sy) / max(len(sx | sy), 1))
    return float(np.mean(vals))


def with_dense_layers(cfg: M3Config, layers) -> M3Config:
    """Config where the given MSA layers run dense causal attention (their index weights go unused)."""
    types = list(cfg.text.layer_types)
    for i in layers:
        types[i] = FULL_ATTENTION
    return cfg.replace_text(layer_types=tuple(types))


def _probe_attention(x, lp, angles, positions, cfg: M3Config, layer: int, keep_scores: bool):
    """The attention block with the probe's metrics: (out [B, T, D], metrics dict)."""
    t = cfg.text
    sparse = t.is_sparse_attention(layer)
    q, k, v, iq, ik = project_qkv(x, lp, angles, t, sparse)
    bs = t.index_block_size
    if not sparse:
        o, merge = msa.map_query_chunks(
            lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs), cfg.attention_chunk, positions, q
        )
        return jnp.einsum("btnh,nhd->btd", merge(o, 1), lp["attn"]["wo"]), {}
    b, _, n, hd = q.shape
    kh = k.shape[2]

    def chunk_fn(qp, qc, iqc):
        scores = msa_layer.scores(iqc, ik, qp, t)
        sel = msa_layer.select_from_scores(scores, qp, t, layer)
        o_sparse = msa.sparse_attention(qc, k, v, sel, qp, bs)
        o_dense = msa.dense_mask_attention(qc, k, v, None, qp, bs)
        # Dense softmax mass inside the selected blocks, per query head.
        qg = qc.reshape(b, -1, kh, n // kh, hd).astype(jnp.float32)
        logits = jnp.einsum("bckgh,bskh->bkgcs", qg, k.astype(jnp.float32), precision=msa.HIGHEST) * hd**-0.5
        s_len = k.shape[1]
        logits = jnp.where((jnp.arange(s_len)[None, :] <= qp[:, :, None])[:, None, None], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        nbk = scores.shape[-1]
        hit = jax.nn.one_hot(sel, nbk + 1, dtype=jnp.bool_)[..., :nbk].any(-2)  # [B, K, C, nb]
        mask = jnp.repeat(hit, bs, axis=-1)[..., :s_len]
        recall = jnp.sum(jnp.where(mask[:, :, None], p, 0.0), -1).reshape(b, n, -1)
        diff = (o_sparse - o_dense).astype(jnp.float32)
        err = jnp.sqrt(jnp.sum(diff**2, (2, 3)) / jnp.maximum(jnp.sum(o_dense.astype(jnp.float32) ** 2, (2, 3)), 1e-30))
        out = (o_sparse, sel, recall, err, selection_margin(scores, sel, qp, bs))
        return out + ((scores,) if keep_scores else ())

    outs, merge = msa.map_query_chunks(chunk_fn, cfg.attention_chunk, positions, q, iq)
    metrics = {"block_indices": merge(outs[1], 2), "recall": merge(outs[2], 2), "output_error": merge(outs[3], 1),
               "margin": merge(outs[4], 2)}
    if keep_scores:
        metrics["block_scores"] = merge(outs[5], 2)
    return jnp.einsum("btnh,nhd->btd", merge(outs[0], 1), lp["attn"]["wo"]), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "keep_scores"))
def _probe_layer(lp, h, positions, cfg: M3Config, layer: int, keep_scores: bool):
    """One decoder layer of the model (its own function) with the probe's attention hook."""
    t = cfg.text
    angles = rope_angles(positions, t.rotary_dim, t.rope_theta)
    attend = functools.partial(_probe_attention, keep_scores=keep_scores)
    observe = (lambda y: route(y.reshape(-1, y.shape[-1]), lp["moe"], t)[0].reshape(*y.shape[:2], -1)) \
        if t.is_moe(layer) else None
    h, aux, _ = decoder_layer(h, lp, angles, positions, cfg, layer, attend=attend, observe_mlp_input=observe)
    metrics, experts = aux if observe is not None else (aux, None)
    if experts is not None:
        metrics = {**metrics, "experts": experts}
    return h, metrics


def _shared_layer_step(cfg: M3Config, layer: int) -> tuple[M3Config, int]:
    """(config, layer) whose jitted probe step computes exactly what ``layer``'s does, chosen so that
    layers of one kind share a compilation: the first layer with the same attention and MLP kind and
    the same forced blocks; dense-attention layers also get MSA knobs they never read reset."""
    t = cfg.text

    def kind(i):
        forced = tuple(b for l, b in t.msa_force_in if l == i), tuple(b for l, b in t.msa_force_out if l == i)
        return t.is_sparse_attention(i), t.is_moe(i), forced

    first = next(i for i in range(t.num_hidden_layers) if kind(i) == kind(layer))
    if not t.is_sparse_attention(layer):
        cfg = cfg.replace_text(index_block_size=1, index_topk_blocks=t.index_local_blocks + t.index_init_blocks,
                               msa_force_in=(), msa_force_out=())
    return cfg, first


def probe(model, input_ids, *, query_chunk: int = 256, keep_scores: bool = False, progress: bool = False,
          share_compilation: bool = False) -> ProbeResult:
    """Run ``model`` on ``input_ids`` [B, T] (text) layer by layer and collect the MSA diagnostics.

    ``share_compilation=True`` compiles one step per layer kind instead of one per layer (and keeps
    the dense layers' step across MSA-knob changes): same numbers, much less compile time in sweeps.
    A model placed on a mesh (``model.mesh``: ``load_pretrained(..., mesh=)`` / ``init_random(..., mesh=)``)
    runs every layer under that mesh with its sharded parameters (expert-parallel MoE, XLA-partitioned
    attention): the same numbers as on one device.
    """
    with use_mesh(getattr(model, "mesh", None)):
        return _probe(model, input_ids, query_chunk, keep_scores, progress, share_compilation)


def _probe(model, input_ids, query_chunk, keep_scores, progress, share_compilation) -> ProbeResult:
    cfg = dataclasses.replace(model.config, attention_chunk=query_chunk)
    ids = np.asarray(input_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    params = model.params["text"]
    h = params["embed"][jnp.asarray(ids, jnp.int32)]
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    layers = {}
    it = enumerate(params["layers"])
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, total=len(params["layers"]), desc="probe", unit="layer")
    for i, lp in it:
        cfg_i, i_step = _shared_layer_step(cfg, i) if share_compilation else (cfg, i)
        h, metrics = _probe_layer(lp, h, positions, cfg_i, i_step, keep_scores)
        layers[i] = LayerProbe(i, **{k: np.asarray(v) for k, v in metrics.items()})
    h = rms_norm(h, params["final_norm"], cfg.text.rms_norm_eps)
    return ProbeResult(np.asarray(lm_head(model.params, h)), layers, cfg.text.index_block_size)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _selections_on_reference_inputs(params, ids, cfg: M3Config):
    """The reference forward, with every MSA layer's kernel selection taken on that layer's own inputs."""
    t = cfg.text
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    def attend(x, lp, angles, q_pos, cfg_, layer):
        if not t.is_sparse_attention(layer):
            return attention(x, lp, angles, q_pos, cfg_, layer)[0], None
        q, k, v, iq, ik = project_qkv(x, lp, angles, t, True)  # once: both selections read them
        o, sel_ref = msa_layer.attention(q, k, v, iq, ik, q_pos, cfg_, layer)
        out = jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"])
        force_in, force_out = msa_layer.forced_blocks(t, layer)
        ik = cached_index_keys(ik, t, iq.dtype)
        _, sel_kernel = kernels.prefill(q, k, v, iq, ik, q_pos, t, force_in, force_out)
        scale = msa.block_scores(jnp.abs(iq), jnp.abs(ik), q_pos, t.index_block_size)  # sum |iq_i ik_i| per block
        scale = jnp.max(jnp.where(jnp.isfinite(scale), scale, 0.0), axis=-1)
        return out, (sel_kernel, sel_ref, msa_layer.scores(iq, ik, q_pos, t), scale)

    _, per_layer, _ = text_hidden(params, params["text"]["embed"][ids], positions, cfg, attend=attend)
    return per_layer


def kernel_selection_agreement(model, input_ids) -> dict[int, SelectionDiff]:
    """Per MSA layer, the Mosaic GPU kernels' block selection against the reference's on the SAME inputs.

    The residual stream is the reference path's; at each MSA layer both selections are computed from
    that layer's own iq / ik, so a difference is the kernels' score arithmetic alone (accumulation
    order), never one inherited from an earlier layer's different selection. Each differing row is
    classified against the summation-order bound of :mod:`m3jax.msa.compare`. Returns {layer: SelectionDiff}.
    """
    cfg = model.config.replace(attention_impl="reference")
    ids = np.asarray(input_ids)
    ids = jnp.asarray(ids[None] if ids.ndim == 1 else ids, jnp.int32)
    with use_mesh(getattr(model, "mesh", None)):
        per_layer = _selections_on_reference_inputs(model.params, ids, cfg)
    q_pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    bound = summation_bound(cfg.text.index_head_dim)
    return {layer: compare_selections(sel_k, sel_r, scores, q_pos, cfg.text.index_block_size, scale, bound)
            for layer, (sel_k, sel_r, scores, scale) in per_layer.items()}
