"""The self-check (m3jax.pallas.verdicts, m3jax.selfcheck): verdict keys and the JSON cache, the fallback
of a failing kernel (fake kernel / reference pairs standing in for a GPU), a canary that hangs in its
worker process, targets the kernels refuse, the comparison rules, and real canaries in interpret mode.
All of it describes a CPU machine standing in for a GPU (device_key / on_gpu patched)."""

from __future__ import annotations

import json
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from m3jax import selfcheck
from m3jax.pallas import _backend, canaries, verdicts
from tests import selfcheck_canaries

FAKE_GPU = {"device": "NVIDIA B200 (sm_100)", "target": "sm_100a", "driver": "cuda 13000"}


@pytest.fixture
def gpu(tmp_path, monkeypatch):
    """A fake GPU (its device key) with its verdicts in tmp_path and a fresh process state."""
    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(verdicts, "_MEMO", {})
    monkeypatch.setattr(verdicts, "_IN_FLIGHT", {})
    monkeypatch.setattr(verdicts, "_WARNED", set())
    monkeypatch.setattr(verdicts, "_SOURCE_HASHES", {})
    dev = dict(FAKE_GPU)
    monkeypatch.setattr(verdicts, "device_key", lambda: dict(dev))
    # The override, not a patched current_target: kernel modules import that function by name, and one
    # first imported under the patch would keep the fake target for the rest of the session.
    monkeypatch.setattr(_backend, "_target_override", _backend.BLACKWELL)
    return dev


@pytest.fixture
def fake(gpu, tmp_path, monkeypatch):
    """A fake kernel "fake" (one path, "p") run in this process; ``fake.out`` is what the kernel returns
    (the reference returns [1, 2, 3]); ``fake.runs`` counts canary runs."""
    monkeypatch.setattr(verdicts, "run_isolated", lambda cs, dev: [verdicts.run_canary(c, dev) for c in cs])
    src = tmp_path / "fake_kernel.py"
    src.write_text("# version 1\n")

    class State:
        runs = 0
        out = jnp.array([1.0, 2.0, 3.0])
        device = gpu
        source = src

    def run():
        State.runs += 1
        if isinstance(State.out, Exception):
            raise State.out
        return State.out, jnp.array([1.0, 2.0, 3.0])

    monkeypatch.setitem(canaries.TOLERANCES, "fake", 1e-3)
    monkeypatch.setitem(canaries.CANARIES, "fake@p", canaries.Canary("fake", "p", run, (src,)))
    return State


def _fresh_process(monkeypatch):
    monkeypatch.setattr(verdicts, "_MEMO", {})
    monkeypatch.setattr(verdicts, "_SOURCE_HASHES", {})


def test_verdict_cached_per_device_driver_jax_and_source(fake, monkeypatch):
    (c,) = canaries.of_kernel("fake")
    assert verdicts.check([c])[0].passed and fake.runs == 1
    assert verdicts.check([c])[0].passed and fake.runs == 1  # this process's memo
    _fresh_process(monkeypatch)
    (v,) = verdicts.check([c])  # a new process: the JSON file
    assert v.passed and v.cached and v.target == "sm_100a" and v.canary == "fake@p" and fake.runs == 1
    entries = json.loads(verdicts.cache_path().read_text())["verdicts"]
    assert len(entries) == 1 and "NVIDIA B200 (sm_100)" in next(iter(entries))

    fake.source.write_text("# version 2\n")  # the kernel's source changed, seen by a new process
    _fresh_process(monkeypatch)
    assert not verdicts.check([c])[0].cached and fake.runs == 2
    for field, value in (("device", "NVIDIA H200 (sm_90)"), ("driver", "cuda 13010")):  # another GPU, driver
        fake.device[field] = value
        verdicts.check([c])
    assert fake.runs == 4
    monkeypatch.setattr(jax, "__version__", "0.0.1")  # another JAX
    verdicts.check([c])
    assert fake.runs == 5
    verdicts.check([c], force=True)
    assert fake.runs == 6
    assert len(json.loads(verdicts.cache_path().read_text())["verdicts"]) == 5


