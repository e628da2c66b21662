"""Training: next-token loss + the MSA indexer objective, optax optimizer, orbax checkpoints, CLI.

Objective (per step)::

    loss = CE(next token)  +  kl_weight * mean over MSA layers of KL_indexer

**Indexer KL** (one MSA layer; per query t and KV group g). The target is the main branch's own
attention, computed from ``stop_gradient``'d q/k: the causal softmax of every query head of the
group, summed per key block, averaged over the group's heads, restricted to the support and
renormalised. The prediction is a softmax over the support of the index branch's max-pooled block
scores scaled by ``1/sqrt(index_head_dim)`` (the selection is scale-free, so the scale is only the
temperature of the KL; 1/sqrt(Hx) puts the scores on the same footing as attention logits). The row
value is KL(target || prediction); rows are averaged over (batch, group, query) among the rows whose
support has at least two blocks (a one-block support has KL = 0 by construction).

The support:

* ``sparse``: the blocks the selection actually picked, forced ones (own block, local window, init
  sinks) included — DSA's sparse stage, KL over S_t;
* ``dense_warmup`` / ``indexer_only``: every visible block — DSA's dense warm-up.

Forced blocks are kept in the support although their score never decides their selection: the
softmax over the support then calibrates the history blocks against the local one, and with a small
top-k (e.g. 2 = own block + one ranked block) a support without them would be a single block and
carry no signal.

The target is the *dense* softmax restricted afterwards: heads that put much of their mass outside
the selection weigh less. (MaxText's DeepSeek-V3.2 indexer loss in its sparse stage instead takes
each head's softmax over the selected keys only, then sums over heads; the two agree when every
head has the same recall.)

Because the KL and the LM loss reach disjoint parameter groups, and each group has its own Adam,
``kl_weight`` barely matters (Adam is invariant to a loss scale); the indexer's pace is set by
``index_lr``.

**Gradient paths.** The index branch reads ``stop_gradient(x)`` of the layer's normed input, and the
target reads ``stop_gradient(q), stop_gradient(k)``, so the KL reaches only the ``index`` weights
(wq, wk, q_norm, k_norm). The LM loss reaches the index weights through nothing: the block selection
is discrete (``lax.top_k`` ids). Sparse attention is differentiated through the gathered
pure-jnp reference (:func:`m3jax.msa.sparse_attention`): its gradient w.r.t. q/k/v is plain autodiff
of gathers, einsums and a softmax, which is correct by construction and fast enough for small models
on CPU/GPU; a custom_vjp for the Pallas kernels is a later, separate step (those kernels are
forward-only).

Modes:

* ``dense_warmup``: dense causal attention in every layer; all weights train (LM on the main
  branch, KL on the index branch over all visible blocks);
* ``sparse``: MSA attention (the model as deployed); all weights train, KL over the selected blocks;
* ``indexer_only``: main weights frozen bit-for-bit (``optax.set_to_zero`` on them, and the step
  puts the old arrays back), dense forward, KL over all visible blocks. Used to retrain the
  indexer of a loaded model for a new block size / top-k; the LM term is not computed.

CLI (text from the Python standard library's own sources, byte-level BPE from ``tokenizers``)::

    python -m m3jax.train --config m3_tiny --steps 300 --seq-len 256 --batch 4 --out /tmp/run \
        [--resume | --overwrite] [--mode sparse] [--dense-warmup-steps 50] [--block-size 8 --topk 8] [--init-from DIR]

``--data retrieval`` plants key/value lines in the text and repeats some later in the row, with the
loss weighted onto the repeated values (see "Data: key/value retrieval tasks" below); the long rows
can take a shorter dense warm-up (``--dense-warmup-seq-len``, ``--dense-warmup-batch``).

``--out`` must be new or empty unless ``--resume`` (continue the run saved there) or ``--overwrite``
(remove that run's files, :data:`RUN_FILES`, and start again; other files are left alone). Bad
arguments end in one ``error:`` line and exit status 2 (``--debug`` for the traceback).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
import json
import os
import re
import shutil
import sys
import sysconfig
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from m3jax import atomic, cli
from m3jax.config import M3Config, load_config, preset
from m3jax.model import index_branch, lm_head, project_qkv, text_hidden
from m3jax.msa import layer as msa_layer, reference as msa
from m3jax.params import ParamSpec, param_specs

MODES = ("dense_warmup", "sparse", "indexer_only")
DATA_KINDS = ("stdlib", "retrieval")
_BIG_NEG = -1e30


# --------------------------------------------------------------------------------------------------
# State


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar


def param_labels(params: dict) -> dict:
    """"index" for the MSA index-branch leaves (``text.layers[i].index.*``), "frozen" for the vision
    tower / projectors (text-only training never updates them, not even by weight decay), "main" for
    the rest of the text decoder."""

    def label(path, _):
        keys = [getattr(p, "key", None) for p in path]
        if keys[0] != "text":
            return "frozen"
        return "index" if "index" in keys else "main"

    return jax.tree_util.tree_map_with_path(label, params)


def _decay_mask(params: dict) -> dict:
    """Weight decay on matrices only (no norms, biases, router correction bias)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(
    mode: str, steps: int, lr: float = 2e-3, index_lr: float | None = None, warmup: int = 20,
    weight_decay: float = 0.1, clip: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW (warm-up + cosine) per parameter group (:func:`param_labels`); ``set_to_zero`` (no state,
    no update) for the frozen group, and for the main group in ``indexer_only``."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")

    def adamw(peak):
        sched = optax.warmup_cosine_decay_schedule(0.0, peak, max(1, min(warmup, steps - 1)), max(steps, 2), peak * 0.1)
        return optax.chain(
            optax.clip_by_global_norm(clip),
            optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=_decay_mask),
        )

    main = optax.set_to_zero() if mode == "indexer_only" else adamw(lr)
    return optax.multi_transform(
        {"main": main, "index": adamw(index_lr or lr), "frozen": optax.set_to_zero()}, param_labels
    )


def init_train_params(cfg: M3Config, seed: int = 0, std: float = 0.02) -> dict:
    """Fresh fp32 weights for training: N(0, std) matrices, zero Gemma-norm offsets (scale 1), zero
    router correction bias. (``params.init_random`` randomises norm offsets on purpose, for tests.)"""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=lambda x: isinstance(x, ParamSpec))
    rng = np.random.default_rng(seed)
    out = []
    for s in leaves:
        if s.init == "normal" and len(s.shape) >= 2:
            x = rng.normal(0.0, std, s.shape)
        elif s.init == "ones":
            x = np.ones(s.shape)
        else:  # norm offsets, biases, router_bias
            x = np.zeros(s.shape)
        out.append(jnp.asarray(x, jnp.float32))
    return jax.tree.unflatten(treedef, out)


