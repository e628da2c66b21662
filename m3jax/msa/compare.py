"""Compare two MSA block selections of the same queries, and say which differences are near-ties.

In fp32 the kernel path and the reference path select the same blocks in every row (the precision
contract, :func:`m3jax.layers.matmul_precision`). In bf16 they compute the same products in another
order and round intermediate activations to bf16 at other points, so a row may select other blocks;
that is legitimate only where the reference's k-th and (k+1)-th block scores lie within what that
rounding can move a score.

The bound (``BF16_TIE_REL``, relative to the row's largest visible |block score|): a layer's index
inputs iq, ik are bf16 on both paths, but each path rounds the residual stream, the attention output
and the projections at other points, so after the first layer iq and ik differ by up to about two
bf16 roundings each (2 x 2^-8 relative: their own, and the one inherited from the residual stream).
A score iq . ik then moves by at most 4 * 2^-8 * sum_i |iq_i ik_i|, and a swap of the k-th and
(k+1)-th blocks needs both scores to move towards each other: margin <= 8 * 2^-8 = 2^-5 times the
score scale. The scale sum_i |iq_i ik_i| is taken as the row's largest |score| (a scale, not a
proof: ``SelectionDiff.worst_margin_rel`` reports the largest margin among differing rows in the same
unit, so the bound is checked by measurement; on the kernel_g8 fixture in bf16 it is 2.1e-2, and two
reference formulations of the same model, ``forward`` and ``probe``, differ in a similar number of
rows). Rows where the sets differ with a margin above the bound are errors, never near-ties.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

BF16_TIE_REL = 2.0**-5


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


def compare_selections(sel, sel_ref, scores_ref, q_pos, block_size: int,
                       rel_bound: float = BF16_TIE_REL) -> SelectionDiff:
    """Count the rows where ``sel`` and ``sel_ref`` (int32 [B, K, T, topk], -1 padded, any order)
    select different sets, and how many of them are near-ties of the reference scores
    ``scores_ref`` fp32 [B, K, T, nb] (the module docstring's bound, ``rel_bound`` x the row's largest
    visible |score|). q_pos [B, T]."""
    sel, sel_ref = np.asarray(sel), np.asarray(sel_ref)
    as_sets = lambda x: np.sort(np.where(x >= 0, x, np.iinfo(np.int32).max), axis=-1)  # noqa: E731
    differ = (as_sets(sel) != as_sets(sel_ref)).any(-1)  # [B, K, T]
    scores_ref = np.asarray(scores_ref, np.float32)
    margin = np.asarray(selection_margin(jnp.asarray(scores_ref), jnp.asarray(sel_ref), jnp.asarray(q_pos),
                                         block_size))
    scale = np.max(np.where(np.isfinite(scores_ref), np.abs(scores_ref), 0.0), axis=-1)
    rel = np.where(np.isnan(margin), np.inf, margin) / np.maximum(scale, 1e-30)  # no margin: not a tie
    inside = differ & (rel <= rel_bound)
    return SelectionDiff(rows=int(differ.size), differing=int(differ.sum()), inside_bound=int(inside.sum()),
                         worst_margin_rel=float(rel[differ].max()) if differ.any() else 0.0)