def test_failing_canary_is_not_used_and_warns_once(fake):
    fake.out = jnp.array([1.0, 2.5, 3.0])
    with pytest.warns(RuntimeWarning, match=r"the fake kernel failed its self-check at fake@p on NVIDIA B200.*0\.5"):
        reason = verdicts.kernel_failure("fake")
    assert "fake@p" in reason and "0.5" in reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verdicts.kernel_failure("fake") == reason  # no second warning, no rerun
    assert fake.runs == 1

    # A kernel that raises (e.g. ptxas refusing an instruction) fails with the error's first line.
    fake.out = RuntimeError("ptxas: wgmma not supported on sm_100a\nmore")
    (v,) = verdicts.check(canaries.of_kernel("fake"), force=True)
    assert v.status == "fail" and v.error == "RuntimeError: ptxas: wgmma not supported on sm_100a"


def _held(fake, monkeypatch):
    """Hold the fake kernel's canary until the returned event is set (a canary still running)."""
    import threading

    release = threading.Event()
    run = canaries.CANARIES["fake@p"].run

    def held():
        assert release.wait(30), "the test never released the canary"
        return run()

    monkeypatch.setitem(canaries.CANARIES, "fake@p", canaries.Canary("fake", "p", held, (fake.source,)))
    return release


def test_a_background_batch_is_presumed_until_confirmed(fake, monkeypatch):
    # A first run's canaries beside its compile: the model's questions presume they pass while the batch
    # runs (nothing waits, nothing runs twice); confirm() waits for the verdicts, which are then cached.
    release = _held(fake, monkeypatch)
    batch = verdicts.check_kernels({"fake": None}, wait=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert verdicts.kernel_failure("fake") is None  # presumed: the canary is held
    assert not batch._future.done()
    release.set()
    batch.confirm()
    (v,) = batch.wait()
    assert v.canary == "fake@p" and v.passed and not v.cached and fake.runs == 1
    assert batch.seconds > 0 and batch.wait_s >= 0
    assert verdicts.check_kernels({"fake": None}, wait=False).wait() == []  # read back: nothing to run
    assert verdicts.kernel_failure("fake") is None and fake.runs == 1


def test_a_background_canary_that_fails_is_raised_at_confirm(fake, monkeypatch):
    fake.out = jnp.array([1.0, 2.5, 3.0])
    release = _held(fake, monkeypatch)
    batch = verdicts.check_kernels({"fake": None}, wait=False)
    assert verdicts.kernel_failure("fake") is None  # what a trace meanwhile sees: presumed
    release.set()
    (v,) = verdicts.check(canaries.of_kernel("fake"))  # a question that does not presume waits for the batch
    assert v.status == "fail" and fake.runs == 1
    with pytest.raises(verdicts.CanaryFailed, match=r"fake@p fail") as e:
        batch.confirm()
    assert [f.canary for f in e.value.failed] == ["fake@p"]
    with pytest.warns(RuntimeWarning, match="the fake kernel failed its self-check"):
        assert "fake@p" in verdicts.kernel_failure("fake")  # the retrace reads the verdict
    assert fake.runs == 1


def test_a_path_the_target_lacks_is_not_presumed(fake, monkeypatch):
    c = canaries.CANARIES["fake@p"]
    monkeypatch.setitem(canaries.CANARIES, "fake@p", canaries.Canary("fake", "p", c.run, c.sources,
                                                                     unsupported=lambda: "no such path here"))
    batch = verdicts.check_kernels({"fake": None}, wait=False)
    assert batch.wait() == [] and fake.runs == 0
    with pytest.warns(RuntimeWarning, match="no path at fake@p"):
        assert "no such path here" in verdicts.kernel_failure("fake")


def test_model_hooks_fall_back(fake, monkeypatch):
    from m3jax import moe
    from m3jax.msa import kernels
    from tests.conftest import tiny_text

    fake.out = jnp.array([0.0, 0.0, 0.0])
    monkeypatch.setattr(canaries, "of_kernel", lambda kernel: [canaries.CANARIES["fake@p"]])  # every kernel is fake
    monkeypatch.setattr(verdicts, "of_kernel", canaries.of_kernel)
    monkeypatch.setattr(_backend, "on_gpu", lambda: True)
    x, w = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="grouped_matmul kernel failed"):
        assert moe.resolve_moe_impl("auto", x, w) == "ragged_dot"
    with pytest.raises(ValueError, match="grouped_matmul kernel failed its self-check"):
        moe.resolve_moe_impl("pallas", x, w)
    cfg = tiny_text(num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_head_dim=64,
                    index_block_size=64)
    with pytest.warns(RuntimeWarning, match="index_scores kernel failed"):
        assert "index_scores kernel failed" in kernels.unsupported_reason(cfg)
    with pytest.warns(RuntimeWarning, match="decode_index_scores kernel failed"):
        assert "decode_index_scores kernel failed" in kernels.decode_unsupported_reason(cfg)