def with_index_branch(params: dict, index_layers: list) -> dict:
    """``params`` with layer i's MSA index branch replaced by ``index_layers[i]`` (None: layer kept)."""
    layers = [lp if ii is None else {**lp, "index": ii} for lp, ii in zip(params["text"]["layers"], index_layers)]
    return {**params, "text": {**params["text"], "layers": layers}}


def init_state(params: dict, tx: optax.GradientTransformation) -> TrainState:
    """Step 0. Every array is committed to its device / sharding (as restored checkpoints are), so a
    fresh and a restored state hit the same compiled step."""
    params = jax.device_put(params, jax.tree.map(lambda x: x.sharding, params))
    opt_state, step = jax.jit(lambda p: (tx.init(p), jnp.zeros((), jnp.int32)))(params)
    meshes = {x.sharding.mesh for x in jax.tree.leaves(params) if isinstance(x.sharding, jax.sharding.NamedSharding)}
    fallback = (jax.sharding.NamedSharding(meshes.pop(), jax.sharding.PartitionSpec()) if meshes
                else jax.sharding.SingleDeviceSharding(jax.devices()[0]))

    def commit(x):  # leaves made from constants (counters) come out of jit uncommitted
        return x if x._committed else jax.device_put(x, fallback)

    return TrainState(params, jax.tree.map(commit, opt_state), commit(step))


# --------------------------------------------------------------------------------------------------
# Loss


def indexer_kl(q, k, scores, support, q_pos, block_size: int, index_head_dim: int):
    """KL(target || index prediction) per (batch, group, query) row of one query chunk.

    Args:
      q: [B, C, N, H] main queries; k: [B, S, K, H] main keys (both used under stop_gradient).
      scores: fp32 [B, K, C, nb] index block scores (differentiable w.r.t. the index branch).
      support: bool [B, K, C, nb] blocks the KL runs over.
    Returns:
      (kl fp32 [B, K, C], valid bool [B, K, C]) — valid = support has >= 2 blocks.
    """
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, c, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    nb = scores.shape[-1]
    qg = q.reshape(b, c, kh, n // kh, h).astype(jnp.float32)
    logits = jnp.einsum("bckgh,bskh->bkgcs", qg, k.astype(jnp.float32), precision=msa.HIGHEST) * h**-0.5
    causal = (jnp.arange(s_len)[None, None, :] <= q_pos[:, :, None])[:, None, None]
    p = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    p = jnp.pad(p, [(0, 0)] * 4 + [(0, nb * block_size - s_len)])
    mass = p.reshape(*p.shape[:4], nb, block_size).sum(-1).mean(2)  # [B, K, C, nb]
    target = jnp.where(support, mass, 0.0)
    z = target.sum(-1, keepdims=True)
    target = jax.lax.stop_gradient(target / jnp.where(z > 0, z, 1.0))
    logq = jax.nn.log_softmax(jnp.where(support, scores * index_head_dim**-0.5, _BIG_NEG), axis=-1)
    pos = target > 0
    kl = jnp.sum(jnp.where(pos, target * (jnp.log(jnp.where(pos, target, 1.0)) - logq), 0.0), -1)
    valid = support.sum(-1) >= 2
    return jnp.where(valid, kl, 0.0), valid


def _train_attention(x, lp, angles, q_pos, cfg: M3Config, layer: int, mode: str):
    """:func:`m3jax.model.decoder_layer`'s attention hook in training: (out [B, T, D], aux) with aux
    (kl_sum, kl_rows) on MSA layers and None on dense ones.

    Both kinds attend through the chunked jnp reference (differentiable; the dense layers use the
    dense-mask form, whose key loop has a static length). The index branch sees a detached input,
    so the KL trains only the index weights.
    """
    t = cfg.text
    bs = t.index_block_size
    sparse = t.is_sparse_attention(layer)
    q, k, v, _, _ = project_qkv(x, lp, angles, t, sparse=False)
    # Each query chunk is rematerialised in the backward pass (jax.checkpoint): otherwise lax.map keeps
    # every chunk's softmax weights as residuals, [T, T] per head and layer in all (a 16K row of
    # m3-small then needs ~117 GB), and chunking the queries would save no memory in training.
    if not sparse:
        o, merge = msa.map_query_chunks(
            jax.checkpoint(lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs)), cfg.attention_chunk, q_pos, q
        )
        return jnp.einsum("btnh,nhd->btd", merge(o, 1), lp["attn"]["wo"]), None
    iq, ik = index_branch(jax.lax.stop_gradient(x), lp["index"], angles, t)

    def chunk_fn(qp, qc, iqc):
        scores = msa_layer.scores(iqc, ik, qp, t)  # [B, K, C, nb]
        nb = scores.shape[-1]
        if mode == "sparse":
            sel = msa_layer.select_from_scores(jax.lax.stop_gradient(scores), qp, t, layer)
            o = msa.sparse_attention(qc, k, v, sel, qp, bs)
            support = jax.nn.one_hot(sel, nb + 1, dtype=jnp.bool_)[..., :nb].any(-2)  # -1 -> no column
        else:
            o = msa.dense_mask_attention(qc, k, v, None, qp, bs)
            support = jnp.isfinite(scores)
        kl, valid = indexer_kl(qc, k, scores, support, qp, bs, t.index_head_dim)
        return o, kl, valid

    (o, kl, valid), merge = msa.map_query_chunks(jax.checkpoint(chunk_fn), cfg.attention_chunk, q_pos, q, iq)
    o, kl, valid = merge(o, 1), merge(kl, 2), merge(valid, 2)
    return jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"]), (jnp.sum(kl), jnp.sum(valid))


def train_forward(params: dict, input_ids: jax.Array, cfg: M3Config, mode: str):
    """Text decoder for training (the model's layer loop with the training attention hook).
    Returns (final hidden [B, T, D], {MSA layer: (kl_sum, kl_rows)})."""
    b, n = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    h = params["text"]["embed"][input_ids]
    attend = functools.partial(_train_attention, mode=mode)
    h, kls, _ = text_hidden(params, h, positions, cfg, attend=attend)
    return h, kls


