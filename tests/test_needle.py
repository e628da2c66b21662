"""Retrieval data (``m3jax.data``, as ``m3jax.train --data retrieval`` uses it) and
``python -m m3jax.needle``: answer positions and loss weights, determinism by seed, held-out text for
the needle, and the CLI on a tiny random model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from m3jax import needle
from m3jax import data

# Filler ids far above the UTF-8 byte ids of the planted lines: a token >= FILLER is text, below is planted.
FILLER = 1000
BYTES = data.text_encoder(None, 256)


def _stream(n=20_000):
    return np.arange(n, dtype=np.int32) + FILLER


def test_retrieval_row_answers_and_filler():
    row = data.retrieval_row(_stream(), 1025, np.random.default_rng(3), BYTES, n_pairs=4)
    tok, ans = row.tokens, row.answer
    assert tok.shape == ans.shape == (1025,)
    # The text is one contiguous window of the stream, in order, around the planted lines.
    text = tok[tok >= FILLER]
    assert np.array_equal(np.diff(text), np.ones(len(text) - 1))
    assert row.query_value_at.count(-1) == 0  # every pair is queried once by default
    for d, q in zip(row.value_at, row.query_value_at):
        assert q > d  # the query comes after its definition
        n_val = 6  # " 90517": a space and five digits, one byte each
        assert np.array_equal(tok[q : q + n_val], tok[d : d + n_val])
        assert ans[q : q + n_val].all() and not ans[d : d + n_val].any()
        assert bytes(tok[d - 12 : d].astype(np.uint8)).startswith(b"\nKEY ") and tok[d - 1] == ord("=")
    assert ans.sum() == 4 * 6
    # Loss weights over the labels (tokens[1:]): the answers carry task_share of the row's loss.
    w = data.answer_weights(ans, 0.25)
    assert w.shape == (1024,)
    assert np.isclose(w[ans[1:]].sum() / w.sum(), 0.25) and np.all(w[~ans[1:]] == 1)


def test_retrieval_batch_deterministic_by_seed_and_step():
    s = _stream()
    a = data.retrieval_batch(s, 5, 2, 512, 0, BYTES)
    assert a["tokens"].shape == (2, 513) and a["mask"].shape == (2, 512) and a["tokens"].dtype == np.int32
    assert all(np.array_equal(a[k], data.retrieval_batch(s, 5, 2, 512, 0, BYTES)[k]) for k in a)
    answers = data.retrieval_batch(s, 5, 2, 512, 0, BYTES, answers_only=True)  # held-out eval: answers' CE only
    assert np.array_equal(answers["tokens"], a["tokens"]) and np.array_equal(answers["mask"] == 1, a["mask"] > 1)
    assert answers["mask"].sum() == 2 * 6  # one pair per 512 tokens, a 6-byte value
    assert not np.array_equal(a["tokens"], data.retrieval_batch(s, 6, 2, 512, 0, BYTES)["tokens"])
    assert not np.array_equal(a["tokens"], data.retrieval_batch(s, 5, 2, 512, 1, BYTES)["tokens"])
    with pytest.raises(ValueError, match="cannot hold"):
        data.retrieval_row(s, 40, np.random.default_rng(0), BYTES, n_pairs=4)


def test_word_keys_are_one_token():
    from tokenizers import Tokenizer

    enc = data.text_encoder(Tokenizer.from_file(str(needle.DEFAULT_CHECKPOINT / "tokenizer.json")), 4096)
    assert len(enc.keys) >= 256 and all(len(enc(" " + k)) == 1 for k in enc.keys[:50])
    row = data.retrieval_row(_stream(), 2049, np.random.default_rng(0), enc, n_pairs=8)
    eq = enc(" =")[0]
    key_tokens = [row.tokens[d - 2] for d in row.value_at]  # "\nKEY <key> =" then the value
    assert all(row.tokens[d - 1] == eq for d in row.value_at)
    assert len(set(key_tokens)) == 8 and all(enc.tok.decode([int(k)]).strip() in enc.keys for k in key_tokens)


def test_needle_text_is_held_out():
    train, held, _ = data.stdlib_files()
    seen = []
    needle.heldout_stream(lambda text: seen.append(text) or BYTES(text[:10]), 10**5, 2)
    assert len(seen) == len(held)  # the stream asked for more than there is: every held-out file, no other
    held_texts = {f.read_text(encoding="utf-8") for f in held}
    assert set(seen) <= held_texts
    assert not set(seen) & {f.read_text(encoding="utf-8") for f in train[:200]}


def test_needle_row():
    row = needle.needle_row(_stream(), 300, 0.5, np.random.default_rng(0), BYTES)
    v = len(row.value)
    assert row.tokens.shape == (300,) and np.array_equal(row.tokens[-v:], row.value)
    assert np.array_equal(row.tokens[row.value_at : row.value_at + v], row.value)
    assert abs(row.value_at - 150) < 25  # at the requested depth (a line is ~20 bytes)


def test_needle_cli(byte_text_checkpoint, tmp_path):
    argv = ["--checkpoint", str(byte_text_checkpoint), "--ctx", "192", "--trials", "4", "--seed", "1", "--depths", "0.2", "0.8"]
    out = tmp_path / "n.json"
    res = needle.main(argv + ["--output-json", str(out)])
    saved = json.loads(out.read_text())
    assert 0.0 <= saved["accuracy"] <= 1.0 and set(saved["per_depth"]) == {"0.2", "0.8"}
    assert all(r["trials"] == 2 for r in saved["per_depth"].values())
    assert set(saved["needle_block_selected"]) == {"1", "2"}  # the MSA layers
    assert all(0.0 <= v <= 1.0 for v in saved["needle_block_selected"].values())
    # Depths respected: the needle's value sits at ~depth of the row.
    for t in saved["trials_detail"]:
        assert abs(t["value_at"] - t["depth"] * 192) < 30
    again = needle.main(argv)
    drop = lambda r: {k: v for k, v in r.items() if k != "seconds"}  # noqa: E731
    assert drop(again) == drop(res)
    other = needle.main(argv[:-5] + ["--seed", "2", "--config-override", "topk=3", "--dense"])
    assert [t["value"] for t in other["trials_detail"]] != [t["value"] for t in res["trials_detail"]]
    assert other["needle_block_selected"] is None and other["topk"] == 3
