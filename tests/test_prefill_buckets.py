"""Prefill buckets: a prompt's last, shorter chunk runs at the smallest compiled size that holds it
(m3jax.engine.prefill_chunk_sizes), with the same logits and tokens as padding it to the whole chunk,
and the warmup compiles every program a prompt then runs."""

from __future__ import annotations

import numpy as np
import pytest

import m3jax
from m3jax import aot
from m3jax import engine as eng
from m3jax.engine import Engine, SamplingParams, prefill_chunk_sizes
from tests.conftest import assert_close, tiny_config

GREEDY = SamplingParams(temperature=0.0)


def test_chunk_sizes():
    assert prefill_chunk_sizes(2048, 64) == (64, 128, 256, 512, 1024, 2048)
    assert prefill_chunk_sizes(48, 16) == (16, 32, 48)  # a chunk that is no power-of-two multiple: itself last
    assert prefill_chunk_sizes(8, 16) == (8,)


# Both tests share this engine shape and a key window per chunk (MIN_KEY_WINDOW patched to the chunk), so
# that their programs compile once (m3jax.aot keeps them in memory).
ENGINE = dict(batch=1, capacity=64, prefill_chunk=16, decode_steps_per_call=2)


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2, num_hidden_layers=2, layer_types=(
        "full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"))
    return cfg, m3jax.init_random(cfg, seed=7, dtype="float32").params


def test_bucketed_prefill_equals_whole_chunk_padding(tiny, monkeypatch):
    """fp32, chunk 16 over block 4 (sizes 4, 8, 16): prompts whose last chunk is 5 and 4 tokens (run at 8 and
    4) give the unbucketed engine's prefill logits, greedy tokens and decode logits. A last chunk that shares
    its key window with an earlier chunk takes that chunk's program (no program more than without buckets)."""
    cfg, params = tiny
    rng = np.random.default_rng(1)
    bucketed, whole = Engine(params, cfg, **ENGINE), Engine(params, cfg, prefill_buckets=False, **ENGINE)
    assert bucketed.chunk_sizes == (4, 8, 16) and whole.chunk_sizes == (16,)
    assert [size for *_, size in bucketed._prefill_plan(21)] == [16, 16]  # one key window (MIN_KEY_WINDOW)
    monkeypatch.setattr(eng, "MIN_KEY_WINDOW", 16)  # a key window per chunk: the last chunk starts its own
    assert [size for *_, size in bucketed._prefill_plan(21)] == [16, 8]
    for n in (5, 20):
        p = rng.integers(0, 90, n).tolist()
        assert_close(bucketed.prefill(0, p), whole.prefill(0, p), "float32", f"prefill logits, {n} tokens")
        got = bucketed.generate([p], max_new_tokens=3, sampling=GREEDY, keep_logits=True)
        ref = whole.generate([p], max_new_tokens=3, sampling=GREEDY, keep_logits=True)
        assert got.generated == ref.generated
        assert_close(np.stack(got.step_logits), np.stack(ref.step_logits), "float32", f"decode logits, {n} tokens")


def test_warmup_compiles_what_prefill_runs(tiny, monkeypatch):
    """warmup(prompt_lens=...) builds exactly the programs of those prompts (a 5-token prompt: one prefill
    program of 8 tokens); warmup(max_prompt_len) every program a prompt up to it can run, after which
    prompts of other lengths compile nothing."""
    cfg, params = tiny
    monkeypatch.setattr(eng, "MIN_KEY_WINDOW", 16)
    e = Engine(params, cfg, **ENGINE)
    w0, w1 = e._windows(20)
    e.warmup(sampling=GREEDY, keep_logits=True, prompt_lens=[5])
    assert list(e._prefill_programs) == [(w0, 8)]
    with pytest.raises(ValueError, match="not both"):
        e.warmup(20, prompt_lens=[5])
    e.warmup(20, GREEDY, keep_logits=True)  # a first chunk of any size, a second of up to 4 tokens in its window
    assert sorted(e._prefill_programs) == sorted([(w0, 4), (w0, 8), (w0, 16), (w1, 4)])
    compiled = len(aot._memo)
    for n in (1, 7, 16, 20):
        e.generate([list(range(1, n + 1))], max_new_tokens=3, sampling=GREEDY, keep_logits=True)
    assert len(aot._memo) == compiled, "a prompt up to max_prompt_len compiled a program after the warmup"
