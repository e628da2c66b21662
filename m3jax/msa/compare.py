"""Compare two MSA block selections of the same queries, and say which differences are near-ties.

In fp32 the kernel path and the reference path select the same blocks in every row (the precision
contract, :func:`m3jax.layers.matmul_precision`). In bf16 the selections are compared on the SAME
inputs (:func:`m3jax.probe.kernel_selection_agreement`: each MSA layer's own iq / ik from the
reference path's residual stream), so the only difference left is arithmetic: the reference upcasts
the bf16 iq, ik to fp32 and sums the Hx products in XLA's order, the kernel multiplies them on the
tensor cores with fp32 accumulation in its own order. A product of two bf16 numbers is exact in fp32,
so each score is the exact dot product up to fp32 summation error: at most (Hx - 1) u sum_i |iq_i ik_i|
for round-to-nearest (u = 2^-24). Two such scores differ by twice that, and the k-th and (k+1)-th
blocks of a row can swap only if their reference margin is below twice the difference again:
margin <= 4 (Hx - 1) u S, with S the row's largest sum_i |iq_i ik_i| over its visible blocks. The
bound used, :func:`summation_bound`, doubles that once more (8 Hx u) because the tensor cores' fp32
accumulation is not guaranteed to round to nearest. Rows whose sets differ with a margin above it are
errors, never near-ties.

The fp8 indexer (``index_score_dtype="float8_e4m3fn"``) changes the scores themselves: e4m3 keeps 3
mantissa bits, so each quantised element is within u8 = 2^-4 of itself (relative, round to nearest;
elements below e4m3's normal range, 2^-6 of the row's scaled maximum, round to a fixed step instead:
outside this bound, and negligible for RMS-normed index vectors) and each product within 2 u8 + u8^2.
A block's score moves by at most that times S, and two blocks swap only if their bf16 margin is below
twice it: :func:`fp8_score_bound` (plus the fp32 summation bound). It is a loose bound: it says which
differences can come from quantisation, and the selection study measures how often they do.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

U_FP32 = 2.0**-24
U_E4M3 = 2.0**-4  # unit roundoff of fp8 e4m3 (3 mantissa bits)


def summation_bound(index_head_dim: int) -> float:
    """Largest reference margin (relative to the row's sum |iq . ik| scale) at which two fp32
    summation orders of the same bf16 products can swap the k-th and (k+1)-th blocks."""
    return 8 * index_head_dim * U_FP32


def fp8_score_bound(index_head_dim: int) -> float:
    """Largest bf16 margin (relative to the row's sum |iq . ik| scale) at which the fp8 indexer can
    select a different set than the bf16 one (module docstring)."""
    return 2 * (2 * U_E4M3 + U_E4M3**2) + summation_bound(index_head_dim)


def selection_margin(scores, sel, q_pos, block_size: int):
    """Last selected score minus the best unselected visible score per (b, group, query), over the
    blocks that compete on their score (before the own block, which is forced); NaN when every
    competing block is selected or none is. scores fp32 [B, K, C, nb]; sel int32 [B, K, C, topk]."""
    nb = scores.shape[-1]
    j = jnp.arange(nb)
    chosen = jnp.any(sel[..., None] == j, axis=-2)  # [B, K, C, nb]
    own = (q_pos // block_size)[:, None, :, None]
    ranked = jnp.isfinite(scores) & (j[None, None, None, :] < own)
    in_score = jnp.where(chosen & ranked, scores, jnp.inf).min(-1)
    out_score = jnp.where(~chosen & ranked, scores, -jnp.inf).max(-1)
    ok = jnp.isfinite(in_score) & jnp.isfinite(out_score)
    return jnp.where(ok, in_score - out_score, jnp.nan)


@dataclasses.dataclass(frozen=True)
class SelectionDiff:
    rows: int  # (batch, group, query) rows compared
    differing: int  # rows whose selected sets differ
    inside_bound: int  # of those, rows whose reference margin is within the near-tie bound
    worst_margin_rel: float  # largest margin / score scale among differing rows (0.0 when none)

    @property
    def unexplained(self) -> int:
        """Differing rows that are not near-ties: errors."""
        return self.differing - self.inside_bound


def compare_selections(sel, sel_ref, scores_ref, q_pos, block_size: int, scale, rel_bound: float) -> SelectionDiff:
    """Count the rows where ``sel`` and ``sel_ref`` (int32 [B, K, T, topk], -1 padded, any order)
    select different sets, and how many of them are near-ties of the reference scores
    ``scores_ref`` fp32 [B, K, T, nb]: reference margin <= ``rel_bound`` x ``scale`` [B, K, T] (the
    row's score scale; module docstring). q_pos [B, T]."""
    sel, sel_ref = np.asarray(sel), np.asarray(sel_ref)
    as_sets = lambda x: np.sort(np.where(x >= 0, x, np.iinfo(np.int32).max), axis=-1)  # noqa: E731
    differ = (as_sets(sel) != as_sets(sel_ref)).any(-1)  # [B, K, T]
    margin = np.asarray(selection_margin(jnp.asarray(scores_ref, jnp.float32), jnp.asarray(sel_ref),
                                         jnp.asarray(q_pos), block_size))
    rel = np.where(np.isnan(margin), np.inf, margin) / np.maximum(np.asarray(scale), 1e-30)  # no margin: not a tie
    inside = differ & (rel <= rel_bound)
    return SelectionDiff(rows=int(differ.size), differing=int(differ.sum()), inside_bound=int(inside.sum()),
                         worst_margin_rel=float(rel[differ].max()) if differ.any() else 0.0)