def test_a_failing_path_bans_only_that_path(gpu, monkeypatch):
    # The real MSA kernels' canaries, their runs replaced by stand-ins (test-only): every path agrees
    # with its reference but the decode index scoring's M3 path (M = 128, block 128). The model then
    # keeps the decode kernels at block 64 and falls back where it would take that path, block 128.
    import dataclasses

    from m3jax.msa import kernels
    from tests.conftest import tiny_text

    monkeypatch.setattr(verdicts, "run_isolated", lambda cs, dev: [verdicts.run_canary(c, dev) for c in cs])
    agrees = lambda: (jnp.ones(3), jnp.ones(3))  # noqa: E731
    broken = "decode_index_scores@b128-m128-n8"
    for name, c in list(canaries.CANARIES.items()):
        if c.kernel in canaries.MSA_DECODE_KERNELS + canaries.MSA_PREFILL_KERNELS:
            run = (lambda: (jnp.zeros(3), jnp.ones(3))) if name == broken else agrees
            monkeypatch.setitem(canaries.CANARIES, name, dataclasses.replace(c, run=run))
    assert [c.name for c in canaries.paths_for("decode_index_scores", 64)] == ["decode_index_scores@b64-m64"]
    assert [c.name for c in canaries.paths_for("decode_index_scores", 192)] == ["decode_index_scores@b64-m64"]
    assert [c.name for c in canaries.paths_for("decode_index_scores", 256)] == [broken]
    assert len(canaries.paths_for("decode_index_scores")) == 2

    def cfg(bs):
        return tiny_text(num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_head_dim=64,
                         index_block_size=bs)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.decode_unsupported_reason(cfg(64)) is None
        assert kernels.unsupported_reason(cfg(64)) is None and kernels.unsupported_reason(cfg(128)) is None
    with pytest.warns(RuntimeWarning, match=f"decode_index_scores kernel failed its self-check at {broken}.*"
                                            "not used at that path"):
        assert broken in kernels.decode_unsupported_reason(cfg(128))
    assert broken in verdicts.kernel_failure("decode_index_scores")  # a caller that names no block: every path
    assert verdicts.kernel_failure("decode_index_scores", block_size=64) is None


