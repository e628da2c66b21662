"""Training: next-token loss + the MSA indexer objective, optax optimizer, orbax checkpoints, CLI.

Objective (per step)::

    loss = CE(next token)  +  kl_weight * mean over MSA layers of KL_indexer

The indexer KL (its target, support and gradient paths) is :mod:`m3jax.indexer_objective`; the
text, tokenizer and retrieval tasks are :mod:`m3jax.data`. This module holds the optimizer (one AdamW
per parameter group, :func:`m3jax.params.param_labels`), the training forward, the jitted step, the orbax
checkpoints of the whole state, and the CLI.

The index branch reads ``stop_gradient(x)`` of the layer's normed input, so the KL trains only the
index weights, and the LM loss never reaches them (the block selection is discrete).

Two attention paths (``--attention-impl``, resolved once by
:func:`m3jax.msa.layer.resolve_attention_impl`: ``auto`` = the kernels on a GPU that takes the
config, the reference elsewhere), the same objective on both:

* ``reference``: every attention through the chunked pure-jnp reference, plain autodiff of gathers,
  einsums and a softmax (correct by construction), each query chunk rematerialised in the backward;
* ``pallas``: sparse attention through :func:`m3jax.msa.kernels.attend_selected` (the KV-block-major
  kernel and its custom VJP) over the selections made per query chunk; dense attention (the
  full-attention layers, and the MSA layers in ``dense_warmup`` / ``indexer_only``) through
  ``jax.nn.dot_product_attention`` (cuDNN for 16-bit inputs on a GPU, XLA per rematerialised query
  chunk otherwise); the indexer KL per rematerialised query chunk, its target mass computed in one
  place, :func:`_target_kl`. Memory grows about linearly in T: no [T, T] array per head is kept for
  the backward.

``--dtype bfloat16`` computes the forward in bf16 (the fp32 weights cast at the step's start, the
optimizer keeping fp32 masters); the KL, its target and the cross-entropy stay fp32.

Modes:

* ``dense_warmup``: dense causal attention in every layer; all weights train (LM on the main
  branch, KL on the index branch over all visible blocks);
* ``sparse``: MSA attention (the model as deployed); all weights train, KL over the selected blocks;
* ``indexer_only``: main weights frozen bit-for-bit (``optax.set_to_zero`` on them, and the step
  puts the old arrays back), dense forward, KL over all visible blocks. Used to retrain the
  indexer of a loaded model for a new block size / top-k; the LM term is not computed.

CLI (text from the Python standard library's own sources, byte-level BPE from ``tokenizers``)::

    python -m m3jax.train --config m3_tiny --steps 300 --seq-len 256 --batch 4 --out /tmp/run \
        [--resume | --overwrite] [--mode sparse] [--dense-warmup-steps 50] [--block-size 8 --topk 8] [--init-from DIR] \
        [--attention-impl auto] [--dtype bfloat16]

``--data retrieval`` plants key/value lines in the text and repeats some later in the row, with the
loss weighted onto the repeated values (:func:`m3jax.data.retrieval_batch`); the long rows can take a
shorter dense warm-up (``--dense-warmup-seq-len``, ``--dense-warmup-batch``).

``--out`` must be new or empty unless ``--resume`` (continue the run saved there) or ``--overwrite``
(remove that run's files, :data:`RUN_FILES`, and start again; other files are left alone). Bad
arguments end in one ``error:`` line and exit status 2 (``--debug`` for the traceback).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from tokenizers import Tokenizer

from m3jax import atomic, cli, data, distributed
from m3jax.api import M3Model, save_pretrained
from m3jax.checkpoint import load_params
from m3jax.config import M3Config, load_config, preset
from m3jax.indexer_objective import indexer_kl, kl_support
from m3jax.model import index_branch, lm_head, project_qkv, text_hidden
from m3jax.msa import kernels as msa_kernels, layer as msa_layer, reference as msa
from m3jax.params import ParamSpec, param_labels, param_specs
from m3jax.probe import probe
from m3jax.sharding import DATA, make_mesh, shard_params

MODES = ("dense_warmup", "sparse", "indexer_only")
DATA_KINDS = ("stdlib", "retrieval")
ATTENTION_IMPLS = ("auto", "reference", "pallas")
DTYPES = ("float32", "bfloat16")
# Query rows per chunk of the kernel path's KL and XLA dense attention when --attention-chunk is 0:
# each chunk keeps [B, K, G, C, T] fp32 target logits alive, ~1 GB at 16K on m3-small.
KERNEL_QUERY_CHUNK = 1024


# --------------------------------------------------------------------------------------------------
# State


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # int32 scalar


def _decay_mask(params: dict) -> dict:
    """Weight decay on matrices only (no norms, biases, router correction bias)."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def make_optimizer(
    mode: str, steps: int, lr: float = 2e-3, index_lr: float | None = None, warmup: int = 20,
    weight_decay: float = 0.1, clip: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW (warm-up + cosine) per parameter group (:func:`m3jax.params.param_labels`); ``set_to_zero``
    (no state, no update) for the frozen group, and for the main group in ``indexer_only``."""
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




def _train_attention(x, lp, angles, q_pos, cfg: M3Config, layer: int, mode: str):
    """:func:`m3jax.model.decoder_layer`'s attention hook in training: (out [B, T, D], aux) with aux
    (kl_sum, kl_rows) on MSA layers and None on dense ones; the path is ``cfg.attention_impl``
    (``"pallas"``: :func:`_kernel_attention`).

    On the reference path both kinds attend through the chunked jnp reference (differentiable; the
    dense layers use the dense-mask form, whose key loop has a static length). The index branch
    sees a detached input, so the KL trains only the index weights.
    """
    t = cfg.text
    bs = t.index_block_size
    sparse = t.is_sparse_attention(layer)
    q, k, v, _, _ = project_qkv(x, lp, angles, t, sparse=False)
    iq, ik = index_branch(jax.lax.stop_gradient(x), lp["index"], angles, t) if sparse else (None, None)
    if cfg.attention_impl == "pallas":
        o, aux = _kernel_attention(q, k, v, iq, ik, q_pos, cfg, layer, mode)
        return jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"]), aux
    # Each query chunk is rematerialised in the backward pass (jax.checkpoint): otherwise lax.map keeps
    # every chunk's softmax weights as residuals, [T, T] per head and layer in all (a 16K row of
    # m3-small then needs ~117 GB), and chunking the queries would save no memory in training.
    if not sparse:
        o, merge = msa.map_query_chunks(
            jax.checkpoint(lambda qp, qc: msa.dense_mask_attention(qc, k, v, None, qp, bs)), cfg.attention_chunk, q_pos, q
        )
        return jnp.einsum("btnh,nhd->btd", merge(o, 1), lp["attn"]["wo"]), None

    def chunk_fn(qp, qc, iqc):
        scores = msa_layer.scores(iqc, ik, qp, t)  # [B, K, C, nb]
        if mode == "sparse":
            sel = msa_layer.select_from_scores(jax.lax.stop_gradient(scores), qp, t, layer)
            o = msa.sparse_attention(qc, k, v, sel, qp, bs)
            support = kl_support(scores, sel)
        else:
            o = msa.dense_mask_attention(qc, k, v, None, qp, bs)
            support = kl_support(scores)
        kl, valid = indexer_kl(qc, k, scores, support, qp, bs, t.index_head_dim)
        return o, kl, valid

    (o, kl, valid), merge = msa.map_query_chunks(jax.checkpoint(chunk_fn), cfg.attention_chunk, q_pos, q, iq)
    o, kl, valid = merge(o, 1), merge(kl, 2), merge(valid, 2)
    return jnp.einsum("btnh,nhd->btd", o, lp["attn"]["wo"]), (jnp.sum(kl), jnp.sum(valid))


def _target_kl(qc, k, scores, support, qp, t):
    """The indexer KL of one query chunk: (kl fp32 [B, K, C], valid bool [B, K, C]).

    The target, the main branch's attention mass per key block, comes from the block-mass kernel
    (:func:`m3jax.msa.kernels.indexer_target_mass`; the reference where the kernel cannot run), so
    no [C, T] softmax per head is built; the objective itself is the reference's
    :func:`m3jax.indexer_objective.indexer_kl`, handed that mass. Off the GPU the reference computes
    the mass here: this runs inside ``jax.checkpoint``, which cannot differentiate the ordered
    callbacks that Pallas interpret mode is made of (the kernel's own CPU tests, KL included, are in
    tests/pallas/test_block_mass.py)."""
    if jax.default_backend() != "gpu":
        return indexer_kl(qc, k, scores, support, qp, t.index_block_size, t.index_head_dim)
    mass = msa_kernels.indexer_target_mass(qc, k, qp, block_size=t.index_block_size, num_blocks=scores.shape[-1])
    return indexer_kl(qc, k, scores, support, qp, t.index_block_size, t.index_head_dim, mass=mass)


def _dense_attention(q, k, v, q_pos, chunk: int):
    """Causal attention of training rows (q_pos = arange(T) per row) through
    ``jax.nn.dot_product_attention``, differentiable: cuDNN's fused kernel on a GPU for 16-bit inputs
    (it takes no fp32), else XLA per query chunk of ``chunk`` rows, each rematerialised in the
    backward so that no [C, T] softmax per head stays alive past its chunk. q [B, T, N, H],
    k/v [B, T, K, H] -> [B, T, N, H]."""
    if jax.default_backend() == "gpu" and q.dtype != jnp.float32:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    key_pos = jnp.arange(k.shape[1])

    def chunk_fn(qp, qc):
        mask = (key_pos[None, None, :] <= qp[:, :, None])[:, None]  # [B, 1, C, S]
        return jax.nn.dot_product_attention(qc, k, v, mask=mask, implementation="xla")

    o, merge = msa.map_query_chunks(jax.checkpoint(chunk_fn), chunk, q_pos, q)
    return merge(o, 1)


def _kernel_attention(q, k, v, iq, ik, q_pos, cfg: M3Config, layer: int, mode: str):
    """The kernel path of :func:`_train_attention`: (o [B, T, N, H], aux) from the projections.

    Per query chunk of ``cfg.attention_chunk`` rows (rematerialised): the index scores, in ``sparse``
    the selection (from detached scores: discrete, no gradient) and the KL over its support
    (:func:`_target_kl`). Then one call over the whole row: the sparse-attention kernel over the
    selections (``sparse``), or dense attention (:func:`_dense_attention`; dense layers, warm-up,
    ``indexer_only``)."""
    t = cfg.text
    sparse_step = ik is not None and mode == "sparse"
    if ik is None:
        return _dense_attention(q, k, v, q_pos, cfg.attention_chunk), None

    def chunk_fn(qp, qc, iqc):
        scores = msa_layer.scores(iqc, ik, qp, t)  # [B, K, C, nb]
        sel = msa_layer.select_from_scores(jax.lax.stop_gradient(scores), qp, t, layer) if sparse_step else None
        kl, valid = _target_kl(qc, k, scores, kl_support(scores, sel), qp, t)
        return sel, kl, valid

    (sel, kl, valid), merge = msa.map_query_chunks(jax.checkpoint(chunk_fn), cfg.attention_chunk, q_pos, q, iq)
    if sparse_step:
        o = msa_kernels.attend_selected(q, k, v, merge(sel, 2), q_pos, block_size=t.index_block_size)
    else:
        o = _dense_attention(q, k, v, q_pos, cfg.attention_chunk)
    return o, (jnp.sum(merge(kl, 2)), jnp.sum(merge(valid, 2)))


def train_forward(params: dict, input_ids: jax.Array, cfg: M3Config, mode: str):
    """Text decoder for training (the model's layer loop with the training attention hook).
    Returns (final hidden [B, T, D], {MSA layer: (kl_sum, kl_rows)})."""
    b, n = input_ids.shape
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    h = params["text"]["embed"][input_ids]
    attend = functools.partial(_train_attention, mode=mode)
    h, kls, _ = text_hidden(params, h, positions, cfg, attend=attend)
    return h, kls


def loss_fn(params: dict, batch: dict, cfg: M3Config, mode: str, kl_weight: float = 1.0, dtype: str = "float32"):
    """LM cross-entropy + kl_weight * mean-over-MSA-layers indexer KL.

    batch: ``{"tokens": int32 [B, T + 1]}`` (inputs are tokens[:, :-1], labels tokens[:, 1:]) and
    optionally ``"mask"`` [B, T] (1 = count the label). ``dtype``: the forward's compute dtype (the
    floating weights are cast to it here, so their gradients come back in the weights' own dtype).
    Returns (total, {"lm", "kl", "kl_layers"}).
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; choose one of {MODES}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {DTYPES}")
    if mode == "indexer_only":
        labels = param_labels(params)
        params = jax.tree.map(lambda l, x: x if l == "index" else jax.lax.stop_gradient(x), labels, params)
    params = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    h, kls = train_forward(params, inputs, cfg, mode)
    if mode == "indexer_only":
        lm = jnp.zeros((), jnp.float32)  # main weights frozen: the LM term has no gradient to give
    else:
        ce = optax.softmax_cross_entropy_with_integer_labels(lm_head(params, h).astype(jnp.float32), targets)
        mask = batch.get("mask")
        mask = jnp.ones_like(ce) if mask is None else mask.astype(jnp.float32)
        lm = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    per_layer = (jnp.stack([(s / jnp.maximum(r, 1)).astype(jnp.float32) for s, r in kls.values()]) if kls
                 else jnp.zeros((0,)))
    kl = jnp.mean(per_layer) if kls else jnp.zeros((), jnp.float32)
    return lm + kl_weight * kl, {"lm": lm, "kl": kl, "kl_layers": per_layer}


def make_train_step(cfg: M3Config, tx: optax.GradientTransformation, mode: str, kl_weight: float = 1.0, mesh=None,
                    dtype: str = "float32"):
    """Jitted ``step(state, batch) -> (state, metrics)`` (state donated); the forward computes in
    ``dtype`` (:func:`loss_fn`). With ``mesh`` the step runs under it: parameters keep the shardings
    they were placed with (``m3jax.sharding.shard_params``), the batch is split over the data axis."""

    def step(state: TrainState, batch: dict):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, cfg, mode, kl_weight,
                                                                       dtype)
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

    def run(state, batch):
        batch = {k: jax.device_put(v, NamedSharding(mesh, P(DATA))) for k, v in batch.items()}
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    return run


