"""m3jax.train (with m3jax.indexer_objective and m3jax.data): loss goes down, gradient paths of the
two objectives, frozen main weights in indexer_only, orbax resume equivalence, the KL definition
against a numpy loop, the tokenizer."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import cli, data, indexer_objective, train as tr
from m3jax.pallas import _backend
from tests.conftest import tiny_config

SEQ = 32


@pytest.fixture(scope="module")
def setup():
    # One dense layer + one MSA/MoE layer; 8 blocks of 4, top-2 (own block + one ranked block).
    cfg = tiny_config(
        num_hidden_layers=2,
        layer_types=("full_attention", "minimax_m3_sparse"),
        mlp_layer_types=("dense", "sparse"),
        index_topk_blocks=2,
    ).replace(attention_chunk=SEQ)
    params = tr.init_train_params(cfg, seed=0, std=0.1)
    batch = {"tokens": np.random.default_rng(0).integers(3, cfg.text.vocab_size, (2, SEQ + 1)).astype(np.int32)}
    tx = tr.make_optimizer("sparse", steps=20, lr=1e-2, warmup=1)
    return cfg, params, batch, tx, tr.make_train_step(cfg, tx, "sparse")


def _fresh(params):
    return jax.tree.map(jnp.array, params)  # the step donates its state


def _leaves(tree):
    return jax.tree_util.tree_flatten_with_path(tree)[0]


def test_steps_reduce_lm_loss(setup):
    cfg, params, batch, tx, step = setup
    state = tr.init_state(_fresh(params), tx)
    lms = []
    for _ in range(5):
        state, m = step(state, batch)
        lms.append(float(m["lm"]))
        assert np.isfinite(float(m["loss"]))
    assert lms[-1] < lms[0] - 0.1, lms
    assert int(state.step) == 5


def test_gradient_paths(setup):
    cfg, params, batch, _, _ = setup
    msa_layer = 1

    def with_layer(p, sub):  # params with the MSA layer's attn / index subtrees replaced
        layers = list(p["text"]["layers"])
        layers[msa_layer] = {**layers[msa_layer], **sub}
        return {**p, "text": {**p["text"], "layers": layers}}

    @jax.jit
    def grads(p):
        kl, g_kl = jax.value_and_grad(lambda q: tr.loss_fn(q, batch, cfg, "sparse")[1]["kl"])(p)
        # LM gradient w.r.t. the MSA layer only (keeps the backward graph small): index and attention.
        sub = {k: p["text"]["layers"][msa_layer][k] for k in ("index", "attn")}
        g_lm = jax.grad(lambda s: tr.loss_fn(with_layer(p, s), batch, cfg, "sparse")[1]["lm"])(sub)
        return kl, g_kl, g_lm

    kl, g_kl, g_lm = grads(params)
    assert float(kl) > 0
    labels = tr.param_labels(params)
    seen = set()
    for (path, lab), (_, g) in zip(_leaves(labels), _leaves(g_kl)):
        name, g = jax.tree_util.keystr(path), np.asarray(g)
        if lab == "index":
            assert np.abs(g).max() > 0, f"KL does not reach {name}"
            seen.add(name.split("'")[-2])
        else:
            assert not g.any(), f"KL reaches a main weight: {name}"
    assert seen == {"wq", "wk", "q_norm", "k_norm"}
    for name, g in g_lm["index"].items():
        assert not np.asarray(g).any(), f"LM loss reaches index {name}"
    for name, g in g_lm["attn"].items():  # sparse attention is differentiated w.r.t. q, k, v
        assert np.abs(np.asarray(g)).max() > 0, f"LM loss does not reach attn {name}"


def test_indexer_only_freezes_main_weights(setup):
    cfg, params, batch, _, _ = setup
    tx = tr.make_optimizer("indexer_only", steps=10, lr=1e-2, warmup=1)
    step = tr.make_train_step(cfg, tx, "indexer_only")
    before = jax.tree.map(np.asarray, params)
    state = tr.init_state(_fresh(params), tx)
    kls = []
    for _ in range(3):
        state, m = step(state, batch)
        kls.append(float(m["kl"]))
    after = jax.tree.map(np.asarray, state.params)
    labels = tr.param_labels(params)
    for (path, lab), (_, x), (_, y) in zip(_leaves(labels), _leaves(before), _leaves(after)):
        if lab != "index":
            assert x.tobytes() == y.tobytes(), f"frozen weight changed: {jax.tree_util.keystr(path)}"
        else:
            assert not np.array_equal(x, y), f"index weight did not train: {jax.tree_util.keystr(path)}"
    assert kls[-1] < kls[0], kls


def test_resume_equals_straight_run(setup, tmp_path):
    cfg, params, batch, tx, step = setup
    batches = [{"tokens": np.roll(batch["tokens"], i, axis=1)} for i in range(4)]
    straight = tr.init_state(_fresh(params), tx)
    for b in batches:
        straight, _ = step(straight, b)

    state = tr.init_state(_fresh(params), tx)
    for b in batches[:2]:
        state, _ = step(state, b)
    mngr = tr.checkpoint_manager(tmp_path / "ckpt")
    tr.save_state(mngr, state)
    like = tr.init_state(_fresh(params), tx)
    restored = tr.restore_state(tr.checkpoint_manager(tmp_path / "ckpt"), like)
    assert int(restored.step) == 2
    for b in batches[2:]:
        restored, _ = step(restored, b)
    for (path, x), (_, y) in zip(_leaves(straight.params), _leaves(restored.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
    for x, y in zip(jax.tree.leaves(straight.opt_state), jax.tree.leaves(restored.opt_state)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# The kernel path (attention_impl="pallas": sparse attention through msa.kernels.attend_selected and its
# custom VJP, dense attention through jax.nn.dot_product_attention, the KL per rematerialised query
# chunk) against jax.grad of the reference path: one MSA layer, block 16, top-2, 48 tokens (3 blocks),
# fp32, kernels in interpret mode on CPU, compiled on a GPU. Query chunks of 16 rows on both paths.
KERNEL_SEQ = 48


@pytest.mark.parametrize("mode", ["sparse", "indexer_only"])
def test_kernel_path_matches_reference(mode):
    cfg = tiny_config(num_hidden_layers=1, layer_types=("minimax_m3_sparse",), mlp_layer_types=("dense",),
                      head_dim=64, index_head_dim=16, index_block_size=16, index_topk_blocks=2)
    ref_cfg = cfg.replace(attention_impl="reference", attention_chunk=16)
    params = tr.init_train_params(cfg, seed=1, std=0.1)
    tokens = np.random.default_rng(2).integers(3, cfg.text.vocab_size, (1, KERNEL_SEQ + 1)).astype(np.int32)

    def loss_and_grads(c):
        fn = jax.jit(jax.value_and_grad(lambda p: tr.loss_fn(p, {"tokens": tokens}, c, mode), has_aux=True))
        (loss, aux), g = fn(params)
        return float(loss), float(aux["kl"]), g

    _backend.reset_interpret_state()
    got = loss_and_grads(ref_cfg.replace(attention_impl="pallas"))
    assert not _backend.interpret_races_found(), "race detector fired"
    want = loss_and_grads(ref_cfg)
    assert want[1] > 0, "the KL term should be non-zero"
    assert abs(got[0] - want[0]) <= 1e-5 * abs(want[0]), (got[0], want[0])
    checked = 0
    for (path, a), (_, b) in zip(_leaves(got[2]), _leaves(want[2])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if not b.any():
            assert not a.any(), jax.tree_util.keystr(path)
            continue
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err <= 1e-5, f"{jax.tree_util.keystr(path)}: relative error {err:.2e}"
        checked += 1
    assert checked >= 4


def _kl_numpy(q, k, scores, support, bs, hx):
    """Loop reference of the indexer KL: group-mean dense block mass, restricted, vs softmax(scores/sqrt(hx))."""
    b, c, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    out = np.zeros((b, kh, c))
    for bi in range(b):
        for gi in range(kh):
            for t in range(c):
                mass = np.zeros(scores.shape[-1])
                for hi in range(gi * g, (gi + 1) * g):
                    logit = k[bi, : t + 1, gi] @ q[bi, t, hi] / np.sqrt(h)
                    p = np.exp(logit - logit.max())
                    p /= p.sum()
                    for s in range(t + 1):
                        mass[s // bs] += p[s] / g
                sup = support[bi, gi, t]
                if sup.sum() < 2:
                    continue
                tgt = mass[sup] / mass[sup].sum()
                z = scores[bi, gi, t, sup] / np.sqrt(hx)
                logq = z - z.max() - np.log(np.exp(z - z.max()).sum())
                out[bi, gi, t] = np.sum(tgt * (np.log(tgt) - logq))
    return out


def test_indexer_kl_definition():
    rng = np.random.default_rng(1)
    b, c, n, kh, h, bs, hx = 1, 12, 4, 2, 8, 4, 16
    q = rng.normal(size=(b, c, n, h)).astype(np.float32)
    k = rng.normal(size=(b, c, kh, h)).astype(np.float32)
    nb = c // bs
    pos = np.arange(c)[None]
    visible = (np.arange(nb)[None, None, None, :] <= (pos // bs)[:, None, :, None]).repeat(kh, 1)
    scores = np.where(visible, rng.normal(size=(b, kh, c, nb)) * 4, -np.inf).astype(np.float32)
    kl, valid = indexer_objective.indexer_kl(jnp.asarray(q), jnp.asarray(k), jnp.asarray(scores), jnp.asarray(visible),
                              jnp.asarray(pos), bs, hx)
    ref = _kl_numpy(q, k, scores, visible, bs, hx)
    np.testing.assert_allclose(np.asarray(kl), ref, rtol=1e-4, atol=1e-6)
    assert np.array_equal(np.asarray(valid), visible.sum(-1) >= 2)
    # Scores that reproduce the target (log mass * sqrt(hx)) give KL = 0.
    mass = np.zeros((b, kh, c, nb))
    for gi in range(kh):
        for t in range(c):
            for hi in range(gi * n // kh, (gi + 1) * n // kh):
                logit = k[0, : t + 1, gi] @ q[0, t, hi] / np.sqrt(h)
                p = np.exp(logit - logit.max())
                p /= p.sum()
                np.add.at(mass[0, gi, t], np.arange(t + 1) // bs, p / (n // kh))
    exact = np.where(visible, np.log(np.maximum(mass, 1e-30)) * np.sqrt(hx), -np.inf).astype(np.float32)
    kl0, _ = indexer_objective.indexer_kl(jnp.asarray(q), jnp.asarray(k), jnp.asarray(exact), jnp.asarray(visible),
                           jnp.asarray(pos), bs, hx)
    assert np.abs(np.asarray(kl0)).max() < 1e-5


def test_tokenizer_and_split():
    train, held, root = data.stdlib_files()
    assert train and held and not set(train) & set(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.1
    cfg = tiny_config(vocab_size=300).replace(image_token_id=298, video_token_id=299)
    texts = data.read_texts(train[:40], 300_000)
    tok = data.train_tokenizer(texts, cfg, tokenizer_mb=0.3)
    assert tok.get_vocab_size() == 300
    assert [tok.token_to_id(s) for s in ("<pad>", "<s>", "</s>", "<image>", "<video>")] == [0, 1, 2, 298, 299]
    ids = tok.encode("def f(x):\n    return x + 1\n", add_special_tokens=False).ids
    assert max(ids) < 298 and tok.decode(ids) == "def f(x):\n    return x + 1\n"
    stream = data.encode_corpus(tok, texts[:3], eos_id=2)
    b1 = data.sample_batch(stream, 7, 2, 16)
    assert np.array_equal(b1["tokens"], data.sample_batch(stream, 7, 2, 16)["tokens"])
    assert b1["tokens"].shape == (2, 17)


def test_kernel_path_bf16_runs():
    # bf16 compute on the kernel path (interpret mode on CPU): finite gradients and the reference path's
    # loss within bf16's tolerance (accumulation order differs; selections may differ at near-ties).
    cfg = tiny_config(num_hidden_layers=1, layer_types=("minimax_m3_sparse",), mlp_layer_types=("dense",),
                      head_dim=64, index_head_dim=16, index_block_size=16, index_topk_blocks=2).replace(attention_chunk=16)
    params = tr.init_train_params(cfg, seed=1, std=0.1)
    batch = {"tokens": np.random.default_rng(2).integers(3, cfg.text.vocab_size, (1, KERNEL_SEQ + 1)).astype(np.int32)}
    losses = {}
    for impl in ("reference", "pallas"):
        c = cfg.replace(attention_impl=impl)
        fn = jax.jit(jax.value_and_grad(lambda p: tr.loss_fn(p, batch, c, "sparse", dtype="bfloat16")[0]))
        loss, g = fn(params)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(g)), impl
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(g)), "gradients come back in the weights' dtype"
        losses[impl] = float(loss)
    assert abs(losses["pallas"] - losses["reference"]) <= 2e-2 * abs(losses["reference"]), losses


def test_run_args_record_the_attention_path_and_dtype(tmp_path):
    base = ["--out", str(tmp_path), "--dtype", "bfloat16"]
    tr.check_run_args(tmp_path, tr.parse_args(base + ["--attention-impl", "reference"]))
    recorded = json.loads((tmp_path / "run_args.json").read_text())
    assert recorded["attention_impl"] == "reference" and recorded["dtype"] == "bfloat16"
    tr.check_run_args(tmp_path, tr.parse_args(base + ["--resume", "--attention-impl", "auto"]))  # a speed choice
    with pytest.raises(cli.UsageError, match="--dtype 'float32'"):
        tr.check_run_args(tmp_path, tr.parse_args(["--out", str(tmp_path), "--resume", "--dtype", "float32"]))