def loss_fn(params: dict, batch: dict, cfg: M3Config, mode: str, kl_weight: float = 1.0):
    """LM cross-entropy + kl_weight * mean-over-MSA-layers indexer KL.

    batch: ``{"tokens": int32 [B, T + 1]}`` (inputs are tokens[:, :-1], labels tokens[:, 1:]) and
    optionally ``"mask"`` [B, T] (1 = count the label). Returns (total, {"lm", "kl", "kl_layers"}).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    if mode == "indexer_only":
        labels = param_labels(params)
        params = jax.tree.map(lambda l, x: x if l == "index" else jax.lax.stop_gradient(x), labels, params)
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h, kls = train_forward(params, inputs, cfg, mode)
    if mode == "indexer_only":
        lm = jnp.zeros((), jnp.float32)  # main weights frozen: the LM term has no gradient to give
    else:
        ce = optax.softmax_cross_entropy_with_integer_labels(lm_head(params, h), targets)
        mask = batch.get("mask")
        mask = jnp.ones_like(ce) if mask is None else mask.astype(jnp.float32)
        lm = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    per_layer = jnp.stack([s / jnp.maximum(r, 1) for s, r in kls.values()]) if kls else jnp.zeros((0,))
    kl = jnp.mean(per_layer) if kls else jnp.zeros((), jnp.float32)
    return lm + kl_weight * kl, {"lm": lm, "kl": kl, "kl_layers": per_layer}


def make_train_step(cfg: M3Config, tx: optax.GradientTransformation, mode: str, kl_weight: float = 1.0, mesh=None):
    """Jitted ``step(state, batch) -> (state, metrics)`` (state donated). With ``mesh`` the step runs
    under it: parameters keep the shardings they were placed with (``m3jax.sharding.shard_params``),
    the batch is split over the data axis."""

    def step(state: TrainState, batch: dict):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, cfg, mode, kl_weight)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        # Weights that must not move keep their old values bit for bit (p + 0.0 would turn -0.0 into +0.0).
        keep = ("main", "frozen") if mode == "indexer_only" else ("frozen",)
        params = jax.tree.map(lambda l, old, new: old if l in keep else new, param_labels(params), state.params, params)
        metrics = {"loss": loss, **aux, "grad_norm": optax.tree.norm(grads)}
        return TrainState(params, opt_state, state.step + 1), metrics

    jitted = jax.jit(step, donate_argnums=0)
    if mesh is None:
        return jitted

    from jax.sharding import NamedSharding, PartitionSpec as P

    from m3jax.sharding import DATA

    def run(state, batch):
        batch = {k: jax.device_put(v, NamedSharding(mesh, P(DATA))) for k, v in batch.items()}
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    return run


def make_eval_step(cfg: M3Config, mode: str = "sparse"):
    """Jitted ``(params, batch) -> {"lm", "kl", "kl_layers"}`` (no gradients)."""
    return jax.jit(lambda params, batch: loss_fn(params, batch, cfg, mode)[1])


# --------------------------------------------------------------------------------------------------
# Checkpoints (orbax): the whole TrainState


def _state_tree(state: TrainState) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def checkpoint_manager(directory: str | Path, max_to_keep: int = 2):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save_state(mngr, state: TrainState) -> None:
    import orbax.checkpoint as ocp

    mngr.save(int(state.step), args=ocp.args.StandardSave(_state_tree(state)))
    mngr.wait_until_finished()


def restore_state(mngr, like: TrainState, step: int | None = None) -> TrainState:
    """Restore the latest (or ``step``) checkpoint into the structure, dtypes and shardings of ``like``."""
    import orbax.checkpoint as ocp

    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {mngr.directory}")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), _state_tree(like)
    )
    tree = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    return TrainState(tree["params"], tree["opt_state"], tree["step"])


# --------------------------------------------------------------------------------------------------
# Data: the Python standard library's own sources


def stdlib_files() -> tuple[list[Path], list[Path], Path]:
    """(train, held-out, root): ``*.py`` under the stdlib (site-packages excluded), sorted by relative
    path; a file is held out when crc32(relative path) % 20 == 0 (about 5 %, stable across machines)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((f for f in root.rglob("*.py") if "site-packages" not in f.parts), key=lambda f: f.relative_to(root).as_posix())
    held = [f for f in files if zlib.crc32(f.relative_to(root).as_posix().encode()) % 20 == 0]
    held_set = set(held)
    return [f for f in files if f not in held_set], held, root


def _read_texts(files: list[Path], budget_bytes: int | None) -> list[str]:
    out, total = [], 0
    for f in files:
        try:
            s = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(s)
        total += len(s)
        if budget_bytes and total >= budget_bytes:
            break
    return out


SPECIALS = ("<pad>", "<s>", "</s>")