def make_eval_step(cfg: M3Config, mode: str = "sparse", dtype: str = "float32"):
    """Jitted ``(params, batch) -> {"lm", "kl", "kl_layers"}`` (no gradients)."""
    return jax.jit(lambda params, batch: loss_fn(params, batch, cfg, mode, dtype=dtype)[1])

# --------------------------------------------------------------------------------------------------
# Checkpoints (orbax): the whole TrainState


def _state_tree(state: TrainState) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


def checkpoint_manager(directory: str | Path, max_to_keep: int = 2):
    return ocp.CheckpointManager(Path(directory).absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep))


def save_state(mngr, state: TrainState) -> None:
    mngr.save(int(state.step), args=ocp.args.StandardSave(_state_tree(state)))
    mngr.wait_until_finished()


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


def restore_state(mngr, like: TrainState, step: int | None = None) -> TrainState:
    """Restore the latest (or ``step``) checkpoint into the structure, dtypes and shardings of ``like``."""
    step = mngr.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {mngr.directory}")
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), _state_tree(like)
    )
    tree = mngr.restore(step, args=ocp.args.StandardRestore(abstract))
    return TrainState(tree["params"], tree["opt_state"], tree["step"])


# --------------------------------------------------------------------------------------------------
# Recall (m3jax.probe) and plots


