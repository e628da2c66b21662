"""The exported-program cache (m3jax.aot): a second engine on the same cache folder runs the stored
programs without tracing the model, gives the same tokens and logits, and bad entries are rebuilt
with a warning, never a crash. The Mosaic GPU kernels survive export (lowered for CUDA on this host)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax import aot
from m3jax import engine as eng
from m3jax.engine import Engine, SamplingParams
from m3jax.msa import layer as msa_layer
from tests.conftest import tiny_config

GREEDY = SamplingParams(temperature=0.0)


def _run(cfg, params, folder, **kw):
    """One engine generating through the exported programs in ``folder``, none in memory (as in a new
    process); returns (result, aot stats)."""
    aot.clear()
    with aot.disk_cache(folder) as stats:
        e = Engine(params, cfg, batch=2, capacity=48, prefill_chunk=16, decode_steps_per_call=4)
        res = e.generate([[5, 6, 7, 8, 9, 10, 11], [3, 4]], max_new_tokens=6, keep_logits=True, **kw)
    return res, stats


def _untraceable(*args, **kwargs):
    raise AssertionError("traced the model: the program should have come from the cache")


def test_second_engine_reads_the_exported_programs(tmp_path, monkeypatch):
    cfg = tiny_config(index_block_size=4, index_topk_blocks=2, num_hidden_layers=2, layer_types=(
        "full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"))
    params = m3jax.init_random(cfg, seed=4).params
    sampling = SamplingParams(0.8, 0.9, 5)
    first, st1 = _run(cfg, params, tmp_path, sampling=sampling, seed=3)
    # one prefill window at two chunk sizes (the 7- and 2-token prompts run 8 and 4), the chunk embedding
    # at both sizes, the first token, decode
    assert st1["misses"] == 6 and st1["hits"] == 0 and st1["uncached"] == 0
    assert len(list(tmp_path.glob("*.m3aot"))) == 6
    monkeypatch.setattr(eng, "prefill_chunk", _untraceable)
    monkeypatch.setattr(eng, "decode_steps", _untraceable)
    second, st2 = _run(cfg, params, tmp_path, sampling=sampling, seed=3)
    assert st2["hits"] == 6 and st2["misses"] == 0
    assert second.generated == first.generated
    np.testing.assert_array_equal(np.stack(second.step_logits), np.stack(first.step_logits))
    aot.clear()


def _axpy(state, x, *, a):
    return {"y": a * x + state["y"]}


def test_bad_entries_are_rebuilt_with_a_warning(tmp_path):
    """A torn entry, another program's entry under this one's name, garbage, and an entry whose
    module is not StableHLO (checksum fixed): each is reported and rebuilt, the result unchanged."""
    state, x = {"y": jnp.arange(4.0)}, jnp.ones(4)
    out_tree = jax.tree.structure({"y": 0})

    def run(a=2.0):
        aot.clear()
        with aot.disk_cache(tmp_path) as stats:
            call = aot.compile("axpy", _axpy, (state, x), out_tree=out_tree, static={"a": a})
        return np.asarray(call(state, x)["y"]), stats

    want, _ = run()
    run(a=3.0)
    entries = {_key_of(p): p for p in tmp_path.glob("axpy-*.m3aot")}
    good = {k: p.read_bytes() for k, p in entries.items()}
    aot.clear()
    with aot.disk_cache(tmp_path):
        key = aot.program_key("axpy", jax.tree.leaves((state, x)), jax.tree.structure((state, x)), {"a": 2.0})
    path, other = entries[key], next(p for k, p in entries.items() if k != key)
    cases = {
        "torn": good[key][: len(good[key]) // 2],
        "foreign": good[_key_of(other)],  # another program's entry under this name
        "garbage": b"\x00\xff not a cache entry",
        "bad module": _with_module(good[key], b"ML\xefR not a module"),
    }
    for name, data in cases.items():
        path.write_bytes(data)
        aot._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, stats = run()
        np.testing.assert_array_equal(got, want)
        assert stats["misses"] == 1 and stats["hits"] == 0, (name, stats)
        assert any("m3jax.aot" in str(w.message) and str(path) in str(w.message) for w in caught), name
        assert aot._decode(path.read_bytes(), key) is not None, name  # rebuilt
    aot.clear()


def _with_module(entry: bytes, module: bytes) -> bytes:
    """``entry`` with its module replaced and the checksum fixed: parses, but is not StableHLO."""
    import hashlib
    import json

    head = json.loads(entry.partition(b"\n")[0])
    head["module_sha256"] = hashlib.sha256(module).hexdigest()
    return json.dumps(head).encode() + b"\n" + module


def _key_of(path) -> str:
    import json

    return json.loads(path.read_bytes().partition(b"\n")[0])["key"]


def test_mosaic_gpu_kernels_survive_export():
    """The decode program on the kernels path, lowered for CUDA here (the Hopper target): exported,
    stored and read back, its module keeps the Mosaic GPU custom calls, and it lowers again for CUDA
    through Exported.call, as a hit does on the GPU."""
    from m3jax.pallas import _backend

    cfg = tiny_config(num_attention_heads=16, head_dim=64, rotary_dim=32, index_head_dim=64, index_block_size=64,
                      index_topk_blocks=2).replace(attention_impl="pallas", moe_impl="ragged_dot")
    params = m3jax.init_random(cfg, seed=0, dtype="bfloat16").params
    cache = eng.init_cache(cfg, 1, 256, jnp.bfloat16)
    b = jax.ShapeDtypeStruct((1,), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    args = (params, cache, b, b, key)
    leaves, in_tree = jax.tree.flatten(args)
    static = {"cfg": cfg, "sampling": GREEDY, "steps": 2, "with_logits": False}
    out_tree = jax.tree.structure((0, 0, 0, 0, None, cache))
    with _backend.lowering_for(_backend.HOPPER):
        exp = aot._export(eng.decode_steps, leaves, in_tree, out_tree, static, "decode_steps")
        back = aot._decode(aot._encode("k", exp), "k")
        assert back.platforms == ("cuda",) and back.mlir_module().count("stablehlo.custom_call @mosaic_gpu_v2") >= 2
        text = jax.jit(back.call).trace(*leaves).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") >= 2


def test_no_disk_cache_without_a_folder(tmp_path):
    """Outside disk_cache nothing is written; a program is compiled once per process."""
    f = lambda x, *, k: x * k
    x = jnp.ones(3)
    run = aot.compile("times", f, (x,), out_tree=jax.tree.structure(0), static={"k": 2})
    assert aot.compile("times", f, (x,), out_tree=jax.tree.structure(0), static={"k": 2}) is run
    np.testing.assert_array_equal(run(x), 2 * np.ones(3))
    with aot.disk_cache(tmp_path) as stats:
        np.testing.assert_array_equal(aot.compile("times", f, (x,), out_tree=jax.tree.structure(0),
                                                  static={"k": 3})(x), 3 * np.ones(3))
    assert stats["misses"] == 1 and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(aot.OutTreeError, match="declared"), aot.disk_cache(tmp_path):
        aot.compile("pair", lambda x: (x, x), (x,), out_tree=jax.tree.structure(0))
    aot.clear()


def test_warmup_compiles_side_by_side(tmp_path, monkeypatch, caplog):
    """warmup hands its programs (a prefill chunk per key window, decode) to aot.compile_all, whose XLA
    compiles run on worker threads: the same entries are written and the engine gives the same tokens
    and logits as with the programs compiled one at a time, and generate compiles nothing more: no
    engine program and no XLA program at all (an op compiled on first use inside the decode loop made
    a first process decode slower than a second one, which reads it from the disk cache)."""
    import logging
    import threading

    cfg = tiny_config(index_block_size=4, index_topk_blocks=2, num_hidden_layers=2, layer_types=(
        "full_attention", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse"))
    params = m3jax.init_random(cfg, seed=5).params
    xla_compile = aot._xla_compile
    threads_seen = []

    def recording(st):
        threads_seen.append(threading.current_thread().name)
        xla_compile(st)

    monkeypatch.setattr(aot, "_xla_compile", recording)
    monkeypatch.setattr(eng, "MIN_KEY_WINDOW", 16)  # a window per chunk: 4 prefill programs
    out = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("M3JAX_COMPILE_THREADS", threads)
        threads_seen.clear()
        aot.clear()
        with aot.disk_cache(tmp_path / threads) as stats:
            # one chunk size (no prefill buckets): a program per key window (buckets: tests/test_prefill_buckets.py)
            e = Engine(params, cfg, batch=2, capacity=64, prefill_chunk=16, decode_steps_per_call=4,
                       prefill_buckets=False)
            windows = set(e._windows(64))
            e.warmup(keep_logits=True)
            compiled = dict(stats)
            caplog.clear()
            with jax.log_compiles(True), caplog.at_level(logging.DEBUG):
                res = e.generate([[5, 6, 7, 8, 9, 10, 11] * 5, [3, 4]], max_new_tokens=6, keep_logits=True, seed=7)
            assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]
        assert len(windows) >= 3
        # a prefill program per window, the chunk embedding (one size), the first token and decode; nothing
        # compiles once generate runs
        programs = len(windows) + 3
        assert compiled["misses"] == programs and stats["misses"] == compiled["misses"], (threads, stats)
        on_workers = [n for n in threads_seen if n.startswith("m3jax-compile")]
        assert len(on_workers) == (0 if threads == "1" else programs), threads_seen
        out[threads] = res
    assert out["3"].generated == out["1"].generated
    np.testing.assert_array_equal(np.stack(out["3"].step_logits), np.stack(out["1"].step_logits))
    aot.clear()


def test_compile_all_compiles_a_repeated_program_once(tmp_path, monkeypatch):
    x = jnp.arange(3.0)
    prog = aot.Program("times", lambda x, *, k: x * k, (x,), jax.tree.structure(0), {"k": 5})
    aot.clear()
    with aot.disk_cache(tmp_path) as stats:
        a, b = aot.compile_all([prog, prog], threads=2)
    assert a is b and stats["misses"] == 1
    np.testing.assert_array_equal(a(x), 5 * np.arange(3.0))
    monkeypatch.setenv("M3JAX_COMPILE_THREADS", "two")
    with pytest.raises(ValueError, match="M3JAX_COMPILE_THREADS"):
        aot.compile_threads()
    from m3jax import cli, generate

    with pytest.raises(cli.UsageError, match="M3JAX_COMPILE_THREADS"):  # the CLI refuses it in one line, first
        generate.main(["--max-new-tokens", "1"])
    aot.clear()


def test_a_failed_confirm_keeps_no_program(tmp_path):
    # Programs traced while the kernels' self-check ran presume its canaries pass: when one did not,
    # compile_all keeps nothing (no file, nothing in memory) and a later compile traces again.
    from m3jax.pallas import verdicts

    x = jnp.arange(3.0)
    prog = aot.Program("times", lambda x, *, k: x * k, (x,), jax.tree.structure(0), {"k": 5})
    failed = verdicts.Verdict("fake@p", "sm_90a", "fake GPU", "fail", 1.0, 0.1, "wrong")

    def confirm():
        raise verdicts.CanaryFailed([failed])

    aot.clear()
    with aot.disk_cache(tmp_path) as stats, pytest.raises(verdicts.CanaryFailed, match="fake@p fail"):
        aot.compile_all([prog], confirm=confirm)
    assert list(tmp_path.glob("*.m3aot")) == [] and stats["misses"] == 0 and not aot._memo
    timing = {}
    with aot.disk_cache(tmp_path) as stats:
        (run,) = aot.compile_all([prog], timing=timing, confirm=lambda: None)
    assert stats["misses"] == 1 and len(list(tmp_path.glob("*.m3aot"))) == 1 and timing["confirm_s"] >= 0
    np.testing.assert_array_equal(run(x), 5 * np.arange(3.0))
    aot.clear()


def test_compile_all_stages_in_child_processes(tmp_path, monkeypatch):
    """compile_all exports programs in forked children as well as here (the first one here, before any
    fork): the programs give what they give staged here, their entries are the ones a later run reads
    back, and a child that fails or hangs (killed at the deadline) has its program staged here, with a
    warning saying why; a program no process can export (effects) has only its own warning."""
    import os
    import time

    parent = os.getpid()
    seen = tmp_path / "traced"
    seen.mkdir()

    def scaled(x, *, k, mode):
        (seen / f"{k}-{os.getpid()}").touch()  # traced by whichever process stages the program
        if os.getpid() != parent and mode == "fail":
            raise RuntimeError("fails in a child only")
        if os.getpid() != parent and mode == "hang":
            time.sleep(120)
        if mode == "effect":  # not exportable anywhere: compiled without the cache, one warning saying so
            jax.debug.callback(lambda: None)
        return x * k + 1.0

    x = jnp.arange(4.0) - 1.5
    modes = {1: "ok", 2: "ok", 3: "fail", 4: "hang", 5: "ok", 6: "effect"}
    progs = [aot.Program(f"scaled{k}", scaled, (x,), jax.tree.structure(0), {"k": k, "mode": m})
             for k, m in modes.items()]
    monkeypatch.setattr(aot, "STAGE_DEADLINE_S", 10.0)
    aot.clear()
    with warnings.catch_warnings(record=True) as caught, aot.disk_cache(tmp_path / "cache") as stats:
        warnings.simplefilter("always")
        calls = aot.compile_all(progs, processes=6)
    said = [str(w.message) for w in caught]
    assert any("staging scaled3 in a child process failed (RuntimeError: fails in a child only at test_aot.py:" in m
               for m in said), said
    assert any("staging scaled4 in a child process took over 10 s" in m for m in said), said
    assert any("scaled6 cannot be exported" in m for m in said) and not any("staging scaled6" in m for m in said)
    for k, call in zip(modes, calls, strict=True):
        np.testing.assert_array_equal(call(x), np.asarray(x) * k + 1.0)
    assert stats["misses"] == 5 and stats["uncached"] == 1 and len(list((tmp_path / "cache").glob("*.m3aot"))) == 5
    by = {k: {int(f.name.split("-")[1]) for f in seen.glob(f"{k}-*")} for k in modes}
    assert by[1] == {parent}
    assert all(len(by[k]) == 1 and parent not in by[k] for k in (2, 5)) and by[2] != by[5]
    assert all(len(by[k]) == 2 and parent in by[k] for k in (3, 4))  # a child, then here
    aot.clear()
    with aot.disk_cache(tmp_path / "cache") as stats:
        again = aot.compile_all(progs, processes=6)
    assert stats["hits"] == 5 and stats["uncached"] == 1
    for call, old in zip(again, calls, strict=True):
        np.testing.assert_array_equal(call(x), old(x))
    monkeypatch.setenv("M3JAX_STAGE_PROCESSES", "0")
    with pytest.raises(ValueError, match="M3JAX_STAGE_PROCESSES"):
        aot.stage_processes()
    aot.clear()


def test_key_holds_the_selection_rules_code(monkeypatch):
    """A config names its MSA selection rules; the code under a name is the registering process's, so the
    key holds its digest (another process may register other code under the name)."""
    msa_layer.register_selection_rule("aot_key_rule", lambda s, q, c, layer: msa_layer.topk_rule(s, q, c, layer))
    cfg = tiny_config().replace_text(msa_selection_rules=((1, "aot_key_rule"),))
    x = [jnp.zeros(3)]
    tree = jax.tree.structure(x)
    key = aot.program_key("p", x, tree, {"cfg": cfg})
    assert key != aot.program_key("p", x, tree, {"cfg": tiny_config()})
    monkeypatch.setattr(msa_layer, "rule_digests", lambda t: {"aot_key_rule": "other code"})
    assert aot.program_key("p", x, tree, {"cfg": cfg}) != key
