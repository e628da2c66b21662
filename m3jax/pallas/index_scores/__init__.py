"""MSA index block scoring (docs/MSA.md §1.2, docs/KERNELS.md §2.1): Mosaic GPU kernel + pure-jnp reference.

``index_block_scores(iq, ik, q_pos, *, block_size, implementation="pallas", config=None,
score_dtype="bfloat16", keys_fp8=False)`` returns fp32 ``[B, Hi, T, nb]`` with the semantics of
``m3jax.msa.block_scores`` (``score_dtype="float8_e4m3fn"``: the fp8 indexer, an e4m3 x e4m3 MMA;
:func:`fp8_unsupported_reason` says where the kernel cannot run it).
``index_select_blocks(...)`` is the fused scores + top-k kernel (the score matrix is never
written); it returns ``m3jax.msa.select_blocks``'s int32 ``[B, Hi, T, topk]`` in the same order, with the same
``force_in`` / ``force_out`` interventions (static tuples of block ids).
"""

from __future__ import annotations

from m3jax.pallas.index_scores import kernel as _kernel
from m3jax.pallas.index_scores import reference as _reference
from m3jax.pallas.index_scores.kernel import IndexScoreConfig, fp8_unsupported_reason, index_block_scores_blockmajor

__all__ = ["IndexScoreConfig", "index_block_scores", "index_select_blocks", "index_block_scores_blockmajor",
           "fp8_unsupported_reason"]


def index_block_scores(iq, ik, q_pos, *, block_size: int, implementation: str = "pallas", config=None,
                       score_dtype: str = "bfloat16", keys_fp8: bool = False):
    kw = dict(block_size=block_size, config=config, score_dtype=score_dtype, keys_fp8=keys_fp8)
    if implementation == "reference":
        _kernel.check_inputs("index_block_scores", iq, ik, q_pos, None, score_dtype)
    if implementation == "pallas":
        return _kernel.index_block_scores(iq, ik, q_pos, **kw)
    if implementation == "reference":
        return _reference.index_block_scores(iq, ik, q_pos, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")


def index_select_blocks(iq, ik, q_pos, *, block_size: int, topk: int, local_blocks: int = 1, init_blocks: int = 0,
                        force_in: tuple[int, ...] = (), force_out: tuple[int, ...] = (), implementation: str = "pallas",
                        config=None, score_dtype: str = "bfloat16", keys_fp8: bool = False):
    kw = dict(block_size=block_size, topk=topk, local_blocks=local_blocks, init_blocks=init_blocks,
              force_in=tuple(force_in), force_out=tuple(force_out), config=config, score_dtype=score_dtype,
              keys_fp8=keys_fp8)
    if implementation == "reference":
        _kernel.check_inputs("index_select_blocks", iq, ik, q_pos, None, score_dtype)
    if implementation == "pallas":
        return _kernel.index_select_blocks(iq, ik, q_pos, **kw)
    if implementation == "reference":
        return _reference.index_select_blocks(iq, ik, q_pos, **kw)
    raise ValueError(f"unknown implementation {implementation!r}")