def mean_recall(params: dict, cfg: M3Config, tokens: np.ndarray) -> dict[int, float]:
    """{MSA layer: mean dense-softmax mass inside the selected blocks} on ``tokens`` [B, T]."""
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


# How long the other processes wait for process 0 to prepare the run folder (training a tokenizer).
CORPUS_TIMEOUT_S = 3600


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
    # Text-only training. The attention path is resolved once, here (msa.layer's one resolution); by
    # default one attention chunk is the whole (short) training sequence on the reference path, and
    # KERNEL_QUERY_CHUNK rows on the kernel path (its memory must stay linear in T at 16K and beyond).
    impl = msa_layer.resolve_attention_impl(args.attention_impl, cfg, args.dtype)
    chunk = args.attention_chunk or (min(args.seq_len, KERNEL_QUERY_CHUNK) if impl == "pallas" else args.seq_len)
    return cfg.replace(attention_impl=impl, attention_chunk=chunk)


def _check_tokenizer_from(folder: Path, cfg: M3Config) -> None:
    """--tokenizer-from's tokenizer must exist and fit the model's vocabulary: ids past it would be clamped
    by the embedding lookup and train a model that never sees them right (the loss goes NaN)."""
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


def _steps_for_budget(cfg: M3Config, params: dict, args, batch_for, mesh) -> int:
    """Steps that fit in ``args.time_budget`` seconds: compile and time a few steps of ``args.mode``
    on a throw-away state, keep a margin for the evaluations and the final save. (A shorter dense
    warm-up, ``--dense-warmup-seq-len``, is cheaper per step: the estimate errs on the safe side.)"""
    tx = make_optimizer(args.mode, 100, args.lr, args.index_lr, args.warmup)
    state = init_state(jax.tree.map(jnp.copy, params), tx)  # the step donates its state
    step = make_train_step(cfg, tx, args.mode, args.kl_weight, mesh, args.dtype)
    times = []
    for s in range(6):
        t0 = time.time()
        state, m = step(state, batch_for(s, args.mode))
        jax.block_until_ready(m)
        times.append(time.time() - t0)
    per_step = float(np.median(times[2:]))
    n_evals_share = 1.15  # a margin for the evaluations every eval_every steps and the checkpoints
    steps = int(args.time_budget / (per_step * n_evals_share))
    print(f"timing: {per_step * 1e3:.0f} ms/step after compile ({times[0]:.1f}s first step)", flush=True)
    return max(steps, 10)


