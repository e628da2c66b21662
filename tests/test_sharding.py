"""Sharding: rule table, partial checkpoint reads, the 8-device plan (and the generate CLI's, equal to it),
and (in a subprocess with 8 simulated CPU devices, tests/multidevice/sharding_checks.py) sharded forward /
greedy decode equal to one device, sharded loading equal to unsharded loading, resident bytes equal to the
plan, the prefill and decode kernels context parallel, ``python -m m3jax.generate`` on 8 and 2 devices and
on a 2 x 4 data x model mesh token for token equal to 1, the exported-program cache under a mesh (a second
engine reads the programs back without tracing, same tokens), and the probe on a mesh equal to 1 device."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import m3jax
from m3jax import plan as plan_cli
from m3jax import sharding as sh
from m3jax.checkpoint import CheckpointReader, _convert, read_entry_shard, tensor_plan
from m3jax.config import preset
from tests.conftest import MULTIDEVICE_RUN, MultideviceRun, tiny_config


class FakeMesh:
    """Only ``.shape`` is read by the spec functions: lets one process reason about an 8-device mesh."""

    def __init__(self, **shape):
        self.shape = shape


def test_rules_cover_every_param_and_never_collide():
    for cfg in (tiny_config(vision=True), preset("minimax_m3")):
        for n in (1, 2, 4, 8):
            sh.validate_rules(cfg, FakeMesh(data=1, model=n))  # raises on collision / unknown axis


def test_m3_specs_on_8():
    mesh = FakeMesh(data=1, model=8)
    specs = sh.param_partition_specs(preset("minimax_m3"), mesh)
    layer = specs["text"]["layers"][10]
    assert specs["text"]["embed"] == P("model", None) and specs["text"]["lm_head"] == P(None, "model")
    assert layer["attn"]["wq"] == P(None, "model", None) and layer["attn"]["wo"] == P("model", None, None)
    assert layer["attn"]["wk"] == P(None, None, None)  # 4 KV heads do not split 8 ways: replicated
    assert layer["moe"]["gate"] == P("model", None, None) and layer["moe"]["router"] == P(None, None)
    assert layer["moe"]["shared"]["down"] == P("model", None)
    notes = sh.validate_rules(preset("minimax_m3"), mesh)
    assert notes == ["kv_heads=4 replicated (mesh axes ('model',) of size 8 do not divide it)"]
    assert sh.param_partition_specs(preset("minimax_m3"), FakeMesh(data=1, model=4))["text"]["layers"][0]["attn"][
        "wk"] == P(None, "model", None)


def test_collision_and_unknown_axis_are_errors():
    mesh = FakeMesh(data=2, model=4)
    with pytest.raises(sh.ShardingRuleError, match="both map to mesh axis 'model'"):
        sh.spec_for(("q_heads", "mlp"), (8, 8), mesh)
    with pytest.raises(sh.ShardingRuleError, match="no rule"):
        sh.spec_for(("nonsense",), (8,), mesh)
    bad = sh.RULES + (("embed", "model"),)  # a later entry wins in the table: embed -> model
    with pytest.raises(sh.ShardingRuleError):
        sh.spec_for(("embed", "q_heads", "head_dim"), (8, 8, 8), mesh, bad)
    assert sh.spec_for(("tokens", "act_embed"), (16, 8), mesh) == P(("data", "model"), None)
    assert sh.spec_for(("tokens", "act_embed"), (6, 8), mesh) == P(None, None)  # 6 % 8: replicated


def test_striped_page_table_is_a_permutation():
    t = sh.striped_page_table(3, 8, 4)
    assert sorted(t.reshape(-1).tolist()) == list(range(24))
    per = 24 // 4
    assert all(t[b, j] // per == j % 4 for b in range(3) for j in range(8))


@pytest.mark.parametrize("quant", [False, True])
def test_read_entry_shard_equals_slice_of_full_read(tmp_path, quant):
    cfg = tiny_config(num_attention_heads=8, num_key_value_heads=2, index_n_heads=2, num_local_experts=8,
                      intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32, vocab_size=96)
    model = m3jax.init_random(cfg, seed=5)
    m3jax.save_pretrained(model, tmp_path, max_shard_bytes=30_000, quantize_mxfp8_weights=quant)
    reader = CheckpointReader(tmp_path)
    rng = np.random.default_rng(0)
    for e in tensor_plan(cfg):
        full, _ = _convert(reader, e, np.dtype(np.float32))
        for _ in range(3):
            index = []
            for d in e.spec.shape:  # a random contiguous range on one axis, whole elsewhere
                index.append(slice(None))
            ax = int(rng.integers(len(e.spec.shape)))
            d = e.spec.shape[ax]
            lo = int(rng.integers(d))
            index[ax] = slice(lo, int(rng.integers(lo + 1, d + 1)))
            got, used = read_entry_shard(reader, e, tuple(index), np.dtype(np.float32))
            np.testing.assert_array_equal(got, full[tuple(index)], err_msg=f"{e.path} {index}")
            if e.kind == "experts" and ax == 0:
                assert len([u for u in used if not u.endswith("_scale_inv")]) == index[0].stop - index[0].start


def test_plan_cli_m3_on_8_gpus(capsys):
    rows = {}
    for hbm in (192, 141):
        for dt in ("bfloat16", "mxfp8"):
            r = plan_cli.main(["--config", "minimax_m3", "--devices", "8", "--hbm-gb", str(hbm), "--ctx", "1000000",
                               "--dtype", dt])
            rows[hbm, dt] = r
    out = capsys.readouterr().out
    assert "fits" in out
    # weights: experts 57 layers x 128 x 3 x 6144 x 3072 split 8 ways dominate
    assert 100e9 < rows[192, "bfloat16"]["weights"] < 112e9
    assert 50e9 < rows[192, "mxfp8"]["weights"] < 62e9
    # KV (60 layers x 2 x 4 x 128) + index (57 x 128) per token at 1M, pages split 8 ways
    assert rows[192, "bfloat16"]["kv_cache"] == pytest.approx(1000448 * 60 * 2 * 4 * 128 * 2 / 8)
    assert rows[192, "bfloat16"]["index_cache"] == pytest.approx(1000448 * 57 * 128 * 2 / 8)
    assert rows[192, "bfloat16"]["fits"] and rows[192, "mxfp8"]["fits"] and rows[141, "mxfp8"]["fits"]
    assert not rows[141, "bfloat16"]["fits"] and 800_000 < rows[141, "bfloat16"]["max_ctx"] < 1_000_000


@pytest.mark.parametrize("hbm", [141, 192])
@pytest.mark.parametrize("dtype", ["bfloat16", "mxfp8"])
def test_generate_plan_equals_plan_cli(capsys, hbm, dtype):
    """The generate CLI's per-device plan (generate.device_plan, what it checks on more than one device)
    and ``python -m m3jax.plan`` give the same numbers for the released config at 1M tokens on 8 devices.
    (The CLI itself is run against the plan on 8 simulated devices: check ``generate_plan``.)"""
    from m3jax import generate

    want = plan_cli.main(["--config", "m3", "--devices", "8", "--hbm-gb", str(hbm), "--ctx", "1000000",
                          "--dtype", dtype, "--chunk", "8192"])
    got = generate.device_plan(preset("m3"), ctx=1_000_000, devices=8, budget_bytes=hbm * 1e9, chunk=8192, dtype=dtype)
    for key in ("weights", "kv_cache", "index_cache", "activations", "workspace", "total", "fits", "max_ctx"):
        assert got.get(key) == want.get(key), key


@pytest.fixture(scope="module")
def multidevice_results(request):
    """The checks' results: started by conftest right after collection, so they run beside the tests
    that come before this one; here they are waited for."""
    run = request.config.stash.get(MULTIDEVICE_RUN, None)
    if run is None:  # not started at collection (the fixture reached some other way): start it now
        run = request.config.stash[MULTIDEVICE_RUN] = MultideviceRun()
    return run.results()


@pytest.mark.parametrize("check", ["forward_divisible", "forward_replicated", "forward_mixed_4", "engine_divisible",
                                   "engine_replicated", "engine_data", "aot_mesh", "loading", "context_parallel", "pallas_mesh",
                                   "pallas_cuda_lowering", "decode_kernels", "prefill_kernels", "generate_cli",
                                   "generate_plan", "engine_pallas", "probe_mesh", "nnx_shardings"])
def test_on_8_cpu_devices(multidevice_results, check):
    r = multidevice_results.get(check)
    assert r is not None, f"check {check} did not report"
    assert r["ok"], json.dumps(r["detail"], indent=1, default=str)


def test_this_process_is_left_alone(multidevice_results):
    """The 8 devices live in the subprocess only: this process's environment and CPU count are unchanged."""
    assert "device_count=8" not in os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        assert len(jax.devices("cpu")) == 1
