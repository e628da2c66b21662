"""Typed, frozen configuration for MiniMax-M3, read from a Hugging Face ``config.json``.

The released checkpoint (``model_type = "minimax_m3_vl"``) nests a ``text_config`` and a
``vision_config``. The text config may carry either the legacy keys of the released file
(``sparse_attention_config``, ``moe_layer_freq``, ``rope_theta``, ``rotary_dim``) or the flat keys that
transformers writes on ``save_pretrained`` (``layer_types``, ``mlp_layer_types``, ``index_*``,
``rope_parameters``). Both are accepted. A value the file does not carry takes transformers' class
default (transformers >= 5.23 is the reference implementation); a value we cannot run raises
:class:`UnsupportedConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import warnings
from pathlib import Path
from typing import Any, Literal

from m3jax.atomic import open_regular

AttentionImpl = Literal["auto", "reference", "dense_mask", "pallas"]
ATTENTION_IMPLS = ("auto", "reference", "dense_mask", "pallas")
# MoE grouped matmul: "auto" = the Mosaic GPU kernel on GPU for bf16 shapes it takes, else ragged_dot.
MoeImpl = Literal["auto", "ragged_dot", "pallas"]
MOE_IMPLS = ("auto", "ragged_dot", "pallas")

# Storage of the MSA index-key cache: "bfloat16" keeps the index keys at the cache's dtype (bf16 when
# serving), "float8_e4m3fn" rounds them to fp8 e4m3 (half the bytes of the decode index scan).
INDEX_CACHE_DTYPES = ("bfloat16", "float8_e4m3fn")
# The index product (the lightning indexer's dot products): "bfloat16" multiplies the index queries and
# keys as they are (the model as released); "float8_e4m3fn" is the fp8 indexer, an fp8 x fp8 product of
# per-row scaled e4m3 queries and keys (m3jax.msa.reference.fp8_dot_scores).
INDEX_SCORE_DTYPES = ("bfloat16", "float8_e4m3fn")
# How the paged MSA decode kernels select blocks (TextConfig.msa_decode_select).
DECODE_SELECTS = ("separate", "fused")

FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"
# The MSA block-selection rule of the model as released (m3jax.msa.layer registers the others by name).
STOCK_SELECTION_RULE = "topk"


class UnsupportedConfigError(ValueError):
    """A config.json value that m3jax cannot run (or that contradicts itself)."""


# Integer sizes that must be >= 1, in the order they are checked (the basic shape first).
_TEXT_SIZES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "dense_intermediate_size", "shared_intermediate_size", "num_local_experts",
    "num_experts_per_tok", "max_position_embeddings",
)
_VISION_SIZES = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "patch_size",
    "temporal_patch_size", "spatial_merge_size",
)


def _check_positive(cfg, where: str, names) -> None:
    for name in names:
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UnsupportedConfigError(f"{where}.{name}={value!r} must be a positive integer")


def _is_index(v) -> bool:
    """A non-negative integer (numpy's too; not a bool): a token id, a layer, a block id."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 0


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """Decoder (language model) hyper-parameters; names follow transformers' MiniMaxM3VLTextConfig."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # Per-layer dispatch: "full_attention" | "minimax_m3_sparse" and "dense" | "sparse" (MoE).
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    intermediate_size: int  # routed expert width
    dense_intermediate_size: int
    shared_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    rotary_dim: int = 64
    max_position_embeddings: int = 524_288
    # MSA (MiniMax Sparse Attention) index branch and block selection.
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    index_init_blocks: int = 0
    # Research interventions (not in any checkpoint): (layer, block id) pairs forced into / out of
    # every selection of that layer. Empty = the model exactly as released.
    msa_force_in: tuple[tuple[int, int], ...] = ()
    msa_force_out: tuple[tuple[int, int], ...] = ()
    # Research intervention (not in any checkpoint): (layer, rule name) pairs, the block-selection rule
    # of those MSA layers, registered in m3jax.msa.layer. Kept sorted by layer, without the stock rule
    # ("topk"), so that one model has one config (one jit / program-cache key).
    msa_selection_rules: tuple[tuple[int, str], ...] = ()
    # Research knob (not in any checkpoint): index keys as the cache stores them, one of INDEX_CACHE_DTYPES.
    # "float8_e4m3fn" applies everywhere the index keys are read (reference, kernels, cache), so a
    # forward pass and a cached decode select from the same rounded keys.
    index_cache_dtype: str = "bfloat16"
    # Research knob (not in any checkpoint): the index product, one of INDEX_SCORE_DTYPES. The jnp
    # reference computes it on every backend; the prefill index-score kernel takes both (fp8: an e4m3
    # MMA), the paged decode scoring kernel fp8 over an fp8 index cache on Hopper (m3jax.msa.kernels
    # says where not, per config).
    index_score_dtype: str = "bfloat16"
    # Kernel switch (not in any checkpoint; the selections are the same either way): how the paged MSA
    # decode kernels select blocks, one of DECODE_SELECTS. "separate": the scoring kernel writes every
    # block's score, then the top-k kernel; "fused": one launch for scores, block max and each context
    # split's top-k, then a merge of the splits' lists (m3jax.pallas.decode.decode_select_blocks).
    msa_decode_select: str = "separate"
    bos_token_id: int | None = 200034
    eos_token_id: int | tuple[int, ...] | None = 200020

    def __post_init__(self):
        # Sizes first: a zero or negative one would surface later as a division by zero or a shape error.
        _check_positive(self, "text_config", _TEXT_SIZES)
        for name in ("rms_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise UnsupportedConfigError(f"text_config.{name}={getattr(self, name)} must be positive")
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise UnsupportedConfigError(
                    f"text_config.{name} has {len(getattr(self, name))} entries but num_hidden_layers={n}"
                )
        bad = set(self.layer_types) - {FULL_ATTENTION, SPARSE_ATTENTION}
        if bad:
            raise UnsupportedConfigError(f"text_config.layer_types has unknown entries {sorted(bad)}")
        if self.index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise UnsupportedConfigError(
                f"index_cache_dtype={self.index_cache_dtype!r}; choose one of {INDEX_CACHE_DTYPES}")
        if self.index_score_dtype not in INDEX_SCORE_DTYPES:
            raise UnsupportedConfigError(
                f"index_score_dtype={self.index_score_dtype!r}; choose one of {INDEX_SCORE_DTYPES}")
        if self.msa_decode_select not in DECODE_SELECTS:
            raise UnsupportedConfigError(
                f"msa_decode_select={self.msa_decode_select!r}; choose one of {DECODE_SELECTS}")
        bad = set(self.mlp_layer_types) - {"dense", "sparse"}
        if bad:
            raise UnsupportedConfigError(f"text_config.mlp_layer_types has unknown entries {sorted(bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise UnsupportedConfigError(f"rotary_dim={self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if self.num_experts_per_tok > self.num_local_experts:
            raise UnsupportedConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} > num_local_experts={self.num_local_experts}"
            )
        if self.has_sparse_layers:
            _check_positive(self, "text_config", ("index_n_heads", "index_head_dim", "index_block_size",
                                                   "index_topk_blocks"))
            if self.index_init_blocks < 0:
                raise UnsupportedConfigError(f"text_config.index_init_blocks={self.index_init_blocks} must be >= 0")
            # One index head scores blocks for one KV (GQA) group; the selection is per group.
            if self.index_n_heads != self.num_key_value_heads:
                raise UnsupportedConfigError(
                    f"index_n_heads={self.index_n_heads} must equal num_key_value_heads="
                    f"{self.num_key_value_heads}: MSA selects blocks per KV group"
                )
            if self.index_head_dim < self.rotary_dim:
                raise UnsupportedConfigError(
                    f"index_head_dim={self.index_head_dim} < rotary_dim={self.rotary_dim}: the index branch "
                    "shares the main RoPE and needs at least rotary_dim channels"
                )
            if self.index_local_blocks < 1:
                raise UnsupportedConfigError(
                    "index_local_blocks must be >= 1: the query's own block carries the causal diagonal"
                )
            if self.index_local_blocks + self.index_init_blocks > self.index_topk_blocks:
                raise UnsupportedConfigError(
                    f"forced blocks (local {self.index_local_blocks} + init {self.index_init_blocks}) exceed "
                    f"index_topk_blocks={self.index_topk_blocks}"
                )
        # Types only: a config that omits them gets M3's ids, which lie past a small model's vocabulary
        # and are then never produced (a stop id that never matches), not an error.
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", eos)):
            if not all(i is None or _is_index(i) for i in ids):
                raise UnsupportedConfigError(f"text_config.{name}={getattr(self, name)!r} must be a token id "
                                             "(a non-negative integer), a list of them, or null")
        # numpy integers as Python ints: config.json is written from these fields
        if self.bos_token_id is not None:
            object.__setattr__(self, "bos_token_id", int(self.bos_token_id))
        if self.eos_token_id is not None:
            object.__setattr__(self, "eos_token_id", tuple(map(int, eos)) if isinstance(self.eos_token_id, tuple)
                               else int(self.eos_token_id))
        for name in ("msa_force_in", "msa_force_out"):
            pairs = getattr(self, name)
            ok = isinstance(pairs, tuple) and all(isinstance(p, tuple) and len(p) == 2 and all(map(_is_index, p))
                                                  for p in pairs)
            if not ok:
                raise UnsupportedConfigError(f"{name}={pairs!r} must be a tuple of (layer, block id) pairs of "
                                             "non-negative ints, e.g. ((2, 0), (2, 5))")
        rules = self.msa_selection_rules
        ok = isinstance(rules, tuple) and all(isinstance(p, tuple) and len(p) == 2 and _is_index(p[0])
                                              and isinstance(p[1], str) and p[1] for p in rules)
        if not ok or len({int(p[0]) for p in rules}) != len(rules):
            raise UnsupportedConfigError(f"msa_selection_rules={rules!r} must be a tuple of (layer, rule name) pairs, "
                                         "one per layer, e.g. ((2, 'my_rule'),)")
        object.__setattr__(self, "msa_selection_rules", tuple(sorted(
            (int(layer), name) for layer, name in rules if name != STOCK_SELECTION_RULE)))

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def has_sparse_layers(self) -> bool:
        return SPARSE_ATTENTION in self.layer_types

    def is_sparse_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == SPARSE_ATTENTION

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """ViT encoder hyper-parameters (CLIP-style, Conv3d patch embed, 3-D axial RoPE)."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10_000.0

    def __post_init__(self):
        _check_positive(self, "vision_config", _VISION_SIZES)
        if self.hidden_size % self.num_attention_heads:
            raise UnsupportedConfigError(
                f"vision hidden_size={self.hidden_size} not divisible by num_attention_heads={self.num_attention_heads}"
            )
        if self.axis_rotary_dim == 0:
            raise UnsupportedConfigError(f"vision head_dim={self.head_dim} is too small for 3-D RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def axis_rotary_dim(self) -> int:
        """Rotated channels per axis (t, h, w): 26 for head_dim 80, so 78 of 80 channels rotate."""
        return 2 * ((self.head_dim // 3) // 2)

    @property
    def patch_dim(self) -> int:
        """Flat length of one patch row of ``pixel_values``: C * T_patch * P * P (1176 for M3)."""
        return self.num_channels * self.temporal_patch_size * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class M3Config:
    """Whole model: text decoder, vision tower, projector, placeholder ids and run-time choices."""

    text: TextConfig
    vision: VisionConfig | None
    image_token_id: int = 200025
    video_token_id: int = 200026
    projector_hidden_size: int = 6144
    # "mxfp8" when the checkpoint stores float8 weights with E8M0 block scales (dequantised on load).
    quantization: str | None = None
    attention_impl: AttentionImpl = "auto"
    # The grouped-GEMM kernel for the MoE experts and, with MXFP8 weights, for the other matmuls at decode
    # rows (m3jax.moe.linear). A run-time choice like attention_impl: never written to config.json.
    moe_impl: MoeImpl = "auto"
    # Query rows processed together by the reference attention; bounds memory at long context.
    attention_chunk: int = 256

    def __post_init__(self):
        _check_positive(self, "config", ("projector_hidden_size", "attention_chunk"))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise UnsupportedConfigError(f"attention_impl={self.attention_impl!r}; choose one of {ATTENTION_IMPLS}")
        if self.moe_impl not in MOE_IMPLS:
            raise UnsupportedConfigError(f"moe_impl={self.moe_impl!r}; choose one of {MOE_IMPLS}")

    def replace(self, **changes) -> "M3Config":
        return dataclasses.replace(self, **changes)

    def replace_text(self, **changes) -> "M3Config":
        """Return a copy with text-config fields changed (e.g. index_topk_blocks for an ablation)."""
        return dataclasses.replace(self, text=dataclasses.replace(self.text, **changes))


# --------------------------------------------------------------------------------------------------
# config.json -> M3Config


_REQUIRED = object()


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise UnsupportedConfigError(f"{where} is missing required key {key!r}")
    return d[key]


def _int(d: dict, key: str, where: str, default=_REQUIRED) -> int | None:
    """``d[key]`` as an int (JSON 4 or 4.0; not 4.5, "4" or true); a null or absent key gives ``default``.
    Ranges are checked by the config classes, the one place every config passes through."""
    v = _require(d, key, where) if default is _REQUIRED else d.get(key)
    if v is None and default is not _REQUIRED:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise UnsupportedConfigError(f"{where}.{key}={v!r} is not an integer")
    return int(v)


def _float(d: dict, key: str, where: str, default: float | None) -> float | None:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise UnsupportedConfigError(f"{where}.{key}={v!r} is not a finite number")
    return float(v)


def _dict(d: dict, key: str, where: str) -> dict:
    v = d.get(key) or {}
    if not isinstance(v, dict):
        raise UnsupportedConfigError(f"{where}.{key} must be a JSON object, got {v!r}")
    return v


def _rope_params(t: dict, head_dim: int, where: str) -> tuple[float, int]:
    """Return (theta, rotary_dim) from either the legacy or the transformers-5 RoPE keys."""
    key = "rope_parameters" if t.get("rope_parameters") else "rope_scaling"
    rope = _dict(t, key, where)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedConfigError(
            f"{where}.rope_parameters.rope_type={rope_type!r}: only plain RoPE ('default') is implemented"
        )
    theta = _float(rope, "rope_theta", f"{where}.{key}", None)
    theta = _float(t, "rope_theta", where, 5_000_000.0) if theta is None else theta
    factor = _float(rope, "partial_rotary_factor", f"{where}.{key}", None)
    factor = _float(t, "partial_rotary_factor", where, None) if factor is None else factor
    rotary_dim = _int(t, "rotary_dim", where, None)
    if factor is not None:
        from_factor = int(head_dim * factor)
        if rotary_dim is not None and rotary_dim != from_factor:
            raise UnsupportedConfigError(
                f"{where}: rotary_dim={rotary_dim} contradicts partial_rotary_factor={factor} (head_dim {head_dim})"
            )
        return theta, from_factor
    if rotary_dim is not None:
        # The released file states partial RoPE only as `rotary_dim` (as MiniMax-M2 does); vLLM/SGLang
        # rotate that many channels. transformers 5.24's M3 config ignores `rotary_dim` and would rotate
        # all of head_dim; we follow the checkpoint's stated value.
        return theta, rotary_dim
    return theta, head_dim


def _layer_list(t: dict, key: str, where: str) -> list | None:
    v = t.get(key)
    if v is not None and not isinstance(v, list):
        raise UnsupportedConfigError(f"{where}.{key} must be a list, got {v!r}")
    return v


def text_config_from_hf(t: dict, where: str = "text_config") -> TextConfig:
    n_layers = _int(t, "num_hidden_layers", where)
    hidden = _int(t, "hidden_size", where)
    n_heads = _int(t, "num_attention_heads", where)
    # A non-positive head count is reported by TextConfig, before head_dim is used.
    head_dim = _int(t, "head_dim", where, None) or (hidden // n_heads if n_heads > 0 else 0)

    if t.get("attention_output_gate"):
        raise UnsupportedConfigError(f"{where}.attention_output_gate=true is not part of M3 and is not implemented")
    if t.get("qk_norm_type", "per_head") != "per_head":
        raise UnsupportedConfigError(f"{where}.qk_norm_type={t['qk_norm_type']!r}: only 'per_head' is implemented")
    if t.get("use_gemma_norm", True) is not True:
        raise UnsupportedConfigError(f"{where}.use_gemma_norm=false: M3 uses (1 + w) Gemma RMSNorm only")
    if t.get("tie_word_embeddings", False):
        raise UnsupportedConfigError(f"{where}.tie_word_embeddings=true: M3 has an untied lm_head")
    act = t.get("hidden_act", "swigluoai")
    if act not in ("swigluoai", "silu"):  # transformers rewrites "swigluoai" to "silu" on save
        raise UnsupportedConfigError(f"{where}.hidden_act={act!r}: only swigluoai is implemented")

    sparse = _dict(t, "sparse_attention_config", where)
    if sparse.get("sparse_score_type", "max") != "max":
        raise UnsupportedConfigError(
            f"{where}.sparse_attention_config.sparse_score_type={sparse['sparse_score_type']!r}: only 'max'"
        )
    if not sparse.get("sparse_disable_index_value", 1) and sparse:
        raise UnsupportedConfigError(f"{where}: an index value/output projection (sparse_disable_index_value=0)")

    layer_types = _layer_list(t, "layer_types", where)
    if layer_types is None:
        freq = _layer_list(sparse, "sparse_attention_freq", f"{where}.sparse_attention_config")
        layer_types = (
            [SPARSE_ATTENTION if f else FULL_ATTENTION for f in freq] if freq is not None else [FULL_ATTENTION] * n_layers
        )
    mlp_types = _layer_list(t, "mlp_layer_types", where)
    if mlp_types is None:
        freq = _layer_list(t, "moe_layer_freq", where)
        mlp_types = ["sparse" if f else "dense" for f in freq] if freq is not None else ["sparse"] * n_layers

    def pick(flat: str, legacy: str, default: int) -> int:
        if legacy in sparse:
            return _int(sparse, legacy, f"{where}.sparse_attention_config")
        return _int(t, flat, where, default)

    theta, rotary_dim = _rope_params(t, head_dim, where)
    eos = t.get("eos_token_id", 200020)
    return TextConfig(
        vocab_size=_int(t, "vocab_size", where),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=_int(t, "num_key_value_heads", where),
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        intermediate_size=_int(t, "intermediate_size", where, 3072),
        dense_intermediate_size=_int(t, "dense_intermediate_size", where, 12288),
        shared_intermediate_size=_int(t, "shared_intermediate_size", where, 3072),
        num_local_experts=_int(t, "num_local_experts", where, _int(t, "num_experts", where, 128)),
        num_experts_per_tok=_int(t, "num_experts_per_tok", where, 4),
        routed_scaling_factor=_float(t, "routed_scaling_factor", where, 2.0),
        swiglu_alpha=_float(t, "swiglu_alpha", where, 1.702),
        swiglu_limit=_float(t, "swiglu_limit", where, 7.0),
        rms_norm_eps=_float(t, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        max_position_embeddings=_int(t, "max_position_embeddings", where, 524_288),
        index_n_heads=pick("index_n_heads", "sparse_num_index_heads", 4),
        index_head_dim=pick("index_head_dim", "sparse_index_dim", 128),
        index_block_size=pick("index_block_size", "sparse_block_size", 128),
        index_topk_blocks=pick("index_topk_blocks", "sparse_topk_blocks", 16),
        index_local_blocks=pick("index_local_blocks", "sparse_local_block", 1),
        index_init_blocks=pick("index_init_blocks", "sparse_init_block", 0),
        bos_token_id=t.get("bos_token_id", 200034),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )


def vision_config_from_hf(v: dict, where: str = "vision_config") -> VisionConfig:
    rope = _dict(v, "rope_parameters", where)
    rope_type = rope.get("rope_type", "axial")
    if rope_type != "axial" or v.get("rope_mode", "3d") != "3d":
        raise UnsupportedConfigError(f"{where}: only 3-D axial vision RoPE is implemented (got {rope_type!r})")
    if v.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedConfigError(f"{where}.hidden_act={v['hidden_act']!r}: only exact GELU is implemented")
    defaults = VisionConfig()
    ints = {name: _int(v, name, where, getattr(defaults, name)) for name in _VISION_SIZES}
    theta = _float(rope, "rope_theta", f"{where}.rope_parameters", None)
    return VisionConfig(
        **ints,
        layer_norm_eps=_float(v, "layer_norm_eps", where, defaults.layer_norm_eps),
        rope_theta=_float(v, "rope_theta", where, defaults.rope_theta) if theta is None else theta,
    )


# Keys every transformers config may carry, which m3jax has no use for (not warned about).
_GENERIC_KEYS = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "model_type", "_name_or_path", "_comment",
    "auto_map", "tie_word_embeddings", "use_cache", "initializer_range", "pad_token_id", "bos_token_id",
    "eos_token_id", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
    "problem_type", "tokenizer_class", "is_encoder_decoder", "chunk_size_feed_forward", "attention_dropout",
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "quantization_config",
    "m3jax_save_id",
})
# The keys each part of a MiniMax-M3 config.json has (read by m3jax, or known and unused).
_KNOWN_KEYS = {
    "config.json": frozenset({
        "text_config", "vision_config", "image_token_index", "image_token_id", "video_token_index",
        "video_token_id", "projector_hidden_size", "merged_hidden_size"}),
    "text_config": frozenset({
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "layer_types", "mlp_layer_types", "moe_layer_freq", "intermediate_size", "dense_intermediate_size",
        "shared_intermediate_size", "num_local_experts", "num_experts", "num_experts_per_tok",
        "routed_scaling_factor", "swiglu_alpha", "swiglu_limit", "rms_norm_eps", "rope_parameters", "rope_theta",
        "rotary_dim", "partial_rotary_factor", "max_position_embeddings", "index_n_heads", "index_head_dim",
        "index_block_size", "index_topk_blocks", "index_local_blocks", "index_init_blocks",
        "sparse_attention_config", "hidden_act", "qk_norm_type", "use_gemma_norm", "attention_output_gate",
        "num_mtp_modules"}),
    "vision_config": frozenset(set(_VISION_SIZES) | {
        "layer_norm_eps", "rope_parameters", "rope_theta", "rope_mode", "hidden_act", "projection_dim",
        "image_size", "vision_segment_max_frames"}),
}


def warn_unknown_keys(d: dict, where: str) -> None:
    """Warn about keys of ``d`` that no MiniMax-M3 config has, with the nearest known key: a misspelled
    field would otherwise be ignored and its default used without a word."""
    known = _KNOWN_KEYS[where] | _GENERIC_KEYS
    for key in sorted(k for k in d if isinstance(k, str) and k not in known):
        near = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        warnings.warn(f"{where}: unknown key {key!r} is ignored{hint}", UserWarning, stacklevel=3)


def config_from_hf(d: dict[str, Any], **overrides) -> M3Config:
    """Build an :class:`M3Config` from a parsed HF ``config.json`` dict."""
    if not isinstance(d, dict):
        raise UnsupportedConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type not in ("minimax_m3_vl", None):
        raise UnsupportedConfigError(f"config.json model_type={model_type!r}; expected 'minimax_m3_vl'")
    if "text_config" not in d:
        raise UnsupportedConfigError("config.json has no 'text_config': not a MiniMax-M3 (minimax_m3_vl) config")
    text_d = _dict(d, "text_config", "config.json")
    warn_unknown_keys(d, "config.json")
    warn_unknown_keys(text_d, "text_config")
    if isinstance(d.get("vision_config"), dict):
        warn_unknown_keys(d["vision_config"], "vision_config")
    quant = d.get("quantization_config") or text_d.get("quantization_config")
    quant_method = None
    if quant:
        quant_method = quant.get("quant_method") if isinstance(quant, dict) else None
        if quant_method != "mxfp8" or list(quant.get("weight_block_size", [1, 32])) != [1, 32]:
            raise UnsupportedConfigError(
                f"quantization_config={quant}: only mxfp8 with weight_block_size [1, 32] is supported"
            )
    text = text_config_from_hf(text_d)
    vision = vision_config_from_hf(_dict(d, "vision_config", "config.json")) if d.get("vision_config") is not None else None
    return M3Config(
        text=text,
        vision=vision,
        image_token_id=_int(d, "image_token_index", "config.json", _int(d, "image_token_id", "config.json", 200025)),
        video_token_id=_int(d, "video_token_index", "config.json", _int(d, "video_token_id", "config.json", 200026)),
        projector_hidden_size=_int(d, "projector_hidden_size", "config.json", text.hidden_size),
        quantization=quant_method,
        **overrides,
    )


def read_json_object(path: Path) -> dict:
    """A checkpoint's JSON side file (tokenizer_config.json, the preprocessor configs) as a dict; ValueError
    naming the file when it is not JSON text or not a JSON object."""
    with open_regular(path, "a JSON file") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise ValueError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_config_json(path: str | Path) -> tuple[Path, dict]:
    """(path of config.json, its parsed contents) for a checkpoint directory or the file itself; a file
    that is not JSON is named in the error."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    with open_regular(path, "config.json") as f:
        raw = f.read()
    try:
        return path, json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedConfigError(f"{path}: not a JSON file ({e})") from None


def load_config(path: str | Path, **overrides) -> M3Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path, d = read_config_json(path)
    try:
        return config_from_hf(d, **overrides)
    except UnsupportedConfigError as e:
        raise UnsupportedConfigError(f"{path}: {e}") from None


def config_to_hf(cfg: M3Config) -> dict[str, Any]:
    """Serialise to the transformers-5 ``config.json`` layout (flat keys, ``rope_parameters``)."""
    t = cfg.text
    text = {
        "model_type": "minimax_m3_vl_text",
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim,
        "layer_types": list(t.layer_types),
        "mlp_layer_types": list(t.mlp_layer_types),
        "intermediate_size": t.intermediate_size,
        "dense_intermediate_size": t.dense_intermediate_size,
        "shared_intermediate_size": t.shared_intermediate_size,
        "num_local_experts": t.num_local_experts,
        "num_experts_per_tok": t.num_experts_per_tok,
        "routed_scaling_factor": t.routed_scaling_factor,
        "swiglu_alpha": t.swiglu_alpha,
        "swiglu_limit": t.swiglu_limit,
        "rms_norm_eps": t.rms_norm_eps,
        "rotary_dim": t.rotary_dim,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": t.rope_theta,
            "partial_rotary_factor": t.rotary_dim / t.head_dim,
        },
        "max_position_embeddings": t.max_position_embeddings,
        "index_n_heads": t.index_n_heads,
        "index_head_dim": t.index_head_dim,
        "index_block_size": t.index_block_size,
        "index_topk_blocks": t.index_topk_blocks,
        "index_local_blocks": t.index_local_blocks,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": list(t.eos_token_id) if isinstance(t.eos_token_id, tuple) else t.eos_token_id,
        "hidden_act": "swigluoai",
        "tie_word_embeddings": False,
    }
    if t.index_init_blocks:
        text["index_init_blocks"] = t.index_init_blocks
    out: dict[str, Any] = {
        "model_type": "minimax_m3_vl",
        "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "text_config": text,
        "image_token_index": cfg.image_token_id,
        "video_token_index": cfg.video_token_id,
        "projector_hidden_size": cfg.projector_hidden_size,
        "tie_word_embeddings": False,
    }
    if cfg.vision is not None:
        v = cfg.vision
        out["vision_config"] = {
            "model_type": "minimax_m3_vl_vision",
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_hidden_layers": v.num_hidden_layers,
            "num_attention_heads": v.num_attention_heads,
            "num_channels": v.num_channels,
            "patch_size": v.patch_size,
            "temporal_patch_size": v.temporal_patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "layer_norm_eps": v.layer_norm_eps,
            "hidden_act": "gelu",
            "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
        }
    if cfg.quantization == "mxfp8":
        out["quantization_config"] = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32]}
    return out


# --------------------------------------------------------------------------------------------------
# Presets (m3jax/configs/*.json, shipped as package data so a non-editable install has them)

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"


# Short names users type for a preset: "m3" is the released model.
PRESET_ALIASES = {"m3": "minimax_m3"}


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def describe_presets() -> str:
    """The preset names and their aliases, for help texts and errors."""
    return f"{', '.join(preset_names())} (aliases: {', '.join(f'{a} = {n}' for a, n in PRESET_ALIASES.items())})"


def preset(name: str, **overrides) -> M3Config:
    """Load a named preset from ``m3jax/configs/<name>.json`` (HF config.json format); ``name`` may be
    an alias of :data:`PRESET_ALIASES` (``"m3"`` = ``"minimax_m3"``)."""
    path = CONFIGS_DIR / f"{PRESET_ALIASES.get(name, name)}.json"
    if not path.exists():
        raise UnsupportedConfigError(f"unknown preset {name!r}; available: {describe_presets()}, in {CONFIGS_DIR}")
    return load_config(path, **overrides)
