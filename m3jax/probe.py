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
* ``mass_by_distance`` / ``selected_mass_by_distance`` fp32 [nb] — dense softmax mass at block
  distance d = own block - key block, summed over batch, query heads and queries, and the part of it
  inside the selected blocks (:meth:`ProbeResult.recall_by_distance`);

and for every MoE layer ``experts`` int32 [B, T, k] (routed expert ids). Cross-group and
cross-layer Jaccard overlap and distance-from-query histograms are computed from the selections.
The residual stream is the model's own (same functions, the kernels on ``attention_impl="pallas"``),
so ``result.logits`` equals ``m3jax.forward``'s. Per query chunk, dense attention is streamed over key
tiles ([heads, chunk, key tile] at a time) and the index scores are [index heads, chunk, S]: no [T, T]
array, sized for 128K tokens on one GPU. Interventions are config fields, e.g.
``model.config.replace_text(index_topk_blocks=8)``, ``msa_force_in=((layer, block),)``,
``msa_selection_rules=((layer, name),)`` (a rule of :func:`m3jax.msa.layer.register_selection_rule`),
or a layer switched to dense by editing ``layer_types`` (:func:`with_dense_layers`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.cache import cached_index_keys
from m3jax.distributed import to_host
from m3jax.config import FULL_ATTENTION, M3Config, UnsupportedConfigError
from m3jax.layers import rms_norm, rope_angles
from m3jax.model import attention, check_input_ids, decoder_layer, lm_head, project_qkv, text_hidden
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
    mass_by_distance: np.ndarray | None = None
    selected_mass_by_distance: np.ndarray | None = None


@dataclasses.dataclass
class ProbeResult:
    logits: np.ndarray  # fp32 [B, T, V]
    layers: dict[int, LayerProbe]
    block_size: int

    @property
    def msa_layers(self) -> list[int]:
        return [i for i, p in self.layers.items() if p.block_indices is not None]

    def _msa_layer(self, layer: int) -> LayerProbe:
        """The probe of MSA layer ``layer`` (ValueError naming the layers that have one)."""
        p = self.layers.get(layer)
        if p is None or p.block_indices is None:
            what = "not probed" if p is None else "full attention (no selection)"
            raise ValueError(f"layer {layer!r} is {what}; MSA layers: {self.msa_layers}")
        return p

    def jaccard_groups(self, layer: int) -> np.ndarray:
        """[K, K] mean Jaccard overlap of the selected-block sets of two KV groups (over batch, queries)."""
        sel = self._msa_layer(layer).block_indices
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

    def recall_by_distance(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(dense mass [nb], recall [nb]) by block distance d = own block - key block, over batch, query
        heads and queries: the dense softmax mass at distance d (summed), and the share of it inside the
        selected blocks (NaN where the dense mass is 0)."""
        p = self._msa_layer(layer)
        mass = p.mass_by_distance.astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return mass, np.where(mass > 0, p.selected_mass_by_distance / mass, np.nan)

    def selection_map(self, layer: int, group: int = 0, batch: int = 0, rows: int = 128, cols: int = 128) -> np.ndarray:
        """[rows, cols] share of (query, key block) pairs selected, queries and key blocks pooled into
        at most rows x cols cells (a 128K x 2048 selection is too large to draw or store)."""
        sel = self._msa_layer(layer).block_indices  # [B, K, T, topk]
        for name, value, size in (("batch", batch, sel.shape[0]), ("group", group, sel.shape[1])):
            if not (isinstance(value, (int, np.integer)) and 0 <= value < size):
                raise ValueError(f"{name} {value!r} outside [0, {size})")
        if rows < 1 or cols < 1:
            raise ValueError(f"rows and cols must be >= 1, got {rows} x {cols}")
        sel = sel[batch, group]  # [T, topk]
        t = sel.shape[0]
        nb = -(-t // self.block_size)
        rows, cols = min(rows, t), min(cols, nb)
        r = np.repeat(np.arange(t) * rows // t, sel.shape[1])
        c = sel.ravel()
        keep = c >= 0
        counts = np.bincount(r[keep] * cols + c[keep] * cols // nb, minlength=rows * cols).reshape(rows, cols)
        per_row = np.bincount(np.arange(t) * rows // t, minlength=rows)[:, None]
        per_col = np.bincount(np.arange(nb) * cols // nb, minlength=cols)[None, :]
        return counts / (per_row * per_col)

    def distance_histogram(self, layer: int) -> np.ndarray:
        """counts[d] = selected blocks at distance d = own block - block (0 = the query's own block)."""
        sel = self._msa_layer(layer).block_indices
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
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(types):
            raise ValueError(f"with_dense_layers: layer {i!r} is not a layer index in [0, {len(types)})")
        types[i] = FULL_ATTENTION
    return cfg.replace_text(layer_types=tuple(types))


def dense_block_mass(q, k, v, q_pos, block_size: int, key_tile: int = 4096):
    """Dense causal attention of one query chunk, streamed over key tiles (no [C, S] array).

    q [B, C, N, H] at q_pos [B, C]; k, v [B, S, K, H] (key s at position s). Each tile of ``key_tile``
    keys (rounded to whole blocks) gives its softmax-normalised output, LSE and per-block mass; the
    tiles are merged by :func:`m3jax.msa.reference.lse_merge`, and a tile's block mass is rescaled by
    exp(lse_tile - lse). Tiles wholly after the chunk's last query are skipped (``lax.cond``), so the
    work is the causal half. Returns (o fp32 [B, C, N, H], mass fp32 [B, N, C, nb]): mass[b, n, c, j]
    is query head n's dense softmax mass in key block j (rows sum to 1).
    """
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    nb = -(-s_len // block_size)
    per_tile = max(1, min(key_tile // block_size, nb))
    tile, n_tiles = per_tile * block_size, -(-nb // per_tile)
    pad = n_tiles * tile - s_len  # padded keys sit after every query: masked as future keys

    def tiles(x):  # [B, S, K, H] -> [n_tiles, B, tile, K, H]
        x = jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)])
        return jnp.moveaxis(x.reshape(b, n_tiles, tile, kh, h), 1, 0)

    qg = q.reshape(b, c, kh, g, h).astype(jnp.float32)
    last = jnp.max(q_pos)

    def compute(start, kt, vt):
        logits = jnp.einsum("bckgh,bskh->bkgcs", qg, kt.astype(jnp.float32), precision=msa.HIGHEST) * h**-0.5
        ok = (start + jnp.arange(tile))[None, None, :] <= q_pos[:, :, None]  # [B, C, tile]
        logits = jnp.where(ok[:, None, None], logits, msa.NEG_INF)
        p = msa.softmax_or_zero(logits)  # [B, K, G, C, tile]
        o = jnp.einsum("bkgcs,bskh->bckgh", p, vt.astype(jnp.float32), precision=msa.HIGHEST)
        lse = jnp.moveaxis(jax.nn.logsumexp(logits, axis=-1), 3, 1).reshape(b, c, n)
        mass = p.reshape(b, n, c, per_tile, block_size).sum(-1)
        return o.reshape(b, c, n, h), lse, mass

    if n_tiles == 1:  # every key in one tile (short rows): the plain softmax, nothing to merge or skip
        o, _, mass = compute(0, *(jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (k, v)))
        return o, mass[..., :nb]

    def one(args):
        start, kt, vt = args
        empty = lambda: (jnp.zeros((b, c, n, h), jnp.float32), jnp.full((b, c, n), msa.NEG_INF),  # noqa: E731
                         jnp.zeros((b, n, c, per_tile), jnp.float32))
        return jax.lax.cond(start <= last, lambda: compute(start, kt, vt), empty)

    starts = jnp.arange(n_tiles, dtype=jnp.int32) * tile
    o_t, lse_t, mass_t = jax.lax.map(one, (starts, tiles(k), tiles(v)))
    o, lse = msa.lse_merge(o_t, lse_t, axis=0)
    w = jnp.exp(lse_t - lse[None])  # [n_tiles, B, C, N]: 0 for skipped tiles
    mass = mass_t * jnp.moveaxis(w, 3, 2)[..., None]  # [n_tiles, B, N, C, per_tile]
    mass = jnp.moveaxis(mass, 0, 3).reshape(b, n, c, n_tiles * per_tile)[..., :nb]
    return o, mass


def _by_distance(values, q_pos, valid, block_size: int):
    """Sum of values [B, C, nb] (per query and key block) over batch and valid queries, binned by the
    block distance own block - key block: fp32 [nb] (future blocks dropped)."""
    nb = values.shape[-1]
    d = (q_pos // block_size)[:, :, None] - jnp.arange(nb)[None, None, :]
    keep = (d >= 0) & valid[:, :, None]
    return jnp.zeros(nb, jnp.float32).at[jnp.where(keep, d, 0).ravel()].add(jnp.where(keep, values, 0.0).ravel())


def _probe_attention(x, lp, angles, positions, cfg: M3Config, layer: int, keep_scores: bool, key_tile: int):
    """The attention block with the probe's metrics: (out [B, T, D], metrics dict).

    Selections come from the model's own path: a variant that takes the whole sequence at once (the
    kernels) over it, else the jnp reference per query chunk. The metrics against
    dense attention are then computed per query chunk, streamed over key tiles (:func:`dense_block_mass`).
    """
    t = cfg.text
    if not t.is_sparse_attention(layer):
        return attention(x, lp, angles, positions, cfg, layer)[0], {}
    q, k, v, iq, ik = project_qkv(x, lp, angles, t, True)
    bs = t.index_block_size
    b, s_len, n, _ = q.shape
    kh = k.shape[2]
    nb = -(-s_len // bs)
    valid = jnp.ones(positions.shape, jnp.bool_)  # map_query_chunks pads with False: padding rows are not summed
    variant = msa_layer.layer_variant(cfg, layer)  # a layer with its own selection rule: the jnp path
    kernels_path = variant.whole_chunk
    if kernels_path:
        reason = variant.unsupported_reason and variant.unsupported_reason(t, q.dtype)
        if reason:
            raise UnsupportedConfigError(f"probe with attention_impl={cfg.attention_impl!r}: {reason}")
        o_model, sel_model = msa_layer.attention(q, k, v, iq, ik, positions, cfg, layer)
        extra = (o_model, jnp.swapaxes(sel_model, 1, 2))  # per query along axis 1, as map_query_chunks splits
    else:
        extra = ()

    def chunk_fn(qp, qc, iqc, vc, *model_chunk):
        scores = msa_layer.scores(iqc, ik, qp, t)
        if kernels_path:
            o_sparse, sel = model_chunk[0], jnp.swapaxes(model_chunk[1], 1, 2)
        else:
            sel = msa_layer.select_from_scores(scores, qp, t, layer)
            o_sparse = msa.sparse_attention(qc, k, v, sel, qp, bs)
        o_dense, mass = dense_block_mass(qc, k, v, qp, bs, key_tile)  # mass [B, N, C, nb]
        hit = jax.nn.one_hot(sel, nb + 1, dtype=jnp.bool_)[..., :nb].any(-2)  # [B, K, C, nb]
        mass_g = mass.reshape(b, kh, n // kh, -1, nb)
        recall = jnp.sum(jnp.where(hit[:, :, None], mass_g, 0.0), -1).reshape(b, n, -1)
        diff = (o_sparse - o_dense).astype(jnp.float32)
        err = jnp.sqrt(jnp.sum(diff**2, (2, 3)) / jnp.maximum(jnp.sum(o_dense**2, (2, 3)), 1e-30))
        by_dist = (_by_distance(mass.sum(1), qp, vc, bs),  # summed over query heads
                   _by_distance(jnp.where(hit[:, :, None], mass_g, 0.0).sum((1, 2)), qp, vc, bs))
        out = (o_sparse, sel, recall, err, selection_margin(scores, sel, qp, bs), by_dist)
        return out + ((scores,) if keep_scores else ())

    outs, merge = msa.map_query_chunks(chunk_fn, cfg.attention_chunk, positions, q, iq, valid, *extra)
    metrics = {"block_indices": merge(outs[1], 2), "recall": merge(outs[2], 2), "output_error": merge(outs[3], 1),
               "margin": merge(outs[4], 2), "mass_by_distance": outs[5][0].sum(0),
               "selected_mass_by_distance": outs[5][1].sum(0)}
    if keep_scores:
        metrics["block_scores"] = merge(outs[6], 2)
    return jnp.einsum("btnh,nhd->btd", merge(outs[0], 1), lp["attn"]["wo"]), metrics


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "keep_scores", "key_tile"))
def _probe_layer(lp, h, positions, cfg: M3Config, layer: int, keep_scores: bool, key_tile: int):
    """One decoder layer of the model (its own function) with the probe's attention hook."""
    t = cfg.text
    angles = rope_angles(positions, t.rotary_dim, t.rope_theta)
    attend = functools.partial(_probe_attention, keep_scores=keep_scores, key_tile=key_tile)
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
    the same forced blocks and selection rule; dense-attention layers also get MSA knobs they never read reset."""
    t = cfg.text

    def kind(i):
        forced = tuple(b for l, b in t.msa_force_in if l == i), tuple(b for l, b in t.msa_force_out if l == i)
        return t.is_sparse_attention(i), t.is_moe(i), forced, msa_layer.selection_rule(t, i)

    first = next(i for i in range(t.num_hidden_layers) if kind(i) == kind(layer))
    if not t.is_sparse_attention(layer):
        cfg = cfg.replace_text(index_block_size=1, index_topk_blocks=t.index_local_blocks + t.index_init_blocks,
                               msa_force_in=(), msa_force_out=(), msa_selection_rules=())
    return cfg, first


def probe(model, input_ids, *, query_chunk: int = 256, keep_scores: bool = False, progress: bool = False,
          share_compilation: bool = False, key_tile: int = 4096) -> ProbeResult:
    """Run ``model`` on ``input_ids`` [B, T] (text) layer by layer and collect the MSA diagnostics.

    ``share_compilation=True`` compiles one step per layer kind instead of one per layer (and keeps
    the dense layers' step across MSA-knob changes): same numbers, much less compile time in sweeps.
    A model placed on a mesh (``model.mesh``: ``load_pretrained(..., mesh=)`` / ``init_random(..., mesh=)``)
    runs every layer under that mesh with its sharded parameters (expert-parallel MoE, XLA-partitioned
    attention): the same numbers as on one device.

    The model's ``attention_impl`` decides where the selections come from: ``"pallas"`` runs the MSA
    layers through the kernels (the index kernels' selections, the kernels' output in the residual
    stream, cuDNN for the full-attention layers of a 16-bit model on the GPU), anything else the jnp
    reference. The metrics against dense attention are the same on both: per query chunk of
    ``query_chunk`` rows, dense softmax streamed over ``key_tile`` keys (:func:`dense_block_mass`),
    so the largest intermediate is [heads, query_chunk, key_tile] and 128K tokens fit one GPU.
    """
    with use_mesh(getattr(model, "mesh", None)):
        return _probe(model, input_ids, query_chunk, keep_scores, progress, share_compilation, key_tile)


def _probe(model, input_ids, query_chunk, keep_scores, progress, share_compilation, key_tile) -> ProbeResult:
    cfg = dataclasses.replace(model.config, attention_chunk=query_chunk)
    ids = check_input_ids(input_ids, cfg.text)
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
        h, metrics = _probe_layer(lp, h, positions, cfg_i, i_step, keep_scores, key_tile)
        # (a value split over several processes' devices is gathered: every process gets the whole result)
        layers[i] = LayerProbe(i, **{k: to_host(v) for k, v in metrics.items()})
    h = rms_norm(h, params["final_norm"], cfg.text.rms_norm_eps)
    return ProbeResult(to_host(lm_head(model.params, h)), layers, cfg.text.index_block_size)


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
    classified against the summation-order bound of :mod:`m3jax.msa.compare`. The kernels compute the stock
    selection rule, so both sides run it (a config's ``msa_selection_rules`` is left out). Returns
    {layer: SelectionDiff}.
    """
    cfg = model.config.replace(attention_impl="reference").replace_text(msa_selection_rules=())
    ids = np.asarray(input_ids)
    ids = jnp.asarray(ids[None] if ids.ndim == 1 else ids, jnp.int32)
    with use_mesh(getattr(model, "mesh", None)):
        per_layer = _selections_on_reference_inputs(model.params, ids, cfg)
    q_pos = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    bound = summation_bound(cfg.text.index_head_dim)
    return {layer: compare_selections(sel_k, sel_r, scores, q_pos, cfg.text.index_block_size, scale, bound)
            for layer, (sel_k, sel_r, scores, scale) in per_layer.items()}
