"""MXFP8 weights kept MXFP8 on the device (``load_pretrained(..., weights="mxfp8")``): what is held, the
exactness against the dequantise-on-load path (the MXFP8 oracle fixture and a random checkpoint saved
as MXFP8), the resident bytes against the memory plans, the sharding rules of values and scales, and
sharded loading on 4 simulated CPU devices (a subprocess). The grouped GEMM kernel's MXFP8 variant is
tested in tests/pallas/test_grouped_matmul.py.

Tolerance: the held weights dequantise exactly to the bf16 / fp32 weights of the dequantise-on-load
path (e4m3 x 2^k is exact in both), so the two differ by accumulation order only: fp32 logits within
1e-5 relative L2 (the fp32 bound of tests/conftest.py; on XLA:CPU they are equal), bf16 within the bf16
bound 2e-2.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import m3jax
from m3jax import memory
from m3jax import plan as plan_cli
from m3jax import sharding as sh
from m3jax.checkpoint import CheckpointError, CheckpointReader, iter_checkpoint_arrays
from m3jax.config import preset
from m3jax.layers import MXFP8Weight
from tests.conftest import FIXTURES, TOL, rel_l2, tiny_config

ROOT = Path(__file__).resolve().parent.parent
# every input width a multiple of 32 (head_dim 32: wo [N, H, D] groups within a head)
WIDE = {"hidden_size": 64, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32,
        "dense_intermediate_size": 64, "shared_intermediate_size": 32, "index_head_dim": 32, "rotary_dim": 8}


def _mx_leaves(params) -> list[MXFP8Weight]:
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, MXFP8Weight))
    return [x for x in leaves if isinstance(x, MXFP8Weight)]


def _nbytes(params) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(params))


def _logits(model, ids):
    return np.asarray(m3jax.forward(model, ids).logits, np.float64)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory) -> tuple[Path, m3jax.M3Model]:
    model = m3jax.init_random(tiny_config(**WIDE), seed=3)
    path = m3jax.save_pretrained(model, tmp_path_factory.mktemp("mx") / "ckpt", quantize_mxfp8_weights=True)
    return path, model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_oracle_fixture_logits_equal_the_dequantised_model(dtype):
    d = FIXTURES / "mxfp8"
    ids = np.load(d / "fixture.npz")["input_ids"]
    deq = m3jax.load_pretrained(d, dtype=dtype, progress=False)
    mx = m3jax.load_pretrained(d, dtype=dtype, progress=False, weights="mxfp8")
    held = _mx_leaves(mx.params)
    # head_dim 16 keeps wo dequantised (a 32-input block would span two heads); the rest stays MXFP8
    assert len(held) == 28 and not isinstance(mx.params["text"]["layers"][0]["attn"]["wo"], MXFP8Weight)
    assert all(w.values.dtype == jnp.float8_e4m3fn and w.scales.dtype == jnp.uint8 for w in held)
    assert _nbytes(mx.params) == memory.weight_bytes(mx.config, jnp.dtype(dtype).itemsize, "mxfp8")
    err = rel_l2(_logits(mx, ids), _logits(deq, ids))
    assert err <= TOL[dtype], err


def test_random_mxfp8_checkpoint_held_as_stored(wide_checkpoint):
    path, model = wide_checkpoint
    cfg = model.config
    deq = m3jax.load_pretrained(path, dtype="float32", progress=False)
    mx = m3jax.load_pretrained(path, dtype="float32", progress=False, weights="mxfp8")
    ids = np.random.default_rng(0).integers(0, 80, (2, 16))  # below the image / video placeholder ids
    assert rel_l2(_logits(mx, ids), _logits(deq, ids)) <= TOL["float32"]
    # every quantised weight is held (attention 4 x 3 layers, index 2 x 2, dense MLP, shared 3 x 2, experts 3 x 2)
    assert len(_mx_leaves(mx.params)) == 12 + 4 + 3 + 6 + 6
    # the bytes of the checkpoint, re-laid out: expert 1 of layer 1's down projection [Fe, D] -> ours [D... ]
    down = mx.params["text"]["layers"][1]["moe"]["down"]
    name = "language_model.model.layers.1.block_sparse_moe.experts.1.w2.weight"
    reader = CheckpointReader(path)
    np.testing.assert_array_equal(np.asarray(down.values[1]).view(np.uint8), reader.read(name).T.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(down.scales[1]), reader.read(name + "_scale_inv").T)
    # resident bytes = the plans' count for weights="mxfp8"
    assert _nbytes(mx.params) == memory.weight_bytes(cfg, 4, "mxfp8")
    mesh1 = plan_cli.PlanMesh(1)
    assert _nbytes(mx.params) == sh.planned_param_bytes(cfg, mesh1, 4, weights="mxfp8")
    wq = cfg.text.hidden_size * cfg.text.num_attention_heads * cfg.text.head_dim
    assert mx.params["text"]["layers"][0]["attn"]["wq"].scales.size == wq // 32


def test_weights_mxfp8_needs_an_mxfp8_checkpoint(wide_checkpoint, tmp_path):
    _, model = wide_checkpoint
    path = m3jax.save_pretrained(model, tmp_path / "bf16", dtype="bfloat16")
    with pytest.raises(CheckpointError, match="not MXFP8"):
        m3jax.load_pretrained(path, progress=False, weights="mxfp8")
    # Refused before the first leaf is converted (the embedding comes first and is not MXFP8), on both
    # loaders: a wrong choice costs no loading time.
    arrays = iter_checkpoint_arrays(path, model.config, progress=False, weights="mxfp8")
    with pytest.raises(CheckpointError, match="not MXFP8"):
        next(arrays)
    with pytest.raises(CheckpointError, match="not MXFP8"):
        sh.load_sharded(path, model.config, sh.make_mesh(1), weights="mxfp8")
    with pytest.raises(ValueError, match="weights="):
        m3jax.load_pretrained(path, progress=False, weights="fp8")


def test_plan_counts_what_load_pretrained_holds():
    cfg = preset("minimax_m3")
    mesh = plan_cli.PlanMesh(8)
    per_dev, total = plan_cli.weights_per_device(cfg, mesh, "mxfp8")
    assert per_dev == pytest.approx(sh.planned_param_bytes(cfg, mesh, 2, weights="mxfp8"))
    assert total == memory.weight_bytes(cfg, 2, "mxfp8")
    assert round(per_dev / 1e9, 2) == 56.17  # README's MXFP8 rows
    # experts: 1 byte + 1 byte per 32 inputs, 16 of 128 per device
    t = cfg.text
    experts = 3 * t.num_local_experts * t.hidden_size * t.intermediate_size
    assert memory.weight_bytes(cfg, 2) - memory.weight_bytes(cfg, 2, "mxfp8") > experts * t.num_hidden_layers * 0.9


def test_values_and_scales_shard_alike_or_refuse():
    specs = sh.param_partition_specs(preset("minimax_m3"), plan_cli.PlanMesh(8), weights="mxfp8")
    layer = specs["text"]["layers"][3]
    assert layer["moe"]["gate"] == MXFP8Weight(jax.P("model", None, None), jax.P("model", None, None))
    assert layer["attn"]["wo"].values == layer["attn"]["wo"].scales == jax.P("model", None, None)
    assert layer["moe"]["shared"]["down"].scales == jax.P("model", None)  # 3072 / 8 = 12 blocks of 32
    # dense MLP width 64 on 4 devices: 16 inputs per shard of the down projection, half a scale block
    cfg = tiny_config(**WIDE)
    with pytest.raises(sh.MXFP8ShardingError, match="whole 32-input blocks"):
        sh.param_partition_specs(cfg, plan_cli.PlanMesh(4), weights="mxfp8")
    with pytest.raises(sh.MXFP8ShardingError):
        plan_cli.weights_per_device(cfg, plan_cli.PlanMesh(4), "mxfp8")


_SHARDED = r"""
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import numpy as np
import m3jax
from m3jax import sharding as sh
from m3jax.layers import MXFP8Weight
from tests.conftest import rel_l2, tiny_config
from tests.test_mxfp8 import WIDE