def train_tokenizer(texts: list[str], cfg: M3Config, tokenizer_mb: float = 8.0):
    """Byte-level BPE (``tokenizers``) to the config's vocabulary. Ids 0, 1, 2 are <pad>, <s>, </s>;
    when the image / video placeholder ids fall inside the vocabulary, the BPE stops below them and
    ``<image>`` / ``<video>`` take those ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    v = cfg.text.vocab_size
    media = sorted(i for i in (cfg.image_token_id, cfg.video_token_id) if i < v)
    n_bpe = media[0] if media else v
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    budget, sample = int(tokenizer_mb * 1e6), []
    for s in texts:
        sample.append(s)
        budget -= len(s)
        if budget <= 0:
            break
    tok.train_from_iterator(sample, trainer=trainer)
    names = {cfg.image_token_id: "<image>", cfg.video_token_id: "<video>"}
    for i in media:
        if tok.get_vocab_size() == i:
            tok.add_special_tokens([names[i]])
    if tok.get_vocab_size() > v:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids > vocab_size {v}")
    return tok


def encode_corpus(tok, texts: list[str], eos_id: int) -> np.ndarray:
    """One int32 stream: each file's tokens followed by </s>."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eos_id], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def sample_batch(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int = 0) -> dict:
    """Deterministic windows of seq_len + 1 tokens for ``step`` (a resumed run sees the same data)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return {"tokens": np.stack([stream[s : s + seq_len + 1] for s in starts])}


def heldout_batches(stream: np.ndarray, n: int, batch: int, seq_len: int) -> list[dict]:
    """``n`` fixed, evenly spaced held-out batches."""
    total = n * batch
    starts = np.linspace(0, len(stream) - seq_len - 2, total).astype(np.int64)
    rows = np.stack([stream[s : s + seq_len + 1] for s in starts])
    return [{"tokens": rows[i * batch : (i + 1) * batch]} for i in range(n)]


# --------------------------------------------------------------------------------------------------
# Data: key/value retrieval tasks planted in the text (``--data retrieval``)
#
# A row is ordinary text with lines ``\nKEY access = 90517\n`` planted at random places; later in the
# row some of those lines appear again (the query), and the value tokens of the repeat are the
# answers. Keys and values are random per row, so an answer is predictable only by finding the
# definition: the loss on the answers is a pure retrieval signal at the definition's distance.
#
# Keys are words that are one token of the tokenizer (`` access``): the token before `` =`` then names
# the key, so one previous-token feature plus one matching head (an induction circuit, what small
# models learn first) solves the lookup; a multi-token key (``48213`` = ``4|8|21|3``) needs the
# last few tokens composed first. Without such words (no tokenizer) keys are 5-digit numbers.

KEY_RANGE = (10000, 100000)  # 5-digit values (and keys when the tokenizer gives no word keys)


@dataclasses.dataclass(frozen=True)
class TextEncoder:
    """``encoder(str) -> int32 ids`` (the tokenizer's, or UTF-8 bytes as ids) and ``keys``: words that
    are one token with their leading space (the retrieval tasks' keys)."""

    tok: Any

    def __call__(self, s: str) -> np.ndarray:
        if self.tok is None:
            return np.frombuffer(s.encode("utf-8"), np.uint8).astype(np.int32)
        return np.asarray(self.tok.encode(s, add_special_tokens=False).ids, np.int32)

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        if self.tok is None:
            return ()
        words = sorted(t[1:] for t in self.tok.get_vocab() if re.fullmatch("\u0120[a-z]{4,}", t))  # Ġ = space
        return tuple(w for w in words if len(self(" " + w)) == 1)


def text_encoder(tok, vocab_size: int) -> TextEncoder:
    """The tokenizer's encoder, or without one UTF-8 bytes as ids (the byte-level fallback of
    ``m3jax.generate``; needs vocab_size >= 256)."""
    if tok is None and vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} < 256: no tokenizer and too small for UTF-8 bytes as ids")
    return TextEncoder(tok)


def draw_keys(rng, encode, n: int) -> list[str]:
    """``n`` distinct keys: single-token words of ``encode.keys`` when there are enough, else 5-digit numbers."""
    pool = getattr(encode, "keys", ())
    if len(pool) >= n:
        return [pool[i] for i in rng.choice(len(pool), n, replace=False)]
    return [str(k) for k in rng.choice(np.arange(*KEY_RANGE), n, replace=False)]


def kv_line(encode, key: str, value: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix ``\\nKEY <key> =``, value `` <value>``, close ``\\n``) token ids, encoded piece by piece
    so the value's tokens are the same at the definition and at the query (the byte-level
    pre-tokenizer splits at ``=`` and before a space anyway: this is the running-text tokenisation)."""
    return encode(f"\nKEY {key} ="), encode(f" {value}"), encode("\n")


@dataclasses.dataclass
class RetrievalRow:
    tokens: np.ndarray  # int32 [n]
    answer: np.ndarray  # bool [n]: the token is a value token of a query line
    value_at: list[int]  # row position of each definition's first value token, per pair
    query_value_at: list[int]  # row position of each query's first value token (-1: pair not queried)


def plant(filler: np.ndarray, events: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Insert token runs into ``filler``: events (offset into filler, ids, answer mask), applied in the
    given order (an earlier event at the same offset comes first). Returns (tokens, answer, start of
    each event's run in the result)."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], i))
    toks, ans, starts, prev, pos = [], [], [0] * len(events), 0, 0
    for i in order:
        off, ids, a = events[i]
        toks += [filler[prev:off], ids]
        ans += [np.zeros(off - prev, bool), a]
        pos += off - prev
        starts[i] = pos
        pos += len(ids)
        prev = off
    toks.append(filler[prev:])
    ans.append(np.zeros(len(filler) - prev, bool))
    return np.concatenate(toks).astype(np.int32), np.concatenate(ans), starts


def retrieval_row(stream: np.ndarray, n: int, rng, encode, n_pairs: int, query_frac: float = 1.0) -> RetrievalRow:
    """One training row of ``n`` tokens: ``n_pairs`` key/value lines at random places in a random
    window of ``stream``, and for ``round(query_frac * n_pairs)`` of them a query (the same line again)
    later in the row. A query sits uniformly in the last 7/8 of the row and its definition uniformly
    before it, so definition-to-query distances cover the whole row."""
    keys = draw_keys(rng, encode, n_pairs)
    values = rng.integers(*KEY_RANGE, n_pairs)
    lines = [kv_line(encode, k, int(v)) for k, v in zip(keys, values)]
    queried = sorted(rng.choice(n_pairs, int(round(query_frac * n_pairs)), replace=False).tolist())
    line_len = [sum(len(x) for x in ln) for ln in lines]
    m = n - sum(line_len) - sum(line_len[i] for i in queried)
    if m < 8:
        raise ValueError(f"a row of {n} tokens cannot hold {n_pairs} key/value lines and their queries")
    start = int(rng.integers(0, len(stream) - m))
    filler = stream[start : start + m]
    q_off = rng.integers(m // 8, m + 1, n_pairs)
    d_off = (rng.random(n_pairs) * np.where(np.isin(np.arange(n_pairs), queried), q_off, m)).astype(np.int64)
    events = []
    for i, (p, v, c) in enumerate(lines):  # definitions first: one at the same offset as a query precedes it
        events.append((int(d_off[i]), np.concatenate([p, v, c]), np.zeros(line_len[i], bool)))
    for i in queried:
        p, v, c = lines[i]
        mask = np.concatenate([np.zeros(len(p), bool), np.ones(len(v), bool), np.zeros(len(c), bool)])
        events.append((int(q_off[i]), np.concatenate([p, v, c]), mask))
    tokens, answer, starts = plant(filler, events)
    value_at = [starts[i] + len(lines[i][0]) for i in range(n_pairs)]
    query_value_at = [-1] * n_pairs
    for j, i in enumerate(queried):
        query_value_at[i] = starts[n_pairs + j] + len(lines[i][0])
    return RetrievalRow(tokens, answer, value_at, query_value_at)


def answer_weights(answer: np.ndarray, task_share: float) -> np.ndarray:
    """``loss_fn``'s ``mask`` for a row's labels (tokens[1:]): 1 on text, and on the answer tokens the
    weight that gives them ``task_share`` of the row's loss (a few dozen answer tokens among 16K text
    tokens would otherwise carry no signal)."""
    labels = answer[1:]
    n_ans = int(labels.sum())
    w = np.ones(len(labels), np.float32)
    if n_ans and task_share > 0:
        w[labels] = task_share / (1.0 - task_share) * (len(labels) - n_ans) / n_ans
    return w


def retrieval_batch(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int, encode,
                    pairs_per_1k: float = 1.0, task_share: float = 0.5, answers_only: bool = False) -> dict:
    """Deterministic batch of retrieval rows for ``step`` (seeded like :func:`sample_batch`):
    ``{"tokens": int32 [B, seq_len + 1], "mask": fp32 [B, seq_len]}``; ``answers_only``: the mask is 1 on
    the answer labels and 0 elsewhere (the loss is then the answers' cross-entropy)."""
    rng = np.random.default_rng([seed, step, 1])
    n_pairs = max(1, int(round(pairs_per_1k * seq_len / 1024)))
    rows = [retrieval_row(stream, seq_len + 1, rng, encode, n_pairs) for _ in range(batch)]
    mask = [r.answer[1:].astype(np.float32) if answers_only else answer_weights(r.answer, task_share) for r in rows]
    return {"tokens": np.stack([r.tokens for r in rows]), "mask": np.stack(mask)}


# --------------------------------------------------------------------------------------------------
# Recall (m3jax.probe) and plots


def mean_recall(params: dict, cfg: M3Config, tokens: np.ndarray) -> dict[int, float]:
    """{MSA layer: mean dense-softmax mass inside the selected blocks} on ``tokens`` [B, T]."""
    from m3jax.api import M3Model
    from m3jax.probe import probe

    res = probe(M3Model(cfg, params), tokens, query_chunk=cfg.attention_chunk)
    return {r["layer"]: r["recall_mean"] for r in res.summary()}


def plot_curves(csv_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = list(csv.DictReader(open(csv_path)))
    rows = [r for r in every if r.get("lm")]
    if not every:
        return
    step = np.array([int(r["step"]) for r in rows])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for key in ("lm", "loss"):
        axes[0].plot(step, [float(r[key]) for r in rows], label=f"train {key}", lw=1)
    ev = [(int(r["step"]), float(r["eval_lm"])) for r in every if r.get("eval_lm")]
    if ev:
        axes[0].plot(*zip(*ev), "o-", label="held-out lm")
    ans = [(int(r["step"]), float(r["eval_answer_ce"])) for r in every if r.get("eval_answer_ce") not in (None, "", "nan")]
    if ans:
        axes[0].plot(*zip(*ans), "^-", label="held-out answer CE (retrieval)")
    axes[0].set_xlabel("step"), axes[0].set_ylabel("nats/token"), axes[0].legend()
    axes[1].plot(step, [float(r["kl"]) for r in rows], lw=1, label="indexer KL (train)")
    rec = [(int(r["step"]), float(r["recall"])) for r in every if r.get("recall")]
    if rec:
        ax2 = axes[1].twinx()
        ax2.plot(*zip(*rec), "s-", color="C2", label="held-out recall")
        ax2.set_ylabel("recall")
        ax2.legend(loc="center right")
    axes[1].set_xlabel("step"), axes[1].legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI


CSV_FIELDS = ("step", "mode", "loss", "lm", "kl", "grad_norm", "seconds", "eval_lm", "eval_kl", "recall",
              "eval_answer_ce")
# Everything a run writes under --out (--overwrite removes exactly these).
RUN_FILES = ("ckpt", "model", "tokenizer.json", "data.npz", "time_budget_steps.json", "train_log.csv",
             "loss_curve.png", "summary.json", "run_args.json")


def prepare_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Create ``out``, refusing one that holds anything unless resuming or overwriting: a new run would
    write over the files there (an earlier run's log, checkpoint and model, or someone else's)."""
    if out.exists() and not out.is_dir():
        raise cli.UsageError(f"--out {out} is a file, not a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not (resume or overwrite):
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise cli.UsageError(
            f"--out {out} is not empty ({shown}); pass --resume to continue the run saved there, --overwrite to "
            "replace a run's files in it, or choose a new folder"
        )
    if overwrite:
        # The cached data and tokenizer go too: a new run with other --data-mb must not read the old ones.
        old = [name for name in RUN_FILES if (out / name).exists()]
        if old:
            print(f"note: --overwrite: removing the earlier run's {old} from {out}", file=sys.stderr)
        for name in old:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        raise cli.UsageError(f"--out {out} is not writable")


def _load_cfg(args) -> M3Config:
    if args.config is None:
        args.config = args.init_from or "m3_tiny"
    p = Path(args.config)
    cfg = load_config(p) if p.exists() else preset(args.config)
    changes = {}
    if args.block_size:
        changes["index_block_size"] = args.block_size
    if args.topk:
        changes["index_topk_blocks"] = args.topk
    if changes:
        cfg = cfg.replace_text(**changes)
    # Text-only training; by default one attention chunk = the whole (short) training sequence.
    return cfg.replace(attention_impl="reference", attention_chunk=args.attention_chunk or args.seq_len)


def _check_tokenizer_from(folder: Path, cfg: M3Config) -> None:
    """--tokenizer-from's tokenizer must exist and fit the model's vocabulary: ids past it would be clamped
    by the embedding lookup and train a model that never sees them right (the loss goes NaN)."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise cli.UsageError(f"--tokenizer-from {folder}: no tokenizer.json there")
    try:
        n = Tokenizer.from_file(str(path)).get_vocab_size()
    except Exception as e:  # the tokenizers library raises its own plain Exception
        raise cli.UsageError(f"--tokenizer-from {folder}: cannot read tokenizer.json ({e})") from e
    if n > cfg.text.vocab_size:
        raise cli.UsageError(f"--tokenizer-from {folder}: the tokenizer has {n} tokens, the model's vocab_size is "
                             f"{cfg.text.vocab_size}")


def _prepare_data(args, cfg: M3Config, out: Path):
    from tokenizers import Tokenizer

    train_files, held_files, _ = stdlib_files()
    budget = int(args.data_mb * 1e6) if args.data_mb else None
    tok_path = out / "tokenizer.json"
    cache = out / "data.npz"
    if tok_path.exists() and cache.exists():
        tok = Tokenizer.from_file(str(tok_path))
        try:
            with np.load(cache) as d:
                return tok, d["train"], d["heldout"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:  # truncated or not ours
            print(f"warning: {cache} is damaged ({type(e).__name__}: {e}); rebuilding it", file=sys.stderr, flush=True)
    t0 = time.time()
    train_texts = _read_texts(train_files, budget)
    held_texts = _read_texts(held_files, budget // 20 if budget else None)
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    elif args.tokenizer_from:
        tok = Tokenizer.from_file(str(Path(args.tokenizer_from) / "tokenizer.json"))
        atomic.atomic_write(tok_path, tok.to_str())
    else:
        tok = train_tokenizer(train_texts, cfg, args.tokenizer_mb)
        atomic.atomic_write(tok_path, tok.to_str())
    eos = cfg.text.eos_token_id if isinstance(cfg.text.eos_token_id, int) else cfg.text.eos_token_id[0]
    train, held = encode_corpus(tok, train_texts, eos), encode_corpus(tok, held_texts, eos)
    buf = io.BytesIO()
    np.savez(buf, train=train, heldout=held)
    atomic.atomic_write(cache, buf.getvalue())
    print(f"data: {len(train_texts)} train / {len(held_texts)} held-out files -> {len(train)} / {len(held)} tokens "
          f"(vocab {tok.get_vocab_size()}, {time.time() - t0:.1f}s)", flush=True)
    return tok, train, held


def _steps_for_budget(cfg: M3Config, params: dict, args, batch_for, mesh) -> int:
    """Steps that fit in ``args.time_budget`` seconds: compile and time a few steps of ``args.mode``
    on a throw-away state, keep a margin for the evaluations and the final save. (A shorter dense
    warm-up, ``--dense-warmup-seq-len``, is cheaper per step: the estimate errs on the safe side.)"""
    tx = make_optimizer(args.mode, 100, args.lr, args.index_lr, args.warmup)
    state = init_state(jax.tree.map(jnp.copy, params), tx)  # the step donates its state
    step = make_train_step(cfg, tx, args.mode, args.kl_weight, mesh)
    times = []
    for s in range(6):
        t0 = time.time()
        state, m = step(state, batch_for(s, args.mode))
        jax.block_until_ready(m)
        times.append(time.time() - t0)
    per_step = float(np.median(times[2:]))
    n_evals_share = 1.15  # evaluations every eval_every steps + checkpoints, measured at about 10-15 %
    steps = int(args.time_budget / (per_step * n_evals_share))
    print(f"timing: {per_step * 1e3:.0f} ms/step after compile ({times[0]:.1f}s first step)", flush=True)
    return max(steps, 10)


def tokenizer_files(tok, cfg: M3Config) -> dict[str, str]:
    """{file name: contents} of the tokenizer saved with the model."""
    return {"tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "pad_token": "<pad>", "model_max_length": cfg.text.max_position_embeddings}, indent=1)}


def refuse_out_over_inputs(args) -> None:
    """--out must not be, hold or lie inside an input of the run: --overwrite would remove a
    checkpoint's tokenizer.json, and the model save would replace its weights."""
    out = args.out.absolute().resolve()
    for flag in ("--init-from", "--tokenizer-from", "--config"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None or not Path(value).exists():
            continue  # a preset name
        p = Path(value).absolute().resolve()
        p = p.parent if p.is_file() else p
        if out == p or out.is_relative_to(p) or p.is_relative_to(out):
            raise cli.UsageError(f"--out {args.out} overlaps {flag} {value}, an input of this run; choose another --out")


# Arguments a resumed run may change (they do not alter what it computes up to its last step);
# any other difference to the recorded run_args.json is refused, naming the argument.
RESUME_MAY_CHANGE = ("steps", "ckpt_every", "eval_every", "eval_batches", "stop_after", "time_budget", "save_format")
_NOT_RECORDED = RESUME_MAY_CHANGE + ("resume", "overwrite", "out", "debug")


def check_run_args(out: Path, args) -> None:
    """Record the run's arguments in ``out/run_args.json`` (a new run), or compare them on --resume."""
    path = out / "run_args.json"
    now = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items())
           if k not in _NOT_RECORDED}
    if args.resume and path.exists():
        try:
            recorded = json.loads(path.read_text())
        except ValueError as e:
            raise cli.UsageError(f"--resume: {path} is not JSON ({e}); it records the run's arguments") from None
        changed = [k for k in sorted(set(now) | set(recorded)) if now.get(k) != recorded.get(k)]
        if changed:
            diffs = ", ".join(f"--{k.replace('_', '-')} {now.get(k)!r} (the run used {recorded.get(k)!r})"
                              for k in changed)
            raise cli.UsageError(
                f"--resume: {diffs} differ from the run in {out}; a resumed run must be the same run (only "
                f"{', '.join('--' + a.replace('_', '-') for a in RESUME_MAY_CHANGE)} may change): start a new --out "
                "instead")
        return
    atomic.atomic_write(path, json.dumps(now, indent=1))


def stop_if_diverged(metrics: dict, step: int, mngr) -> None:
    """End the run at a non-finite loss or gradient: one line naming the step; nothing is saved (the
    last good orbax step stays the newest) and the exit status is 2."""
    if np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]):
        return
    kept = mngr.latest_step()
    raise SystemExit(
        f"step {step}: loss {metrics['loss']} / gradient norm {metrics['grad_norm']}: the run diverged; stopped "
        f"without saving (the last good checkpoint, {'step ' + str(kept) if kept is not None else 'none'}, "
        f"is kept in {mngr.directory})")


def restore_intact_state(mngr, like: TrainState) -> TrainState:
    """Restore the newest orbax step that restores and holds only finite values; a damaged newer step
    is skipped with a warning naming it. None intact: the run is refused."""
    steps = sorted(mngr.all_steps(), reverse=True)
    for step in steps:
        try:
            state = restore_state(mngr, like, step)
        except Exception as e:  # noqa: BLE001  (orbax and tensorstore raise many kinds for a damaged step)
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
        else:
            finite = all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(_state_tree(state))
                         if jnp.issubdtype(x.dtype, jnp.floating))
            if finite:
                return state
            why = "it holds NaN or infinite values"
        print(f"warning: --resume: checkpoint step {step} in {mngr.directory} is damaged ({why}); trying an older "
              "step", file=sys.stderr, flush=True)
    raise cli.UsageError(f"--resume: no intact checkpoint in {mngr.directory} (steps {steps} all damaged); "
                         "start a new run")


def main(argv=None) -> int:
    ap = cli.ArgumentParser(prog="python -m m3jax.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None,
                    help="preset name (m3jax/configs/; m3 = minimax_m3) or a config.json / checkpoint dir "
                         "(default: --init-from's config, else m3_tiny)")
    ap.add_argument("--steps", type=cli.positive_int, default=300)
    ap.add_argument("--seq-len", type=cli.positive_int, default=256)
    ap.add_argument("--batch", type=cli.positive_int, default=4)
    ap.add_argument("--out", type=Path, required=True, help="run folder: new or empty, unless --resume or --overwrite")
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true",
                       help="continue from the latest orbax checkpoint in OUT/ckpt (none yet: a note, then step 0)")
    again.add_argument("--overwrite", action="store_true",
                       help=f"remove an earlier run's files from OUT ({', '.join(RUN_FILES)}) and start again")
    ap.add_argument("--mode", choices=MODES, default="sparse")
    ap.add_argument("--dense-warmup-steps", type=cli.nonnegative_int, default=0,
                    help="first N steps in dense_warmup (mode sparse)")
    ap.add_argument("--block-size", type=cli.nonnegative_int, default=0, help="MSA block size (0 = the config's)")
    ap.add_argument("--topk", type=cli.nonnegative_int, default=0, help="MSA top-k blocks (0 = the config's)")
    ap.add_argument("--init-from", default=None, help="start from an HF checkpoint dir (e.g. for indexer_only)")
    ap.add_argument("--tokenizer-from", default=None, help="reuse DIR/tokenizer.json instead of training one")
    ap.add_argument("--lr", type=cli.positive_float, default=2e-3)
    ap.add_argument("--index-lr", type=cli.positive_float, default=None)
    ap.add_argument("--warmup", type=cli.nonnegative_int, default=20)
    ap.add_argument("--kl-weight", type=cli.nonnegative_float, default=1.0)
    ap.add_argument("--ckpt-every", type=cli.positive_int, default=100)
    ap.add_argument("--eval-every", type=cli.positive_int, default=50)
    ap.add_argument("--eval-batches", type=cli.positive_int, default=4)
    ap.add_argument("--data-mb", type=cli.nonnegative_float, default=0.0,
                    help="read only the first N MB of train sources (0 = all)")
    ap.add_argument("--tokenizer-mb", type=cli.positive_float, default=8.0)
    ap.add_argument("--attention-chunk", type=cli.nonnegative_int, default=0,
                    help="query rows per attention chunk (0 = seq-len)")
    ap.add_argument("--data-parallel", type=cli.nonnegative_int, default=0,
                    help="N > 0: run on a (N, 1) mesh, batch split N ways")
    ap.add_argument("--seed", type=cli.seed, default=0)
    ap.add_argument("--time-budget", type=cli.nonnegative_float, default=0.0,
                    help="seconds: time a few steps first, then set --steps to what fits (recorded in summary.json)")
    ap.add_argument("--stop-after", type=cli.nonnegative_float, default=0.0,
                    help="seconds: end the training loop at the first step past this wall time (the LR schedule "
                         "still follows --steps), then evaluate and save as usual; 0 = run every step")
    ap.add_argument("--dense-warmup-frac", type=cli.fraction, default=0.0,
                    help="with --time-budget: the dense warm-up's share of the chosen steps")
    ap.add_argument("--data", choices=DATA_KINDS, default="stdlib",
                    help="stdlib: windows of standard-library source; retrieval: the same text with key/value "
                         "lines planted and queried later in the row, loss weighted onto the answers")
    ap.add_argument("--kv-per-1k", type=cli.positive_float, default=1.0,
                    help="--data retrieval: key/value pairs per 1024 tokens of a row (each queried once)")
    ap.add_argument("--task-share", type=cli.fraction, default=0.5,
                    help="--data retrieval: share of each row's loss carried by the answer tokens, in [0, 1)")
    ap.add_argument("--dense-warmup-seq-len", type=cli.nonnegative_int, default=0,
                    help="sequence length of the dense warm-up steps (0 = --seq-len): dense attention in every "
                         "layer keeps T x T softmax residuals, so a long --seq-len may need a shorter warm-up")
    ap.add_argument("--dense-warmup-batch", type=cli.nonnegative_int, default=0,
                    help="batch of the dense warm-up steps (0 = --batch)")
    ap.add_argument("--save-format", choices=["float32", "bfloat16", "mxfp8"], default="float32",
                    help="dtype of the saved HF checkpoint (mxfp8: the released MXFP8 layout, 1 byte per linear weight)")
    cli.add_debug_flag(ap)
    args = ap.parse_args(argv)
    if not args.time_budget and args.dense_warmup_steps > args.steps:
        ap.error(f"--dense-warmup-steps {args.dense_warmup_steps} exceeds --steps {args.steps}")
    if args.data_parallel and args.batch % args.data_parallel:
        ap.error(f"--batch {args.batch} does not split over --data-parallel {args.data_parallel} devices")
    args.dense_warmup_seq_len = args.dense_warmup_seq_len or args.seq_len
    args.dense_warmup_batch = args.dense_warmup_batch or args.batch
    if args.data_parallel and args.dense_warmup_batch % args.data_parallel:
        ap.error(f"--dense-warmup-batch {args.dense_warmup_batch} does not split over --data-parallel "
                 f"{args.data_parallel} devices")

    # Everything that can refuse the run does so before --out is touched.
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        raise cli.UsageError(f"--init-from {args.init_from}: no config.json there (an HF checkpoint folder)")
    cfg = _load_cfg(args)
    if args.tokenizer_from:
        _check_tokenizer_from(Path(args.tokenizer_from), cfg)
    out = args.out
    refuse_out_over_inputs(args)
    out.absolute().parent.mkdir(parents=True, exist_ok=True)
    with atomic.folder_lock(out, "a second training run"):  # two runs on one --out would corrupt its files
        return _run(args, cfg, out)


