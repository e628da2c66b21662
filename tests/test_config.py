"""Config parsing (legacy and transformers-5 keys) and cheap full-size checks of the released M3."""

from __future__ import annotations

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax.checkpoint import tensor_plan
from m3jax.config import config_from_hf, config_to_hf, preset
from m3jax.model import multimodal_forward
from m3jax.params import abstract_params, count_params


@pytest.fixture(scope="module")
def m3():
    return preset("minimax_m3")


def test_released_config_values(m3):
    t, v = m3.text, m3.vision
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (6144, 60, 64, 4, 128)
    assert (t.rotary_dim, t.rope_theta, t.vocab_size) == (64, 5e6, 200064)
    assert t.layer_types == ("full_attention",) * 3 + ("minimax_m3_sparse",) * 57
    assert t.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 57
    assert (t.index_n_heads, t.index_head_dim, t.index_block_size, t.index_topk_blocks) == (4, 128, 128, 16)
    assert (t.index_local_blocks, t.index_init_blocks) == (1, 0)
    assert (t.num_local_experts, t.num_experts_per_tok, t.intermediate_size, t.shared_intermediate_size) == (128, 4, 3072, 3072)
    assert (v.hidden_size, v.num_hidden_layers, v.head_dim, v.axis_rotary_dim * 3) == (1280, 32, 80, 78)
    assert (m3.image_token_id, m3.video_token_id) == (200025, 200026)


def test_eval_shape_parameter_count(m3):
    n = count_params(m3)
    assert abs(n - 427.04e9) / 427.04e9 < 0.005, n
    abstract = abstract_params(m3, jnp.bfloat16)
    leaves = jax.tree.leaves(abstract)
    assert sum(math.prod(x.shape) for x in leaves) == n
    # dtype policy: router and patch embedding stay fp32
    assert abstract["text"]["layers"][3]["moe"]["router"].dtype == jnp.float32
    assert abstract["vision"]["patch_embed"].dtype == jnp.float32
    assert abstract["text"]["layers"][3]["moe"]["gate"].dtype == jnp.bfloat16


# docs/ARCHITECTURE.md §4.2–4.3: name pattern -> torch-layout shape.
SPEC_SHAPES = [
    (r"language_model\.model\.embed_tokens\.weight", (200064, 6144)),
    (r"language_model\.lm_head\.weight", (200064, 6144)),
    (r"language_model\.model\.norm\.weight", (6144,)),
    (r".*\.(input|post_attention)_layernorm\.weight", (6144,)),
    (r"language_model.*\.self_attn\.q_proj\.weight", (8192, 6144)),
    (r"language_model.*\.self_attn\.[kv]_proj\.weight", (512, 6144)),
    (r"language_model.*\.self_attn\.o_proj\.weight", (6144, 8192)),
    (r"language_model.*\.self_attn\.[qk]_norm\.weight", (128,)),
    (r"language_model.*\.self_attn\.index_q_proj\.weight", (512, 6144)),
    (r"language_model.*\.self_attn\.index_k_proj\.weight", (128, 6144)),
    (r"language_model.*\.self_attn\.index_[qk]_norm\.weight", (128,)),
    (r"language_model.*\.mlp\.(gate|up)_proj\.weight", (12288, 6144)),
    (r"language_model.*\.mlp\.down_proj\.weight", (6144, 12288)),
    (r".*\.block_sparse_moe\.gate\.weight", (128, 6144)),
    (r".*\.block_sparse_moe\.e_score_correction_bias", (128,)),
    (r".*\.experts\.\d+\.w[13]\.weight", (3072, 6144)),
    (r".*\.experts\.\d+\.w2\.weight", (6144, 3072)),
    (r".*\.shared_experts\.(gate|up)_proj\.weight", (3072, 6144)),
    (r".*\.shared_experts\.down_proj\.weight", (6144, 3072)),
    (r"vision_tower\.vision_model\.embeddings\.patch_embedding\.weight", (1280, 3, 2, 14, 14)),
    (r"vision_tower\.vision_model\..*(layer_norm\d|pre_layrnorm)\.(weight|bias)", (1280,)),
    (r".*\.self_attn\.(q|k|v|out)_proj\.weight", (1280, 1280)),
    (r".*\.self_attn\.(q|k|v|out)_proj\.bias", (1280,)),
    (r".*\.mlp\.fc1\.weight", (5120, 1280)),
    (r".*\.mlp\.fc1\.bias", (5120,)),
    (r".*\.mlp\.fc2\.weight", (1280, 5120)),
    (r".*\.mlp\.fc2\.bias", (1280,)),
    (r"multi_modal_projector\.linear_1\.weight", (6144, 1280)),
    (r"multi_modal_projector\.linear_2\.weight", (6144, 6144)),
    (r"patch_merge_mlp\.linear_1\.weight", (6144, 24576)),
    (r"patch_merge_mlp\.linear_2\.weight", (6144, 6144)),
    (r"(multi_modal_projector|patch_merge_mlp)\.linear_\d\.bias", (6144,)),
]


def test_every_tensor_name_has_the_spec_shape(m3):
    names = {}
    for e in tensor_plan(m3):
        shape = (1280, 3, 2, 14, 14) if e.kind == "patch" else e.hf_shape()
        for n in e.names:
            names[n] = shape
    assert len(names) == 23416  # docs/ARCHITECTURE.md §4.4 tensor census of the BF16 repo
    for name, shape in names.items():
        pattern = next((s for p, s in SPEC_SHAPES if re.fullmatch(p, name)), None)
        assert pattern is not None, f"{name} matches no spec pattern"
        assert shape == pattern, f"{name}: {shape} != spec {pattern}"


