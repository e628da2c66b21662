"""MoE: sorted grouped-matmul path vs the dense every-expert reference; router semantics."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp
import pytest

import jax

from m3jax.moe import FEW_PAIRS, choose_experts, expert_order, moe_dense_reference, moe_sorted, route, sum_rows
from m3jax.params import init_random
from tests.conftest import assert_close, tiny_config


def _moe_params(cfg, dtype=jnp.float32):
    return init_random(cfg, seed=5, dtype=dtype, scale=0.3)["text"]["layers"][1]["moe"]


@pytest.mark.parametrize("pairs", [1, 8, FEW_PAIRS, FEW_PAIRS + 1, 300])
def test_expert_order_is_the_stable_sort(pairs):
    # Machine: any. Few pairs are ranked by comparison, many sorted: both give numpy's stable argsort and
    # bincount, ties (repeated experts) and ids past the last expert (the expert-parallel empty slots,
    # in no group) included.
    rng = np.random.default_rng(pairs)
    e = 6
    ids = rng.integers(0, e + 1, size=pairs).astype(np.int32)
    order, sizes = expert_order(jnp.asarray(ids), e)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(ids, kind="stable"))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(ids, minlength=e + 1)[:e])
    ys = rng.normal(size=(pairs, 5)).astype(np.float32)
    token = rng.integers(0, 3, size=pairs).astype(np.int32)
    want = np.zeros((3, 5), np.float32)
    np.add.at(want, token, ys)
    np.testing.assert_allclose(np.asarray(sum_rows(jnp.asarray(ys), jnp.asarray(token), 3)), want, rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 8, 17])
def test_choose_experts_is_top_k(tokens):
    # Machine: any. Few pairs by ranks (1 and 8 tokens of top-4), many by lax.top_k (17): the same experts in
    # the same order as lax.top_k, equal values ordered by id, and the unbiased scores at them, exactly
    rng = np.random.default_rng(tokens)
    biased = np.round(rng.normal(size=(tokens, 64)), 1).astype(np.float32)  # one decimal: many ties
    biased[:, 7] = biased[:, 3] = biased.max(1)  # a tie at the top
    scores = rng.random(size=(tokens, 64)).astype(np.float32)
    ids, w = choose_experts(jnp.asarray(biased), jnp.asarray(scores), 4)
    _, want = jax.lax.top_k(jnp.asarray(biased), 4)
    assert ids.dtype == jnp.int32 and (tokens * 4 > FEW_PAIRS) == (tokens == 17)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(w), np.take_along_axis(scores, np.asarray(want), -1))


@pytest.mark.parametrize("tokens", [1, 53])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sorted_equals_dense_reference(dtype, tokens):
    cfg = tiny_config()
    p = _moe_params(cfg, jnp.dtype(dtype))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(tokens, cfg.text.hidden_size)), dtype)
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


@pytest.mark.parametrize("tokens", [1, 20])
def test_route_shared_slot_leads_the_same_choice(tokens):
    # Machine: any. shared_slot: slot 0 is the shared expert as id E with weight 0, then the same experts in
    # the same order with the same weights as without it (ranks at one token, lax.top_k at 20); the weights to
    # fp32 rounding: the GPU's XLA may sum the routed slots in another order inside the router's other fusion
    cfg = tiny_config()
    p = _moe_params(cfg)
    x = jnp.asarray(np.random.default_rng(2).normal(size=(tokens, cfg.text.hidden_size)), jnp.float32)
    ids, w = route(x, p, cfg.text)
    ids1, w1 = route(x, p, cfg.text, shared_slot=True)
    assert ids1.shape == (tokens, cfg.text.num_experts_per_tok + 1)
    assert (np.asarray(ids1[:, 0]) == cfg.text.num_local_experts).all() and (np.asarray(w1[:, 0]) == 0).all()
    np.testing.assert_array_equal(np.asarray(ids1[:, 1:]), np.asarray(ids))
    np.testing.assert_allclose(np.asarray(w1[:, 1:]), np.asarray(w), rtol=1e-6)
