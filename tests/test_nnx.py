"""m3jax.nnx: the NNX modules run the functional model's maths over its own arrays.

References: the functional forward (``m3jax.model.forward_jit``) on the same random weights, exact
(bitwise) on CPU since both trace the same functions; ``jax.grad`` of the functional loss (fp32,
TOL["float32"]); ``m3jax.train.param_labels`` for the optimizer groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import m3jax
from m3jax import nnx as mnnx
from m3jax.layers import MXFP8Weight, rope_angles
from m3jax.model import decoder_layer, forward_jit
from m3jax.moe import route
from m3jax.msa import layer as msa_layer, reference
from m3jax.params import ParamSpec, param_specs
from m3jax.train import param_labels
from tests.conftest import TOL, rel_l2, tiny_config

TWO_LAYER_TYPES = ("full_attention", "minimax_m3_sparse")
T = 24  # tokens: 6 blocks of 4, top-3, so selections differ between rules


@pytest.fixture(scope="module")
def model():
    return m3jax.init_random(tiny_config(), seed=3)


@pytest.fixture(scope="module")
def ids():
    return jnp.asarray(np.random.default_rng(0).integers(0, 90, (2, T)), jnp.int32)


@pytest.fixture(scope="module")
def reference_out(model, ids):
    return forward_jit(model.params, ids, None, None, model.config, None, None)


def _leaves_with_paths(tree):
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {jax.tree_util.keystr(p, simple=True, separator="/"): x for p, x in leaves}


@functools.partial(jax.jit, static_argnums=2)
def _functional_routing(params, ids, cfg):
    t = cfg.text
    h = params["text"]["embed"][ids]
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
    angles = rope_angles(pos, t.rotary_dim, t.rope_theta)
    out = {}
    for i, lp in enumerate(params["text"]["layers"]):
        observe = (lambda y, lp=lp: route(y.reshape(-1, y.shape[-1]), lp["moe"], t)[0].reshape(*y.shape[:2], -1)) \
            if t.is_moe(i) else None
        h, aux, _ = decoder_layer(h, lp, angles, pos, cfg, i, observe_mlp_input=observe)
        if observe is not None:
            out[i] = aux[1]
    return out


def test_logits_selections_routing_equal_functional(model, ids, reference_out):
    m = mnnx.from_model(model)
    logits, inter = mnnx.apply(m, ids)
    ref_logits, ref_sel = reference_out
    assert np.array_equal(np.asarray(logits), np.asarray(ref_logits))
    sel = mnnx.selections(inter)
    assert sorted(sel) == sorted(ref_sel) == [1, 2]
    for i in ref_sel:
        assert np.array_equal(np.asarray(sel[i]), np.asarray(ref_sel[i]))
    # routing: the router's choice on each MoE layer's normed MLP input, read by the functional layer loop
    experts = _functional_routing(model.params, ids, model.config)
    routes = mnnx.routing(inter)
    assert sorted(routes) == sorted(experts) == [1, 2]
    for i in experts:
        assert np.array_equal(np.asarray(routes[i]), np.asarray(experts[i]))


def _random_mxfp8(cfg):
    """Random weights of ``param_specs(cfg, "mxfp8")``, drawn on the host: fp8 values N(0, 64) clipped to
    e4m3's range, E8M0 scales 2^-8..2^-6, fp32 elsewhere."""
    rng = np.random.default_rng(1)

    def one(s):
        if s.dtype == "float8_e4m3fn":
            return jnp.asarray(np.clip(rng.normal(0, 64, s.shape), -448, 448).astype(ml_dtypes.float8_e4m3fn))
        if s.dtype == "uint8":
            return jnp.asarray(rng.integers(119, 122, s.shape).astype(np.uint8))
        return jnp.asarray(rng.normal(0, 0.1, s.shape).astype(np.float32))

    return jax.tree.map(one, param_specs(cfg, "mxfp8"), is_leaf=lambda x: isinstance(x, ParamSpec))