def test_eval_shape_full_forward(m3):
    abstract = abstract_params(m3, jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    logits, sel = jax.eval_shape(lambda p, i: multimodal_forward(p, i, None, None, m3, None, None), abstract, ids)
    assert logits.shape == (1, 8, 200064)
    assert sorted(sel) == list(range(3, 60)) and sel[3].shape == (1, 4, 8, 16)


def test_legacy_and_flat_keys_agree(m3):
    flat = config_from_hf(config_to_hf(m3))
    assert flat == m3


def test_tiny_preset_roundtrip():
    cfg = preset("m3_tiny")
    assert config_from_hf(json.loads(json.dumps(config_to_hf(cfg)))) == cfg


def _hf(m3):
    return json.loads(json.dumps(config_to_hf(m3)))


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
        (lambda d: d["text_config"].update(index_n_heads=2), "index_n_heads"),
        (lambda d: d["text_config"].update(attention_output_gate=True), "attention_output_gate"),
        (lambda d: d["text_config"].update(layer_types=["full_attention"] * 3), "layer_types"),
        (lambda d: d["text_config"].update(sparse_attention_config={"sparse_score_type": "mean"}), "sparse_score_type"),
        (lambda d: d["text_config"].pop("hidden_size"), "hidden_size"),
        (lambda d: d.update(quantization_config={"quant_method": "gptq"}), "quantization_config"),
        (lambda d: d["text_config"].update(rotary_dim=32), "rotary_dim"),
        (lambda d: d.update(model_type="llama"), "model_type"),
    ],
)
def test_unrunnable_configs_name_the_key(m3, edit, needle):
    d = _hf(m3)
    edit(d)
    with pytest.raises(m3jax.UnsupportedConfigError, match=needle):
        config_from_hf(d)


def test_rotary_dim_from_legacy_key_only():
    d = _hf(preset("m3_tiny"))
    del d["text_config"]["rope_parameters"]
    d["text_config"]["rope_theta"] = 1e4
    cfg = config_from_hf(d)
    assert cfg.text.rotary_dim == d["text_config"]["rotary_dim"] and cfg.text.rope_theta == 1e4


def test_forward_rejects_bad_inputs():
    model = m3jax.init_random(preset("m3_tiny"))
    cfg = model.config
    with pytest.raises(ValueError, match="out of range"):
        m3jax.forward(model, np.array([[0, cfg.text.vocab_size]]))
    with pytest.raises(ValueError, match="placeholder"):
        m3jax.forward(model, np.array([[1, cfg.image_token_id, 2]]))
    pv = np.zeros((16, cfg.vision.patch_dim), np.float32)
    with pytest.raises(ValueError, match="placeholder"):
        m3jax.forward(model, np.array([[1, cfg.image_token_id, 2]]), pixel_values=pv, image_grid_thw=[[1, 4, 4]])
    with pytest.raises(ValueError, match="grid_thw covers"):
        m3jax.forward(model, np.array([[1] + [cfg.image_token_id] * 4]), pixel_values=pv, image_grid_thw=[[1, 4, 8]])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        small = m3jax.M3Model(cfg.replace_text(max_position_embeddings=4), model.params)
        m3jax.forward(small, np.ones((1, 5), np.int64))


@pytest.mark.parametrize("key, value, needle", [
    ("num_attention_heads", -4, "text_config.num_attention_heads=-4 must be a positive integer"),
    ("num_attention_heads", 0, "text_config.num_attention_heads=0 must be a positive integer"),
    ("num_key_value_heads", 0, "text_config.num_key_value_heads=0 must be a positive integer"),
    ("hidden_size", -64, "text_config.hidden_size=-64 must be a positive integer"),
    ("num_hidden_layers", 0, "text_config.num_hidden_layers=0 must be a positive integer"),
    ("vocab_size", 4.5, "text_config.vocab_size=4.5 is not an integer"),
    ("num_local_experts", "8", "text_config.num_local_experts='8' is not an integer"),
    ("index_block_size", 0, "text_config.index_block_size=0 must be a positive integer"),
    ("rms_norm_eps", -1e-6, "text_config.rms_norm_eps=-1e-06 must be positive"),
])
def test_config_sizes_are_checked_by_name(tmp_path, key, value, needle):
    """Issue #19: such values surfaced as a shape error or ZeroDivisionError deep in the model."""
    d = _hf(preset("m3_tiny"))
    d["text_config"][key] = value
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(m3jax.UnsupportedConfigError, match=re.escape(needle)) as ei:
        m3jax.load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(ei.value)


def test_vision_sizes_are_checked_by_name():
    d = _hf(preset("m3_tiny"))
    d["vision_config"]["num_attention_heads"] = 0
    with pytest.raises(m3jax.UnsupportedConfigError, match=re.escape("vision_config.num_attention_heads=0")):
        config_from_hf(d)


@pytest.mark.parametrize("text", ['{"model_type": ', "[1, 2]", "\udcff"])
def test_config_file_that_is_not_a_json_object_is_named(tmp_path, text):
    path = tmp_path / "config.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(m3jax.UnsupportedConfigError) as ei:
        m3jax.load_config(tmp_path)
    assert str(path) in str(ei.value)


def test_m3_is_an_alias_of_the_released_preset(m3):
    assert preset("m3") == m3
    with pytest.raises(m3jax.UnsupportedConfigError, match="m3 = minimax_m3"):
        preset("m3x")


def test_forward_rejects_empty_input_ids():
    model = m3jax.init_random(preset("m3_tiny"))
    for shape in ((1, 0), (0, 3)):
        with pytest.raises(ValueError, match="at least one sequence of at least one token"):
            m3jax.forward(model, np.zeros(shape, np.int32))