# --------------------------------------------------------------------------------------------------
# main, step by step


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
# any other difference to the recorded run_args.json is refused, naming the argument. The attention
# path is one of them (both paths compute the same objective; the kernels are a speed choice, and
# "auto" resolves by the machine) but it is recorded: run_args.json says what the run started on.
RESUME_MAY_CHANGE = ("steps", "ckpt_every", "eval_every", "eval_batches", "stop_after", "time_budget", "save_format",
                     "attention_impl")
# How the job was joined is not the run: the coordinator's address and this process's index change
# from job to job, and the timeouts alter nothing computed. The job's process count is recorded
# instead, as "processes", and may change on --resume (see check_run_args).
_JOB_FLAGS = ("coordinator", "num_processes", "process_id", "heartbeat_timeout", "init_timeout")
_NOT_RECORDED = (tuple(a for a in RESUME_MAY_CHANGE if a != "attention_impl") + _JOB_FLAGS
                 + ("resume", "overwrite", "out", "debug"))


def check_run_args(out: Path, args) -> None:
    """Record the run's arguments and the job's process count in ``out/run_args.json`` (a new run), or
    compare them on --resume. Another process count is handled, with a note naming both counts: orbax
    restores the state into this job's mesh whatever layout saved it, and the batches depend on the
    step alone (another device count is refused anyway, as another --data-parallel)."""
    path = out / "run_args.json"
    now = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items()) if k not in _NOT_RECORDED}
    now["processes"] = jax.process_count()
    if args.resume and path.exists():
        try:
            recorded = json.loads(path.read_text())
        except ValueError as e:
            raise cli.UsageError(f"--resume: {path} is not JSON ({e}); it records the run's arguments") from None
        recorded = {k: v for k, v in recorded.items() if k not in _JOB_FLAGS}  # recorded by older runs
        was = recorded.pop("processes", 1)  # a run recorded before jobs of several processes: one
        now.pop("processes")
        changed = [k for k in sorted(set(now) | set(recorded))
                   if k not in RESUME_MAY_CHANGE and now.get(k) != recorded.get(k)]
        if changed:
            diffs = ", ".join(f"--{k.replace('_', '-')} {now.get(k)!r} (the run used {recorded.get(k)!r})"
                              for k in changed)
            raise cli.UsageError(
                f"--resume: {diffs} differ from the run in {out}; a resumed run must be the same run (only "
                f"{', '.join('--' + a.replace('_', '-') for a in RESUME_MAY_CHANGE)} may change): start a new --out "
                "instead")
        if was != jax.process_count():
            print(f"note: --resume: the run in {out} ran as {was} process(es), this job has {jax.process_count()}: "
                  "its orbax state is restored into this job's mesh", file=sys.stderr, flush=True)
        return
    atomic.atomic_write(path, json.dumps(now, indent=1))


