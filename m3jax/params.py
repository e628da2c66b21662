"""Parameter declarations: one tree of :class:`ParamSpec` leaves from which shapes, random init,
parameter counts and sharding are all derived (never written twice).

Layout (our names; matmul weights are ``[in, out]``, heads split out)::

    text.embed            [V, D]            text.lm_head      [D, V]       text.final_norm [D]
    text.layers[i].input_norm / post_attn_norm                 [D]
    text.layers[i].attn.{wq [D,N,H], wk [D,K,H], wv [D,K,H], wo [N,H,D], q_norm [H], k_norm [H]}
    text.layers[i].index.{wq [D,Hi,Hx], wk [D,Hx], q_norm [Hx], k_norm [Hx]}       (MSA layers)
    text.layers[i].mlp.{gate [D,F], up [D,F], down [F,D]}                          (dense layers)
    text.layers[i].moe.{router [D,E] f32, router_bias [E] f32,
                         gate [E,D,Fe], up [E,D,Fe], down [E,Fe,D], shared.{gate, up, down}}
    vision.patch_embed [C*Tp*P*P, Dv] f32,  vision.pre_ln.{scale, bias}
    vision.layers[j].{ln1, ln2, wq, bq, wk, bk, wv, bv, wo, bo, fc1, b1, fc2, b2}
    projector.{w1 [Dv,Pj], b1, w2 [Pj,D], b2}      merger.{w1 [4D,Pj], b1, w2 [Pj,D], b2}

Dimension letters (README has the table): V vocab, D hidden, N query heads, K KV heads, H head dim,
Hi index heads, Hx index head dim, F dense MLP width, E experts, Fe expert width.
Every leaf names its logical axes; the sharding module maps them onto a mesh.

``weights="mxfp8"`` (what ``load_pretrained(..., weights="mxfp8")`` holds): the matmul weights the
released MXFP8 checkpoint quantises (attention and index projections, dense / shared-expert MLPs,
experts) become :class:`m3jax.layers.MXFP8Weight` nodes of two specs, fp8 values of the weight's shape
and uint8 scales with the last input axis / 32, both with the weight's logical axes. A weight whose last
input axis is not a multiple of 32 stays a model-dtype leaf (dequantised on load).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from m3jax.config import M3Config
from m3jax.layers import MXFP8_BLOCK, MXFP8Weight

WEIGHTS = ("dequantize", "mxfp8")  # load_pretrained's ``weights``: how MXFP8 checkpoint weights are held


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Shape, storage dtype policy and logical axes of one parameter."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    # "model": the caller's dtype (bf16/fp32). "float32": always fp32 because the model computes in fp32.
    # "float8_e4m3fn" / "uint8": an MXFP8 weight's values / scales.
    dtype: str = "model"
    # "normal" weights, "norm_offset" Gemma (1 + w) offsets, "ones"/"zeros" for LayerNorm.
    init: str = "normal"

    def __post_init__(self):
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)

    def resolve_dtype(self, model_dtype) -> jnp.dtype:
        return jnp.dtype(model_dtype) if self.dtype == "model" else jnp.dtype(self.dtype)


def _is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def _mxfp8(spec: ParamSpec, last_in: int) -> ParamSpec | MXFP8Weight:
    """``spec`` as MXFP8 values + scales (``last_in``: its last input axis), or as it is when that axis
    is not a whole number of 32-input blocks."""
    if spec.shape[last_in] % MXFP8_BLOCK:
        return spec
    scale_shape = spec.shape[:last_in] + (spec.shape[last_in] // MXFP8_BLOCK,) + spec.shape[last_in + 1:]
    return MXFP8Weight(ParamSpec(spec.shape, spec.axes, "float8_e4m3fn", "mxfp8_values"),
                       ParamSpec(scale_shape, spec.axes, "uint8", "mxfp8_scales"))


# The quantised weights of one text layer: group -> {name: last input axis}.
_MXFP8_LEAVES = {
    "attn": {"wq": 0, "wk": 0, "wv": 0, "wo": 1},
    "index": {"wq": 0, "wk": 0},
    "mlp": {"gate": 0, "up": 0, "down": 0},
    "moe": {"gate": 1, "up": 1, "down": 1},
    "shared": {"gate": 0, "up": 0, "down": 0},
}


def _quantize_layer(layer: dict) -> dict:
    out = dict(layer)
    for group, names in _MXFP8_LEAVES.items():
        parent = out.get("moe", {}) if group == "shared" else out
        if group in parent:
            parent[group] = dict(parent[group])
            for name, last_in in names.items():
                parent[group][name] = _mxfp8(parent[group][name], last_in)
    return out


def _dense_mlp(d: int, f: int) -> dict:
    return {
        "gate": ParamSpec((d, f), ("embed", "mlp")),
        "up": ParamSpec((d, f), ("embed", "mlp")),
        "down": ParamSpec((f, d), ("mlp", "embed")),
    }


def _layer_norm(d: int, axis: str) -> dict:
    return {"scale": ParamSpec((d,), (axis,), init="ones"), "bias": ParamSpec((d,), (axis,), init="zeros")}


def text_param_specs(cfg: M3Config, weights: str = "dequantize") -> dict:
    if weights not in WEIGHTS:
        raise ValueError(f"weights={weights!r}; choose one of {WEIGHTS}")
    t = cfg.text
    d, n, k, h = t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim
    layers = []
    for i in range(t.num_hidden_layers):
        layer: dict[str, Any] = {
            "input_norm": ParamSpec((d,), ("embed",), init="norm_offset"),
            "post_attn_norm": ParamSpec((d,), ("embed",), init="norm_offset"),
            "attn": {
                "wq": ParamSpec((d, n, h), ("embed", "q_heads", "head_dim")),
                "wk": ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim")),
                "wv": ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim")),
                "wo": ParamSpec((n, h, d), ("q_heads", "head_dim", "embed")),
                "q_norm": ParamSpec((h,), ("head_dim",), init="norm_offset"),
                "k_norm": ParamSpec((h,), ("head_dim",), init="norm_offset"),
            },
        }
        if t.is_sparse_attention(i):
            hi, hx = t.index_n_heads, t.index_head_dim
            layer["index"] = {
                "wq": ParamSpec((d, hi, hx), ("embed", "kv_heads", "head_dim")),
                "wk": ParamSpec((d, hx), ("embed", "head_dim")),
                "q_norm": ParamSpec((hx,), ("head_dim",), init="norm_offset"),
                "k_norm": ParamSpec((hx,), ("head_dim",), init="norm_offset"),
            }
        if t.is_moe(i):
            e, fe = t.num_local_experts, t.intermediate_size
            layer["moe"] = {
                "router": ParamSpec((d, e), ("embed", None), dtype="float32"),
                "router_bias": ParamSpec((e,), (None,), dtype="float32"),
                "gate": ParamSpec((e, d, fe), ("experts", "embed", "expert_mlp")),
                "up": ParamSpec((e, d, fe), ("experts", "embed", "expert_mlp")),
                "down": ParamSpec((e, fe, d), ("experts", "expert_mlp", "embed")),
                "shared": _dense_mlp(d, t.shared_intermediate_size),
            }
        else:
            layer["mlp"] = _dense_mlp(d, t.dense_intermediate_size)
        layers.append(_quantize_layer(layer) if weights == "mxfp8" else layer)
    return {
        "embed": ParamSpec((t.vocab_size, d), ("vocab", "embed")),
        "lm_head": ParamSpec((d, t.vocab_size), ("embed", "vocab")),
        "final_norm": ParamSpec((d,), ("embed",), init="norm_offset"),
        "layers": layers,
    }


def vision_param_specs(cfg: M3Config) -> dict:
    v = cfg.vision
    dv, fv = v.hidden_size, v.intermediate_size
    layers = []
    for _ in range(v.num_hidden_layers):
        layer = {"ln1": _layer_norm(dv, "vis_embed"), "ln2": _layer_norm(dv, "vis_embed")}
        for name in ("q", "k", "v", "o"):
            layer[f"w{name}"] = ParamSpec((dv, dv), ("vis_embed", "vis_heads"))
            layer[f"b{name}"] = ParamSpec((dv,), ("vis_heads",))
        layer["fc1"] = ParamSpec((dv, fv), ("vis_embed", "vis_mlp"))
        layer["b1"] = ParamSpec((fv,), ("vis_mlp",))
        layer["fc2"] = ParamSpec((fv, dv), ("vis_mlp", "vis_embed"))
        layer["b2"] = ParamSpec((dv,), ("vis_embed",))
        layers.append(layer)
    return {
        # fp32 in the released checkpoint; transformers runs the Conv3d in the weight's dtype.
        "patch_embed": ParamSpec((v.patch_dim, dv), (None, "vis_embed"), dtype="float32"),
        "pre_ln": _layer_norm(dv, "vis_embed"),
        "layers": layers,
    }


def projector_param_specs(cfg: M3Config) -> tuple[dict, dict]:
    d, p, dv = cfg.text.hidden_size, cfg.projector_hidden_size, cfg.vision.hidden_size
    merged = d * cfg.vision.spatial_merge_size**2

    def mlp(d_in):
        return {
            "w1": ParamSpec((d_in, p), (None, "mlp")),
            "b1": ParamSpec((p,), ("mlp",)),
            "w2": ParamSpec((p, d), ("mlp", "embed")),
            "b2": ParamSpec((d,), ("embed",)),
        }

    return mlp(dv), mlp(merged)


def param_labels(params: dict) -> dict:
    """The training group of each leaf of ``params`` (the same tree, str leaves): "index" for the MSA
    index-branch leaves (``text.layers[i].index.*``), "frozen" for the vision tower / projectors
    (text-only training never updates them, not even by weight decay), "main" for the rest of the
    text decoder. ``m3jax.train``'s optimizer and ``m3jax.nnx.param_group`` both read it."""

    def label(path, _):
        keys = [getattr(p, "key", None) for p in path]
        if keys[0] != "text":
            return "frozen"
        return "index" if "index" in keys else "main"

    return jax.tree_util.tree_map_with_path(label, params)


