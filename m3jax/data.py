"""Training text: the Python standard library's sources, a byte-level BPE tokenizer, and the
key/value retrieval tasks planted in that text.

The corpus is every ``*.py`` file of the running interpreter's standard library (site-packages
excluded), split into train and held-out files by a hash of the relative path, so the split is the
same on every machine. :func:`train_tokenizer` fits a BPE to the config's vocabulary;
:func:`prepare_corpus` builds (or reads back from a run folder) the tokenizer and the two encoded
streams. :func:`sample_batch` / :func:`heldout_batches` cut plain-text windows from a stream;
:func:`retrieval_batch` plants key/value lines in them (``python -m m3jax.train --data retrieval``),
and :mod:`m3jax.needle` plants one the same way (:func:`draw_keys`, :func:`kv_line`, :func:`plant`).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import re
import sys
import sysconfig
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from m3jax.atomic import atomic_write
from m3jax.config import M3Config

# --------------------------------------------------------------------------------------------------
# The Python standard library's own sources


def stdlib_files() -> tuple[list[Path], list[Path], Path]:
    """(train, held-out, root): ``*.py`` under the stdlib (site-packages excluded), sorted by relative
    path; a file is held out when crc32(relative path) % 20 == 0 (about 5 %, stable across machines)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((f for f in root.rglob("*.py") if "site-packages" not in f.parts), key=lambda f: f.relative_to(root).as_posix())
    held = [f for f in files if zlib.crc32(f.relative_to(root).as_posix().encode()) % 20 == 0]
    held_set = set(held)
    return [f for f in files if f not in held_set], held, root


def read_texts(files: list[Path], budget_bytes: int | None) -> list[str]:
    """The files' UTF-8 texts in order (unreadable ones skipped) until ``budget_bytes`` characters."""
    out, total = [], 0
    for f in files:
        try:
            s = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(s)
        total += len(s)
        if budget_bytes and total >= budget_bytes:
            break
    return out


SPECIALS = ("<pad>", "<s>", "</s>")


def train_tokenizer(texts: list[str], cfg: M3Config, tokenizer_mb: float = 8.0):
    """Byte-level BPE (``tokenizers``) to the config's vocabulary. Ids 0, 1, 2 are <pad>, <s>, </s>;
    when the image / video placeholder ids fall inside the vocabulary, the BPE stops below them and
    ``<image>`` / ``<video>`` take those ids."""
    v = cfg.text.vocab_size
    media = sorted(i for i in (cfg.image_token_id, cfg.video_token_id) if i < v)
    n_bpe = media[0] if media else v
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    budget, sample = int(tokenizer_mb * 1e6), []
    for s in texts:
        sample.append(s)
        budget -= len(s)
        if budget <= 0:
            break
    tok.train_from_iterator(sample, trainer=trainer)
    names = {cfg.image_token_id: "<image>", cfg.video_token_id: "<video>"}
    for i in media:
        if tok.get_vocab_size() == i:
            tok.add_special_tokens([names[i]])
    if tok.get_vocab_size() > v:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids > vocab_size {v}")
    return tok