def build_parser() -> cli.ArgumentParser:
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
                    help=f"query rows per attention chunk (0 = seq-len; on the kernels at most {KERNEL_QUERY_CHUNK})")
    ap.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                    help="auto: the MSA kernels (with their backward) on a GPU that takes the config, the jnp "
                         "reference elsewhere; pallas off the GPU runs them in interpret mode (a test tool)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="compute dtype of the forward (weights and optimizer state stay fp32)")
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
    cli.add_distributed_arguments(ap)
    cli.add_debug_flag(ap)
    return ap


def parse_args(argv=None):
    """The CLI's arguments, checked against each other; the warm-up's sequence length and batch
    default to the run's."""
    ap = build_parser()
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
    return args


@dataclasses.dataclass
class Run:
    """What the steps of :func:`main` share: arguments, config, run folder, data and mesh."""

    args: Any
    cfg: M3Config
    out: Path
    mngr: Any  # orbax CheckpointManager of out/ckpt
    resuming: bool
    tok: Any
    train_stream: np.ndarray
    held_stream: np.ndarray
    encode: data.TextEncoder
    mesh: Any

    def batch(self, step: int, mode: str) -> dict:
        """The training batch of ``step`` (deterministic: a resumed run sees the same data)."""
        a = self.args
        seq, b = (a.dense_warmup_seq_len, a.dense_warmup_batch) if mode == "dense_warmup" else (a.seq_len, a.batch)
        if a.data == "retrieval":
            return data.retrieval_batch(self.train_stream, step, b, seq, a.seed, self.encode, a.kv_per_1k, a.task_share)
        return data.sample_batch(self.train_stream, step, b, seq, a.seed)


