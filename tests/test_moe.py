"""MoE: sorted grouped-matmul path vs the dense every-expert reference; router semantics."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

from m3jax.moe import moe_dense_reference, moe_sorted, route
from m3jax.params import init_random
from tests.conftest import assert_close, tiny_config


def _moe_params(cfg, dtype=jnp.float32):
    return init_random(cfg, seed=5, dtype=dtype, scale=0.3)["text"]["layers"][1]["moe"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sorted_equals_dense_reference(dtype):
    cfg = tiny_config()
    p = _moe_params(cfg, jnp.dtype(dtype))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(53, cfg.text.hidden_size)), dtype)
    got = moe_sorted(x, p, cfg.text)
    ref = moe_dense_reference(x, p, cfg.text)
    assert got.dtype == x.dtype
    assert_close(got.astype(jnp.float32), ref.astype(jnp.float32), dtype, "sorted vs dense MoE")


def test_router_bias_only_chooses():
    cfg = tiny_config()
    p = dict(_moe_params(cfg))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(20, cfg.text.hidden_size)), jnp.float32)
    ids, w = route(x, p, cfg.text)
    np.testing.assert_allclose(np.asarray(w.sum(-1)), 1.0, rtol=1e-6)
    scores = 1 / (1 + np.exp(-(np.asarray(x) @ np.asarray(p["router"]))))
    want_ids = np.argsort(-(scores + np.asarray(p["router_bias"])), axis=-1, kind="stable")[:, : cfg.text.num_experts_per_tok]
    assert (np.sort(np.asarray(ids), -1) == np.sort(want_ids, -1)).all()
    picked = np.take_along_axis(scores, np.asarray(ids), -1)
    np.testing.assert_allclose(np.asarray(w), picked / picked.sum(-1, keepdims=True), rtol=1e-5)
    # A huge bias on one expert forces its choice but leaves its weight unbiased.
    p["router_bias"] = p["router_bias"].at[0].set(100.0)
    ids2, w2 = route(x, p, cfg.text)
    assert (np.asarray(ids2) == 0).any(-1).all()
    picked2 = np.take_along_axis(scores, np.asarray(ids2), -1)
    np.testing.assert_allclose(np.asarray(w2), picked2 / picked2.sum(-1, keepdims=True), rtol=1e-5)
