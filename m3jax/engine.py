"""Generation engine: chunked prefill into a paged KV + index-key cache, batched decode, sampling.

* Prefill runs one sequence at a time in fixed-size chunks (one compiled shape per chunk size);
  each chunk writes its K/V/index keys into the sequence's pages, then attends over the whole
  cache of that sequence, so the maths equals the full forward pass.
* Decode runs all sequences together, one token each, with static shapes: the step is compiled
  once and reused for every token (positions and tokens are traced values).
* Sampling follows the model card by default (temperature 1.0, top-p 0.95, top-k 40);
  temperature 0 is greedy.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.cache import PagedCache, init_cache
from m3jax.config import M3Config
from m3jax.model import lm_head, text_hidden


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 40

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@functools.partial(jax.jit, static_argnames=("params",))
def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] fp32 -> token ids [B]. Top-k, then top-p (nucleus) over the renormalised rest."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / params.temperature
    k = min(params.top_k, logits.shape[-1]) if params.top_k > 0 else logits.shape[-1]
    vals, idx = jax.lax.top_k(logits, k)  # sorted descending
    probs = jax.nn.softmax(vals, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < params.top_p
    vals = jnp.where(keep, vals, -jnp.inf)
    choice = jax.random.categorical(key, vals, axis=-1)
    return jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def prefill_chunk(params, cache: PagedCache, embeds, row, start, last, cfg: M3Config):
    """One prefill chunk of one sequence. embeds [1, C, D] at positions start..start+C-1 of sequence
    ``row``; returns (fp32 logits [V] at chunk index ``last``, MSA selections, cache)."""
    c = embeds.shape[1]
    positions = (start + jnp.arange(c, dtype=jnp.int32))[None]
    page_table = jax.lax.dynamic_slice_in_dim(cache.page_table, row, 1, axis=0)
    h, selections, cache = text_hidden(params, embeds, positions, cfg, cache, page_table)
    return lm_head(params, h[0, last]), selections, cache


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def decode_step(params, cache: PagedCache, tokens, positions, cfg: M3Config):
    """One token for every sequence. tokens, positions: int32 [B] -> (fp32 logits [B, V], cache)."""
    embeds = params["text"]["embed"][tokens][:, None]
    h, _, cache = text_hidden(params, embeds, positions[:, None], cfg, cache, cache.page_table)
    return lm_head(params, h[:, 0]), cache


@dataclasses.dataclass
class GenerationResult:
    prompt_lens: list[int]
    generated: list[list[int]]  # per sequence, stops after eos (inclusive) or max_new_tokens
    step_logits: list[np.ndarray] | None  # per decode step fp32 [B, V] (first entry: end of prefill)
    timings: dict[str, float]


class Engine:
    """Holds a model, its cache and the compiled steps; ``generate`` takes prompts of any lengths."""

    def __init__(self, params: dict, cfg: M3Config, *, batch: int, capacity: int, prefill_chunk: int = 512,
                 cache_dtype=None, mesh=None):
        if capacity > cfg.text.max_position_embeddings:
            raise ValueError(
                f"context {capacity} exceeds max_position_embeddings={cfg.text.max_position_embeddings} of the config"
            )
        self.params, self.cfg = params, cfg
        self.batch, self.capacity = batch, capacity
        self.chunk = min(prefill_chunk, capacity)
        dtype = cache_dtype or params["text"]["embed"].dtype
        self.cache = init_cache(cfg, batch, capacity, dtype) if mesh is None else None
        # With a mesh (m3jax.sharding): parameters placed by the rule table, cache pages split over the
        # model axis (striped page table), and every step traced under jax.set_mesh (expert-parallel MoE).
        self.mesh = mesh
        if mesh is not None:
            from m3jax import sharding

            self.params = sharding.shard_params(params, cfg, mesh)
            self.cache = sharding.init_sharded_cache(cfg, batch, capacity, dtype, mesh)

    def _under_mesh(fn):  # noqa: N805  (method decorator: run under the engine's mesh, if any)
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            if self.mesh is None:
                return fn(self, *args, **kwargs)
            with jax.set_mesh(self.mesh):
                return fn(self, *args, **kwargs)

        return wrapped

    @_under_mesh
    def warmup(self) -> float:
        """Compile the prefill chunk and the decode step (one dummy call each) so that timings after
        it measure running, not compiling. The dummy writes land in row 0 at positions the real
        prefill rewrites before anything reads them. Returns the seconds spent."""
        t0 = time.perf_counter()
        d = self.params["text"]["embed"].shape[1]
        dummy = jnp.zeros((1, self.chunk, d), self.params["text"]["embed"].dtype)
        logits, _, self.cache = prefill_chunk(self.params, self.cache, dummy, jnp.int32(0), jnp.int32(0),
                                              jnp.int32(0), self.cfg)
        zeros = jnp.zeros((self.batch,), jnp.int32)
        logits, self.cache = decode_step(self.params, self.cache, zeros, zeros, self.cfg)
        jax.block_until_ready(logits)
        return time.perf_counter() - t0

    @_under_mesh
    def prefill(self, row: int, prompt_embeds: jax.Array, on_progress: Callable[[int], None] | None = None):
        """Prefill sequence ``row`` with embeddings [T, D]; returns fp32 logits [V] at the last token."""
        t = prompt_embeds.shape[0]
        if t == 0:
            raise ValueError("empty prompt")
        if t > self.capacity:
            raise ValueError(f"prompt of {t} tokens exceeds the context capacity {self.capacity}")
        for start in range(0, t, self.chunk):
            n = min(self.chunk, t - start)
            piece = prompt_embeds[start : start + n]
            if n < self.chunk:  # pad to the compiled chunk; pad rows land beyond the prompt and are rewritten later
                piece = jnp.concatenate([piece, jnp.zeros((self.chunk - n, piece.shape[1]), piece.dtype)])
            logits, _, self.cache = prefill_chunk(
                self.params, self.cache, piece[None], jnp.int32(row), jnp.int32(start), jnp.int32(n - 1), self.cfg
            )
            if on_progress:
                on_progress(n)
        return logits

    @_under_mesh
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | None = None,
        *,
        prompt_embeds: Sequence[jax.Array] | None = None,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        seed: int = 0,
        eos_ids: Sequence[int] = (),
        keep_logits: bool = False,
        on_token: Callable[[int, int], None] | None = None,
        on_prefill_progress: Callable[[int], None] | None = None,
    ) -> GenerationResult:
        """Generate for up to ``batch`` prompts (token ids, or precomputed embeddings [T, D] each)."""
        if prompt_embeds is None:
            embed = self.params["text"]["embed"]
            prompt_embeds = [embed[jnp.asarray(p, jnp.int32)] for p in prompts]
        n = len(prompt_embeds)
        if not 0 < n <= self.batch:
            raise ValueError(f"{n} prompts for an engine of batch {self.batch}")
        lens = [int(e.shape[0]) for e in prompt_embeds]
        if max(lens) + max_new_tokens > self.capacity:
            raise ValueError(
                f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context capacity "
                f"{self.capacity}; raise --ctx or shorten the prompt"
            )
        timings: dict[str, float] = {}
        key = jax.random.key(seed)
        t0 = time.perf_counter()
        first_logits = []
        for row, e in enumerate(prompt_embeds):
            first_logits.append(self.prefill(row, e, on_progress=on_prefill_progress))
        logits = jnp.stack(first_logits + [first_logits[0]] * (self.batch - n))
        key, sub = jax.random.split(key)
        tokens = sample(logits, sub, sampling)
        tokens.block_until_ready()
        timings["ttft_s"] = time.perf_counter() - t0
        timings["prefill_tokens"] = sum(lens)

        positions = np.array(lens + [0] * (self.batch - n), np.int32)
        generated = [[] for _ in range(n)]
        done = [False] * n
        step_logits = [np.asarray(logits[:n])] if keep_logits else None
        t1 = time.perf_counter()
        steps = 0
        for step in range(max_new_tokens):
            host_tokens = np.asarray(tokens)
            for b in range(n):
                if not done[b]:
                    generated[b].append(int(host_tokens[b]))
                    if on_token:
                        on_token(b, int(host_tokens[b]))
                    done[b] = int(host_tokens[b]) in eos_ids
            if all(done) or step == max_new_tokens - 1:
                break
            logits, self.cache = decode_step(self.params, self.cache, tokens, jnp.asarray(positions), self.cfg)
            positions = positions + 1
            key, sub = jax.random.split(key)
            tokens = sample(logits, sub, sampling)
            steps += 1
            if keep_logits:
                step_logits.append(np.asarray(logits[:n]))
        jax.block_until_ready(tokens)
        timings["decode_steps"] = steps
        timings["decode_s"] = time.perf_counter() - t1
        return GenerationResult(lens, generated, step_logits, timings)
