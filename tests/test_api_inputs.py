"""Bad input to the Python API (engine, probe, config interventions): a ValueError naming the thing,
raised before anything runs. Token ids outside the vocabulary are the dangerous case: an embedding
lookup clamps them, so unchecked they give a wrong answer instead of an error."""

from __future__ import annotations

import re

import numpy as np
import pytest

import m3jax
from m3jax.config import UnsupportedConfigError, preset
from m3jax.engine import Engine
from m3jax.probe import probe


@pytest.fixture(scope="module")
def model():
    return m3jax.init_random(preset("m3_tiny").replace(attention_impl="reference"), seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model.params, model.config, batch=1, capacity=64, prefill_chunk=16)


@pytest.mark.parametrize("prompt, message", [
    ([5, 10**6], r"prompt 0: token id 1000000 at \(0, 1\) is out of range \[0, "),
    ([-5, 3], r"prompt 0: token id -5 at \(0, 0\) is out of range"),
    ([1.7, 3.2], r"prompt 0 must be an integer"),
])
def test_engine_refuses_bad_token_ids(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([prompt], max_new_tokens=2)


def test_engine_refuses_bad_rows_seeds_and_embeddings(engine, model):
    with pytest.raises(ValueError, match=r"row 5 outside \[0, batch=1\)"):
        engine.prefill(5, [1, 2])
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*63\)"):
        engine.generate([[1, 2]], max_new_tokens=1, seed=2**70)
    d = model.config.text.hidden_size
    with pytest.raises(ValueError, match=rf"prompt_embeds\[0\] must be \[T, hidden_size={d}\], got shape \(3, 7\)"):
        engine.generate(prompt_embeds=[np.ones((3, 7), np.float32)], max_new_tokens=1)
    # a good prompt still runs after the refusals (nothing half-prefilled)
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=2).generated[0]) == 2


def test_probe_refuses_bad_ids_and_names_the_msa_layers(model):
    v = model.config.text.vocab_size
    with pytest.raises(ValueError, match=rf"token id {v} at \(0, 1\) is out of range"):
        probe(model, np.array([[1, v]]))
    with pytest.raises(ValueError, match="need at least one sequence of at least one token"):
        probe(model, np.zeros((1, 0), np.int32))
    rng = np.random.default_rng(0)
    res = probe(model, rng.integers(0, v, (1, 40)))
    msa, full = res.msa_layers, [i for i in res.layers if i not in res.msa_layers]
    assert msa and full
    with pytest.raises(ValueError, match=re.escape(f"layer {full[0]} is full attention (no selection); MSA layers: {msa}")):
        res.selection_map(full[0])
    with pytest.raises(ValueError, match="layer 99 is not probed"):
        res.jaccard_groups(99)
    with pytest.raises(ValueError, match=r"group 99 outside \[0, "):
        res.selection_map(msa[0], group=99)
    with pytest.raises(ValueError, match=r"batch -1 outside \[0, 1\)"):
        res.selection_map(msa[0], batch=-1)


@pytest.mark.parametrize("pairs", [5, ((1,),), ((1, -2),), [[1, 0]], ((1, 0.5),)])
def test_msa_force_in_must_be_layer_block_pairs(pairs):
    with pytest.raises(UnsupportedConfigError, match="msa_force_in=.* must be a tuple of \\(layer, block id\\) pairs"):
        preset("m3_tiny").replace_text(msa_force_in=pairs)
    assert preset("m3_tiny").replace_text(msa_force_in=((1, np.int64(0)),)).text.msa_force_in == ((1, 0),)


@pytest.mark.parametrize("rules", [5, ((1,),), ((1, ""),), ((-1, "r"),), ((1, 3),), ((1, "a"), (1, "b"))])
def test_msa_selection_rules_must_be_one_name_per_layer(rules):
    with pytest.raises(UnsupportedConfigError, match="msa_selection_rules=.* must be a tuple of \\(layer, rule name\\)"):
        preset("m3_tiny").replace_text(msa_selection_rules=rules)
    # canonical: sorted by layer, the stock rule dropped (one model, one config)
    cfg = preset("m3_tiny").replace_text(msa_selection_rules=((3, "b"), (np.int64(1), "a"), (2, "topk")))
    assert cfg.text.msa_selection_rules == ((1, "a"), (3, "b"))


def test_engine_checks_every_prompt_before_any_prefill(model):
    engine = Engine(model.params, model.config, batch=2, capacity=64, prefill_chunk=16)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2, 3], []], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"prompt 1 must be a 1-D sequence of token ids, got shape \(1, 2\)"):
        engine.generate([[1, 2, 3], [[1, 2]]], max_new_tokens=1)


def test_engine_takes_numpy_and_jax_integer_seeds(engine):
    import jax.numpy as jnp

    a = engine.generate([[1, 2, 3]], max_new_tokens=2, seed=3).generated
    assert engine.generate([[1, 2, 3]], max_new_tokens=2, seed=np.int64(3)).generated == a
    assert engine.generate([[1, 2, 3]], max_new_tokens=2, seed=jnp.int32(3)).generated == a


def test_numpy_token_ids_in_the_config_become_python_ints():
    t = preset("m3_tiny").replace_text(eos_token_id=(np.int64(2), 3), bos_token_id=np.int32(1)).text
    assert t.eos_token_id == (2, 3) and type(t.eos_token_id[0]) is int and type(t.bos_token_id) is int
    with pytest.raises(UnsupportedConfigError, match="eos_token_id='abc' must be a token id"):
        preset("m3_tiny").replace_text(eos_token_id="abc")
