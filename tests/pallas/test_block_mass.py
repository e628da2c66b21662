"""The indexer objective's target mass: Mosaic GPU kernel (m3jax/pallas/block_mass) vs the pure-jnp
reference, and the KL objective on the kernel's mass vs the reference objective.

Off-GPU the kernel runs in Mosaic GPU interpret mode with the race detector on; the same bodies run
on a Hopper GPU. Shapes are tiny to keep the file fast on a CPU, but cover every block size the
model uses (16, 64, 128), one and two KV groups, a ragged T (not a multiple of the 64-token tile),
and chunked prefill (q_pos offset, keys beyond the chunk, per-row offsets in a batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax.indexer_objective import indexer_kl, kl_support
from m3jax.msa.kernels import indexer_target_mass
from m3jax.pallas import _backend
from m3jax.pallas.block_mass import BlockMassConfig, block_mass
from m3jax.pallas.tolerances import TOL

# (batch, T, N, K, H, block, S, q_pos offsets per batch row, dtype, config)
CASES = {
    "bs16_g2_ragged_fp32": (1, 100, 4, 2, 32, 16, 100, (0,), jnp.float32, None),
    "bs64_g1_chunk_bf16": (2, 70, 4, 1, 64, 64, 200, (130, 100), jnp.bfloat16, None),
    # 25 key blocks: two key spans (CTAs) per query tile, their LSEs merged between the passes
    "bs16_g2_spans_fp32": (1, 64, 4, 2, 32, 16, 400, (336,), jnp.float32, BlockMassConfig(key_span_blocks=16)),
    # one head per CTA: the group's heads summed over CTAs, as M3's 16 are (two chunks of 8)
    "bs128_g2_chunk_fp32_split_heads": (1, 64, 4, 2, 32, 128, 300, (236,), jnp.float32,
                                        BlockMassConfig(max_heads_per_cta=1)),
}


def _inputs(b, t, n, kh, h, s, offsets, dtype, seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(k1, (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(k2, (b, s, kh, h), jnp.float32).astype(dtype)
    q_pos = (jnp.asarray(offsets, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None]).astype(jnp.int32)
    return q, k, q_pos


@pytest.mark.parametrize("case", list(CASES))
def test_block_mass_matches_reference(case):
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    b, t, n, kh, h, bs, s, offsets, dtype, config = CASES[case]
    q, k, q_pos = _inputs(b, t, n, kh, h, s, offsets, dtype)
    nb = -(-s // bs)
    got = np.asarray(block_mass(q, k, q_pos, block_size=bs, num_blocks=nb, config=config))
    ref = np.asarray(block_mass(q, k, q_pos, block_size=bs, num_blocks=nb, implementation="reference"))
    assert not _backend.interpret_races_found()
    assert got.shape == ref.shape == (b, kh, t, nb) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, **TOL[("block_mass", jnp.dtype(dtype).name)])
    np.testing.assert_array_equal(got == 0, ref == 0)  # blocks a row cannot see are exactly 0


@pytest.mark.parametrize("sparse", [False, True], ids=["dense_warmup", "sparse"])
def test_indexer_kl_on_kernel_mass(sparse):
    """KL value and its gradient w.r.t. the index scores, mass from the kernel vs the reference objective
    (fp32 1e-5); no gradient reaches q or k through the kernel."""
    # Machine: any: interpret mode on a CPU, compiled for the device on a GPU (the same assertions on both)
    b, t, n, kh, h, bs, s, offsets, dtype, _ = CASES["bs16_g2_ragged_fp32"]
    q, k, q_pos = _inputs(b, t, n, kh, h, s, offsets, dtype)
    nb, hx = -(-s // bs), 32
    visible = jnp.arange(nb)[None, None, None, :] <= (q_pos // bs)[:, None, :, None]
    noise = jax.random.normal(jax.random.key(1), (b, kh, t, nb)) * 4
    scores = jnp.where(visible, noise, -jnp.inf)
    sel = None
    if sparse:  # own block + up to two ranked visible blocks, -1 padded
        ranked = jnp.argsort(-jnp.where(visible, noise, -jnp.inf), axis=-1)[..., :3].astype(jnp.int32)
        sel = jnp.where(jnp.take_along_axis(visible, ranked, -1), ranked, -1)
        sel = sel.at[..., 0].set(jnp.broadcast_to((q_pos // bs)[:, None, :], sel.shape[:-1]))
    support = kl_support(scores, sel)

    def objective(scores, q, k, use_kernel):
        mass = indexer_target_mass(q, k, q_pos, block_size=bs, num_blocks=nb) if use_kernel else None
        kl, valid = indexer_kl(q, k, scores, support, q_pos, bs, hx, mass=mass)
        return kl.sum() / jnp.maximum(valid.sum(), 1)

    (val, (g_scores, g_q, g_k)) = jax.value_and_grad(objective, argnums=(0, 1, 2))(scores, q, k, True)
    ref_val, ref_g = jax.value_and_grad(objective)(scores, q, k, False)
    assert not _backend.interpret_races_found()
    np.testing.assert_allclose(float(val), float(ref_val), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(g_scores), np.asarray(ref_g), rtol=1e-5, atol=1e-5)
    assert not np.asarray(g_q).any() and not np.asarray(g_k).any()


def test_block_mass_lowers_for_hopper():
    """Interpret mode does not check Mosaic GPU's layout rules; lowering for sm_90a does (on any machine,
    nothing compiled). M3's widths: 16 heads per group in two CTAs of 8, H = 128, block 128, keys in
    two spans."""
    # Machine: any: lowers for a named target (no GPU needed); nothing is compiled or run
    shapes = (jax.ShapeDtypeStruct((1, 128, 64, 128), jnp.bfloat16),
              jax.ShapeDtypeStruct((1, 4096, 4, 128), jnp.bfloat16), jax.ShapeDtypeStruct((1, 128), jnp.int32))
    with _backend.lowering_for(_backend.HOPPER):
        fn = jax.jit(lambda q, k, p: block_mass(q, k, p, block_size=128, num_blocks=32))
        text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
