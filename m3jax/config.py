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
import json
from pathlib import Path
from typing import Any, Literal

AttentionImpl = Literal["auto", "reference", "dense_mask", "pallas"]
ATTENTION_IMPLS = ("auto", "reference", "dense_mask", "pallas")
# MoE grouped matmul: "auto" = the Mosaic GPU kernel on GPU for bf16 shapes it takes, else ragged_dot.
MoeImpl = Literal["auto", "ragged_dot", "pallas"]
MOE_IMPLS = ("auto", "ragged_dot", "pallas")

FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"


class UnsupportedConfigError(ValueError):
    """A config.json value that m3jax cannot run (or that contradicts itself)."""


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
    bos_token_id: int | None = 200034
    eos_token_id: int | tuple[int, ...] | None = 200020

    def __post_init__(self):
        n = self.num_hidden_layers
        for name in ("layer_types", "mlp_layer_types"):
            if len(getattr(self, name)) != n:
                raise UnsupportedConfigError(
                    f"text_config.{name} has {len(getattr(self, name))} entries but num_hidden_layers={n}"
                )
        bad = set(self.layer_types) - {FULL_ATTENTION, SPARSE_ATTENTION}
        if bad:
            raise UnsupportedConfigError(f"text_config.layer_types has unknown entries {sorted(bad)}")
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
            if self.index_block_size < 1 or self.index_topk_blocks < 1:
                raise UnsupportedConfigError("index_block_size and index_topk_blocks must be positive")
            if self.index_local_blocks < 1:
                raise UnsupportedConfigError(
                    "index_local_blocks must be >= 1: the query's own block carries the causal diagonal"
                )
            if self.index_local_blocks + self.index_init_blocks > self.index_topk_blocks:
                raise UnsupportedConfigError(
                    f"forced blocks (local {self.index_local_blocks} + init {self.index_init_blocks}) exceed "
                    f"index_topk_blocks={self.index_topk_blocks}"
                )

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
    moe_impl: MoeImpl = "auto"  # run-time choice like attention_impl: never written to config.json
    # Query rows processed together by the reference attention; bounds memory at long context.
    attention_chunk: int = 256

    def __post_init__(self):
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


def _require(d: dict, key: str, where: str):
    if key not in d:
        raise UnsupportedConfigError(f"{where} is missing required key {key!r}")
    return d[key]


