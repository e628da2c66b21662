"""Generation engine: chunked prefill into a paged KV + index-key cache, batched decode, sampling.

* Prefill runs one sequence at a time in fixed-size chunks; each chunk writes its K/V/index keys
  into the sequence's pages, then attends over a key window of the first W pages, W = the chunk's
  end rounded up to a bucket (:func:`key_window_pages`). Keys past the chunk's end are in every
  query's future, so the window gives the full forward pass's maths while a chunk costs what it
  reads, not the whole capacity; buckets (of at least ``MIN_KEY_WINDOW`` tokens) keep the compiled
  shapes to O(log capacity). A prompt's last chunk, shorter than the chunk, is padded only up to the
  smallest size that holds it (:func:`prefill_chunk_sizes`, the prefill buckets: the MSA block size
  times powers of two, up to the chunk), so a short prompt costs what it is, not a whole chunk; pad
  rows land beyond the prompt and are rewritten before anything reads them. Where an earlier chunk of
  the prompt runs in the same key window, the last one takes that full-chunk program instead: a
  prompt never compiles more programs than without buckets (at 1M tokens a last window holds dozens
  of chunks, and one more program there would be one more long compile for under a chunk's time).
* Decode runs all sequences together, one token each per step, with static shapes: one compiled
  program runs ``decode_steps_per_call`` steps (a ``lax.fori_loop``; each step embeds, runs the
  layers, samples, and advances positions and the PRNG key on the device) and hands back that many
  tokens per row. The host dispatches call c+1 before it reads call c's tokens, so the device never
  waits for Python and the host pays its per-call cost once per N tokens; streaming and stop tokens
  see tokens in groups of N. Tokens after a row's stop token (and steps past ``max_new_tokens``) are
  computed and discarded: the cache of such a row holds their keys beyond its kept tokens, which
  nothing reads (the next ``generate`` prefills the row again).
* Every program (each prefill window, decode per sampling mode) is compiled through
  :mod:`m3jax.aot`: with a disk cache on, a second process reads the exported program instead of
  tracing and lowering the model again; ``warmup`` hands all of them to :func:`m3jax.aot.compile_all`,
  so XLA compiles them side by side.
* Sampling follows the model card by default (temperature 1.0, top-p 0.95, top-k 40);
  temperature 0 is greedy, and so is one so small that ``logits / T`` overflows (the limit).
* One engine serves one thread at a time: a call from a second thread while one runs raises
  RuntimeError (the engine holds one cache).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import threading
import time
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from m3jax import aot, sharding
from m3jax.cache import PagedCache, init_cache
from m3jax.config import M3Config
from m3jax.model import check_input_ids, check_kernels_ahead, lm_head, text_hidden


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature: 0 = greedy, else > 0 (finite); top_p in (0, 1]; top_k >= 1 (a k at or above the
    vocabulary size keeps every token). Out-of-range values are refused here: a negative temperature
    would sample the least likely tokens, and top_p > 1 or top_k <= 0 would quietly turn the cut off."""

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 40

    def __post_init__(self):
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))  # numpy scalars too: the jit cache keys on the value
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1 (k >= vocabulary size keeps every token), got {self.top_k}")
        object.__setattr__(self, "top_k", int(self.top_k))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@functools.partial(jax.jit, static_argnames=("params",))