def open_run(args) -> Run:
    """Config, run folder, checkpoint manager, data and mesh. Everything that can refuse the run does
    so before --out is touched."""
    if args.init_from and not (Path(args.init_from) / "config.json").is_file():
        raise cli.UsageError(f"--init-from {args.init_from}: no config.json there (an HF checkpoint folder)")
    cfg = _load_cfg(args)
    if args.tokenizer_from:
        _check_tokenizer_from(Path(args.tokenizer_from), cfg)
    out = args.out
    corpus = (out, cfg, args.data_mb, args.tokenizer_mb, args.tokenizer_from)
    # Several processes (one shared --out): process 0 prepares the folder and then the corpus, the others
    # read its tokenizer.json and data.npz back once it is done.
    if distributed.is_voice():
        prepare_out_dir(out, args.resume, args.overwrite)
        check_run_args(out, args)
    distributed.barrier("train/run-folder", CORPUS_TIMEOUT_S)
    mngr = checkpoint_manager(out / "ckpt")
    resuming = args.resume and mngr.latest_step() is not None
    if args.resume and not resuming and distributed.is_voice():
        print(f"note: --resume: no checkpoint in {out / 'ckpt'} yet; starting at step 0", file=sys.stderr, flush=True)
    if distributed.is_voice():
        tok, train_stream, held_stream = data.prepare_corpus(*corpus)
    distributed.barrier("train/corpus", CORPUS_TIMEOUT_S)
    if not distributed.is_voice():
        tok, train_stream, held_stream = data.prepare_corpus(*corpus)
    encode = data.text_encoder(tok, cfg.text.vocab_size)
    mesh = make_mesh(args.data_parallel, data=args.data_parallel) if args.data_parallel else None
    return Run(args, cfg, out, mngr, resuming, tok, train_stream, held_stream, encode, mesh)


def initial_params(run: Run) -> dict:
    """fp32 weights from --init-from's checkpoint or fresh, placed on the mesh when there is one."""
    if run.args.init_from:
        params = load_params(run.args.init_from, run.cfg, dtype="float32", progress=False)
    else:
        params = init_train_params(run.cfg, run.args.seed)
    return params if run.mesh is None else shard_params(params, run.cfg, run.mesh)


def settle_step_counts(run: Run, params: dict) -> None:
    """With --time-budget: set ``args.steps`` (and the warm-up's share) to what fits, or to the counts
    an earlier run chose (they set the LR schedule and the phase boundary: a resumed run reuses them)."""
    args = run.args
    if not args.time_budget:
        return
    chosen = run.out / "time_budget_steps.json"
    if run.resuming and chosen.exists():
        args.steps, args.dense_warmup_steps = json.loads(chosen.read_text())
    else:  # process 0's timing decides for every process
        args.steps = distributed.from_voice(_steps_for_budget(run.cfg, params, args, run.batch, run.mesh))
        if args.dense_warmup_frac:
            args.dense_warmup_steps = int(round(args.steps * args.dense_warmup_frac))
        if distributed.is_voice():
            atomic.atomic_write(chosen, json.dumps([args.steps, args.dense_warmup_steps]))
    print(f"time budget {args.time_budget:.0f}s -> --steps {args.steps} --dense-warmup-steps {args.dense_warmup_steps}",
          flush=True)


