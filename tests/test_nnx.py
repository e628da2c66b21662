"""m3jax.nnx: the NNX modules run the functional model's maths over its own arrays.

References: the functional forward (``m3jax.model.forward_jit``) on the same random weights, exact
(bitwise) on CPU since both trace the same functions; ``jax.grad`` of the functional loss (fp32,
TOL["float32"]); ``m3jax.params.param_labels`` for the optimizer groups.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

import m3jax
from m3jax import nnx as mnnx
from m3jax.config import UnsupportedConfigError
from m3jax.engine import Engine, SamplingParams
from m3jax.layers import MXFP8Weight, rope_angles
from m3jax.model import decoder_layer, forward_jit
from m3jax.moe import route
from m3jax.msa import layer as msa_layer, reference
from m3jax.params import ParamSpec, param_labels, param_specs
from m3jax.probe import probe
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


@msa_layer.register_selection_rule("recent")
def recent_blocks(block_scores, q_pos, cfg, layer):
    """A different top-k rule: the k most recent visible blocks (a sliding window of blocks)."""
    nb = block_scores.shape[-1]
    recency = jnp.where(block_scores > reference.NEG_INF, jnp.arange(nb, dtype=block_scores.dtype), block_scores)
    return reference.select_blocks(recency, q_pos, block_size=cfg.index_block_size, topk=cfg.index_topk_blocks)


class Recent(mnnx.MSA):
    rule = "recent"


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
    # the other layers keep the stock modules; the functional model gets the same arrays and names the rule
    assert [type(layer.attn) for layer in m.text.layers] == [mnnx.FullAttention, mnnx.MSA, Recent]
    swapped = mnnx.to_model(m)
    assert all(a is b for a, b in zip(jax.tree.leaves(swapped.params), jax.tree.leaves(model.params)))
    assert swapped.config.text.msa_selection_rules == ((2, "recent"),)
    # ... and back: from_model of that model builds the layer with the rule, the same forward
    assert mnnx.from_model(swapped).text.layers[2].attn.rule == "recent"
    ref = forward_jit(swapped.params, ids, None, None, swapped.config, None, None)
    assert np.array_equal(np.asarray(ref[0]), np.asarray(logits))
    assert all(np.array_equal(np.asarray(ref[1][i]), np.asarray(sel[i])) for i in (1, 2))
    # greedy generation runs through the swapped layer: each new token is the argmax of the module's
    # logits one position before
    new = mnnx.generate(m, ids[:, :T - 4], 4)
    full = np.concatenate([np.asarray(ids[:, :T - 4]), new], axis=1)
    assert np.array_equal(np.asarray(jnp.argmax(mnnx.apply(m, full)[0][:, T - 5:T - 1], -1)), new)


def test_swapped_rule_runs_in_probe_and_engine(model, ids, reference_out):
    """The rule a module declares reaches the functional paths through the config: the probe's selections
    change on that layer only, and the engine (paged cache, chunked prefill, decode steps) generates
    what the cache-free module generate does with the same rule."""
    m = mnnx.from_model(model)
    m.text.layers[2].attn = mnnx.swap(m.text.layers[2].attn, Recent)
    swapped = mnnx.to_model(m)
    got = probe(swapped, ids, query_chunk=8)  # the stock probe's selections are the forward's (test_probe)
    _, inter = mnnx.apply(m, ids)
    assert np.array_equal(got.layers[1].block_indices, np.asarray(reference_out[1][1]))
    assert not np.array_equal(got.layers[2].block_indices, np.asarray(reference_out[1][2]))
    assert np.array_equal(got.layers[2].block_indices, np.asarray(mnnx.selections(inter)[2]))

    prompt, n = np.asarray(ids[:, :T - 6]), 6
    engine = Engine(swapped.params, swapped.config, batch=2, capacity=T, prefill_chunk=16, decode_steps_per_call=3)
    res = engine.generate([list(r) for r in prompt], max_new_tokens=n, sampling=SamplingParams(temperature=0.0),
                          keep_logits=True)
    assert np.array_equal(np.array(res.generated), mnnx.generate(m, prompt, n))
    # every step's logits are the rule's forward's (the functional reference), not the stock model's
    full = jnp.asarray(np.concatenate([prompt, np.array(res.generated)], axis=1), jnp.int32)
    steps = np.stack(res.step_logits, axis=1)
    own, stock = (np.asarray(forward_jit(p.params, full, None, None, p.config, None, None)[0])[:, T - 7:T - 1]
                  for p in (swapped, model))
    assert rel_l2(steps, own) <= TOL["float32"] < rel_l2(steps, stock)


def test_stock_rule_is_the_model_as_released(model, ids, reference_out):
    """Naming the stock rule changes nothing: the same config (one jit key) and the same logits, bitwise."""
    cfg = model.config.replace_text(msa_selection_rules=((2, "topk"), (1, "topk")))
    assert cfg == model.config and cfg.text.msa_selection_rules == ()
    m = mnnx.from_model(model)
    m.text.layers[2].attn = mnnx.swap(m.text.layers[2].attn, mnnx.MSA, rule="topk")
    assert mnnx.to_model(m).config == model.config
    assert np.array_equal(np.asarray(mnnx.apply(m, ids)[0]), np.asarray(reference_out[0]))
    with pytest.raises(ValueError, match="registered with other code"):
        msa_layer.register_selection_rule("recent", lambda s, q, c, l: s)
    with pytest.raises(UnsupportedConfigError, match="'nope' is not registered"):
        forward_jit(model.params, ids, None, None, model.config.replace_text(msa_selection_rules=((1, "nope"),)),
                    None, None)


def test_rule_layer_takes_the_jnp_route():
    """On the kernels' variant a layer with its own rule runs the rule over jnp scores and the jnp attention,
    over a gathered window (no in-place decode, no context-parallel top-k); the other layers keep the kernels."""
    cfg = tiny_config(index_block_size=64, index_head_dim=64).replace(attention_impl="pallas")
    ruled = cfg.replace_text(msa_selection_rules=((2, "recent"),))
    assert msa_layer.layer_variant(ruled, 1) is msa_layer.VARIANTS["pallas"]
    v = msa_layer.layer_variant(ruled, 2)
    assert (v.decode, v.local, v.whole_chunk, v.attention) == (None, None, False, reference.sparse_attention)


class Recorded(mnnx.MoE):
    """Wraps the MoE: records its output (the stock computation)."""

    def __call__(self, y, cfg):
        out = super().__call__(y, cfg)
        self.sow(nnx.Intermediate, "mlp_out", out)
        return out


class Doubled(Recorded):
    """Replaces the MoE: twice its output."""

    def __call__(self, y, cfg):
        return 2 * super().__call__(y, cfg)


def test_mlp_hook_replaces_one_layer(model, ids, reference_out):
    """``decoder_layer``'s ``mlp`` hook: a wrapped MLP module records and keeps the model bitwise; a
    replaced one changes its layer's output and what follows, nothing before."""
    m = mnnx.from_model(model)
    for layer in m.text.layers[1:]:
        layer.moe = mnnx.swap(layer.moe, Recorded)
    logits, inter = mnnx.apply(m, ids)
    assert np.array_equal(np.asarray(logits), np.asarray(reference_out[0]))
    recorded = nnx.to_pure_dict(inter)["text"]["layers"]
    m.text.layers[1].moe = mnnx.swap(m.text.layers[1].moe, Doubled)
    logits2, inter2 = mnnx.apply(m, ids)
    recorded2 = nnx.to_pure_dict(inter2)["text"]["layers"]
    np.testing.assert_array_equal(np.asarray(mnnx.selections(inter2)[1]), np.asarray(reference_out[1][1]))
    np.testing.assert_array_equal(recorded2[1]["moe"]["mlp_out"][-1], recorded[1]["moe"]["mlp_out"][-1])
    assert not np.array_equal(recorded2[2]["moe"]["mlp_out"][-1], recorded[2]["moe"]["mlp_out"][-1])
    assert not np.array_equal(np.asarray(logits2), np.asarray(logits))


def test_nnx_does_not_import_train():
    """m3jax.nnx reads the parameter groups from m3jax.params: no orbax or tokenizers behind it."""
    code = "import sys, m3jax.nnx; print(sorted(m for m in ('m3jax.train', 'orbax', 'tokenizers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


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