def _rope_params(t: dict, head_dim: int, where: str) -> tuple[float, int]:
    """Return (theta, rotary_dim) from either the legacy or the transformers-5 RoPE keys."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedConfigError(
            f"{where}.rope_parameters.rope_type={rope_type!r}: only plain RoPE ('default') is implemented"
        )
    theta = float(rope.get("rope_theta", t.get("rope_theta", 5_000_000.0)))
    factor = rope.get("partial_rotary_factor", t.get("partial_rotary_factor"))
    rotary_dim = t.get("rotary_dim")
    if factor is not None:
        from_factor = int(head_dim * float(factor))
        if rotary_dim is not None and int(rotary_dim) != from_factor:
            raise UnsupportedConfigError(
                f"{where}: rotary_dim={rotary_dim} contradicts partial_rotary_factor={factor} (head_dim {head_dim})"
            )
        return theta, from_factor
    if rotary_dim is not None:
        # The released file states partial RoPE only as `rotary_dim` (as MiniMax-M2 does); vLLM/SGLang
        # rotate that many channels. transformers 5.24's M3 config ignores `rotary_dim` and would rotate
        # all of head_dim; we follow the checkpoint's stated value.
        return theta, int(rotary_dim)
    return theta, head_dim


def text_config_from_hf(t: dict, where: str = "text_config") -> TextConfig:
    n_layers = int(_require(t, "num_hidden_layers", where))
    hidden = int(_require(t, "hidden_size", where))
    n_heads = int(_require(t, "num_attention_heads", where))
    head_dim = int(t.get("head_dim") or hidden // n_heads)

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

    sparse = t.get("sparse_attention_config") or {}
    if sparse.get("sparse_score_type", "max") != "max":
        raise UnsupportedConfigError(
            f"{where}.sparse_attention_config.sparse_score_type={sparse['sparse_score_type']!r}: only 'max'"
        )
    if not sparse.get("sparse_disable_index_value", 1) and sparse:
        raise UnsupportedConfigError(f"{where}: an index value/output projection (sparse_disable_index_value=0)")

    layer_types = t.get("layer_types")
    if layer_types is None:
        freq = sparse.get("sparse_attention_freq")
        layer_types = (
            [SPARSE_ATTENTION if f else FULL_ATTENTION for f in freq] if freq is not None else [FULL_ATTENTION] * n_layers
        )
    mlp_types = t.get("mlp_layer_types")
    if mlp_types is None:
        freq = t.get("moe_layer_freq")
        mlp_types = ["sparse" if f else "dense" for f in freq] if freq is not None else ["sparse"] * n_layers

    def pick(flat: str, legacy: str, default):
        if legacy in sparse:
            return sparse[legacy]
        return t.get(flat, default)

    theta, rotary_dim = _rope_params(t, head_dim, where)
    eos = t.get("eos_token_id", 200020)
    return TextConfig(
        vocab_size=int(_require(t, "vocab_size", where)),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=int(_require(t, "num_key_value_heads", where)),
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        mlp_layer_types=tuple(mlp_types),
        intermediate_size=int(t.get("intermediate_size", 3072)),
        dense_intermediate_size=int(t.get("dense_intermediate_size", 12288)),
        shared_intermediate_size=int(t.get("shared_intermediate_size", 3072)),
        num_local_experts=int(t.get("num_local_experts", t.get("num_experts", 128))),
        num_experts_per_tok=int(t.get("num_experts_per_tok", 4)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 2.0)),
        swiglu_alpha=float(t.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(t.get("swiglu_limit", 7.0)),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        max_position_embeddings=int(t.get("max_position_embeddings", 524_288)),
        index_n_heads=int(pick("index_n_heads", "sparse_num_index_heads", 4)),
        index_head_dim=int(pick("index_head_dim", "sparse_index_dim", 128)),
        index_block_size=int(pick("index_block_size", "sparse_block_size", 128)),
        index_topk_blocks=int(pick("index_topk_blocks", "sparse_topk_blocks", 16)),
        index_local_blocks=int(pick("index_local_blocks", "sparse_local_block", 1)),
        index_init_blocks=int(pick("index_init_blocks", "sparse_init_block", 0)),
        bos_token_id=t.get("bos_token_id", 200034),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
    )


def vision_config_from_hf(v: dict, where: str = "vision_config") -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", "axial")
    if rope_type != "axial" or v.get("rope_mode", "3d") != "3d":
        raise UnsupportedConfigError(f"{where}: only 3-D axial vision RoPE is implemented (got {rope_type!r})")
    if v.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedConfigError(f"{where}.hidden_act={v['hidden_act']!r}: only exact GELU is implemented")
    defaults = VisionConfig()
    return VisionConfig(
        hidden_size=int(v.get("hidden_size", defaults.hidden_size)),
        intermediate_size=int(v.get("intermediate_size", defaults.intermediate_size)),
        num_hidden_layers=int(v.get("num_hidden_layers", defaults.num_hidden_layers)),
        num_attention_heads=int(v.get("num_attention_heads", defaults.num_attention_heads)),
        num_channels=int(v.get("num_channels", defaults.num_channels)),
        patch_size=int(v.get("patch_size", defaults.patch_size)),
        temporal_patch_size=int(v.get("temporal_patch_size", defaults.temporal_patch_size)),
        spatial_merge_size=int(v.get("spatial_merge_size", defaults.spatial_merge_size)),
        layer_norm_eps=float(v.get("layer_norm_eps", defaults.layer_norm_eps)),
        rope_theta=float(rope.get("rope_theta", v.get("rope_theta", defaults.rope_theta))),
    )


def config_from_hf(d: dict[str, Any], **overrides) -> M3Config:
    """Build an :class:`M3Config` from a parsed HF ``config.json`` dict."""
    model_type = d.get("model_type")
    if model_type not in ("minimax_m3_vl", None):
        raise UnsupportedConfigError(f"config.json model_type={model_type!r}; expected 'minimax_m3_vl'")
    if "text_config" not in d:
        raise UnsupportedConfigError("config.json has no 'text_config': not a MiniMax-M3 (minimax_m3_vl) config")
    quant = d.get("quantization_config") or d["text_config"].get("quantization_config")
    quant_method = None
    if quant:
        quant_method = quant.get("quant_method")
        if quant_method != "mxfp8" or list(quant.get("weight_block_size", [1, 32])) != [1, 32]:
            raise UnsupportedConfigError(
                f"quantization_config={quant}: only mxfp8 with weight_block_size [1, 32] is supported"
            )
    text = text_config_from_hf(d["text_config"])
    vision = vision_config_from_hf(d["vision_config"]) if d.get("vision_config") is not None else None
    return M3Config(
        text=text,
        vision=vision,
        image_token_id=int(d.get("image_token_index", d.get("image_token_id", 200025))),
        video_token_id=int(d.get("video_token_index", d.get("video_token_id", 200026))),
        projector_hidden_size=int(d.get("projector_hidden_size", text.hidden_size)),
        quantization=quant_method,
        **overrides,
    )


def load_config(path: str | Path, **overrides) -> M3Config:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    with open(path) as f:
        return config_from_hf(json.load(f), **overrides)


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


def preset_names() -> list[str]:
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def preset(name: str, **overrides) -> M3Config:
    """Load a named preset from ``m3jax/configs/<name>.json`` (HF config.json format)."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.exists():
        raise UnsupportedConfigError(f"unknown preset {name!r}; available: {preset_names()} (in {CONFIGS_DIR})")
    return load_config(path, **overrides)
