"""HF checkpoint loader: round trips, dtypes, MXFP8, error reporting and laziness.

Every checkpoint here is a tiny one built in ``tmp_path`` with ``init_random`` + ``save_pretrained``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import m3jax
from m3jax.checkpoint import (
    MXFP8_BLOCK,
    CheckpointReader,
    checkpoint_dtype,
    dequantize_mxfp8,
    is_mxfp8_quantized,
    quantize_mxfp8,
    read_entry_shard,
    tensor_plan,
)
from m3jax.config import M3Config, TextConfig, VisionConfig
from m3jax.safetensors_io import SafetensorsFile, write_safetensors

LM = "language_model.model."
Q_PROJ = LM + "layers.0.self_attn.q_proj.weight"
INPUT_NORM = LM + "layers.0.input_layernorm.weight"
EXPERT_W1 = LM + "layers.1.block_sparse_moe.experts.2.w1.weight"
PATCH = "vision_tower.vision_model.embeddings.patch_embedding.weight"


def tiny_config() -> M3Config:
    text = TextConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=("full_attention", "minimax_m3_sparse"),
        mlp_layer_types=("dense", "sparse"),
        intermediate_size=32,
        dense_intermediate_size=64,
        shared_intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        rotary_dim=4,
        index_n_heads=2,
        index_head_dim=8,
        index_block_size=4,
        index_topk_blocks=2,
    )
    vision = VisionConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2)
    return M3Config(text=text, vision=vision, projector_hidden_size=16)


# --------------------------------------------------------------------------------------------------
# Helpers


@pytest.fixture(scope="module")
def model() -> m3jax.M3Model:
    return m3jax.init_random(tiny_config(), seed=1)


@pytest.fixture(scope="module")
def template(model, tmp_path_factory) -> Path:
    """A single-file fp32 checkpoint of ``model``; tests copy it before changing anything."""
    return m3jax.save_pretrained(model, tmp_path_factory.mktemp("template") / "ckpt")


@pytest.fixture(scope="module")
def template_mxfp8(model, tmp_path_factory) -> Path:
    return m3jax.save_pretrained(model, tmp_path_factory.mktemp("template8") / "ckpt", quantize_mxfp8_weights=True)


@pytest.fixture
def ckpt(template, tmp_path) -> Path:
    return Path(shutil.copytree(template, tmp_path / "ckpt"))


@pytest.fixture
def ckpt8(template_mxfp8, tmp_path) -> Path:
    return Path(shutil.copytree(template_mxfp8, tmp_path / "ckpt8"))


def load(path, dtype="float32") -> m3jax.M3Model:
    return m3jax.load_pretrained(path, dtype=dtype, progress=False)


def read_all(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, copied out of the memmap."""
    f = SafetensorsFile(path)
    return {n: np.array(f.get(n)) for n in f.keys()}


def rewrite(path: Path, edit) -> None:
    """Rewrite one safetensors file with ``edit(tensors) -> tensors`` (written aside, then renamed,
    so no live memmap ever sees its file truncated). Its metadata (the save id) is kept: the edit
    stands for a damaged file, not for a file of another save."""
    tensors = edit(read_all(path))
    tmp = path.with_suffix(".rewrite")
    write_safetensors(tmp, tensors, SafetensorsFile(path).metadata)
    os.replace(tmp, path)


def flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    fa, fb = flat(a), flat(b)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, (k, fa[k].dtype, fb[k].dtype)
        assert fa[k].shape == fb[k].shape, (k, fa[k].shape, fb[k].shape)
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def fast(m: m3jax.M3Model) -> m3jax.M3Model:
    """Same weights, attention chunk = the test length: halves the XLA compile time on CPU."""
    return m3jax.M3Model(m.config.replace(attention_chunk=16), m.params)


def random_ids(cfg: M3Config, t: int = 16) -> np.ndarray:
    # Text only (no image/video placeholder ids: those are far above the tiny vocab anyway).
    return np.random.default_rng(0).integers(0, cfg.text.vocab_size, (2, t))