path, out = sys.argv[1], sys.argv[2]
cfg = m3jax.load_config(path)
mesh = sh.make_mesh(4)
log = {}
params = sh.load_sharded(path, cfg, mesh, dtype="float32", read_log=log, weights="mxfp8")
one = m3jax.load_pretrained(path, dtype="float32", progress=False, weights="mxfp8")
want = jax.tree.map(lambda s: s.spec, sh.param_shardings(cfg, mesh, weights="mxfp8"))
got = jax.tree.map(lambda a: a.sharding.spec, params)
ids = np.random.default_rng(0).integers(0, 80, (2, 16))  # below the image / video placeholder ids
ref = np.asarray(m3jax.forward(one, ids).logits)
with sh.use_mesh(mesh):
    logits = np.asarray(m3jax.forward(m3jax.M3Model(cfg, params, mesh), ids).logits)
from m3jax.model import sharded_forward
logits_jit = np.asarray(sharded_forward(params, ids, cfg, mesh)[0])
equal = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), params, one.params)
res = sh.resident_bytes(params)
expert = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight"
json.dump({"specs": got == want, "equal": all(jax.tree.leaves(equal)), "err": rel_l2(logits, ref),
           "err_sharded_forward": rel_l2(logits_jit, ref),
           "resident": sorted(set(res.values())), "planned": sh.planned_param_bytes(cfg, mesh, 4, weights="mxfp8"),
           "expert_reads": log.get(expert), "scale_reads": log.get(expert + "_scale_inv"),
           "mx_leaves": sum(isinstance(x, MXFP8Weight) for x in jax.tree.leaves(
               params, is_leaf=lambda x: isinstance(x, MXFP8Weight)))}, open(out, "w"))