def _run(args, cfg: M3Config, out: Path) -> int:
    """The run, under the lock on ``out``."""
    prepare_out_dir(out, args.resume, args.overwrite)
    check_run_args(out, args)
    mngr = checkpoint_manager(out / "ckpt")
    resuming = args.resume and mngr.latest_step() is not None
    if args.resume and not resuming:
        print(f"note: --resume: no checkpoint in {out / 'ckpt'} yet; starting at step 0", file=sys.stderr, flush=True)
    tok, train_stream, held_stream = _prepare_data(args, cfg, out)

    encode = text_encoder(tok, cfg.text.vocab_size)

    def batch_for(step: int, mode: str) -> dict:
        """The training batch of ``step`` (deterministic: a resumed run sees the same data)."""
        seq, b = (args.dense_warmup_seq_len, args.dense_warmup_batch) if mode == "dense_warmup" else (args.seq_len, args.batch)
        if args.data == "retrieval":
            return retrieval_batch(train_stream, step, b, seq, args.seed, encode, args.kv_per_1k, args.task_share)
        return sample_batch(train_stream, step, b, seq, args.seed)

    mesh = None
    if args.data_parallel:
        from m3jax.sharding import make_mesh

        mesh = make_mesh(args.data_parallel, data=args.data_parallel)

    if args.init_from:
        from m3jax.checkpoint import load_params

        params = load_params(args.init_from, cfg, dtype="float32", progress=False)
    else:
        params = init_train_params(cfg, args.seed)
    if mesh is not None:
        from m3jax.sharding import shard_params

        params = shard_params(params, cfg, mesh)

    if args.time_budget:
        # The chosen counts set the LR schedule and the phase boundary: a resumed run must reuse them.
        chosen = out / "time_budget_steps.json"
        if resuming and chosen.exists():
            args.steps, args.dense_warmup_steps = json.loads(chosen.read_text())
        else:
            args.steps = _steps_for_budget(cfg, params, args, batch_for, mesh)
            if args.dense_warmup_frac:
                args.dense_warmup_steps = int(round(args.steps * args.dense_warmup_frac))
            atomic.atomic_write(chosen, json.dumps([args.steps, args.dense_warmup_steps]))
        print(f"time budget {args.time_budget:.0f}s -> --steps {args.steps} --dense-warmup-steps {args.dense_warmup_steps}",
              flush=True)
    phases = [("dense_warmup", args.dense_warmup_steps), (args.mode, args.steps - args.dense_warmup_steps)]
    if args.mode != "sparse" or args.dense_warmup_steps <= 0:
        phases = [(args.mode, args.steps)]
    tx = make_optimizer(phases[-1][0], args.steps, args.lr, args.index_lr, args.warmup)
    state = init_state(params, tx)
    index_init = jax.tree.map(np.asarray, [lp.get("index") for lp in params["text"]["layers"]])
    csv_path = out / "train_log.csv"
    rows: list[dict] = []
    if resuming:
        state = restore_intact_state(mngr, state)
        if csv_path.exists():
            rows = [r for r in csv.DictReader(open(csv_path)) if int(r["step"]) <= int(state.step)]
        print(f"resumed at step {int(state.step)}", flush=True)

    steps = {m: make_train_step(cfg, tx, m, args.kl_weight, mesh) for m, _ in phases}
    eval_step = make_eval_step(cfg, "sparse")
    evals = heldout_batches(held_stream, args.eval_batches, args.batch, args.seq_len)
    probe_tokens = evals[0]["tokens"][:, :-1]
    boundary = phases[0][1] if len(phases) == 2 else 0
    task_evals = []
    if args.data == "retrieval":
        # Held-out rows with the tasks, loss on the answers only: the retrieval learning curve. The text
        # batches get an all-ones mask so both kinds share one compiled eval step.
        evals = [{**b, "mask": np.ones(b["tokens"][:, 1:].shape, np.float32)} for b in evals]
        task_evals = [retrieval_batch(held_stream, i, args.batch, args.seq_len, args.seed, encode, args.kv_per_1k,
                                      answers_only=True) for i in range(args.eval_batches)]

    def evaluate(params, rec=None):
        """(held-out text lm, kl, recall, answer CE of the held-out retrieval rows or NaN). ``rec``: the
        per-layer recall when the caller has it already (a probe pass at 16K takes tens of seconds)."""
        ms = [eval_step(params, b) for b in evals]
        lm = float(np.mean([m["lm"] for m in ms]))
        kl = float(np.mean([m["kl"] for m in ms]))
        if rec is None:
            rec = mean_recall(params, cfg, probe_tokens) if cfg.text.has_sparse_layers else {}
        ans = float(np.mean([eval_step(params, b)["lm"] for b in task_evals])) if task_evals else float("nan")
        return lm, kl, float(np.mean(list(rec.values()))) if rec else float("nan"), ans

    # The CSV is rewritten with the rows up to the (restored) step, then appended to every step.
    csv_file = open(csv_path, "w", newline="")
    log = csv.DictWriter(csv_file, CSV_FIELDS)
    log.writeheader()
    log.writerows(rows)
    if int(state.step) == 0:
        lm0, kl0, rec0, ans0 = evaluate(state.params)
        log.writerow({"step": 0, "mode": "init", "eval_lm": f"{lm0:.5f}", "eval_kl": f"{kl0:.5f}", "recall": f"{rec0:.5f}",
                      "eval_answer_ce": f"{ans0:.5f}"})
        print(f"step 0: held-out lm {lm0:.4f} kl {kl0:.4f} recall {rec0:.4f} answer ce {ans0:.4f}", flush=True)
    t_start = time.time()
    while int(state.step) < args.steps:
        if args.stop_after and time.time() - t_start > args.stop_after:
            print(f"--stop-after {args.stop_after:.0f}s: stopped at step {int(state.step)} of {args.steps}", flush=True)
            save_state(mngr, state)
            break
        s = int(state.step)
        mode = phases[0][0] if s < boundary else phases[-1][0]
        t0 = time.time()
        state, m = steps[mode](state, batch_for(s, mode))
        m = jax.device_get(m)
        stop_if_diverged(m, s + 1, mngr)
        row = {"step": s + 1, "mode": mode, "loss": f"{m['loss']:.5f}", "lm": f"{m['lm']:.5f}", "kl": f"{m['kl']:.5f}",
               "grad_norm": f"{m['grad_norm']:.4f}", "seconds": f"{time.time() - t0:.3f}"}
        done = int(state.step)
        if done % args.eval_every == 0 or done == args.steps:
            lm, kl, rec, ans = evaluate(state.params)
            row.update(eval_lm=f"{lm:.5f}", eval_kl=f"{kl:.5f}", recall=f"{rec:.5f}", eval_answer_ce=f"{ans:.5f}")
            print(f"step {done} [{mode}]: train lm {m['lm']:.4f} kl {m['kl']:.4f} | held-out lm {lm:.4f} "
                  f"kl {kl:.4f} recall {rec:.4f} answer ce {ans:.4f} ({time.time() - t_start:.0f}s)", flush=True)
        log.writerow(row)
        csv_file.flush()
        if done % args.ckpt_every == 0 or done == args.steps:
            save_state(mngr, state)
    csv_file.close()
    plot_curves(csv_path, out / "loss_curve.png")

    from m3jax.api import M3Model, save_pretrained

    params = jax.device_get(state.params)
    final = out / "model"
    fmt = args.save_format
    # prepare_out_dir guarded --out; a --resume of a run that saved its model already saves it again.
    # The tokenizer goes in the same atomic save: a model folder never lacks the tokenizer it was trained with.
    save_pretrained(M3Model(cfg.replace(attention_impl="auto"), params), final,
                    dtype="bfloat16" if fmt == "mxfp8" else fmt, quantize_mxfp8_weights=fmt == "mxfp8",
                    overwrite=True, extra_files=tokenizer_files(tok, cfg))
    summary = {"steps": int(state.step), "scheduled_steps": args.steps, "dense_warmup_steps": args.dense_warmup_steps, "config": args.config,
               "block_size": cfg.text.index_block_size, "topk": cfg.text.index_topk_blocks, "seq_len": args.seq_len,
               "batch": args.batch, "data": args.data, "train_seconds": round(time.time() - t_start, 1), "save_format": fmt,
               "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    rec = None
    if cfg.text.has_sparse_layers:
        untrained = with_index_branch(params, index_init)
        rec = summary["recall_trained_index"] = mean_recall(params, cfg, probe_tokens)
        summary["recall_initial_index"] = mean_recall(untrained, cfg, probe_tokens)
    lm, kl, _, ans = evaluate(params, rec)
    summary.update(heldout_lm=lm, heldout_kl=kl)
    if args.data == "retrieval":
        summary.update(heldout_answer_ce=ans, kv_per_1k=args.kv_per_1k, task_share=args.task_share,
                       dense_warmup_seq_len=args.dense_warmup_seq_len, dense_warmup_batch=args.dense_warmup_batch)
    atomic.atomic_write(out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    cli.run(main)