@pytest.mark.oracle
def test_image_fixture_equal_functional_and_oracle(oracle_dir):
    """The transformers checkpoint with an image: the module's logits are m3jax.forward's (bitwise) and
    the oracle's (fp32 tolerance)."""
    fx = np.load(oracle_dir / "image" / "fixture.npz")
    model = m3jax.load_pretrained(oracle_dir / "image", dtype="float32", attention_impl="reference", progress=False)
    ref = m3jax.forward(model, fx["input_ids"], pixel_values=fx["pixel_values"], image_grid_thw=fx["image_grid_thw"],
                        return_block_indices=True)
    grid = tuple(tuple(int(v) for v in row) for row in fx["image_grid_thw"])
    logits, inter = mnnx.apply(mnnx.from_model(model), fx["input_ids"], jnp.asarray(fx["pixel_values"], jnp.float32),
                               grid)
    assert np.array_equal(np.asarray(logits), np.asarray(ref.logits))
    sel = mnnx.selections(inter)
    assert sorted(sel) == sorted(ref.block_indices)
    assert all(np.array_equal(np.asarray(sel[i]), np.asarray(ref.block_indices[i])) for i in sel)
    assert rel_l2(logits, fx["logits"]) <= TOL["float32"]


def test_mxfp8_model_equal_functional(ids):
    cfg = tiny_config(hidden_size=32, head_dim=32, index_head_dim=32, intermediate_size=32,
                      dense_intermediate_size=32, shared_intermediate_size=32, num_hidden_layers=2,
                      layer_types=("full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"))
    params = _random_mxfp8(cfg)
    m = mnnx.from_model(params, cfg)
    assert isinstance(m.text.layers[1].moe.gate, mnnx.MXFP8)
    assert m.text.layers[1].moe.gate.values[...].dtype == jnp.float8_e4m3fn
    assert isinstance(mnnx.to_model(m).params["text"]["layers"][1]["attn"]["wq"], MXFP8Weight)
    logits, inter = mnnx.apply(m, ids)
    ref_logits, ref_sel = forward_jit(params, ids, None, None, cfg, None, None)
    assert np.array_equal(np.asarray(logits), np.asarray(ref_logits))
    assert all(np.array_equal(np.asarray(mnnx.selections(inter)[i]), np.asarray(ref_sel[i])) for i in ref_sel)


def test_round_trip_shares_buffers(model, ids):
    m = mnnx.from_model(model)
    before = _leaves_with_paths(model.params)
    state = _leaves_with_paths(nnx.to_pure_dict(nnx.state(m, nnx.Param)))
    assert state.keys() == before.keys()  # the functional tree's names
    assert all(state[k] is before[k] for k in before)
    mnnx.apply(m, ids)  # a call writes nothing back
    back = _leaves_with_paths(mnnx.to_model(m).params)
    assert back.keys() == before.keys() and all(back[k] is before[k] for k in before)
    graphdef, st = nnx.split(m)
    merged = _leaves_with_paths(mnnx.to_model(nnx.merge(graphdef, st)).params)
    assert all(merged[k] is before[k] for k in before)
    # logical axes travel as the Params' sharding metadata
    assert m.text.layers[0].attn.wq.get_metadata()["out_sharding"] == ("embed", "q_heads", "head_dim")


def test_bad_tree_is_named(model):
    bad = jax.tree.map(lambda x: x, model.params)
    bad["text"]["layers"][1]["attn"]["wk"] = jnp.zeros((3, 3))
    with pytest.raises(ValueError, match=r"text\.layers\[1\]\.attn\.wk"):
        mnnx.from_model(bad, model.config)


class Recent(mnnx.MSA):
    """A different top-k rule: the k most recent visible blocks (a sliding window of blocks)."""

    def select(self, iq, ik, q_pos, cfg, layer):
        scores = msa_layer.scores(iq, ik, q_pos, cfg)  # -inf on the blocks a query cannot see
        recency = jnp.where(scores > reference.NEG_INF, jnp.arange(scores.shape[-1], dtype=scores.dtype), scores)
        return reference.select_blocks(recency, q_pos, block_size=cfg.index_block_size, topk=cfg.index_topk_blocks)