"""


def test_sharded_loading_on_4_devices(tmp_path):
    # 4 devices: heads, experts (8 -> 2 per device) and MLP widths split; each device reads its blocks
    cfg = tiny_config(**{**WIDE, "num_local_experts": 8, "dense_intermediate_size": 128, "shared_intermediate_size": 128,
                         "vocab_size": 96})
    path = m3jax.save_pretrained(m3jax.init_random(cfg, seed=4), tmp_path / "ckpt", quantize_mxfp8_weights=True)
    out = tmp_path / "out.json"
    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED)
    # 4 simulated CPU devices, also on a GPU machine (where JAX would otherwise pick its one GPU)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    proc = subprocess.run([sys.executable, str(script), str(path), str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["specs"] and r["equal"] and r["mx_leaves"] == 31
    assert r["err"] <= TOL["float32"] and r["err_sharded_forward"] <= TOL["float32"]
    assert r["resident"] == [r["planned"]]  # every device holds exactly the planned bytes
    # expert 0 lives on device 0 only: its values and scales are read once (one shard), not per device
    assert r["expert_reads"] == 1 and r["scale_reads"] == 1


def test_saving_a_model_held_as_mxfp8_round_trips(wide_checkpoint, tmp_path):
    path, _ = wide_checkpoint
    mx = m3jax.load_pretrained(path, dtype="float32", progress=False, weights="mxfp8")
    again = m3jax.save_pretrained(mx, tmp_path / "again", quantize_mxfp8_weights=True)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight"
    a, b = CheckpointReader(path), CheckpointReader(again)
    for n in (name, name + "_scale_inv"):
        assert b.read(n).dtype == a.read(n).dtype
    def deq(r):
        return r.dequantize(name, r.read(name), r.read(name + "_scale_inv"))

    np.testing.assert_array_equal(deq(b), deq(a))
    assert a.read(name).dtype == ml_dtypes.float8_e4m3fn and math.prod(a.read(name).shape) > 0


def test_generate_cli_weights_flag():
    # the built-in m3-small is MXFP8: generated from weights held as such (token equality with the
    # dequantised model is the logits tests' business), the plan counting what is held
    from m3jax import generate

    mx = generate.main(["--ctx", "128", "--max-new-tokens", "3", "--temperature", "0", "--prompt-ids", "5,6,7,8,9",
                        "--quiet", "--weights", "mxfp8"])
    assert len(mx["generated_ids"]) == 3
    cfg = m3jax.load_config(generate.DEFAULT_CHECKPOINT)
    dtype_bytes = jnp.dtype(mx["dtype"]).itemsize
    assert mx["memory_plan_per_device"]["weights_bytes"] == memory.weight_bytes(cfg, dtype_bytes, "mxfp8")
    assert memory.weight_bytes(cfg, dtype_bytes, "mxfp8") < 0.8 * memory.weight_bytes(cfg, dtype_bytes)
