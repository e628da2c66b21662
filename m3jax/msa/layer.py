"""One MSA attention layer as the model runs it: the one entry (:func:`attend`) and the one place that
reads ``cfg.attention_impl``.

``cfg.attention_impl`` names a :class:`Variant` of :data:`VARIANTS`: ``"reference"`` (pure jnp, query
chunks of ``cfg.attention_chunk``), ``"dense_mask"`` (the dense-mask formulation, for tiny tests) or
``"pallas"`` (the Mosaic GPU kernels of :mod:`m3jax.msa.kernels`). :func:`resolve_attention_impl`
turns ``"auto"`` into one of them once, when a model is built; :func:`variant` reads it everywhere
else. :func:`attend` picks the route of one layer's step: the paged cache read in place (decode),
context parallel over a page-split cache (:mod:`m3jax.msa.parallel`), or the key window gathered.
The projections (q/k/v and the index branch) are the model's; this module takes them as arrays.

A layer's block selection is a named rule (:func:`register_selection_rule`): the stock top-k
(:func:`topk_rule`) unless ``cfg.msa_selection_rules`` names another for that layer, which then runs
on every path through :func:`select_from_scores` (:func:`layer_variant`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from m3jax.cache import LayerCache, cached_block_scores, cached_index_keys
from m3jax.config import STOCK_SELECTION_RULE, M3Config, TextConfig, UnsupportedConfigError
from m3jax.mesh_axes import MODEL
from m3jax.msa import kernels, parallel, reference
from m3jax.pallas import _backend


def forced_blocks(cfg: TextConfig, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ``msa_force_in`` / ``msa_force_out`` block ids of ``layer``."""
    return (tuple(b for l, b in cfg.msa_force_in if l == layer), tuple(b for l, b in cfg.msa_force_out if l == layer))


def scores(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, cfg: TextConfig) -> jax.Array:
    """Index block scores of one query chunk: fp32 [B, K, C, nb] (see :func:`reference.block_scores`), from
    the index keys as the cache holds them (``cfg.index_cache_dtype``), in ``cfg.index_score_dtype``."""
    return cached_block_scores(iq, ik, q_pos, cfg)


def topk_rule(block_scores: jax.Array, q_pos: jax.Array, cfg: TextConfig, layer: int) -> jax.Array:
    """The stock selection rule (:data:`~m3jax.config.STOCK_SELECTION_RULE`): top-k with the config's MSA
    knobs and ``layer``'s forced blocks (:func:`m3jax.msa.reference.select_blocks`), int32 [B, K, C, topk]."""
    force_in, force_out = forced_blocks(cfg, layer)
    return reference.select_blocks(
        block_scores, q_pos, block_size=cfg.index_block_size, topk=cfg.index_topk_blocks,
        local_blocks=cfg.index_local_blocks, init_blocks=cfg.index_init_blocks, force_in=force_in, force_out=force_out,
    )


# name -> (rule, digest of its code). A config names a layer's rule (TextConfig.msa_selection_rules); the
# jit caches key on the config, so a name stands for one code for the life of the process.
_RULES: dict[str, tuple[Callable, str]] = {STOCK_SELECTION_RULE: (topk_rule, "")}