def phase_plan(args) -> list[tuple[str, int]]:
    """[(mode, steps)]: a dense warm-up before a sparse run when asked for, else one phase."""
    if args.mode != "sparse" or args.dense_warmup_steps <= 0:
        return [(args.mode, args.steps)]
    return [("dense_warmup", args.dense_warmup_steps), (args.mode, args.steps - args.dense_warmup_steps)]


def resume(run: Run, state: TrainState) -> tuple[TrainState, list[dict]]:
    """The saved state and the log rows up to its step when resuming, else ``state`` and no rows."""
    if not run.resuming:
        return state, []
    state = restore_intact_state(run.mngr, state)
    csv_path = run.out / "train_log.csv"
    rows = []
    if csv_path.exists():
        with open(csv_path) as f:
            rows = [r for r in csv.DictReader(f) if int(r["step"]) <= int(state.step)]
    print(f"resumed at step {int(state.step)}", flush=True)
    return state, rows


class Evaluator:
    """``evaluator(params, rec=None)`` -> (held-out text lm, kl, recall, answer CE of the held-out
    retrieval rows or NaN) on fixed held-out batches."""

    def __init__(self, run: Run):
        args, self.cfg = run.args, run.cfg
        self.step = make_eval_step(run.cfg, "sparse", args.dtype)
        text = data.heldout_batches(run.held_stream, args.eval_batches, args.batch, args.seq_len)
        self.evals, self.probe_tokens = text, text[0]["tokens"][:, :-1]
        self.task_evals = []
        if args.data == "retrieval":
            # Held-out rows with the tasks, loss on the answers only: the retrieval learning curve. The text
            # batches get an all-ones mask so both kinds share one compiled eval step.
            self.evals = [{**b, "mask": np.ones(b["tokens"][:, 1:].shape, np.float32)} for b in text]
            self.task_evals = [
                data.retrieval_batch(run.held_stream, i, args.batch, args.seq_len, args.seed, run.encode,
                                     args.kv_per_1k, answers_only=True)
                for i in range(args.eval_batches)
            ]

    def recall(self, params) -> dict[int, float]:
        return mean_recall(params, self.cfg, self.probe_tokens)

    def __call__(self, params, rec=None):
        """``rec``: the per-layer recall when the caller has it already (a probe pass over long rows
        is slow)."""
        ms = [self.step(params, b) for b in self.evals]
        lm = float(np.mean([m["lm"] for m in ms]))
        kl = float(np.mean([m["kl"] for m in ms]))
        if rec is None:
            rec = self.recall(params) if self.cfg.text.has_sparse_layers else {}
        ans = float(np.mean([self.step(params, b)["lm"] for b in self.task_evals])) if self.task_evals else float("nan")
        return lm, kl, float(np.mean(list(rec.values()))) if rec else float("nan"), ans


def train_loop(run: Run, state: TrainState, tx, phases, evaluate: Evaluator, rows: list[dict]):
    """Run the phases' steps up to ``args.steps`` (or --stop-after), logging every step to
    train_log.csv, evaluating every --eval-every and saving every --ckpt-every steps; then plot the
    curves. Returns (state, wall time the loop started)."""
    args = run.args
    steps = {m: make_train_step(run.cfg, tx, m, args.kl_weight, run.mesh, args.dtype) for m, _ in phases}
    boundary = phases[0][1] if len(phases) == 2 else 0
    csv_path = run.out / "train_log.csv"
    # The CSV is rewritten with the rows up to the (restored) step, then appended to every step.
    csv_file = open(csv_path if distributed.is_voice() else os.devnull, "w", newline="")
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
        # (process 0's clock decides, so that every process stops at the same step)
        if args.stop_after and distributed.from_voice(time.time() - t_start > args.stop_after):
            print(f"--stop-after {args.stop_after:.0f}s: stopped at step {int(state.step)} of {args.steps}", flush=True)
            save_state(run.mngr, state)
            break
        s = int(state.step)
        mode = phases[0][0] if s < boundary else phases[-1][0]
        t0 = time.time()
        state, m = steps[mode](state, run.batch(s, mode))
        m = jax.device_get(m)
        stop_if_diverged(m, s + 1, run.mngr)
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
            save_state(run.mngr, state)
    csv_file.close()
    if distributed.is_voice():
        plot_curves(csv_path, run.out / "loss_curve.png")
    return state, t_start


