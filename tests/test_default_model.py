"""The shipped default checkpoint (m3jax/assets/m3-small): it loads through the MXFP8 path, has the
m3_small architecture, has learned its corpus (held-out stdlib code scores far below a uniform
guess and below an untrained model), retrieves a key/value line planted in held-out text through
native MSA, and the CLI default generates corpus-like text."""

import json

import numpy as np
import pytest

import m3jax
from m3jax import generate, needle
from m3jax.config import preset
from m3jax.data import stdlib_files

ASSET = generate.DEFAULT_CHECKPOINT


@pytest.fixture(scope="module")
def shipped():
    return m3jax.load_pretrained(ASSET, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def heldout_ids():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    _, held, _ = stdlib_files()
    text = "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in held[:8])
    return np.asarray(tok.encode(text).ids[:1024], np.int32)[None]


def _nll(model, ids):
    logits = np.asarray(m3jax.forward(model, ids[:, :-1]).logits, np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0]
    return float(np.mean(logz - picked))


def test_shipped_checkpoint_is_m3_small_in_mxfp8():
    cfg = m3jax.load_config(ASSET)
    assert cfg.text == preset("m3_small").text
    raw = (ASSET / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert "F8_E4M3" in dtypes and any(k.endswith("_scale_inv") for k in header)
    assert (ASSET / "model.safetensors").stat().st_size < 24e6


def test_shipped_model_learned_its_corpus(shipped, heldout_ids):
    trained = _nll(shipped, heldout_ids)
    untrained = _nll(m3jax.init_random(shipped.config, seed=0), heldout_ids)
    # Uniform over 4096 ids is 8.3 nats; the training run logged 3.3 on its own held-out split.
    assert trained < 4.5 < untrained, (trained, untrained)


def test_default_cli_generates_python_like_text(tmp_path):
    report = generate.main(["--max-new-tokens", "48", "--temperature", "0", "--quiet",
                            "--output-json", str(tmp_path / "out.json")])
    assert report["config"] == str(ASSET)
    text = report["text"]
    assert len(report["generated_ids"]) == 48
    assert any(w in text for w in ("self", "return", "def ", "import", "if ", " = ")), text


def test_shipped_model_retrieves_through_msa():
    # 2,048 tokens: twice stage 1's row length (the stage-1 model scored 0.125 there all-dense), 32
    # blocks of 64, so native top-8 has to select the key's block. Issue #17's 4K/16K numbers are in
    # experiments/2026-12-01_m3_small_curriculum; this keeps the shipped file honest in seconds.
    res = needle.main(["--ctx", "2048", "--trials", "8", "--seed", "3"])
    assert res["block_size"] == 64 and res["topk"] == 8
    assert res["accuracy"] >= 0.75, res["per_depth"]
    assert max(res["needle_block_selected"].values()) >= 0.75, res["needle_block_selected"]