def test_the_fp8_indexer_decode_asks_its_own_canary(gpu, monkeypatch):
    # As above on an H100 stand-in, the canaries' runs replaced by stand-ins: every path agrees but the
    # fp8 indexer's decode scoring at M3's path. The bf16 indexer keeps its decode kernels at block 128;
    # the fp8 indexer over an fp8 index cache does not take them there (and does at block 64).
    import dataclasses

    from m3jax.cache import FP8_NAME
    from m3jax.msa import kernels
    from tests.conftest import tiny_text

    gpu.update(device="NVIDIA H100 (sm_90)", target="sm_90a")
    monkeypatch.setattr(_backend, "_target_override", _backend.HOPPER)
    monkeypatch.setattr(verdicts, "run_isolated", lambda cs, dev: [verdicts.run_canary(c, dev) for c in cs])
    broken = "decode_index_scores_fp8@b128-m128-n8"
    for name, c in list(canaries.CANARIES.items()):
        run = (lambda: (jnp.zeros(3), jnp.ones(3))) if name == broken else (lambda: (jnp.ones(3), jnp.ones(3)))
        monkeypatch.setitem(canaries.CANARIES, name, dataclasses.replace(c, run=run))

    def cfg(bs, **kw):
        return tiny_text(num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_head_dim=64,
                         index_block_size=bs, **kw)

    fp8 = dict(index_score_dtype=FP8_NAME, index_cache_dtype=FP8_NAME)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.decode_unsupported_reason(cfg(128)) is None
        assert kernels.decode_unsupported_reason(cfg(64, **fp8)) is None
    with pytest.warns(RuntimeWarning, match=f"decode_index_scores_fp8 kernel failed its self-check at {broken}"):
        assert broken in kernels.decode_unsupported_reason(cfg(128, **fp8))


