"""MSA — MiniMax Sparse Attention, in one package.

- :mod:`m3jax.msa.reference`: the maths in pure jnp (index block scores, block priority and top-k
  selection, gathered sparse attention, the dense-mask form, log-sum-exp merge). It imports nothing
  from m3jax, so every layer may use it: the model, the parallel MSA and the Pallas kernels'
  references.
- :mod:`m3jax.msa.layer`: one MSA attention layer as the model runs it, through the reference or
  the Mosaic GPU kernels (:mod:`m3jax.pallas`), and the reasons a config cannot take the kernels.
- :mod:`m3jax.msa.parallel`: MSA over a device mesh (query heads split, or the context split over
  the devices with a global top-k and an LSE merge).

Imports go one way: model -> msa.layer / msa.parallel -> pallas -> msa.reference. This module
re-exports the reference only, so importing it never pulls in the kernels.
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
