"""The MSA indexer objective: KL from the main branch's attention to the index branch's block scores.

Per MSA layer, query t and KV group g, the **target** is the main branch's own attention, computed
from ``stop_gradient``'d q/k: the causal softmax of every query head of the group, summed per key
block, averaged over the group's heads, restricted to the support and renormalised. The
**prediction** is a softmax over the support of the index branch's max-pooled block scores scaled by
``1/sqrt(index_head_dim)`` (the selection is scale-free, so the scale is only the temperature of the
KL; 1/sqrt(Hx) puts the scores on the same footing as attention logits). The row value is
KL(target || prediction); rows are averaged over (batch, group, query) among the rows whose support
has at least two blocks (a one-block support has KL = 0 by construction).

The target's mass per block is :func:`m3jax.msa.reference.causal_block_mass`; on a GPU it comes from
the flash-style kernel (:func:`m3jax.msa.kernels.indexer_target_mass`, no [C, S] softmax), passed to
:func:`indexer_kl` as ``mass=``.

The support (:func:`kl_support`):

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

**Gradient paths.** The target reads ``stop_gradient(q), stop_gradient(k)``, and the training
forward (:mod:`m3jax.train`) feeds the index branch ``stop_gradient(x)`` of the layer's normed
input, so the KL reaches only the ``index`` weights (wq, wk, q_norm, k_norm). The LM loss reaches the
index weights through nothing: the block selection is discrete (``lax.top_k`` ids). Because the KL
and the LM loss reach disjoint parameter groups, each with its own Adam, the KL's weight in the total
loss barely matters (Adam is invariant to a loss scale); the indexer's pace is set by its learning
rate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from m3jax.msa import reference as msa

_BIG_NEG = -1e30


def kl_support(scores, sel=None):
    """bool [B, K, C, nb]: the blocks the KL runs over. ``sel`` int [B, K, C, topk] (-1 padded): the
    selected blocks (mode ``sparse``); None: every visible block (finite score)."""
    if sel is None:
        return jnp.isfinite(scores)
    nb = scores.shape[-1]
    return jax.nn.one_hot(sel, nb + 1, dtype=jnp.bool_)[..., :nb].any(-2)  # -1 -> no column


def indexer_kl(q, k, scores, support, q_pos, block_size: int, index_head_dim: int, mass=None):
    """KL(target || index prediction) per (batch, group, query) row of one query chunk.

    Args:
      q: [B, C, N, H] main queries; k: [B, S, K, H] main keys (both used under stop_gradient).
      scores: fp32 [B, K, C, nb] index block scores (differentiable w.r.t. the index branch).
      support: bool [B, K, C, nb] blocks the KL runs over.
      mass: fp32 [B, K, C, nb], the target mass already computed from these q, k (e.g. by the
        Mosaic GPU kernel, :func:`m3jax.msa.kernels.indexer_target_mass`); None: computed here by
        :func:`m3jax.msa.reference.causal_block_mass`. Either way it gets no gradient.
    Returns:
      (kl fp32 [B, K, C], valid bool [B, K, C]) — valid = support has >= 2 blocks.
    """
    if mass is None:
        q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
        mass = msa.causal_block_mass(q, k, q_pos, block_size, scores.shape[-1])
    target = jnp.where(support, jax.lax.stop_gradient(mass), 0.0)
    z = target.sum(-1, keepdims=True)
    target = jax.lax.stop_gradient(target / jnp.where(z > 0, z, 1.0))
    logq = jax.nn.log_softmax(jnp.where(support, scores * index_head_dim**-0.5, _BIG_NEG), axis=-1)
    pos = target > 0
    kl = jnp.sum(jnp.where(pos, target * (jnp.log(jnp.where(pos, target, 1.0)) - logq), 0.0), -1)
    valid = support.sum(-1) >= 2
    return jnp.where(valid, kl, 0.0), valid