def save_model(run: Run, state: TrainState) -> dict:
    """The trained weights as an HF checkpoint with its tokenizer in OUT/model; returns them on the host."""
    params = jax.device_get(state.params)
    if not distributed.is_voice():
        return params
    final = run.out / "model"
    fmt = run.args.save_format
    # prepare_out_dir guarded --out; a --resume of a run that saved its model already saves it again.
    # The tokenizer goes in the same atomic save: the folder never holds the weights without it.
    save_pretrained(M3Model(run.cfg.replace(attention_impl="auto"), params), final,
                    dtype="bfloat16" if fmt == "mxfp8" else fmt, quantize_mxfp8_weights=fmt == "mxfp8",
                    overwrite=True, extra_files=data.tokenizer_files(run.tok, run.cfg))
    return params


def write_summary(run: Run, state: TrainState, params: dict, index_init: list, evaluate: Evaluator,
                  t_start: float) -> None:
    """OUT/summary.json (also printed): the run's settings, held-out losses and, with MSA layers, the
    recall of the trained index branch against the one it started from."""
    args, cfg = run.args, run.cfg
    summary = {"steps": int(state.step), "scheduled_steps": args.steps, "dense_warmup_steps": args.dense_warmup_steps,
               "config": args.config, "block_size": cfg.text.index_block_size, "topk": cfg.text.index_topk_blocks,
               "seq_len": args.seq_len, "batch": args.batch, "data": args.data, "attention_impl": cfg.attention_impl,
               "dtype": args.dtype, "train_seconds": round(time.time() - t_start, 1),
               "save_format": args.save_format, "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    rec = None
    if cfg.text.has_sparse_layers:
        untrained = with_index_branch(params, index_init)
        rec = summary["recall_trained_index"] = evaluate.recall(params)
        summary["recall_initial_index"] = evaluate.recall(untrained)
    lm, kl, _, ans = evaluate(params, rec)
    summary.update(heldout_lm=lm, heldout_kl=kl)
    if args.data == "retrieval":
        summary.update(heldout_answer_ce=ans, kv_per_1k=args.kv_per_1k, task_share=args.task_share,
                       dense_warmup_seq_len=args.dense_warmup_seq_len, dense_warmup_batch=args.dense_warmup_batch)
    summary["processes"] = jax.process_count()
    if distributed.is_voice():
        atomic.atomic_write(run.out / "summary.json", json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    if distributed.initialize(args) and args.data_parallel != jax.device_count():
        raise cli.UsageError(f"a job of {jax.process_count()} processes trains data parallel over all its "
                             f"{jax.device_count()} devices: pass --data-parallel {jax.device_count()}")
    refuse_out_over_inputs(args)
    with contextlib.ExitStack() as stack:
        if distributed.is_voice():  # process 0 holds the run lock for the job: two runs on one --out would corrupt it
            args.out.absolute().parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(atomic.folder_lock(args.out, "a second training run"))
        else:  # one voice: the other processes' step lines go nowhere (their errors still reach stderr)
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        return _main(args)


def _main(args) -> int:
    run = open_run(args)
    params = initial_params(run)
    settle_step_counts(run, params)
    phases = phase_plan(args)
    tx = make_optimizer(phases[-1][0], args.steps, args.lr, args.index_lr, args.warmup)
    state = init_state(params, tx)
    index_init = jax.tree.map(np.asarray, [lp.get("index") for lp in params["text"]["layers"]])
    state, rows = resume(run, state)
    evaluate = Evaluator(run)
    state, t_start = train_loop(run, state, tx, phases, evaluate, rows)
    params = save_model(run, state)
    write_summary(run, state, params, index_init, evaluate, t_start)
    return 0


if __name__ == "__main__":
    cli.run(main)