def test_swapped_msa_changes_that_layer(model, ids, reference_out):
    m = mnnx.from_model(model)
    last = m.text.layers[2]
    last.attn = mnnx.swap(last.attn, Recent)
    logits, inter = mnnx.apply(m, ids)
    sel, ref_sel = mnnx.selections(inter), reference_out[1]
    assert np.array_equal(np.asarray(sel[1]), np.asarray(ref_sel[1]))  # the layer before: untouched
    new = np.asarray(sel[2])
    assert not np.array_equal(new, np.asarray(ref_sel[2]))
    # the rule holds: each query's own block and the k - 1 blocks just before it
    k = model.config.text.index_topk_blocks
    for t in range(T):
        own = t // model.config.text.index_block_size
        want = set(range(max(0, own - k + 1), own + 1))
        assert all(set(row[row >= 0].tolist()) == want for row in new[:, :, t].reshape(-1, k)), t
    assert not np.array_equal(np.asarray(logits), np.asarray(reference_out[0]))
    # the other layers keep the stock modules, and the functional model (engine, probe) is unchanged
    assert [type(layer.attn) for layer in m.text.layers] == [mnnx.FullAttention, mnnx.MSA, Recent]
    assert all(a is b for a, b in zip(jax.tree.leaves(mnnx.to_model(m).params), jax.tree.leaves(model.params)))
    # greedy generation runs through the swapped layer: each new token is the argmax of the module's
    # logits one position before
    new = mnnx.generate(m, ids[:, :T - 4], 4)
    full = np.concatenate([np.asarray(ids[:, :T - 4]), new], axis=1)
    assert np.array_equal(np.asarray(jnp.argmax(mnnx.apply(m, full)[0][:, T - 5:T - 1], -1)), new)


def _ce(logits, ids):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


def test_param_group_optimizer_freezes_the_rest(ids):
    # dense_mask: the full-attention layers' dense-mask form is differentiable (the reference's key loop is
    # a while loop); the index branch gets no gradient from the LM loss (top-k is discrete). Two layers
    # (full attention + dense MLP, MSA + MoE) and the vision tower: every group, half the compile.
    model = m3jax.init_random(tiny_config(vision=True, num_hidden_layers=2, layer_types=TWO_LAYER_TYPES,
                                          mlp_layer_types=("dense", "sparse")), seed=4)
    cfg = model.config.replace(attention_impl="dense_mask")
    m = mnnx.from_model(model.params, cfg)
    main = mnnx.param_group("main")
    labels = _leaves_with_paths(param_labels(model.params))
    chosen = set(_leaves_with_paths(nnx.to_pure_dict(nnx.state(m, main))))
    assert chosen == {k for k, v in labels.items() if v == "main"}
    rest = nnx.state(m, mnnx.param_group("index", "frozen"))
    assert set(_leaves_with_paths(nnx.to_pure_dict(rest))) == labels.keys() - chosen

    # nnx.jit over nnx.grad (apply is jax.jit over nnx.split's state)
    loss = lambda m, x: _ce(nnx.capture(m, nnx.Intermediate)(x)[0], x)  # noqa: E731  (sown values captured)
    grad_fn = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, main)), graph_updates=False)
    grads = grad_fn(m, ids)
    got = _leaves_with_paths(nnx.to_pure_dict(grads))
    ref = jax.grad(lambda p: _ce(forward_jit(p, ids, None, None, cfg, None, None)[0], ids))(model.params)
    ref = _leaves_with_paths(ref)
    assert got.keys() == chosen
    for k in chosen:
        assert rel_l2(got[k], ref[k]) <= TOL["float32"], k
    assert float(jnp.abs(got["text/lm_head"]).max()) > 0

    before = _leaves_with_paths(model.params)
    opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=main)
    opt.update(m, grads)
    after = _leaves_with_paths(mnnx.to_model(m).params)
    for k, v in labels.items():
        if v != "main":  # frozen by the filter: the very same array
            assert after[k] is before[k], k
        else:  # SGD moved every weight with a gradient (the router bias has none: it only ranks experts)
            moved = not np.array_equal(np.asarray(after[k]), np.asarray(before[k]))
            assert moved == bool(np.abs(np.asarray(got[k])).max() > 0), k