def test_a_path_the_target_lacks_is_na(gpu, monkeypatch, tmp_path, capsys):
    # The fp8 indexer's decode scoring has no tcgen05 path: on the (fake) B200 its canaries do not run
    # and their verdicts are "n/a", which the command line does not count as a failure but which keeps
    # the kernel unused (the model refuses that config there before it asks).
    monkeypatch.setattr(verdicts, "run_isolated", lambda cs, dev: [verdicts.run_canary(c, dev) for c in cs])
    out = tmp_path / "v.json"
    assert selfcheck.main(["--kernels", "decode_index_scores_fp8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["verdicts"]
    assert [(r["status"], r["max_error"]) for r in rows] == [("n/a", None), ("n/a", None)]
    assert all("no e4m3 x e4m3 path" in r["error"] for r in rows)
    assert "n/a" in capsys.readouterr().out
    with pytest.warns(RuntimeWarning, match="decode_index_scores_fp8 kernel has no path at .* on NVIDIA B200"):
        assert "no e4m3 x e4m3 path" in verdicts.kernel_failure("decode_index_scores_fp8", block_size=128)


def test_hung_canary_is_killed_at_its_deadline_and_the_kernel_not_used(gpu, monkeypatch):
    # The real worker process: its first canary passes, the second one sleeps past a 3 s deadline (the
    # worker is killed), the third, in a new worker, ends its process. The model asks while tracing
    # (moe.resolve_moe_impl runs inside the jitted forward): the worker runs outside the trace.
    monkeypatch.setenv("M3JAX_SELFCHECK_DEADLINE", "3")
    for name, c in selfcheck_canaries.CANARIES.items():
        monkeypatch.setitem(canaries.CANARIES, name, c)
    seen = []

    def f(x):
        seen.append(verdicts.kernel_failure("hang_test"))
        return x + 1

    t0 = time.perf_counter()
    hung_warning = r"hang_test kernel hung in its self-check at hang_test@sleeps .*3 s deadline"
    with pytest.warns(RuntimeWarning, match=hung_warning):
        jax.jit(f).trace(jnp.zeros(3))
    elapsed = time.perf_counter() - t0
    assert "hung" in seen[0] and elapsed < 3 + 2 * verdicts._STARTUP_S
    ok, hung, died = verdicts.check(canaries.of_kernel("hang_test"))  # this process's memo: nothing runs again
    assert (ok.status, hung.status, died.status) == ("pass", "hung", "fail") and 3 <= hung.seconds < 10
    assert "worker process ended" in died.error
    stored = json.loads(verdicts.cache_path().read_text())["verdicts"]
    assert sorted(v["status"] for v in stored.values()) == ["fail", "hung", "pass"]


def test_canaries_run_side_by_side_and_a_hung_one_ends_only_its_worker(gpu, monkeypatch, tmp_path):
    # Two worker slots share eight canaries: the hung one is killed at its 3 s deadline, the one that
    # ends its process fails and so does the one whose report does not parse, each taking only its own
    # worker down; every other canary passes, in a worker of one of the two slots, and the verdicts
    # come back in the order asked.
    monkeypatch.setenv("M3JAX_SELFCHECK_DEADLINE", "3")
    monkeypatch.setenv("M3JAX_TEST_PID_DIR", str(tmp_path))
    for name, c in selfcheck_canaries.CANARIES.items():
        monkeypatch.setitem(canaries.CANARIES, name, c)
    side = selfcheck_canaries.SIDE_BY_SIDE
    asked = [*side[:2], *canaries.of_kernel("hang_test"), selfcheck_canaries.GARBLED, *side[2:]]
    got = verdicts.run_isolated(asked, verdicts.device_key(), workers=2)
    assert [v.canary for v in got] == [c.name for c in asked]
    assert [v.status for v in got] == ["pass", "pass", "pass", "hung", "fail", "fail", "pass", "pass"], got
    assert "did not parse" in got[5].error, got[5]
    pids = {p.read_text() for p in tmp_path.glob("*.pid")}
    assert len(list(tmp_path.glob("*.pid"))) == 4 and 2 <= len(pids) <= 4, pids


def test_long_canaries_start_first(gpu, monkeypatch, tmp_path):
    # One worker slot: the two long canaries run before the others, and the verdicts still come back in
    # the order asked.
    monkeypatch.setenv("M3JAX_TEST_PID_DIR", str(tmp_path))
    asked = selfcheck_canaries.IN_TURN
    got = verdicts.run_isolated(asked, verdicts.device_key(), workers=1)
    assert [v.canary for v in got] == [c.name for c in asked] and all(v.passed for v in got), got
    ran = [p.name.split("-")[1] for p in sorted(tmp_path.iterdir(), key=lambda p: int(p.name.split("-")[0]))]
    assert ran == ["c2", "c3", "c0", "c1"], ran


def test_one_batch_ahead_holds_every_verdict_the_model_asks_for(gpu, monkeypatch):
    # An H100 stand-in whose canaries all agree: check_kernels_ahead runs the prefill, decode and
    # grouped-GEMM canaries of the config's paths in one batch; afterwards the model's own questions
    # (made while tracing) run nothing. A config that takes no kernel asks for nothing.
    import dataclasses

    from m3jax.model import check_kernels_ahead
    from m3jax.msa import kernels
    from tests.conftest import tiny_config

    gpu.update(device="NVIDIA H100 (sm_90)", target="sm_90a")
    monkeypatch.setattr(_backend, "_target_override", _backend.HOPPER)
    for name, c in list(canaries.CANARIES.items()):
        monkeypatch.setitem(canaries.CANARIES, name, dataclasses.replace(c, run=lambda: (jnp.ones(3), jnp.ones(3))))
    batches = []

    def run_isolated(cs, dev):
        batches.append([c.name for c in cs])
        return [verdicts.run_canary(c, dev) for c in cs]

    monkeypatch.setattr(verdicts, "run_isolated", run_isolated)
    cfg = tiny_config(num_attention_heads=16, num_key_value_heads=2, head_dim=64, index_head_dim=64,
                      index_block_size=128)
    got = check_kernels_ahead(cfg)
    assert len(batches) == 1 and [v.canary for v in got] == batches[0]
    wanted = {c.name for k in (*kernels.canary_kernels(cfg.text), "grouped_matmul")
              for c in canaries.paths_for(k, None if k == "grouped_matmul" else 128)}
    assert set(batches[0]) == wanted and all(v.passed for v in got)
    assert any(k.startswith("decode_index_scores@") for k in batches[0]), batches[0]

    monkeypatch.setattr(verdicts, "run_isolated", lambda *a: pytest.fail(f"a canary ran again: {a[0]}"))
    assert kernels.unsupported_reason(cfg.text) is None and kernels.decode_unsupported_reason(cfg.text) is None
    assert verdicts.kernel_failure("grouped_matmul") is None  # what the MoE asks (m3jax.moe.resolve_moe_impl)
    assert check_kernels_ahead(cfg.replace(attention_impl="reference", moe_impl="ragged_dot")) == []


def test_worker_count_setting(monkeypatch, capsys):
    monkeypatch.setenv("M3JAX_SELFCHECK_WORKERS", "3")
    assert verdicts.canary_workers() == 3
    monkeypatch.setenv("M3JAX_SELFCHECK_WORKERS", "0")
    with pytest.raises(ValueError, match="M3JAX_SELFCHECK_WORKERS"):
        verdicts.canary_workers()
    # Both commands refuse it in one line before anything runs (on a GPU it is read only once canaries run).
    from m3jax import cli, generate

    with pytest.raises(SystemExit):
        selfcheck.main(["--kernels", "topk_blockmajor"])
    assert "M3JAX_SELFCHECK_WORKERS='0' must be >= 1" in capsys.readouterr().err
    with pytest.raises(cli.UsageError, match="M3JAX_SELFCHECK_WORKERS"):
        generate.main(["--max-new-tokens", "1"])


def test_refused_targets(gpu, monkeypatch):
    assert _backend.target_of("9.0") is _backend.HOPPER
    assert _backend.target_of("10.0") is _backend.BLACKWELL and _backend.target_of("10.3") is _backend.BLACKWELL
    sm120 = _backend.target_of("12.0")
    assert sm120.mma == "none" and sm120.smem_bytes < 102_400 and "neither wgmma nor tcgen05" in sm120.refused
    future = _backend.target_of("11.0")
    assert future.name == "sm_110" and "compute capability 11.0 is not a target" in future.refused

    monkeypatch.setattr(_backend, "_target_override", sm120)
    monkeypatch.setattr(verdicts, "run_isolated", lambda *a: pytest.fail("no canary runs on a refused target"))
    with pytest.warns(RuntimeWarning, match="kernels are not used on NVIDIA B200.*neither wgmma nor tcgen05"):
        assert "neither wgmma" in verdicts.kernel_failure("grouped_matmul")
    assert "neither wgmma" in verdicts.kernel_failure("index_scores")  # warned once


def test_off_gpu_nothing_is_checked(fake, monkeypatch):
    monkeypatch.setattr(verdicts, "device_key", lambda: {"device": "cpu interpret", "target": "interpret"})
    fake.out = jnp.zeros(3)
    assert verdicts.kernel_failure("fake") is None and fake.runs == 0


@pytest.mark.parametrize("text", ["{not json", '{"verdicts": {"a": 1', '{"verdicts": [1]}', "[]"])
def test_malformed_cache_is_ignored_with_a_warning_and_rewritten(fake, text):
    verdicts.cache_path().parent.mkdir(parents=True)
    verdicts.cache_path().write_text(text)
    with pytest.warns(RuntimeWarning, match="ignoring the verdict cache"):
        assert verdicts.check(canaries.of_kernel("fake"))[0].passed and fake.runs == 1
    assert len(json.loads(verdicts.cache_path().read_text())["verdicts"]) == 1
    assert not list(verdicts.cache_path().parent.glob("*.tmp"))


def test_compare_rules():
    inf = -np.inf
    assert canaries.compare(np.array([inf, 1.0]), np.array([inf, 1.0001]), 2e-4)[0]
    ok, err, why = canaries.compare(np.array([0.0, 1.0], np.float32), np.array([inf, 1.0], np.float32), 2e-4)
    assert not ok and "-inf" in why
    assert not canaries.compare(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), 1.0)[0]
    ok, err, why = canaries.compare(np.array([3, 1, -1], np.int32), np.array([1, 3, -1], np.int32), None)
    assert not ok and err == 2 and "2 of 3" in why
    assert not canaries.compare(np.zeros(3, np.int32), np.zeros(3, np.float32), None)[0]  # dtypes differ


def test_every_tcgen05_kernel_has_a_canary_at_m3s_tile_path():
    m3 = {c.kernel for c in canaries.CANARIES.values() if c.m3}
    assert {"index_scores", "sparse_attention_kv_major", "decode_index_scores", "sparse_decode_attention",
            "grouped_matmul"} <= m3
    assert set(canaries.MSA_PREFILL_KERNELS + canaries.MSA_DECODE_KERNELS + canaries.FP8_INDEXER_PREFILL_KERNELS
               + canaries.FP8_INDEXER_DECODE_KERNELS) <= set(canaries.KERNELS)


def test_cli_runs_a_real_canary(tmp_path, monkeypatch, capsys):
    # In interpret mode on a CPU, on the kernel itself on a GPU (the same test body on both).
    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verdicts, "_MEMO", {})
    out = tmp_path / "selfcheck.out.json"
    assert selfcheck.main(["--kernels", "decode_index_scores@b64-m64", "--json", str(out)]) == 0
    (v,) = json.loads(out.read_text())["verdicts"]
    target = verdicts.device_key()["target"]
    assert v["canary"] == "decode_index_scores@b64-m64" and v["target"] == target and v["status"] == "pass"
    assert v["max_error"] <= 2e-4
    table = capsys.readouterr().out
    assert "decode_index_scores@b64-m64" in table and "pass" in table
    with pytest.raises(SystemExit):
        selfcheck.main(["--kernels", "no_such_kernel"])
    with pytest.raises(SystemExit):
        selfcheck.main(["--full"])  # --report is required
    assert "unknown kernels or canaries ['no_such_kernel']" in capsys.readouterr().err