# --------------------------------------------------------------------------------------------------
# 1. Round trip


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_round_trip(model, tmp_path, sharded):
    kwargs = {"max_shard_bytes": 16 << 10} if sharded else {}
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", **kwargs)
    shards = sorted(d.glob("*.safetensors"))
    if sharded:
        assert len(shards) > 2
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]
        assert index["metadata"]["total_size"] == sum(
            SafetensorsFile(p).get(n).nbytes for p in shards for n in SafetensorsFile(p).keys()
        )
    else:
        assert [p.name for p in shards] == ["model.safetensors"]
        assert not (d / "model.safetensors.index.json").exists()

    loaded = load(d)
    assert loaded.config == model.config
    assert_trees_equal(loaded.params, model.params)

    ids = random_ids(model.config)
    want = m3jax.forward(fast(model), ids).logits
    got = m3jax.forward(fast(loaded), ids).logits
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_checkpoint_names_follow_plan(template):
    """The file holds exactly the names of the tensor plan (torch layout shapes)."""
    f = SafetensorsFile(template / "model.safetensors")
    want = {}
    for e in tensor_plan(tiny_config()):
        for n in e.names:
            want[n] = e.hf_shape() if e.kind != "patch" else None
    assert set(f.keys()) == set(want)
    for n, shape in want.items():
        if shape is not None:
            assert f.shape(n) == shape, n
    v = tiny_config().vision
    assert f.shape(PATCH) == (v.hidden_size, v.num_channels, v.temporal_patch_size, v.patch_size, v.patch_size)


# --------------------------------------------------------------------------------------------------
# 2. bf16 load


def test_bf16_load_dtypes(model, template):
    loaded = load(template, dtype="bfloat16")
    fp32 = {"['vision']['patch_embed']"}
    for i in range(model.config.text.num_hidden_layers):
        if model.config.text.is_moe(i):
            fp32 |= {f"['text']['layers'][{i}]['moe']['router']", f"['text']['layers'][{i}]['moe']['router_bias']"}
    got = flat(loaded.params)
    orig = flat(model.params)
    assert fp32 <= set(got)
    for k, v in got.items():
        want = np.float32 if k in fp32 else ml_dtypes.bfloat16
        assert v.dtype == want, (k, v.dtype)
        # bf16 leaves are the fp32 originals rounded once; fp32 leaves are exact.
        np.testing.assert_array_equal(v, orig[k].astype(want), err_msg=k)


def test_bf16_save_then_load(model, tmp_path):
    """dtype= on save stores bf16 (fp32-policy leaves stay fp32); loading it back is exact."""
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", dtype="bfloat16")
    f = SafetensorsFile(d / "model.safetensors")
    assert f.dtype(Q_PROJ) == ml_dtypes.bfloat16
    assert f.dtype(LM + "layers.1.block_sparse_moe.gate.weight") == np.float32
    assert f.dtype(PATCH) == np.float32
    a = flat(load(d, dtype="bfloat16").params)
    b = flat(load(tmp_path / "ckpt", dtype="bfloat16").params)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(
        a["['text']['layers'][0]['attn']['wq']"],
        np.asarray(model.params["text"]["layers"][0]["attn"]["wq"]).astype(ml_dtypes.bfloat16),
    )


# --------------------------------------------------------------------------------------------------
# 3. MXFP8