def _code_digest(code: types.CodeType, h=None) -> str:
    """SHA-256 of what a function computes: bytecode, names and constants (nested functions' too),
    not its file or line numbers (a notebook cell run again is the same rule)."""
    h = h or hashlib.sha256()
    h.update(code.co_code + repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(c, h)
        else:
            h.update(repr(c).encode())
    return h.hexdigest()


def register_selection_rule(name: str, rule: Callable | None = None):
    """Register ``rule(block_scores, q_pos, cfg: TextConfig, layer) -> block ids`` under ``name`` for
    ``TextConfig.msa_selection_rules`` (as a decorator: ``@register_selection_rule("mine")``). Returns
    the rule.

    block_scores fp32 [B, K, C, nb] (:func:`scores`: -inf for blocks after the query), q_pos [B, C];
    the rule returns int32 [B, K, C, cfg.index_topk_blocks]: distinct block ids, -1 in empty slots.
    The forced blocks are the rule's to keep (the query's own block carries its causal diagonal:
    a query that selects none of its keys gets a zero output); :func:`topk_rule` with another config
    does the stock forcing. The rule runs in jnp wherever a layer names it (the model, the engine's
    prefill and decode over the gathered cache, the probe, training): see :func:`layer_variant`.

    A name is one rule for the process: registering it again with other code (bytecode, names or
    constants) is a ValueError, because compiled programs are keyed by the name (and on disk by the
    code's digest, :func:`rule_digests`). Values a rule closes over are not part of it: a rule with
    other parameters needs another name.
    """
    if rule is None:
        return lambda fn: register_selection_rule(name, fn)
    if not isinstance(name, str) or not name or name == STOCK_SELECTION_RULE:
        raise ValueError(f"register_selection_rule: name {name!r} must be a non-empty str other than "
                         f"{STOCK_SELECTION_RULE!r} (the stock rule)")
    code = getattr(rule, "__code__", None)
    if code is None:
        raise TypeError(f"register_selection_rule: {rule!r} is not a Python function")
    digest = _code_digest(code)
    if name in _RULES and _RULES[name][1] != digest:
        raise ValueError(f"selection rule {name!r} is registered with other code; register this one under "
                         "another name (programs compiled for a rule are keyed by its name)")
    _RULES[name] = (rule, digest)
    return rule


def selection_rule(cfg: TextConfig, layer: int) -> str:
    """The name of ``layer``'s selection rule (``cfg.msa_selection_rules``, else the stock rule)."""
    return dict(cfg.msa_selection_rules).get(layer, STOCK_SELECTION_RULE)


def _rule(name: str) -> Callable:
    if name not in _RULES:
        raise UnsupportedConfigError(f"MSA selection rule {name!r} is not registered "
                                     f"(m3jax.msa.layer.register_selection_rule); registered: {sorted(_RULES)}")
    return _RULES[name][0]


def rule_digests(cfg: TextConfig) -> dict[str, str]:
    """{name: digest of its code} of the registered rules ``cfg`` names: what a program-cache key holds
    beside the config, whose names alone do not say which code another process registered."""
    digests = {}
    for _, name in cfg.msa_selection_rules:
        _rule(name)  # an unregistered name: the error that lists the registered ones
        digests[name] = _RULES[name][1]
    return digests


def select_from_scores(block_scores: jax.Array, q_pos: jax.Array, cfg: TextConfig, layer: int) -> jax.Array:
    """``layer``'s block selection (its rule, :func:`selection_rule`) from one query chunk's block scores
    fp32 [B, K, C, nb] at q_pos [B, C]: int32 [B, K, C, topk]."""
    name = selection_rule(cfg, layer)
    sel = _rule(name)(block_scores, q_pos, cfg, layer)
    want = (*block_scores.shape[:3], cfg.index_topk_blocks)
    if tuple(sel.shape) != want or sel.dtype != jnp.int32:
        raise ValueError(f"selection rule {name!r} of layer {layer}: {sel.dtype}{list(sel.shape)}, "
                         f"want int32{list(want)}")
    return sel


def select(iq: jax.Array, ik: jax.Array, q_pos: jax.Array, cfg: TextConfig, layer: int) -> jax.Array:
    """Block selection of one query chunk (iq [B, C, K, Hx], ik [B, S, Hx]): int32 [B, K, C, topk]."""
    return select_from_scores(scores(iq, ik, q_pos, cfg), q_pos, cfg, layer)


# --------------------------------------------------------------------------------------------------
# The variants: one entry each


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of computing MSA, named by ``cfg.attention_impl``.

    - ``gathered(q, k, v, iq, ik, q_pos, cfg: M3Config, layer) -> (o, block ids)``: MSA over
      contiguous keys (the whole sequence, or a gathered key window). The only required piece.
    - ``local(cfg: TextConfig, query_chunk) -> parallel.Local``: the per-device pieces of
      context-parallel prefill over a page-split cache (None: such a cache is gathered instead);
      ``query_chunk`` is ``cfg.attention_chunk``, for a variant that runs in query chunks.
    - ``decode(q, iq, kv, page_table, q_pos, cfg: TextConfig, force_in, force_out) -> (o, block ids)``
      and ``local_decode(cfg: TextConfig) -> parallel.Local``; ``dense_decode(q, kv, page_table, q_pos,
      cfg: TextConfig) -> o`` and ``local_dense_decode``: one token per sequence read from the paged
      cache in place, on one device and context parallel (None: the cache is gathered).
    - ``unsupported_reason(cfg: TextConfig, dtype)`` / ``decode_unsupported_reason(cfg)``: why the
      variant (its decode) cannot run a config (None: it can, or it runs everything).
    - ``attention(q, k, v, block_ids, q_pos, block_size)``: the jnp attention over selected blocks a
      chunked variant runs (None: not one), for code that brings its own selection.
    - ``whole_chunk``: the variant tiles a prefill chunk itself (no ``attention_chunk`` sub-chunks).
    - ``dense``: how the full-attention layers run a gathered prefill: ``"flash"`` (cuDNN on the GPU
      for 16-bit models, else key blocks), ``"blocked"`` (key blocks of jnp) or ``"dense_mask"``.
    """

    gathered: Callable
    local: Callable | None = None
    decode: Callable | None = None
    local_decode: Callable | None = None
    dense_decode: Callable | None = None
    local_dense_decode: Callable | None = None
    unsupported_reason: Callable | None = None
    decode_unsupported_reason: Callable | None = None
    attention: Callable | None = None
    whole_chunk: bool = False
    dense: str = "blocked"


def _chunked(attention: Callable) -> Callable:
    """``gathered`` of a jnp variant: selection and ``attention(q, k, v, sel, q_pos, block_size)`` per
    query chunk of ``cfg.attention_chunk`` (no [T, S] score matrix of the whole sequence)."""

    def gathered(q, k, v, iq, ik, q_pos, cfg: M3Config, layer: int):
        def chunk_fn(qp, qc, iqc):
            sel = select(iqc, ik, qp, cfg.text, layer)
            return attention(qc, k, v, sel, qp, cfg.text.index_block_size), sel

        (o, sel), merge = reference.map_query_chunks(chunk_fn, cfg.attention_chunk, q_pos, q, iq)
        return merge(o, 1), merge(sel, 2)

    return gathered


def _reference_local(cfg: TextConfig, query_chunk: int) -> parallel.Local:
    """Per-device pieces of the jnp variant's context-parallel prefill, in query chunks."""
    bs = cfg.index_block_size

    def local_scores(iq, keys, local_len):  # fp8 index pages upcast (exact); scores in cfg.index_score_dtype
        return cached_block_scores(iq, keys[2].astype(iq.dtype), local_len - 1, cfg)

    def local_attend(q, keys, local_sel, local_len):
        return reference.sparse_attention(q, keys[0], keys[1], local_sel, jnp.maximum(local_len - 1, 0), bs,
                                          return_lse=True)

    return parallel.Local(keys=parallel.local_window, scores=local_scores, attend=local_attend, query_chunk=query_chunk)


def _kernels_gathered(q, k, v, iq, ik, q_pos, cfg: M3Config, layer: int):
    """The prefill kernels over contiguous keys, heads split over the active mesh."""
    t = cfg.text
    force_in, force_out = forced_blocks(t, layer)
    kernel = functools.partial(kernels.prefill, force_in=force_in, force_out=force_out)
    return parallel.head_split(kernel, q, k, v, iq, cached_index_keys(ik, t, iq.dtype), q_pos, t,
                               unsupported_reason=kernels.unsupported_reason)


VARIANTS: dict[str, Variant] = {
    "reference": Variant(gathered=_chunked(reference.sparse_attention), local=_reference_local,
                         attention=reference.sparse_attention),
    "dense_mask": Variant(gathered=_chunked(reference.dense_mask_attention), attention=reference.dense_mask_attention,
                          dense="dense_mask"),
    "pallas": Variant(
        gathered=_kernels_gathered, local=lambda t, query_chunk: kernels.local_prefill(t),
        decode=kernels.decode, local_decode=kernels.local_decode,
        dense_decode=kernels.dense_decode, local_dense_decode=kernels.local_dense_decode,
        unsupported_reason=kernels.unsupported_reason, decode_unsupported_reason=kernels.decode_unsupported_reason,
        whole_chunk=True, dense="flash",
    ),
}


def variant(cfg: M3Config) -> Variant:
    """The variant ``cfg.attention_impl`` names; ``"auto"`` left unresolved runs the reference."""
    return VARIANTS["reference" if cfg.attention_impl == "auto" else cfg.attention_impl]


def layer_variant(cfg: M3Config, layer: int) -> Variant:
    """The variant MSA layer ``layer`` runs: ``cfg``'s, or for a layer with another selection rule than
    the stock one (:func:`selection_rule`) the rule over the jnp index scores and the jnp attention over
    its blocks (``cfg``'s variant's ``attention``, else the reference's) in query chunks, over
    contiguous keys only (a paged cache is gathered): the kernels, the in-place decode and the
    context-parallel selection (:func:`m3jax.msa.parallel.global_topk`) compute the stock rule."""
    v = variant(cfg)
    if selection_rule(cfg.text, layer) == STOCK_SELECTION_RULE:
        return v
    attention = v.attention or reference.sparse_attention
    return Variant(gathered=_chunked(attention), attention=attention, dense=v.dense)


_FALLBACK_WARNED: set[str] = set()


def resolve_attention_impl(impl: str, cfg: M3Config | None = None, dtype="bfloat16") -> str:
    """The attention path a model of ``cfg`` in ``dtype`` runs.

    "auto" -> "pallas" on a GPU when the MSA kernels take the config (:func:`m3jax.msa.kernels.unsupported_reason`:
    shapes, and a kernel that failed its self-check there), else "reference" with one warning per reason;
    off the GPU always "reference" (the kernels' interpret mode is a test tool, not a fast path). Both
    paths compute the same model: exact in fp32 (the kernels split fp32 into bf16 pieces, XLA runs fp32
    dots at full precision, :func:`m3jax.model.matmul_precision`), and in bf16 they differ only by
    accumulation order (:mod:`m3jax.msa.compare`). "pallas" is checked the same way and refused with
    the reason; any other named variant is returned as it is."""
    if impl not in ("auto", "pallas"):
        return impl
    check = VARIANTS["pallas"].unsupported_reason
    reason = check(cfg.text, dtype) if cfg is not None and cfg.text.has_sparse_layers else None
    if impl == "pallas":
        if reason:
            raise UnsupportedConfigError(f"attention_impl='pallas' cannot run this config: {reason}")
        if not _backend.on_gpu():
            warnings.warn("attention_impl='pallas' off the GPU runs the kernels in Mosaic GPU's interpret mode: the "
                          "same numbers, orders of magnitude slower (a test tool; 'reference' is the CPU path)",
                          stacklevel=3)
        return impl
    if not _backend.on_gpu():
        return "reference"
    if reason:
        if reason not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(reason)
            warnings.warn(f"attention_impl='auto': the MSA kernels cannot run this config ({reason}); "
                          "running the jnp reference path", RuntimeWarning, stacklevel=3)
        return "reference"
    return "pallas"


# --------------------------------------------------------------------------------------------------
# The route


def _context_parallel(v: Variant, cfg: M3Config, kv: LayerCache, page_table, q) -> bool:
    """Whether MSA over the paged cache (a prefill chunk, or a decode step not read in place) runs
    context parallel over the page-split cache instead of gathering the key window: under a mesh model
    axis > 1 whose pages split, by the traffic rule of :func:`m3jax.msa.parallel.prefill_context_parallel`.
    A cache whose pages do not split gathers, with one warning naming why."""
    n = parallel.axis_size(None, MODEL)
    if v.local is None or n == 1:
        return False
    reason = parallel.context_split_reason(kv, n)
    if reason is not None:
        warnings.warn(f"MSA over the paged cache not context parallel over {n} devices (the key window is "
                      f"gathered): {reason}", stacklevel=3)
        return False
    window = page_table.shape[0] * page_table.shape[1] * kv.k.shape[1]
    return parallel.prefill_context_parallel(cfg.text, n, queries=q.shape[0] * q.shape[1], window_tokens=window,
                                             q_bytes=q.dtype.itemsize, kv_bytes=kv.k.dtype.itemsize)


def _in_place(v: Variant, cfg: M3Config, q, sparse: bool) -> bool:
    """Whether this step reads the paged cache in place (one query per sequence and a variant whose
    decode takes the config) instead of gathering it (then the prefill path runs on the gathered
    cache: e.g. block sizes the decode kernels cannot take)."""
    if q.shape[1] != 1 or (v.decode if sparse else v.dense_decode) is None:
        return False
    # A full-attention layer scores no index keys: the index product cannot keep its decode from the pages.
    text = cfg.text if sparse else dataclasses.replace(cfg.text, index_score_dtype="bfloat16")
    reason = None if v.decode_unsupported_reason is None else v.decode_unsupported_reason(text)
    if reason is not None and reason not in _FALLBACK_WARNED:
        # A gathered decode step reads the whole key window, not the index pages and 16 blocks: at 1M it
        # is an order of magnitude slower, which a research setting must not hide.
        _FALLBACK_WARNED.add(reason)
        warnings.warn(f"{'MSA' if sparse else 'full-attention'} decode gathers the paged cache every step and runs "
                      f"the prefill path over it, instead of reading the pages in place: {reason}", RuntimeWarning,
                      stacklevel=3)
    return reason is None


def _paged_decode(single: Callable, local: Callable, what: str, q, iq, kv, page_table, q_pos, cfg: M3Config,
                  **force):
    """``single`` on one device, or context parallel (``local`` pieces) over a page-split cache under a
    mesh model axis > 1 (pages that do not split: ``single``, with a warning; XLA gathers the pages)."""
    t = cfg.text
    n = parallel.axis_size(None, MODEL)
    reason = None if n == 1 else parallel.context_split_reason(kv, n, index=iq is not None)
    if n > 1 and reason is None:
        return parallel.context_parallel(local(t), q, iq, kv, page_table, q_pos, t, **force)
    if reason is not None:
        warnings.warn(f"{what} not context parallel over the {n}-device {MODEL!r} axis: {reason}", stacklevel=3)
    return single(q, iq, kv, page_table, q_pos, t, **force) if iq is not None else single(q, kv, page_table, q_pos, t)


def attend(q, k, v, iq, ik, q_pos, cfg: M3Config, layer: int, kv: LayerCache | None = None,
           page_table: jax.Array | None = None, full: Callable | None = None):
    """Attention of ``layer``: MSA on the sparse layers, and on the full-attention layers the paged
    decode read in place or ``full(q, k, v, q_pos, cfg)`` over the keys (the model's dense attention).

    q [B, T, N, H] at q_pos [B, T]; k/v [B, S, K, H] (key s at position s), and on MSA layers index
    queries iq [B, T, K, Hx] and keys ik [B, S, Hx]. With ``kv`` (a :class:`LayerCache` the new keys
    are already written to) and ``page_table`` [B, W] the keys are those cache pages, and the route is
    chosen here: read in place (one query per sequence, a variant with a decode, context parallel
    under a mesh), context parallel over the page-split cache (:func:`_context_parallel`), or the key
    window gathered. Returns (o [B, T, N, H] in q.dtype, block ids int32 [B, K, T, topk] or None).
    """
    sparse = iq is not None
    v_ = layer_variant(cfg, layer) if sparse else variant(cfg)
    if kv is not None:
        force = dict(zip(("force_in", "force_out"), forced_blocks(cfg.text, layer))) if sparse else {}
        if _in_place(v_, cfg, q, sparse):
            if sparse:
                return _paged_decode(v_.decode, v_.local_decode, "MSA decode kernels", q, iq, kv, page_table, q_pos,
                                     cfg, **force)
            return _paged_decode(v_.dense_decode, v_.local_dense_decode, "full-attention decode", q, None, kv,
                                 page_table, q_pos, cfg), None
        if sparse and _context_parallel(v_, cfg, kv, page_table, q):  # no key window gathered
            local = v_.local(cfg.text, cfg.attention_chunk)
            return parallel.context_parallel(local, q, iq, kv, page_table, q_pos, cfg.text, **force)
        k, v, ik_all = kv.gather(page_table)
        ik = ik_all if sparse else None
    if sparse:
        return v_.gathered(q, k, v, iq, ik, q_pos, cfg, layer)
    return full(q, k, v, q_pos, cfg), None


def attention(q, k, v, iq, ik, q_pos, cfg: M3Config, layer: int):
    """MSA of queries q [B, T, N, H] (index queries iq [B, T, K, Hx]) at q_pos [B, T] over contiguous
    keys k/v [B, S, K, H] and index keys ik [B, S, Hx] (key s at position s), by ``cfg``'s variant.

    Returns (o [B, T, N, H] in q.dtype, block ids int32 [B, K, T, topk]).
    """
    return layer_variant(cfg, layer).gathered(q, k, v, iq, ik, q_pos, cfg, layer)
