"""m3jax.selfcheck: verdict keys and the JSON cache, the fallback of a failing kernel (fake kernel /
reference pairs standing in for a GPU), the comparison rules, and one real canary in interpret mode."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import selfcheck
from m3jax.pallas import _backend

FAKE_GPU = {"device": "NVIDIA B200 (sm_100)", "target": "sm_100a"}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake kernel "fake" on a fake GPU, its verdicts in tmp_path; ``fake.out`` is what the kernel
    returns (the reference returns [1, 2, 3]); ``fake.runs`` counts canary runs."""
    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(selfcheck, "_MEMO", {})
    monkeypatch.setattr(selfcheck, "_WARNED", set())
    monkeypatch.setattr(selfcheck, "_SOURCE_HASHES", {})
    dev = dict(FAKE_GPU)
    monkeypatch.setattr(selfcheck, "device_key", lambda: dict(dev))
    src = tmp_path / "fake_kernel.py"
    src.write_text("# version 1\n")

    class State:
        runs = 0
        out = jnp.array([1.0, 2.0, 3.0])
        device = dev
        source = src

    def run():
        State.runs += 1
        if isinstance(State.out, Exception):
            raise State.out
        return State.out + 0, jnp.array([1.0, 2.0, 3.0])  # binds a primitive: a tracer inside a trace

    monkeypatch.setitem(selfcheck.CANARIES, "fake", selfcheck.Canary("fake", run, (src,), 1e-3))
    return State


def test_verdict_cached_per_device_jax_and_source(fake, monkeypatch):
    assert selfcheck.check("fake").passed and fake.runs == 1
    assert selfcheck.check("fake").passed and fake.runs == 1  # this process's memo
    monkeypatch.setattr(selfcheck, "_MEMO", {})
    v = selfcheck.check("fake")  # a new process: the JSON file
    assert v.passed and v.cached and v.target == "sm_100a" and fake.runs == 1
    entries = json.loads(selfcheck.cache_path().read_text())["verdicts"]
    assert len(entries) == 1 and "NVIDIA B200 (sm_100)" in next(iter(entries))

    fake.source.write_text("# version 2\n")  # the kernel's source changed, seen by a new process
    monkeypatch.setattr(selfcheck, "_MEMO", {})
    monkeypatch.setattr(selfcheck, "_SOURCE_HASHES", {})
    assert not selfcheck.check("fake").cached and fake.runs == 2
    fake.device["device"] = "NVIDIA H200 (sm_90)"  # another GPU
    selfcheck.check("fake")
    assert fake.runs == 3
    monkeypatch.setattr(jax, "__version__", "0.0.1")  # another JAX
    selfcheck.check("fake")
    assert fake.runs == 4
    selfcheck.check("fake", force=True)
    assert fake.runs == 5
    assert len(json.loads(selfcheck.cache_path().read_text())["verdicts"]) == 4


def test_failing_canary_is_not_used_and_warns_once(fake, monkeypatch):
    fake.out = jnp.array([1.0, 2.5, 3.0])
    with pytest.warns(RuntimeWarning, match=r"the fake kernel failed its self-check on NVIDIA B200.*max \|error\| 0\.5"):
        reason = selfcheck.kernel_failure("fake")
    assert "fake" in reason and "0.5" in reason
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert selfcheck.kernel_failure("fake") == reason  # no second warning, no rerun
    assert fake.runs == 1

    # A kernel that raises (e.g. ptxas refusing an instruction) fails with the error's first line.
    fake.out = RuntimeError("ptxas: wgmma not supported on sm_100a\nmore")
    v = selfcheck.check("fake", force=True)
    assert not v.passed and v.error == "RuntimeError: ptxas: wgmma not supported on sm_100a"