def test_full_report(tmp_path, monkeypatch):
    # Every canary afresh, the GPU checks (skipped, with the reason, on this CPU device) and the generate
    # in one JSON report (canaries and generate stubbed: the CLI's report, not the kernels).
    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verdicts, "_MEMO", {})
    dev = {"device": "cpu interpret", "target": "interpret", "driver": "-"}
    for module in (verdicts, selfcheck):  # the same report on a GPU machine
        monkeypatch.setattr(module, "device_key", lambda: dict(dev))
    ran = []

    def stub(cs, dev):
        ran.extend(c.name for c in cs)
        return [verdicts.Verdict(c.name, dev["target"], dev["device"], "pass", 0.0, 0.1) for c in cs]

    monkeypatch.setattr(verdicts, "run_isolated", stub)
    generated = {"config": "m3-small", "generated_ids": list(range(8)), "text": "x", "passed": True, "seconds": 0.1}
    monkeypatch.setattr(selfcheck, "short_generate", lambda: dict(generated))
    report = tmp_path / "report.json"
    assert selfcheck.main(["--full", "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert ran == list(canaries.CANARIES) and data["passed"] and data["device"] == dev
    assert {v["canary"] for v in data["verdicts"] if v["m3"]} >= {"decode_index_scores@b128-m128-n8"}
    assert "sized for a GPU" in data["gpu_checks"]["skipped"] and data["generate"] == generated
    assert selfcheck.main(["--full", "--report", str(report)]) == 0 and len(ran) == 2 * len(canaries.CANARIES)
    monkeypatch.setattr(selfcheck, "short_generate", lambda: dict(generated, passed=False))
    assert selfcheck.main(["--full", "--report", str(report), "--gpu-checks", "none"]) == 1
    data = json.loads(report.read_text())
    assert not data["passed"] and "gpu_checks" not in data


def _kernels_as_references(monkeypatch, broken: str | None = None):
    """gpu_checks' kernel calls routed to the jnp references (the checks' code, not the kernels: those
    have their own interpret-mode tests), ``broken`` raising instead."""
    import types

    from m3jax.pallas import decode, gpu_checks, index_scores, topk
    from m3jax.pallas.sparse_attention import sparse_attention

    def ref(name, f):
        def call(*a, implementation=None, config=None, **kw):
            if name == broken:
                raise RuntimeError(f"{name}: a test-only launch failure")
            return f(*a, implementation="reference", **kw)
        return call

    def space(mod, *names):
        return types.SimpleNamespace(**{n: ref(n, getattr(mod, n)) if n in names else getattr(mod, n)
                                        for n in dir(mod)})
    monkeypatch.setattr(gpu_checks, "I", space(index_scores, "index_block_scores", "index_select_blocks"))
    monkeypatch.setattr(gpu_checks, "K", space(topk, "select_blocks"))
    monkeypatch.setattr(gpu_checks, "D", space(decode, "decode_index_scores", "sparse_decode_attention",
                                               "decode_select_blocks"))
    monkeypatch.setattr(gpu_checks, "sparse_attention", ref("sparse_attention", sparse_attention))


def test_full_report_runs_the_gpu_checks_at_small_shapes(tmp_path, monkeypatch, capsys):
    # The M3-shape checks' code path at small shapes (--gpu-checks small), every family, on this CPU,
    # one kernel made to fail; on a GPU --full runs the same code at M3's shapes.
    from m3jax.pallas import gpu_checks

    monkeypatch.setenv("M3JAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(verdicts, "run_isolated", lambda cs, dev: [
        verdicts.Verdict(c.name, dev["target"], dev["device"], "pass", 0.0, 0.1) for c in cs])
    _kernels_as_references(monkeypatch, broken="sparse_decode_attention")
    report = tmp_path / "report.json"
    argv = ["--full", "--report", str(report), "--gpu-checks", "small", "--no-generate", "--kernels", "topk_rowsplit"]
    assert selfcheck.main(argv) == 1  # the failing check fails the command
    data = json.loads(report.read_text())
    checks, rows = data["gpu_checks"], data["gpu_checks"]["rows"]
    assert checks["size"] == "small" and not checks["passed"] and not data["passed"]
    assert {r["check"] for r in rows} == set(gpu_checks.FAMILIES)
    failed = [r for r in rows if not r["passed"]]
    assert [r["kernel"] for r in failed] == ["sparse_decode_attention"] and "test-only" in failed[0]["error"]
    assert {r["kernel"] for r in rows} >= {"sparse_attention_kv_major", "index_scores", "decode_index_scores"}
    assert all(r["err_over_tol"] == 0 for r in rows if r["passed"])  # the references against themselves
    assert "sparse_decode_attention" in capsys.readouterr().out


def test_canaries_run_the_blackwell_variants_on_blackwell(monkeypatch):
    # On a Blackwell GPU the canaries go through the same public functions as the model, so they test
    # the tcgen05 variants the target selects: here the MSA kernels with one, as built for sm_100a in
    # interpret mode (the decode index scoring and the grouped GEMM have their own interpret tests).
    from m3jax.pallas.decode import blackwell as decode_bw
    from m3jax.pallas.index_scores import blackwell as index_bw
    from m3jax.pallas.sparse_attention import blackwell as attention_bw

    ran = set()
    for module, name in [(index_bw, "row_max"), (attention_bw, "tile"), (decode_bw, "sparse_decode_attention")]:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _m=module, _f=fn, **kw: ran.add(_m.__name__) or _f(*a, **kw))
    dev = {"device": "cpu interpret", "target": "interpret"}
    with _backend.interpret_as(_backend.BLACKWELL):
        for canary in ("index_scores@b16-hx64", "sparse_attention_kv_major@b64-h64-g8",
                       "sparse_decode_attention@b64-h64-g8"):
            verdict = verdicts.run_canary(canaries.CANARIES[canary], dev)
            assert verdict.passed, verdict
    assert ran == {index_bw.__name__, attention_bw.__name__, decode_bw.__name__}