def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] fp32 -> token ids [B]. Top-k, then top-p (nucleus) over the renormalised rest.

    A temperature so small that ``logits / T`` overflows (e.g. 1e-39) picks the argmax: the limit of
    sampling as T -> 0 (the overflowed softmax would be NaN and draw token 0)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if params.greedy:
        return greedy
    spread = jnp.max(jnp.abs(jnp.where(jnp.isfinite(logits), logits, 0.0)), axis=-1)
    overflow = ~jnp.isfinite(spread / params.temperature)
    logits = logits / params.temperature
    k = min(params.top_k, logits.shape[-1])
    vals, idx = jax.lax.top_k(logits, k)  # sorted descending
    probs = jax.nn.softmax(vals, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < params.top_p
    vals = jnp.where(keep, vals, -jnp.inf)
    choice = jax.random.categorical(key, vals, axis=-1)
    sampled = jnp.take_along_axis(idx, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(overflow, greedy, sampled)


# Smallest key window (tokens) of a prefill chunk. Below it a wider window costs next to nothing
# (the full-attention layers stop at the chunk's own keys, the MSA kernels skip the key blocks past a
# query tile's causal limit) while every bucket is one more compile: a 1M prefill in chunks of 2048
# compiles 5 windows, and a context up to 64K one.
MIN_KEY_WINDOW = 65536


def key_window_pages(end: int, block_size: int, max_pages: int) -> int:
    """Pages a prefill chunk ending (exclusive) at token ``end`` attends over: ceil(end / block)
    rounded up to the next power of two (under 2x the keys needed: the kernels skip keys past the
    causal limit, so a wider window costs little, and each distinct window is one more long compile,
    about log2(max_pages) of them), at least ``MIN_KEY_WINDOW`` tokens, capped at the sequence's
    ``max_pages``."""
    need = max(-(-end // block_size), -(-MIN_KEY_WINDOW // block_size))
    w = 1
    while w < need:
        w *= 2
    return min(w, max_pages)


def prefill_chunk_sizes(chunk: int, block_size: int) -> tuple[int, ...]:
    """Sizes a prefill chunk is compiled at, ascending: ``block_size * 2^k`` below ``chunk``, then ``chunk``
    (log2(chunk / block) + 1 programs per key window at most). A chunk of n tokens runs at the smallest
    size >= n; every full chunk runs at ``chunk``."""
    sizes, b = [], block_size
    while b < chunk:
        sizes.append(b)
        b *= 2
    return (*sizes, chunk)


def prefill_chunk(params, cache: PagedCache, embeds, row, start, last, *, cfg: M3Config, key_pages: int):
    """One prefill chunk of one sequence. embeds [1, C, D] at positions start..start+C-1 of sequence
    ``row``, all below ``key_pages * block``; returns (fp32 logits [V] at chunk index ``last``, cache).
    Only the row's first ``key_pages`` pages are written and read. (The MSA selections are not
    returned: nothing in generation reads them, and they would be one more output per chunk.)"""
    c = embeds.shape[1]
    positions = (start + jnp.arange(c, dtype=jnp.int32))[None]
    page_table = jax.lax.dynamic_slice(cache.page_table, (row, 0), (1, key_pages))
    h, _, cache = text_hidden(params, embeds, positions, cfg, cache, page_table)
    return lm_head(params, h[0, last]), cache


def embed_chunk(embed, ids, n):
    """Embeddings [1, C, D] of a chunk's token ids [1, C] (int32, checked in range), rows from ``n`` on
    zero (the padding of a chunk shorter than its compiled size)."""
    rows = jnp.arange(ids.shape[1])[None, :, None]
    return jnp.where(rows < n, jnp.take(embed, ids, axis=0), jnp.zeros((), embed.dtype))


def first_tokens(row_logits, key_data, *, sampling: SamplingParams):
    """The first sampled token of every row from its prefill's fp32 logits (``row_logits``: B arrays
    [V]): returns (logits [B, V], tokens [B], whether each row's logits are all finite [B], key data
    after the split the token was sampled with)."""
    logits = jnp.stack(row_logits)
    key, sub = jax.random.split(jax.random.wrap_key_data(key_data))
    return logits, sample(logits, sub, sampling), jnp.isfinite(logits).all(-1), jax.random.key_data(key)


def decode_steps(params, cache: PagedCache, tokens, positions, key_data, *, cfg: M3Config,
                 sampling: SamplingParams, steps: int, with_logits: bool):
    """``steps`` decode steps for every sequence, sampled on the device. tokens, positions: int32 [B]
    (the last sampled token and its position); key_data: uint32 raw PRNG key before these steps.
    Returns (tokens [B, steps], the last of them [B], positions + steps, key data, fp32 logits
    [steps, B, V] or None, cache).
    Each step splits the key as the host loop did (key, sub = split(key); sample with sub), so a
    seed gives the same tokens whatever ``steps`` is. Positions past the cache's last slot (only
    in steps whose tokens the host discards) are held at that slot, so no step reads pages beyond the
    page table; such a step's keys land in a slot no kept token attends to."""
    last_slot = cache.page_table.shape[1] * cache.layers[0].k.shape[1] - 1
    b = tokens.shape[0]

    def step(i, carry):
        tokens, positions, key, out, logits_out, cache = carry
        embeds = params["text"]["embed"][tokens][:, None]
        h, _, cache = text_hidden(params, embeds, positions[:, None], cfg, cache, cache.page_table)
        logits = lm_head(params, h[:, 0])
        key, sub = jax.random.split(key)
        tokens = sample(logits, sub, sampling)
        out = jax.lax.dynamic_update_slice(out, tokens[:, None], (0, i))
        if with_logits:
            logits_out = jax.lax.dynamic_update_slice(logits_out, logits[None], (i, 0, 0))
        return tokens, jnp.minimum(positions + 1, last_slot), key, out, logits_out, cache

    vocab = params["text"]["embed"].shape[0]
    out = jnp.zeros((b, steps), jnp.int32)
    logits_out = jnp.zeros((steps, b, vocab), jnp.float32) if with_logits else None
    key = jax.random.wrap_key_data(key_data)
    tokens, positions, key, out, logits_out, cache = jax.lax.fori_loop(
        0, steps, step, (tokens, positions, key, out, logits_out, cache))
    return out, tokens, positions, jax.random.key_data(key), logits_out, cache


@dataclasses.dataclass
class GenerationResult:
    prompt_lens: list[int]
    generated: list[list[int]]  # per sequence, stops after eos (inclusive) or max_new_tokens
    step_logits: list[np.ndarray] | None  # per decode step fp32 [B, V] (first entry: end of prefill)
    timings: dict[str, float]


# Decode steps per compiled call by default: the host's per-call cost (dispatch, reading the tokens)
# is paid once per 8 tokens, while a stop token wastes at most 2 calls (the one that found it and the
# one in flight), 16 steps' compute. Wall against device time per step, by steps per call:
# benchmarks/RESULTS.md#generate-second-process.
DECODE_STEPS_PER_CALL = 8


class Engine:
    """Holds a model, its cache and the compiled programs; ``generate`` takes prompts of any lengths.
    ``decode_steps_per_call`` (N): decode steps one compiled call runs (tokens come back N at a time).
    ``prefill_buckets``: a prompt's last, shorter chunk runs at the smallest of :func:`prefill_chunk_sizes`
    that holds it, unless an earlier chunk runs in its key window (off: padded to the whole chunk; either
    way one program per key window a prompt runs)."""

    def __init__(self, params: dict, cfg: M3Config, *, batch: int, capacity: int, prefill_chunk: int = 512,
                 cache_dtype=None, mesh=None, decode_steps_per_call: int = DECODE_STEPS_PER_CALL,
                 prefill_buckets: bool = True):
        for name, value in (("batch", batch), ("capacity", capacity), ("prefill_chunk", prefill_chunk),
                            ("decode_steps_per_call", decode_steps_per_call)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if capacity > cfg.text.max_position_embeddings:
            raise ValueError(
                f"context {capacity} exceeds max_position_embeddings={cfg.text.max_position_embeddings} of the config"
            )
        self.params, self.cfg = params, cfg
        self.batch, self.capacity = batch, capacity
        self.chunk = min(prefill_chunk, capacity)
        # The sizes a chunk is compiled at (prefill_chunk_sizes); without buckets every chunk runs at the chunk.
        block = cfg.text.index_block_size
        self.chunk_sizes = prefill_chunk_sizes(self.chunk, block) if prefill_buckets else (self.chunk,)
        self.steps_per_call = decode_steps_per_call
        dtype = cache_dtype or params["text"]["embed"].dtype
        self.cache = init_cache(cfg, batch, capacity, dtype) if mesh is None else None
        # With a mesh (m3jax.sharding): parameters placed by the rule table, cache pages split over the
        # model axis (striped page table), and every step traced under jax.set_mesh (expert-parallel MoE).
        self.mesh = mesh
        if mesh is not None:
            self.params = sharding.shard_params(params, cfg, mesh)
            self.cache = sharding.init_sharded_cache(cfg, batch, capacity, dtype, mesh)
        self.max_pages = self.cache.page_table.shape[1]
        # This engine's prefill programs by (key window, chunk size): every chunk looks its program up
        # here, not through the AOT cache, whose key hashes every parameter leaf's shape and sharding on
        # every lookup (hundreds of leaves per model).
        self._prefill_programs: dict[tuple[int, int], Callable] = {}
        self._embed_programs: dict[int, Callable] = {}  # by chunk size
        self._first_programs: dict[SamplingParams, Callable] = {}  # by sampling mode
        # Compiled programs take inputs exactly as lowered: chunk embeddings go in replicated (and logits
        # come out so under a mesh), and the decode loop's small arrays on the engine's devices (nothing
        # moves host-to-device per call).
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._small_sharding = self.cache.page_table.sharding
        self._busy = threading.RLock()  # re-entrant: generate calls prefill (see _exclusive)

    def _under_mesh(fn):  # noqa: N805  (method decorator: run under the engine's mesh, if any)
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            if self.mesh is None:
                return fn(self, *args, **kwargs)
            with jax.set_mesh(self.mesh):
                return fn(self, *args, **kwargs)

        return wrapped

    def _exclusive(fn):  # noqa: N805  (method decorator: one thread at a time)
        """The engine holds one cache: two threads generating at once would write each other's rows and
        return wrong tokens. A second thread is refused at once (not queued: a caller that shares an
        engine by mistake learns it, and one that means to can hold its own lock)."""
        @functools.wraps(fn)
        def wrapped(self, *args, **kwargs):
            if not self._busy.acquire(blocking=False):
                raise RuntimeError(f"Engine.{fn.__name__}: this engine is in use by another thread; an engine "
                                   "runs one generation at a time (use one engine per thread, or a lock)")
            try:
                return fn(self, *args, **kwargs)
            finally:
                self._busy.release()

        return wrapped

    def _windows(self, prompt_len: int) -> list[int]:
        """Key windows (pages) of the chunks of a ``prompt_len``-token prefill, in order."""
        bs = self.cfg.text.index_block_size
        return [key_window_pages(start + self.chunk, bs, self.max_pages) for start in range(0, prompt_len, self.chunk)]

    def _chunk_size(self, n: int) -> int:
        """The compiled size a chunk of ``n`` tokens runs at: the smallest of ``chunk_sizes`` >= n."""
        return next(c for c in self.chunk_sizes if c >= n)

    def _prefill_plan(self, prompt_len: int) -> list[tuple[int, int, int, int]]:
        """(start, tokens, key window, compiled size) of each chunk of a ``prompt_len``-token prefill: full
        chunks at the chunk, the last at its bucket when it is alone in its key window."""
        starts = range(0, prompt_len, self.chunk)
        windows = self._windows(prompt_len)
        plan = [(start, min(self.chunk, prompt_len - start), window, self.chunk)
                for start, window in zip(starts, windows)]
        start, n, window, _ = plan[-1]
        if len(plan) == 1 or plan[-2][2] != window:
            plan[-1] = (start, n, window, self._chunk_size(n))
        return plan

    def _programs_up_to(self, max_prompt_len: int) -> set[tuple[int, int]]:
        """(key window, size) of every prefill program a prompt of up to ``max_prompt_len`` tokens can run:
        a window's first chunk at each size up to that of its tokens (a prompt may end there), its later
        chunks at the chunk (one program per window without buckets, up to ``len(chunk_sizes)`` with)."""
        out, last_window = set(), None
        for _, n, window, _ in self._prefill_plan(max_prompt_len):
            if window == last_window:  # a later chunk of the window: full, or a last one sharing the full program
                out.add((window, self.chunk))
            else:  # a window's first chunk, of up to n tokens
                out.update((window, c) for c in self.chunk_sizes if c <= self._chunk_size(n))
            last_window = window
        return out

    def _out_tree(self, *outputs):
        """Output pytree of a program returning ``outputs`` and then the cache (declared, so that a
        program read from the AOT cache needs no trace)."""
        return jax.tree.structure((*outputs, self.cache))

    def _out_shardings(self, *outputs):
        """Under a mesh, where a program's ``outputs`` (shardings, None for an absent output) and then
        the cache go: the cache and the decode loop's small arrays stay where they came in, since each
        call's outputs are the next call's inputs; logits come back replicated. None on one device."""
        if self.mesh is None:
            return None
        return (*outputs, jax.tree.map(lambda x: x.sharding, self.cache))

    def _prefill_spec(self, key_pages: int, size: int) -> aot.Program:
        """The prefill chunk of ``size`` tokens for one key window, as the AOT cache compiles it."""
        embed = self.params["text"]["embed"]
        embeds = jax.ShapeDtypeStruct((1, size, embed.shape[1]), embed.dtype, sharding=self._replicated)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)  # host scalars
        return aot.Program("prefill_chunk", prefill_chunk, (self.params, self.cache, embeds, i32, i32, i32),
                           out_tree=self._out_tree(0), static={"cfg": self.cfg, "key_pages": key_pages},
                           donate_argnums=(1,), out_shardings=self._out_shardings(self._replicated))

    @staticmethod
    def _program(store: dict, key, spec: Callable[[], aot.Program]) -> Callable:
        """``store[key]``: a prefill, chunk-embedding or first-token program, compiled from ``spec()``
        the first time it is asked for (warmup fills the stores ahead, without running them)."""
        fn = store.get(key)
        if fn is None:
            fn = store[key] = aot.compile_all([spec()])[0]
        return fn

    def _decode_spec(self, sampling: SamplingParams, with_logits: bool) -> aot.Program:
        """``decode_steps`` for ``steps_per_call`` steps in ``sampling``'s mode, as the AOT cache compiles it."""
        b = self.batch
        i32 = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=self._small_sharding)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self._small_sharding)
        return aot.Program("decode_steps", decode_steps, (self.params, self.cache, i32, i32, key),
                           out_tree=self._out_tree(0, 0, 0, 0, 0 if with_logits else None),
                           static={"cfg": self.cfg, "sampling": sampling, "steps": self.steps_per_call,
                                   "with_logits": with_logits},
                           donate_argnums=(1,), out_shardings=self._out_shardings(
                               *(self._small_sharding,) * 4, self._replicated if with_logits else None))

    def _decode_program(self, sampling: SamplingParams, with_logits: bool) -> Callable:
        """The decode program compiled (once per mode: the AOT cache keeps it in memory)."""
        return aot.compile_all([self._decode_spec(sampling, with_logits)])[0]

    def _embed_spec(self, size: int) -> aot.Program:
        """:func:`embed_chunk` of a chunk of ``size`` token ids, as the AOT cache compiles it."""
        embed = self.params["text"]["embed"]
        ids = jax.ShapeDtypeStruct((1, size), jnp.int32)
        return aot.Program("embed_chunk", embed_chunk, (embed, ids, jax.ShapeDtypeStruct((), jnp.int32)),
                           out_tree=jax.tree.structure(0), out_shardings=self._replicated)

    def _first_spec(self, sampling: SamplingParams) -> aot.Program:
        """:func:`first_tokens` for this engine's batch in ``sampling``'s mode, as the AOT cache compiles it."""
        vocab = self.params["text"]["embed"].shape[0]
        row = jax.ShapeDtypeStruct((vocab,), jnp.float32, sharding=self._replicated)
        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        small = None if self.mesh is None else (self._replicated, *(self._small_sharding,) * 3)
        return aot.Program("first_tokens", first_tokens, ((row,) * self.batch, key),
                           out_tree=jax.tree.structure((0, 0, 0, 0)), static={"sampling": sampling},
                           out_shardings=small)

    @staticmethod
    def _seed_key_data(seed: int) -> jax.Array:
        """The raw PRNG key of ``seed`` (``jax.random.key``; its program is compiled in the warmup)."""
        return jax.random.key_data(jax.random.key(seed))

    @_under_mesh
    def warmup(self, max_prompt_len: int | None = None, sampling: SamplingParams = SamplingParams(),
               keep_logits: bool = False, *, prompt_lens: Sequence[int] | None = None,
               confirm: Callable[[], None] | None = None) -> float:
        """Compile the prefill programs that prompts of up to ``max_prompt_len`` tokens (default: the
        capacity) can run (every key window, and with prefill buckets every chunk size of a last chunk),
        or, given ``prompt_lens``, exactly those that prompts of these lengths run (what the CLI knows);
        and the decode program for ``sampling`` (and ``keep_logits``); then run one decode call (its
        first run loads the kernels), so that timings after it measure running, not compiling. The
        dummy call writes positions 0..N-1 of each row, which the real prefill or decode rewrites
        before anything reads them. Returns the seconds spent; their split is in ``warmup_split``
        (programs compiled or read back, and that time by phase of :func:`m3jax.aot.compile_all`:
        ``programs_stage_s``, ``programs_xla_s``, ``programs_confirm_s``, ``programs_finish_s``, and
        ``programs_forked``, the programs staged in a child process; the decode call).

        ``confirm``: the caller's kernel self-check runs in the background
        (:class:`m3jax.pallas.verdicts.Background`) and the programs are traced presuming its canaries
        pass; canaries this engine's config asks for beyond it join it. Both are confirmed once the
        programs are compiled, before any is kept or run: the :class:`~m3jax.pallas.verdicts.CanaryFailed`
        raised when one did not pass leaves nothing compiled here, and the caller builds its model's
        config and engine again (the kernel choices read the verdicts then)."""
        t0 = time.perf_counter()
        confirm_all = None
        if confirm is None:  # every verdict the traces below ask for, in one batch (first run on a GPU)
            check_kernels_ahead(self.cfg)
        else:
            extra = check_kernels_ahead(self.cfg, wait=False)

            def confirm_all():
                extra.confirm()
                confirm()
        if prompt_lens is None:
            wanted = self._programs_up_to(min(max_prompt_len or self.capacity, self.capacity))
        elif max_prompt_len is not None:
            raise ValueError("warmup takes max_prompt_len or prompt_lens, not both")
        else:
            wanted = {(w, c) for t in prompt_lens for _, _, w, c in self._prefill_plan(min(t, self.capacity))}
        # Traced one after the other, compiled by XLA side by side (aot.compile_all): at 1M tokens of M3
        # widths that is five prefill programs, one per key window, and the decode program; with them the
        # small programs around them (a chunk's embedding per chunk size, the first token), so that
        # nothing compiles once generation runs: a compile inside the decode loop was the first
        # process's decode time over a second process's (which reads them from the disk cache).
        programs = [wc for wc in sorted(wanted) if wc not in self._prefill_programs]
        sizes = sorted({c for _, c in wanted})
        phases: dict[str, float] = {}
        compiled = aot.compile_all([*(self._prefill_spec(*wc) for wc in programs),
                                    *(self._embed_spec(c) for c in sizes), self._first_spec(sampling),
                                    self._decode_spec(sampling, keep_logits)], timing=phases, confirm=confirm_all)
        self._prefill_programs.update(zip(programs, compiled))
        self._embed_programs.update(zip(sizes, compiled[len(programs):]))
        self._first_programs[sampling] = compiled[-2]
        decode = compiled[-1]
        self._seed_key_data(0)
        t1 = time.perf_counter()
        zeros = jax.device_put(np.zeros((self.batch,), np.int32), self._small_sharding)
        key = jax.device_put(np.zeros((2,), np.uint32), self._small_sharding)
        out, *_, self.cache = decode(self.params, self.cache, zeros, zeros, key)
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        self.warmup_split = {"programs_s": t1 - t0, "first_decode_call_s": t2 - t1,
                             **{f"programs_{k}": v for k, v in phases.items()}}
        return t2 - t0

    def _check_embeds(self, x, name: str) -> None:
        """Precomputed embeddings [T, hidden_size] of one prompt (ValueError naming ``name``)."""
        d = self.cfg.text.hidden_size
        if np.ndim(x) != 2 or np.shape(x)[1] != d:
            raise ValueError(f"{name} must be [T, hidden_size={d}], got shape {np.shape(x)}")

    @_exclusive
    @_under_mesh
    def prefill(self, row: int, prompt: Sequence[int] | jax.Array, on_progress: Callable[[int], None] | None = None):
        """Prefill sequence ``row`` with token ids or embeddings [T, D]; returns fp32 logits [V] at the
        last token. Token ids are embedded one chunk at a time: at 1M tokens of M3 the whole prompt's
        embeddings would be 12 GB."""
        if not (isinstance(row, (int, np.integer)) and 0 <= row < self.batch):
            raise ValueError(f"row {row!r} outside [0, batch={self.batch})")
        by_id = np.ndim(prompt) == 1
        if len(prompt) == 0:
            raise ValueError("empty prompt")
        if by_id:
            prompt = check_input_ids(prompt, self.cfg.text, name=f"prompt of row {row}")[0]
        else:
            self._check_embeds(prompt, f"prompt embeddings of row {row}")
        embed = self.params["text"]["embed"]
        t = prompt.shape[0]
        if t > self.capacity:
            raise ValueError(f"prompt of {t} tokens exceeds the context capacity {self.capacity}")
        for start, n, window, size in self._prefill_plan(t):
            # Padded to the compiled size: pad rows land beyond the prompt and are rewritten later.
            if by_id:  # ids padded on the host, embedded by a compiled program (nothing compiles per prompt)
                ids = np.zeros((1, size), np.int32)
                ids[0, :n] = prompt[start : start + n]
                piece = self._program(self._embed_programs, size, lambda: self._embed_spec(size))(
                    embed, ids, np.int32(n))
            else:
                piece = prompt[start : start + n]
                if n < size:
                    piece = jnp.concatenate([piece, jnp.zeros((size - n, piece.shape[1]), piece.dtype)])
                piece = jax.device_put(piece[None], self._replicated)
            step = self._program(self._prefill_programs, (window, size), lambda: self._prefill_spec(window, size))
            logits, self.cache = step(
                self.params, self.cache, piece, np.int32(row), np.int32(start), np.int32(n - 1))
            if on_progress:
                on_progress(n)
        return logits

    @_exclusive
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
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (an integer; 0 = prefill only), got {max_new_tokens!r}")
        eos = tuple(eos_ids) if isinstance(eos_ids, Iterable) and not isinstance(eos_ids, (str, bytes)) else None
        if eos is None or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in eos):
            raise ValueError(f"eos_ids must be a sequence of integer token ids, got {eos_ids!r}")
        eos_ids = eos
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not (np.ndim(seed) == 0 and np.issubdtype(np.asarray(seed).dtype, np.integer)
                and -(2**63) <= int(seed) < 2**63):
            raise ValueError(f"seed must be an integer in [-2**63, 2**63) (a JAX PRNG key), got {seed!r}")
        inputs = list(prompts) if prompt_embeds is None else list(prompt_embeds)
        n = len(inputs)
        if not 0 < n <= self.batch:
            raise ValueError(f"{n} prompts for an engine of batch {self.batch}")
        for i, p in enumerate(inputs):  # before any prefill: a bad prompt must not leave others half-run
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            if prompt_embeds is not None:
                self._check_embeds(p, f"prompt_embeds[{i}]")
            elif np.ndim(p) != 1:
                raise ValueError(f"prompt {i} must be a 1-D sequence of token ids, got shape {np.shape(p)}")
            else:
                check_input_ids(p, self.cfg.text, name=f"prompt {i}")
        lens = [len(p) for p in inputs]
        if max(lens) + max_new_tokens > self.capacity:
            raise ValueError(
                f"prompt ({max(lens)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context capacity "
                f"{self.capacity}; raise --ctx or shorten the prompt"
            )
        timings: dict[str, float] = {}
        key_data = self._seed_key_data(seed)
        t0 = time.perf_counter()
        first_logits = []
        for row, p in enumerate(inputs):
            first_logits.append(self.prefill(row, p, on_progress=on_prefill_progress))
        first = self._program(self._first_programs, sampling, lambda: self._first_spec(sampling))
        logits, tokens, finite, key_data = first(
            tuple(first_logits + [first_logits[0]] * (self.batch - n)), key_data)
        bad = [i for i, ok in enumerate(jax.device_get(finite)[:n]) if not ok]
        if bad:
            raise FloatingPointError(f"the logits at the end of prompt(s) {bad} hold NaN or infinite values: the "
                                     "weights or the inputs overflow; refusing to sample from them")
        timings["ttft_s"] = time.perf_counter() - t0
        timings["prefill_tokens"] = sum(lens)

        positions = jax.device_put(np.array(lens + [0] * (self.batch - n), np.int32), self._small_sharding)
        tokens = jax.device_put(tokens, self._small_sharding)
        key_data = jax.device_put(key_data, self._small_sharding)
        decode = self._decode_program(sampling, keep_logits) if max_new_tokens > 1 else None
        t1 = time.perf_counter()
        generated, step_logits, steps = self._decode(
            decode, tokens, positions, key_data, logits, n, max_new_tokens, eos_ids, keep_logits, on_token
        )
        timings["decode_steps"] = steps
        timings["decode_s"] = time.perf_counter() - t1
        return GenerationResult(lens, generated, step_logits, timings)

    def _decode(self, decode, tokens, positions, key_data, logits, n, max_new_tokens, eos_ids, keep_logits, on_token):
        """The decode loop. ``tokens`` [B] (sampled from the prefill's ``logits``), ``positions`` [B]
        and ``key_data`` are on the device; ``decode`` is the compiled program of N steps. Call c+1 is
        dispatched before call c's tokens [B, N] are read (``jax.device_get``, the loop's only
        device-to-host transfer besides the logits it is asked to keep; nothing goes host-to-device),
        so the device runs call after call while the host streams and checks stop tokens a call
        behind. ceil((max_new_tokens - 1) / N) calls at most: the last may run steps past
        max_new_tokens, whose tokens are discarded (as are a row's tokens after its stop token); once
        every row has stopped, the call in flight is discarded. Returns (generated ids per row,
        per-step logits or None, decode steps run); returns after the last dispatched call has
        finished, so the caller's wall time covers every step it counts."""
        generated = [[] for _ in range(n)]
        step_logits = [] if keep_logits else None
        if max_new_tokens == 0:
            return generated, step_logits, 0
        done = [False] * n
        calls = -(-(max_new_tokens - 1) // self.steps_per_call) if max_new_tokens > 1 else 0
        pending = (tokens, logits if keep_logits else None)  # the first token: one "step" (shaped on the host)
        latest = tokens
        steps = 0
        for call in range(calls + 1):
            if call < calls:  # dispatch the next call before reading this one
                out, tokens, positions, key_data, next_logits, self.cache = decode(
                    self.params, self.cache, tokens, positions, key_data)
                latest = out
                steps += self.steps_per_call
            # [B, steps] tokens and [steps, B, V] logits ([B] and [B, V] for the first token)
            host_tokens = np.asarray(jax.device_get(pending[0])).reshape(self.batch, -1)
            host_logits = np.asarray(jax.device_get(pending[1])).reshape(-1, *logits.shape) if keep_logits else None
            for j in range(host_tokens.shape[1]):
                if all(done):
                    break
                if keep_logits:
                    step_logits.append(host_logits[j, :n])
                for b in range(n):
                    if not done[b]:
                        token = int(host_tokens[b, j])
                        generated[b].append(token)
                        if on_token:
                            on_token(b, token)
                        done[b] = token in eos_ids or len(generated[b]) == max_new_tokens
            if all(done) or call == calls:
                break
            pending = (out, next_logits)
        jax.block_until_ready(latest)
        return generated, step_logits, steps