def test_mxfp8_file_layout(template_mxfp8):
    d = template_mxfp8
    f = SafetensorsFile(d / "model.safetensors")
    names = set(f.keys())
    quantized = [
        Q_PROJ,
        LM + "layers.0.self_attn.o_proj.weight",
        LM + "layers.0.mlp.down_proj.weight",
        LM + "layers.1.self_attn.index_q_proj.weight",
        LM + "layers.1.self_attn.index_k_proj.weight",
        LM + "layers.1.block_sparse_moe.shared_experts.up_proj.weight",
        EXPERT_W1,
        LM + "layers.1.block_sparse_moe.experts.3.w2.weight",
    ]
    for n in quantized:
        assert f.dtype(n) == ml_dtypes.float8_e4m3fn, n
        out_dim, in_dim = f.shape(n)
        assert f.dtype(n + "_scale_inv") == np.uint8, n
        assert f.shape(n + "_scale_inv") == (out_dim, in_dim // MXFP8_BLOCK), n
    plain = [
        "language_model.lm_head.weight",
        LM + "embed_tokens.weight",
        LM + "norm.weight",
        INPUT_NORM,
        LM + "layers.0.self_attn.q_norm.weight",
        LM + "layers.1.self_attn.index_q_norm.weight",
        LM + "layers.1.block_sparse_moe.gate.weight",
        LM + "layers.1.block_sparse_moe.e_score_correction_bias",
        PATCH,
        "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
        "multi_modal_projector.linear_1.weight",
        "patch_merge_mlp.linear_2.weight",
    ]
    for n in plain:
        assert f.dtype(n) == np.float32, n
        assert n + "_scale_inv" not in names, n
    # Exactly the names is_mxfp8_quantized picks carry fp8 + scales, nothing else.
    fp8 = {n for n in names if f.dtype(n) == ml_dtypes.float8_e4m3fn}
    scales = {n for n in names if n.endswith("_scale_inv")}
    base_names = {n for n in names if not n.endswith("_scale_inv")}
    assert fp8 == {n for n in base_names if is_mxfp8_quantized(n)}
    assert scales == {n + "_scale_inv" for n in fp8}

    hf = json.loads((d / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "mxfp8"
    assert hf["quantization_config"]["weight_block_size"] == [1, 32]


def test_mxfp8_load_dequantizes(model, template_mxfp8):
    loaded = load(template_mxfp8)
    assert loaded.config.quantization == "mxfp8"
    assert loaded.config.replace(quantization=None) == model.config

    def qdq(m):  # [out, in] torch layout
        return dequantize_mxfp8(*quantize_mxfp8(np.asarray(m, np.float32)))

    n_quantized = 0
    for e in tensor_plan(model.config):
        orig = np.asarray(_get(model.params, e.path))
        got = np.asarray(_get(loaded.params, e.path))
        assert got.dtype == np.float32
        if not is_mxfp8_quantized(e.names[0]):
            np.testing.assert_array_equal(got, orig, err_msg=str(e.path))
            continue
        n_quantized += 1
        if e.kind == "experts":
            want = np.stack([qdq(x.T).T for x in orig])
        else:
            assert e.kind == "linear"
            mat = orig.reshape(math.prod(orig.shape[: e.n_in]), -1).T
            want = qdq(mat).T.reshape(orig.shape)
        np.testing.assert_array_equal(got, want, err_msg=str(e.path))
        assert not np.array_equal(got, orig)  # it really went through fp8
    assert n_quantized == 8 + 2 + 3 + 3 + 3  # attn (4 x 2 layers), index, dense mlp, shared, expert stacks


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def test_mxfp8_logits_close(model, template_mxfp8):
    """Dequantised model stays close to the original (a smoke check on the layouts)."""
    ids = random_ids(model.config)
    want = np.asarray(m3jax.forward(fast(model), ids).logits)
    loaded = load(template_mxfp8)
    got = np.asarray(m3jax.forward(fast(m3jax.M3Model(model.config, loaded.params)), ids).logits)
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()


# E4M3 has 3 mantissa bits, so round-to-nearest of a *normal* value (scaled |x| >= 2^-6) is off by at
# most half an ulp = 2^(exponent - 4) <= 2^-4 * |x|. Below 2^-6 the format is subnormal with a fixed
# step of 2^-9, i.e. an absolute error of at most 2^-10 (times the block scale 2^e). The quantizer
# picks e = ceil(log2(amax / 448)), so every scaled value is <= 448 (no saturation) and the block
# maximum lands in [224, 448]; only values ~2^14 times smaller than the block maximum are subnormal.
# Hence: |dq - w| <= max(2^-4 |w|, 2^-10 * 2^e) element-wise, and <= 2^-4 |w| where |w| >= 2^(e-6).
REL_BOUND = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_mxfp8_error_bound(seed):
    rng = np.random.default_rng(seed)
    out_dim, in_dim = 16, 8 * MXFP8_BLOCK
    # Per-block magnitudes over many decades, plus a few tiny values inside each block.
    w = rng.standard_normal((out_dim, in_dim)) * 10.0 ** rng.uniform(-8, 8, (out_dim, in_dim // MXFP8_BLOCK)).repeat(
        MXFP8_BLOCK, axis=1
    )
    w[:, ::7] *= 1e-6
    w = w.astype(np.float32)
    q, s = quantize_mxfp8(w)
    assert q.dtype == ml_dtypes.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == np.uint8 and s.shape == (out_dim, in_dim // MXFP8_BLOCK)
    assert np.isfinite(q.astype(np.float32)).all()

    e = s.astype(np.int32) - 127
    scale = np.ldexp(1.0, e)
    amax = np.abs(w.reshape(out_dim, -1, MXFP8_BLOCK)).max(-1)
    # The tightest power-of-two scale that keeps the block within E4M3's max of 448.
    assert (amax <= 448 * scale).all() and (amax > 224 * scale).all()

    dq = dequantize_mxfp8(q, s)
    assert dq.dtype == np.float32
    err = np.abs(dq.astype(np.float64) - w)
    scale_el = scale.repeat(MXFP8_BLOCK, axis=1)
    assert (err <= np.maximum(REL_BOUND * np.abs(w), SUBNORMAL_ABS * scale_el)).all()
    normal = np.abs(w) >= 2.0**-6 * scale_el
    assert normal.mean() > 0.5
    assert (err[normal] <= REL_BOUND * np.abs(w[normal])).all()
    # Not trivially exact either: the bound is about as tight as E4M3 allows.
    assert (err[normal] / np.abs(w[normal])).max() > 2.0**-6


def test_quantize_mxfp8_exact_on_representable():
    """Blocks that are E4M3 values times a power of two (with the block max at +-448) round-trip bit
    exactly, including the codes themselves and the exponents; all-zero blocks give scale 2^-127."""
    rng = np.random.default_rng(0)
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    codes = codes[np.isfinite(codes.astype(np.float32))]
    out_dim, n_blocks = 8, 6
    vals = rng.choice(codes, (out_dim, n_blocks, MXFP8_BLOCK)).astype(np.float32)
    vals[:, :, 0] = 448.0 * rng.choice([-1.0, 1.0], (out_dim, n_blocks))
    k = rng.integers(-30, 30, (out_dim, n_blocks))
    vals[0, 1] = 0.0  # one all-zero block
    w = (vals * np.ldexp(np.float32(1.0), k)[..., None]).reshape(out_dim, -1).astype(np.float32)
    q, s = quantize_mxfp8(w)
    want_s = (k + 127).astype(np.uint8)
    want_s[0, 1] = 0
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(q.astype(np.float32), vals.reshape(out_dim, -1))
    np.testing.assert_array_equal(dequantize_mxfp8(q, s), w)


def test_quantize_mxfp8_rejects_ragged_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp8(np.ones((4, 48), np.float32))


def test_dequantize_mxfp8_checks_scale():
    q, s = quantize_mxfp8(np.ones((4, 64), np.float32))
    with pytest.raises(m3jax.CheckpointError, match="foo.weight_scale_inv"):
        dequantize_mxfp8(q, s[:, :1], "foo.weight")
    with pytest.raises(m3jax.CheckpointError, match="foo.weight_scale_inv"):
        dequantize_mxfp8(q, s.astype(np.int8), "foo.weight")


# --------------------------------------------------------------------------------------------------
# 4. Errors


def test_missing_tensor(ckpt):
    rewrite(ckpt / "model.safetensors", lambda t: {k: v for k, v in t.items() if k != EXPERT_W1})
    with pytest.raises(m3jax.CheckpointError, match="missing tensor") as ei:
        load(ckpt)
    assert EXPERT_W1 in str(ei.value)


def test_missing_tensor_in_sharded_checkpoint(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = d / index["weight_map"][Q_PROJ]
    rewrite(shard, lambda t: {k: v for k, v in t.items() if k != Q_PROJ})
    del index["weight_map"][Q_PROJ]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(m3jax.CheckpointError, match="missing tensor") as ei:
        load(d)
    assert Q_PROJ in str(ei.value)


def test_unexpected_tensor(ckpt):
    extra = LM + "layers.7.self_attn.q_proj.weight"
    rewrite(ckpt / "model.safetensors", lambda t: {**t, extra: np.zeros((2, 2), np.float32)})
    with pytest.raises(m3jax.CheckpointError, match="unexpected") as ei:
        load(ckpt)
    assert extra in str(ei.value)


def test_mtp_tensors_are_ignored(model, ckpt):
    mtp = {
        "mtp.layers.0.eh_proj.weight": np.ones((4, 4), np.float32),
        LM + "mtp.0.norm.weight": np.ones(4, ml_dtypes.bfloat16),
    }
    rewrite(ckpt / "model.safetensors", lambda t: {**t, **mtp})
    assert_trees_equal(load(ckpt).params, model.params)


@pytest.mark.parametrize(
    "name, shape",
    [
        (Q_PROJ, (32, 33)),  # linear, one dim off
        (Q_PROJ, (32 * 32,)),  # linear, right size but flat
        (EXPERT_W1, (32, 16)),  # one expert of a stack
        (INPUT_NORM, (33,)),  # copy
        (PATCH, (24, 3, 2, 14, 13)),  # Conv3d weight
        (PATCH, (24, 2, 3, 14, 14)),  # Conv3d weight with C and T swapped (same element count)
    ],
    ids=["linear", "linear-flat", "expert", "norm", "patch", "patch-permuted"],
)
def test_wrong_shape(ckpt, name, shape):
    rewrite(ckpt / "model.safetensors", lambda t: {**t, name: np.zeros(shape, np.float32)})
    with pytest.raises(m3jax.CheckpointError, match="shape") as ei:
        load(ckpt)
    assert name in str(ei.value) and str(ckpt / "model.safetensors") in str(ei.value)


@pytest.mark.parametrize(
    "name, dtype",
    [
        (INPUT_NORM, np.int32),
        (Q_PROJ, np.int32),
        (EXPERT_W1, np.int32),
        (PATCH, np.int32),
        (INPUT_NORM, np.uint8),
        (Q_PROJ, np.int64),
        (EXPERT_W1, np.bool_),
    ],
    ids=["norm-i32", "linear-i32", "expert-i32", "patch-i32", "norm-u8", "linear-i64", "expert-bool"],
)
def test_integer_dtype_rejected(ckpt, name, dtype):
    def edit(t):
        return {**t, name: np.zeros(t[name].shape, dtype)}

    rewrite(ckpt / "model.safetensors", edit)
    with pytest.raises(m3jax.CheckpointError, match="dtype") as ei:
        load(ckpt)
    assert name in str(ei.value) and str(ckpt / "model.safetensors") in str(ei.value)


def test_truncated_file(ckpt):
    path = ckpt / "model.safetensors"
    size = path.stat().st_size
    os.truncate(path, size - 100)
    with pytest.raises(m3jax.CheckpointError, match="truncated") as ei:
        load(ckpt)
    assert str(path) in str(ei.value)


def test_truncated_inside_header(ckpt):
    path = ckpt / "model.safetensors"
    os.truncate(path, 100)
    with pytest.raises(m3jax.CheckpointError, match="truncated") as ei:
        load(ckpt)
    assert str(path) in str(ei.value)


def test_truncated_shard_of_sharded_checkpoint(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    shard = sorted(d.glob("model-*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(m3jax.CheckpointError, match="truncated") as ei:
        load(d)
    assert shard.name in str(ei.value)


def _header_span(path: Path) -> tuple[int, int]:
    n = int.from_bytes(path.read_bytes()[:8], "little")
    return 8, 8 + n


@pytest.mark.parametrize(
    "corrupt",
    ["json-syntax", "not-utf8", "not-an-object", "entry-without-offsets"],
)
def test_corrupt_header(ckpt, corrupt):
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    start, end = _header_span(path)
    if corrupt == "json-syntax":
        raw[start : start + 5] = b"{{{{{"
    elif corrupt == "not-utf8":
        raw[start + 1 : start + 5] = b"\xff\xfe\xfd\xfc"
    elif corrupt == "not-an-object":
        raw[start:end] = b"[" + b" " * (end - start - 2) + b"]"
    else:
        header = json.loads(bytes(raw[start:end]))
        del header[Q_PROJ]["data_offsets"]
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (end - start - len(blob))
        assert len(blob) == end - start
        raw[start:end] = blob
    path.write_bytes(bytes(raw))
    with pytest.raises(m3jax.CheckpointError) as ei:
        load(ckpt)
    assert str(path) in str(ei.value)


def test_header_length_beyond_file(ckpt):
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[:8] = (1 << 40).to_bytes(8, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(m3jax.CheckpointError, match="truncated") as ei:
        load(ckpt)
    assert str(path) in str(ei.value)


def test_index_points_to_missing_shard(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][Q_PROJ] = "model-00099-of-00099.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(m3jax.CheckpointError, match="does not exist") as ei:
        load(d)
    assert "model-00099-of-00099.safetensors" in str(ei.value)
    assert "model.safetensors.index.json" in str(ei.value)


def test_index_shard_deleted(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(m3jax.CheckpointError, match="does not exist") as ei:
        load(d)
    assert shard.name in str(ei.value)


def test_index_maps_tensor_no_shard_holds(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    ghost = LM + "layers.0.self_attn.ghost_proj.weight"
    shard = index["weight_map"][Q_PROJ]
    index["weight_map"][ghost] = shard
    index_path.write_text(json.dumps(index))
    with pytest.raises(m3jax.CheckpointError, match="does not hold") as ei:
        load(d)
    assert ghost in str(ei.value) and shard in str(ei.value)


@pytest.mark.parametrize("text", [
    "{oops",
    "[1, 2]",
    '{"metadata": {}}',
    '{"weight_map": ["a"]}',
    '{"weight_map": {"%s": 3}}' % Q_PROJ,
    '{"weight_map": {"%s": "../other/model.safetensors"}}' % Q_PROJ,
], ids=["not-json", "not-an-object", "no-weight-map", "weight-map-list", "value-not-string", "value-a-path"])
def test_malformed_index(model, tmp_path, text):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    index_path = d / "model.safetensors.index.json"
    index_path.write_text(text)
    with pytest.raises(m3jax.CheckpointError, match="shard index") as ei:
        load(d)
    assert str(index_path) in str(ei.value)


def _edit_header(path: Path, edit) -> None:
    """Rewrite the JSON header of one safetensors file with ``edit(header)``, the data unchanged."""
    raw = path.read_bytes()
    start, end = _header_span(path)
    header = json.loads(raw[start:end])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[end:])


def _first_tensor(header: dict) -> str:
    return min((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])


def _shift_first_back(h):  # the first tensor's bytes moved onto the header's last ones
    b, e = h[_first_tensor(h)]["data_offsets"]
    h[_first_tensor(h)]["data_offsets"] = [b - 64, e - 64]


def _swap_offsets(h):
    b, e = h[Q_PROJ]["data_offsets"]
    h[Q_PROJ]["data_offsets"] = [e, b]


@pytest.mark.parametrize("edit, match", [
    (_shift_first_back, "data_offsets"),
    (_swap_offsets, "data_offsets"),
    (lambda h: h[Q_PROJ].update(data_offsets=h[LM + "layers.0.self_attn.o_proj.weight"]["data_offsets"]), "overlap"),
    (lambda h: h[Q_PROJ].update(shape=[-d for d in h[Q_PROJ]["shape"]]), "shape"),
    (lambda h: h[Q_PROJ].update(shape=[float(d) for d in h[Q_PROJ]["shape"]]), "shape"),
    (lambda h: h[Q_PROJ].update(shape=str(h[Q_PROJ]["shape"])), "shape"),
    (lambda h: h[Q_PROJ].update(dtype=["F32"]), "dtype"),
    (lambda h: h[Q_PROJ].update(data_offsets=[str(x) for x in h[Q_PROJ]["data_offsets"]]), "data_offsets"),
], ids=["negative-offset", "begin-after-end", "overlap", "negative-dims", "float-dims", "shape-string",
        "dtype-list", "offsets-strings"])
def test_bad_header_entry(ckpt, edit, match):
    path = ckpt / "model.safetensors"
    header = json.loads(path.read_bytes()[slice(*_header_span(path))])
    _edit_header(path, edit)
    named = _first_tensor(header) if edit is _shift_first_back else Q_PROJ
    with pytest.raises(m3jax.CheckpointError, match=match) as ei:
        load(ckpt)
    assert str(path) in str(ei.value) and named in str(ei.value)


def test_no_safetensors_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(m3jax.CheckpointError) as ei:
        load(ckpt)
    assert str(ckpt) in str(ei.value)


@pytest.mark.parametrize("name", [Q_PROJ, EXPERT_W1])
def test_fp8_without_scale_inv(ckpt8, name):
    rewrite(ckpt8 / "model.safetensors", lambda t: {k: v for k, v in t.items() if k != name + "_scale_inv"})
    with pytest.raises(m3jax.CheckpointError, match="scale_inv") as ei:
        load(ckpt8)
    assert name + "_scale_inv" in str(ei.value) and str(ckpt8 / "model.safetensors") in str(ei.value)


def test_fp8_scale_inv_wrong_shape(ckpt8):
    rewrite(ckpt8 / "model.safetensors", lambda t: {**t, Q_PROJ + "_scale_inv": np.zeros((32, 2), np.uint8)})
    with pytest.raises(m3jax.CheckpointError, match="shape") as ei:
        load(ckpt8)
    assert Q_PROJ + "_scale_inv" in str(ei.value) and str(ckpt8 / "model.safetensors") in str(ei.value)


def test_fp8_extra_scale_inv_is_unexpected(ckpt):
    """A stray scale next to a non-fp8 weight is not silently dropped."""
    rewrite(ckpt / "model.safetensors", lambda t: {**t, Q_PROJ + "_scale_inv": np.zeros((32, 1), np.uint8)})
    with pytest.raises(m3jax.CheckpointError, match="unexpected") as ei:
        load(ckpt)
    assert Q_PROJ + "_scale_inv" in str(ei.value)


def _edit_config(d: Path, edit) -> None:
    hf = json.loads((d / "config.json").read_text())
    edit(hf)
    (d / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
        (lambda c: c["text_config"].update(sparse_attention_config={"sparse_score_type": "mean"}), "sparse_score_type"),
        (lambda c: c["text_config"].update(index_n_heads=1), "index_n_heads"),
        (lambda c: c["text_config"].update(attention_output_gate=True), "attention_output_gate"),
        (lambda c: c["text_config"].update(layer_types=["full_attention"]), "layer_types"),
        (lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
         "quantization_config"),
        (lambda c: c["vision_config"].update(hidden_act="quick_gelu"), "hidden_act"),
        (lambda c: c.update(model_type="llama"), "model_type"),
    ],
    ids=["rope-yarn", "score-mean", "index-heads", "output-gate", "layer-types", "quant", "vision-act", "model-type"],
)
def test_unsupported_config(ckpt, edit, key):
    _edit_config(ckpt, edit)
    with pytest.raises(m3jax.UnsupportedConfigError) as ei:
        load(ckpt)
    assert key in str(ei.value)


def test_config_weights_disagree(ckpt):
    """A config.json with fewer experts than the weights: the router shape gives it away, by name."""
    _edit_config(ckpt, lambda c: c["text_config"].update(num_local_experts=3))
    with pytest.raises(m3jax.CheckpointError, match="shape") as ei:
        load(ckpt)
    assert LM + "layers.1.block_sparse_moe.gate.weight" in str(ei.value)


def test_config_fewer_layers_than_weights(ckpt):
    """A config.json with one layer less: every tensor of the dropped layer is reported unexpected."""

    def edit(c):
        t = c["text_config"]
        t.update(num_hidden_layers=1, layer_types=t["layer_types"][:1], mlp_layer_types=t["mlp_layer_types"][:1])

    _edit_config(ckpt, edit)
    with pytest.raises(m3jax.CheckpointError, match="unexpected") as ei:
        load(ckpt)
    assert LM + "layers.1." in str(ei.value)


def test_sharded_read_errors_name_the_file(ckpt, model):
    """The per-device reader (sharded loading) reports a wrong shape with its file, as the whole-leaf one does."""
    rewrite(ckpt / "model.safetensors", lambda t: {**t, Q_PROJ: np.zeros((32, 33), np.float32)})
    entry = next(e for e in tensor_plan(model.config) if e.names == (Q_PROJ,))
    with pytest.raises(m3jax.CheckpointError, match="shape") as ei:
        read_entry_shard(CheckpointReader(ckpt), entry, None, np.float32)
    assert str(ckpt / "model.safetensors") in str(ei.value)


# --------------------------------------------------------------------------------------------------
# 5. Saving into a folder that holds a checkpoint (issue #19)


def test_single_file_save_over_a_sharded_checkpoint(model, tmp_path):
    """The older index and shards are removed, by name: left in place the index was followed and the
    old model came back."""
    d = tmp_path / "ckpt"
    m3jax.save_pretrained(model, d, max_shard_bytes=16 << 10)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    new = m3jax.init_random(tiny_config(), seed=2)
    with pytest.warns(UserWarning, match="would be loaded instead of") as w:
        m3jax.save_pretrained(new, d, overwrite=True)
    # the warning that matched: in a full run another UserWarning (one a process gives once) may come first
    msg = next(str(x.message) for x in w if "would be loaded instead of" in str(x.message))
    assert all(n in msg for n in ["model.safetensors.index.json", *shards])
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    assert_trees_equal(load(d).params, new.params)


def test_sharded_save_over_other_checkpoints(model, tmp_path):
    d = tmp_path / "ckpt"
    m3jax.save_pretrained(model, d)
    with pytest.warns(UserWarning, match=r"\['model.safetensors'\]"):
        m3jax.save_pretrained(model, d, max_shard_bytes=8 << 10, overwrite=True)  # many shards
    with pytest.warns(UserWarning) as w:
        m3jax.save_pretrained(model, d, max_shard_bytes=64 << 10, overwrite=True)  # fewer: the extra old shards go
    index = json.loads((d / "model.safetensors.index.json").read_text())
    on_disk = {p.name for p in d.glob("*.safetensors")}
    said = " ".join(str(x.message) for x in w)  # every warning: none names a shard that stays
    assert on_disk == set(index["weight_map"].values()) and not any(n in said for n in on_disk)
    assert_trees_equal(load(d).params, model.params)


def test_resave_in_place_does_not_warn(model, ckpt):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m3jax.save_pretrained(model, ckpt, overwrite=True)


def test_save_refuses_other_safetensors_files(model, ckpt):
    (ckpt / "adapter.safetensors").write_bytes(b"someone else's")
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    with pytest.raises(m3jax.CheckpointError, match="adapter.safetensors"):
        m3jax.save_pretrained(model, ckpt, overwrite=True)
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir()}


@pytest.mark.filterwarnings("ignore:.*would be loaded instead of:UserWarning")  # the overwrite=True save
@pytest.mark.parametrize("held", ["single", "sharded", "config-only"])
def test_save_refuses_a_folder_holding_a_checkpoint(model, tmp_path, held):
    d = tmp_path / "ckpt"
    if held == "config-only":
        d.mkdir()
        (d / "config.json").write_text('{"mine": 1}')
    else:
        m3jax.save_pretrained(model, d, **({"max_shard_bytes": 16 << 10} if held == "sharded" else {}))
    before = _snapshot(d)
    new = m3jax.init_random(tiny_config(), seed=2)
    with pytest.raises(m3jax.CheckpointError, match="overwrite=True") as ei:
        m3jax.save_pretrained(new, d)
    assert str(d) in str(ei.value) and "config.json" in str(ei.value)
    assert _snapshot(d) == before
    m3jax.save_pretrained(new, d, overwrite=True)
    assert_trees_equal(load(d).params, new.params)


def test_save_into_an_empty_folder(model, tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    m3jax.save_pretrained(model, d)
    assert_trees_equal(load(d).params, model.params)


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": "int8"}, "dtype='int8'"),
    ({"dtype": "float64"}, "dtype='float64'"),
    ({"dtype": "bf16"}, "dtype='bf16'"),
    ({"max_shard_bytes": 0}, "max_shard_bytes=0"),
    ({"max_shard_bytes": -1}, "max_shard_bytes=-1"),
], ids=["int8", "float64", "unknown-name", "shard-0", "shard-negative"])
def test_save_refuses_bad_arguments(model, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        m3jax.save_pretrained(model, tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_save_float16(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", dtype="float16")
    assert SafetensorsFile(d / "model.safetensors").dtype(Q_PROJ) == np.float16
    assert checkpoint_dtype(d) == "float32"


@pytest.mark.parametrize("dtype", ["int8", "float16", "bogus"])
def test_init_random_refuses_non_compute_dtypes(dtype):
    with pytest.raises(ValueError, match=f"dtype='{dtype}'"):
        m3jax.init_random(tiny_config(), dtype=dtype)


def test_reader_refuses_two_checkpoints_in_one_folder(model, tmp_path):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=16 << 10)
    shutil.copy(sorted(d.glob("model-*.safetensors"))[0], d / "model.safetensors")
    with pytest.raises(m3jax.CheckpointError, match="two checkpoints in one folder"):
        load(d)


# --------------------------------------------------------------------------------------------------
# 6. The checkpoint's own dtype (dtype="auto", issue #18)


@pytest.mark.parametrize("saved, key, stored, expected", [
    (None, "dtype", None, "float32"),  # what save_pretrained writes
    ("bfloat16", "dtype", None, "bfloat16"),
    ("bfloat16", "torch_dtype", "bfloat16", "bfloat16"),  # transformers < 4.56 spelling
    ("bfloat16", None, None, "bfloat16"),  # no key: the stored embedding's dtype
    ("float32", "torch_dtype", "float16", "float32"),  # float16 runs in float32, exactly
], ids=["fp32", "bf16", "torch_dtype", "no-key", "fp16"])
def test_checkpoint_dtype(model, tmp_path, saved, key, stored, expected):
    d = m3jax.save_pretrained(model, tmp_path / "ckpt", dtype=saved)
    hf = json.loads((d / "config.json").read_text())
    assert hf.pop("dtype") == (saved or "float32")
    if key is not None:
        hf[key] = stored or saved or "float32"
    (d / "config.json").write_text(json.dumps(hf))
    assert checkpoint_dtype(d) == expected
    assert m3jax.load_pretrained(d, dtype="auto", progress=False).params["text"]["embed"].dtype == expected


@pytest.mark.parametrize("edit, key", [
    (lambda c: c.update(dtype=["x"]), "dtype"),
    (lambda c: c.pop("dtype") and c.update(torch_dtype={"a": 1}), "torch_dtype"),
    (lambda c: c.pop("dtype") and c["text_config"].update(dtype=5), "text_config.dtype"),
], ids=["dtype-list", "torch_dtype-object", "text-dtype-int"])
def test_checkpoint_dtype_not_a_name(ckpt, edit, key):
    _edit_config(ckpt, edit)
    with pytest.raises(m3jax.UnsupportedConfigError, match="not a dtype name") as ei:
        checkpoint_dtype(ckpt)
    assert str(ckpt / "config.json") in str(ei.value) and f"{key}=" in str(ei.value)


def test_checkpoint_dtype_unsupported(ckpt):
    _edit_config(ckpt, lambda c: c.update(dtype="int8"))
    with pytest.raises(m3jax.UnsupportedConfigError, match="dtype='int8'"):
        checkpoint_dtype(ckpt)


# --------------------------------------------------------------------------------------------------
# 7. Laziness


def test_reader_is_lazy(model, template):
    """get() returns a read-only memmap-backed view of just that tensor (released with the view)."""
    f = SafetensorsFile(template / "model.safetensors")
    a = f.get(Q_PROJ)
    assert a.shape == (32, 32) and a.dtype == np.float32
    assert not a.flags.writeable
    base, chain = a, []
    while base is not None:
        chain.append(base)
        base = getattr(base, "base", None)
    maps = [x for x in chain if isinstance(x, np.memmap)]
    assert maps and maps[-1].nbytes == a.nbytes  # only this tensor's bytes are mapped
    b = f.get(EXPERT_W1)
    assert not np.shares_memory(a, b)