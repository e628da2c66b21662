"""MSA — MiniMax Sparse Attention, in one package.

- :mod:`m3jax.msa.reference`: the maths in pure jnp (index block scores, block priority and top-k
  selection, gathered sparse attention, the dense-mask form, log-sum-exp merge). It imports nothing
  from m3jax, so every layer may use it: the model, the parallel MSA and the Pallas kernels'
  references.
- :mod:`m3jax.msa.layer`: the one entry the model calls (``attend``): the route of a layer's step
  (paged cache read in place, context parallel, or the key window gathered), the registry of MSA
  variants that ``attention_impl`` names, and its one resolution.
- :mod:`m3jax.msa.kernels`: the one place that composes the Mosaic GPU kernels (:mod:`m3jax.pallas`),
  including the per-device pieces of the context-parallel paths, and the reasons a config cannot
  take them.
- :mod:`m3jax.msa.parallel`: MSA over a device mesh: one head-split wrapper and one context-parallel
  skeleton (the context split over the devices, a global top-k and an LSE merge).
- :mod:`m3jax.msa.compare`: two block selections of the same queries compared, near-ties named.

Imports go one way: model -> msa.layer -> msa.kernels / msa.parallel -> pallas -> msa.reference.
This module re-exports the reference only, so importing it never pulls in the kernels.
"""

from m3jax.msa.reference import (  # noqa: F401
    HIGHEST,
    NEG_INF,
    block_scores,
    dense_mask_attention,
    forced_priority,
    lse_merge,
    map_query_chunks,
    rank_scores,
    select_blocks,
    sparse_attention,
)