def encode_corpus(tok, texts: list[str], eos_id: int) -> np.ndarray:
    """One int32 stream: each file's tokens followed by </s>."""
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, np.int32))
        parts.append(np.asarray([eos_id], np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def sample_batch(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int = 0) -> dict:
    """Deterministic windows of seq_len + 1 tokens for ``step`` (a resumed run sees the same data)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return {"tokens": np.stack([stream[s : s + seq_len + 1] for s in starts])}


def heldout_batches(stream: np.ndarray, n: int, batch: int, seq_len: int) -> list[dict]:
    """``n`` fixed, evenly spaced held-out batches."""
    total = n * batch
    starts = np.linspace(0, len(stream) - seq_len - 2, total).astype(np.int64)
    rows = np.stack([stream[s : s + seq_len + 1] for s in starts])
    return [{"tokens": rows[i * batch : (i + 1) * batch]} for i in range(n)]



def prepare_corpus(folder: Path, cfg: M3Config, data_mb: float = 0.0, tokenizer_mb: float = 8.0,
                   tokenizer_from: Path | None = None):
    """(tokenizer, train stream, held-out stream) for a run folder: read back from ``folder``'s
    ``tokenizer.json`` and ``data.npz`` when both are there, else built and written there. The
    tokenizer is ``folder``'s own, else ``tokenizer_from``'s ``tokenizer.json``, else trained on the
    train files; ``data_mb`` > 0 reads only that many MB of train sources (a 20th of it held out)."""
    train_files, held_files, _ = stdlib_files()
    budget = int(data_mb * 1e6) if data_mb else None
    tok_path = folder / "tokenizer.json"
    cache = folder / "data.npz"
    if tok_path.exists() and cache.exists():
        tok = Tokenizer.from_file(str(tok_path))
        try:
            with np.load(cache) as d:
                return tok, d["train"], d["heldout"]
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:  # truncated, or not ours
            print(f"warning: {cache} is damaged ({type(e).__name__}: {e}); rebuilding it", file=sys.stderr, flush=True)
    t0 = time.time()
    train_texts = read_texts(train_files, budget)
    held_texts = read_texts(held_files, budget // 20 if budget else None)
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
    elif tokenizer_from:
        tok = Tokenizer.from_file(str(Path(tokenizer_from) / "tokenizer.json"))
        atomic_write(tok_path, tok.to_str(pretty=True))
    else:
        tok = train_tokenizer(train_texts, cfg, tokenizer_mb)
        atomic_write(tok_path, tok.to_str(pretty=True))
    eos = cfg.text.eos_token_id if isinstance(cfg.text.eos_token_id, int) else cfg.text.eos_token_id[0]
    train, held = encode_corpus(tok, train_texts, eos), encode_corpus(tok, held_texts, eos)
    buf = io.BytesIO()  # written whole or not at all: a killed run must not leave a truncated cache
    np.savez(buf, train=train, heldout=held)
    atomic_write(cache, buf.getvalue())
    print(f"data: {len(train_texts)} train / {len(held_texts)} held-out files -> {len(train)} / {len(held)} tokens "
          f"(vocab {tok.get_vocab_size()}, {time.time() - t0:.1f}s)", flush=True)
    return tok, train, held


def tokenizer_files(tok, cfg: M3Config) -> dict[str, str]:
    """{name: contents} of ``tokenizer.json`` and a ``tokenizer_config.json`` naming the special tokens,
    saved with a model (in the same atomic save as its weights)."""
    return {"tokenizer.json": tok.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "pad_token": "<pad>", "model_max_length": cfg.text.max_position_embeddings}, indent=1)}


# --------------------------------------------------------------------------------------------------
# Key/value retrieval tasks planted in the text (``--data retrieval``)
#
# A row is ordinary text with lines ``\nKEY access = 90517\n`` planted at random places; later in the
# row some of those lines appear again (the query), and the value tokens of the repeat are the
# answers. Keys and values are random per row, so an answer is predictable only by finding the
# definition: the loss on the answers is a pure retrieval signal at the definition's distance.
#
# Keys are words that are one token of the tokenizer (`` access``): the token before `` =`` then names
# the key, so one previous-token feature plus one matching head (an induction circuit, what small
# models learn first) solves the lookup; a multi-token key (``48213`` = ``4|8|21|3``) needs the
# last few tokens composed first. Without such words (no tokenizer) keys are 5-digit numbers.

KEY_RANGE = (10000, 100000)  # 5-digit values (and keys when the tokenizer gives no word keys)


@dataclasses.dataclass(frozen=True)
class TextEncoder:
    """``encoder(str) -> int32 ids`` (the tokenizer's, or UTF-8 bytes as ids) and ``keys``: words that
    are one token with their leading space (the retrieval tasks' keys)."""

    tok: Any

    def __call__(self, s: str) -> np.ndarray:
        if self.tok is None:
            return np.frombuffer(s.encode("utf-8"), np.uint8).astype(np.int32)
        return np.asarray(self.tok.encode(s, add_special_tokens=False).ids, np.int32)

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        if self.tok is None:
            return ()
        words = sorted(t[1:] for t in self.tok.get_vocab() if re.fullmatch("\u0120[a-z]{4,}", t))  # Ġ = space
        return tuple(w for w in words if len(self(" " + w)) == 1)


def text_encoder(tok, vocab_size: int) -> TextEncoder:
    """The tokenizer's encoder, or without one UTF-8 bytes as ids (the byte-level fallback of
    ``m3jax.generate``; needs vocab_size >= 256)."""
    if tok is None and vocab_size < 256:
        raise ValueError(f"vocab_size {vocab_size} < 256: no tokenizer and too small for UTF-8 bytes as ids")
    return TextEncoder(tok)


def draw_keys(rng, encode, n: int) -> list[str]:
    """``n`` distinct keys: single-token words of ``encode.keys`` when there are enough, else 5-digit numbers."""
    pool = getattr(encode, "keys", ())
    if len(pool) >= n:
        return [pool[i] for i in rng.choice(len(pool), n, replace=False)]
    return [str(k) for k in rng.choice(np.arange(*KEY_RANGE), n, replace=False)]


def kv_line(encode, key: str, value: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix ``\\nKEY <key> =``, value `` <value>``, close ``\\n``) token ids, encoded piece by piece
    so the value's tokens are the same at the definition and at the query (the byte-level
    pre-tokenizer splits at ``=`` and before a space anyway: this is the running-text tokenisation)."""
    return encode(f"\nKEY {key} ="), encode(f" {value}"), encode("\n")


@dataclasses.dataclass
class RetrievalRow:
    tokens: np.ndarray  # int32 [n]
    answer: np.ndarray  # bool [n]: the token is a value token of a query line
    value_at: list[int]  # row position of each definition's first value token, per pair
    query_value_at: list[int]  # row position of each query's first value token (-1: pair not queried)


def plant(filler: np.ndarray, events: list[tuple[int, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Insert token runs into ``filler``: events (offset into filler, ids, answer mask), applied in the
    given order (an earlier event at the same offset comes first). Returns (tokens, answer, start of
    each event's run in the result)."""
    order = sorted(range(len(events)), key=lambda i: (events[i][0], i))
    toks, ans, starts, prev, pos = [], [], [0] * len(events), 0, 0
    for i in order:
        off, ids, a = events[i]
        toks += [filler[prev:off], ids]
        ans += [np.zeros(off - prev, bool), a]
        pos += off - prev
        starts[i] = pos
        pos += len(ids)
        prev = off
    toks.append(filler[prev:])
    ans.append(np.zeros(len(filler) - prev, bool))
    return np.concatenate(toks).astype(np.int32), np.concatenate(ans), starts


def retrieval_row(stream: np.ndarray, n: int, rng, encode, n_pairs: int, query_frac: float = 1.0) -> RetrievalRow:
    """One training row of ``n`` tokens: ``n_pairs`` key/value lines at random places in a random
    window of ``stream``, and for ``round(query_frac * n_pairs)`` of them a query (the same line again)
    later in the row. A query sits uniformly in the last 7/8 of the row and its definition uniformly
    before it, so definition-to-query distances cover the whole row."""
    keys = draw_keys(rng, encode, n_pairs)
    values = rng.integers(*KEY_RANGE, n_pairs)
    lines = [kv_line(encode, k, int(v)) for k, v in zip(keys, values)]
    queried = sorted(rng.choice(n_pairs, int(round(query_frac * n_pairs)), replace=False).tolist())
    line_len = [sum(len(x) for x in ln) for ln in lines]
    m = n - sum(line_len) - sum(line_len[i] for i in queried)
    if m < 8:
        raise ValueError(f"a row of {n} tokens cannot hold {n_pairs} key/value lines and their queries")
    start = int(rng.integers(0, len(stream) - m))
    filler = stream[start : start + m]
    q_off = rng.integers(m // 8, m + 1, n_pairs)
    d_off = (rng.random(n_pairs) * np.where(np.isin(np.arange(n_pairs), queried), q_off, m)).astype(np.int64)
    events = []
    for i, (p, v, c) in enumerate(lines):  # definitions first: one at the same offset as a query precedes it
        events.append((int(d_off[i]), np.concatenate([p, v, c]), np.zeros(line_len[i], bool)))
    for i in queried:
        p, v, c = lines[i]
        mask = np.concatenate([np.zeros(len(p), bool), np.ones(len(v), bool), np.zeros(len(c), bool)])
        events.append((int(q_off[i]), np.concatenate([p, v, c]), mask))
    tokens, answer, starts = plant(filler, events)
    value_at = [starts[i] + len(lines[i][0]) for i in range(n_pairs)]
    query_value_at = [-1] * n_pairs
    for j, i in enumerate(queried):
        query_value_at[i] = starts[n_pairs + j] + len(lines[i][0])
    return RetrievalRow(tokens, answer, value_at, query_value_at)


def answer_weights(answer: np.ndarray, task_share: float) -> np.ndarray:
    """:func:`m3jax.train.loss_fn`'s ``mask`` for a row's labels (tokens[1:]): 1 on text, and on the answer tokens the
    weight that gives them ``task_share`` of the row's loss (a few dozen answer tokens among 16K text
    tokens would otherwise carry no signal)."""
    labels = answer[1:]
    n_ans = int(labels.sum())
    w = np.ones(len(labels), np.float32)
    if n_ans and task_share > 0:
        w[labels] = task_share / (1.0 - task_share) * (len(labels) - n_ans) / n_ans
    return w


def retrieval_batch(stream: np.ndarray, step: int, batch: int, seq_len: int, seed: int, encode,
                    pairs_per_1k: float = 1.0, task_share: float = 0.5, answers_only: bool = False) -> dict:
    """Deterministic batch of retrieval rows for ``step`` (seeded like :func:`sample_batch`):
    ``{"tokens": int32 [B, seq_len + 1], "mask": fp32 [B, seq_len]}``; ``answers_only``: the mask is 1 on
    the answer labels and 0 elsewhere (the loss is then the answers' cross-entropy)."""
    rng = np.random.default_rng([seed, step, 1])
    n_pairs = max(1, int(round(pairs_per_1k * seq_len / 1024)))
    rows = [retrieval_row(stream, seq_len + 1, rng, encode, n_pairs) for _ in range(batch)]
    mask = [r.answer[1:].astype(np.float32) if answers_only else answer_weights(r.answer, task_share) for r in rows]
    return {"tokens": np.stack([r.tokens for r in rows]), "mask": np.stack(mask)}