def param_specs(cfg: M3Config, weights: str = "dequantize") -> dict:
    """The whole parameter tree as :class:`ParamSpec` leaves (``weights``: see the module docstring)."""
    tree = {"text": text_param_specs(cfg, weights)}
    if cfg.vision is not None:
        tree["vision"] = vision_param_specs(cfg)
        tree["projector"], tree["merger"] = projector_param_specs(cfg)
    return tree


def abstract_params(cfg: M3Config, dtype=jnp.bfloat16, weights: str = "dequantize") -> dict:
    """``jax.ShapeDtypeStruct`` tree (for ``jax.eval_shape`` and sharded loading)."""
    return jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.resolve_dtype(dtype)), param_specs(cfg, weights), is_leaf=_is_spec
    )


def count_params(cfg: M3Config) -> int:
    leaves = jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec)
    return sum(math.prod(s.shape) for s in leaves)


def init_random(cfg: M3Config, seed: int = 0, dtype=jnp.float32, scale: float = 0.1) -> dict:
    """Random weights for any config: N(0, scale) for weights and biases, N(0, 0.3) Gemma-norm offsets,
    1 + N(0, 0.2) LayerNorm scales. Norm offsets are random (not zero) so a missing (1 + w) shows up."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    rng = np.random.default_rng(seed % 2**64)  # any signed 64-bit seed (numpy's generator takes only >= 0)
    out = []
    for s in leaves:
        if s.init == "normal":
            x = rng.normal(0.0, scale, s.shape)
        elif s.init == "norm_offset":
            x = rng.normal(0.0, 0.3, s.shape)
        elif s.init == "ones":
            x = 1.0 + rng.normal(0.0, 0.2, s.shape)
        else:
            x = rng.normal(0.0, 0.2, s.shape)
        # Cast on the host (ml_dtypes) so that no per-shape device conversion gets compiled.
        out.append(jnp.asarray(x.astype(s.resolve_dtype(dtype))))
    return jax.tree.unflatten(treedef, out)


def init_random_on_device(cfg: M3Config, seed: int = 0, dtype=jnp.bfloat16, scale: float = 0.02,
                          parts: tuple[str, ...] | None = None, weights: str = "dequantize") -> dict:
    """Random weights generated on the default device (large configs: benchmarks at real widths).

    Same distributions as :func:`init_random` (weights N(0, scale)) but drawn with ``jax.random``, so a
    multi-GB model never passes through host numpy. ``parts`` keeps only those top-level groups
    (e.g. ``("vision", "projector", "merger")`` for the vision tower alone). ``weights="mxfp8"``: the
    quantised weights as fp8 values N(0, 64) with one scale 2^e per leaf, 2^e ~ scale / 64.
    """
    specs = param_specs(cfg, weights)
    if parts is not None:
        specs = {k: v for k, v in specs.items() if k in parts}
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [_random_leaf(s.shape, s.resolve_dtype(dtype), s.init, float(scale), k)
                                        for s, k in zip(leaves, keys)])


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _random_leaf(shape: tuple[int, ...], dt: jnp.dtype, init: str, scale: float, key) -> jax.Array:
    """One leaf of :func:`init_random_on_device`. Module-level, keyed by what the values depend on (not
    the leaf's logical axes): leaves of one shape share a compilation, within a call and across calls."""
    if init == "normal":
        return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    if init == "norm_offset":
        return (0.3 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    if init == "ones":
        return (1.0 + 0.2 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
    if init == "mxfp8_values":  # clipped to e4m3's range (448): a value beyond it would cast to NaN
        return jnp.clip(64.0 * jax.random.normal(key, shape, jnp.float32), -448.0, 448.0).astype(dt)
    if init == "mxfp8_scales":
        return jnp.full(shape, 127 + round(math.log2(scale / 64.0)), dt)
    return (0.2 * jax.random.normal(key, shape, jnp.float32)).astype(dt)