def test_model_hooks_fall_back(fake, monkeypatch):
    from m3jax import moe
    from m3jax.msa import kernels
    from tests.conftest import tiny_text

    fake.out = jnp.array([0.0, 0.0, 0.0])
    monkeypatch.setitem(selfcheck.CANARIES, "grouped_matmul", selfcheck.CANARIES["fake"])
    monkeypatch.setattr(selfcheck, "MSA_PREFILL_KERNELS", ("fake",))
    monkeypatch.setattr(selfcheck, "MSA_DECODE_KERNELS", ("fake",))
    monkeypatch.setattr(_backend, "on_gpu", lambda: True)
    x, w = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="grouped_matmul kernel failed"):
        assert moe.resolve_moe_impl("auto", x, w) == "ragged_dot"
    with pytest.raises(ValueError, match="grouped_matmul kernel failed its self-check"):
        moe.resolve_moe_impl("pallas", x, w)
    cfg = tiny_text(num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_head_dim=64,
                    index_block_size=64)
    with pytest.warns(RuntimeWarning, match="fake kernel failed"):
        assert "fake kernel failed" in kernels.unsupported_reason(cfg)
    assert "fake kernel failed" in kernels.decode_unsupported_reason(cfg)  # warned once already


def test_off_gpu_nothing_is_checked(fake, monkeypatch):
    monkeypatch.setattr(selfcheck, "device_key", lambda: {"device": "cpu interpret", "target": "interpret"})
    fake.out = jnp.zeros(3)
    assert selfcheck.kernel_failure("fake") is None and fake.runs == 0


def test_unreadable_cache_is_rewritten(fake):
    selfcheck.cache_path().parent.mkdir(parents=True)
    selfcheck.cache_path().write_text("{not json")
    assert selfcheck.check("fake").passed and fake.runs == 1
    assert len(json.loads(selfcheck.cache_path().read_text())["verdicts"]) == 1


def test_compare_rules():
    inf = -np.inf
    assert selfcheck.compare(np.array([inf, 1.0]), np.array([inf, 1.0001]), 2e-4)[0]
    ok, err, why = selfcheck.compare(np.array([0.0, 1.0], np.float32), np.array([inf, 1.0], np.float32), 2e-4)
    assert not ok and "-inf" in why
    assert not selfcheck.compare(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), 1.0)[0]
    ok, err, why = selfcheck.compare(np.array([3, 1, -1], np.int32), np.array([1, 3, -1], np.int32), None)
    assert not ok and err == 2 and "2 of 3" in why
    assert not selfcheck.compare(np.zeros(3, np.int32), np.zeros(3, np.float32), None)[0]  # dtypes differ


def test_cli_runs_a_real_canary_in_interpret_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(selfcheck, "_MEMO", {})
    out = tmp_path / "selfcheck.out.json"
    assert selfcheck.main(["--kernels", "decode_index_scores", "--json", str(out)]) == 0
    (v,) = json.loads(out.read_text())["verdicts"]
    assert v["kernel"] == "decode_index_scores" and v["target"] == "interpret" and v["passed"]
    assert v["max_error"] <= 2e-4
    table = capsys.readouterr().out
    assert "decode_index_scores" in table and "pass" in table


def test_canary_runs_eagerly_when_asked_inside_a_jit_trace(fake):
    # The model asks while tracing (moe.resolve_moe_impl runs inside the jitted forward): the canary
    # runs in its own thread, outside the trace, on concrete arrays.
    seen = []

    def f(x):
        seen.append(selfcheck.kernel_failure("fake"))
        return x + 1

    jax.jit(f).trace(jnp.zeros(3))
    assert seen == [None] and fake.runs == 1


def test_canaries_run_the_blackwell_variants_on_blackwell(monkeypatch):
    # On a Blackwell GPU the canaries go through the same public functions as the model, so they test
    # the tcgen05 variants the target selects: here the MSA kernels with one, as built for sm_100a in
    # interpret mode (the decode index scoring and the grouped GEMM have their own interpret tests).
    from m3jax.pallas.decode import blackwell as decode_bw
    from m3jax.pallas.index_scores import blackwell as index_bw
    from m3jax.pallas.sparse_attention import blackwell as attention_bw

    ran = set()
    for module, name in [(index_bw, "tcgen05_row_max"), (attention_bw, "tcgen05_tile"),
                         (decode_bw, "sparse_decode_attention_tcgen05")]:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _f=fn, **kw: ran.add(_n) or _f(*a, **kw))
    dev = {"device": "cpu interpret", "target": "interpret"}
    with _backend.interpret_as(_backend.BLACKWELL):
        for kernel in ("index_scores", "sparse_attention_kv_major", "sparse_decode_attention"):
            verdict = selfcheck.run_canary(selfcheck.CANARIES[kernel], dev)
            assert verdict.passed, verdict
    assert ran == {"tcgen05_row_max", "tcgen05_tile", "sparse_decode_attention_tcgen05"}
