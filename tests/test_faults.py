"""Faults and concurrency: atomic writes and checkpoint saves, one writer per folder, loads that never
mix two saves, non-finite guards, outputs that never replace inputs, one line for OS errors.

Crashes are injected in-process at every write point of a save (an exception raised where the
process would have died: what is on disk then is what a kill -9 leaves), which covers each point
exactly and costs no subprocess per try; the kill -9 loop itself is in scripts/fault_loops.py.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import m3jax
from m3jax import atomic, cli
from m3jax.checkpoint import CheckpointChanged, NonFiniteError, save_checkpoint
from m3jax.config import config_from_hf, config_to_hf
from m3jax.engine import SamplingParams, sample
from m3jax.safetensors_io import CheckpointError, write_safetensors

from .conftest import ROOT, tiny_config

EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.1.w1.weight"
NORM = "language_model.model.layers.0.input_layernorm.weight"
EMBED = "language_model.model.embed_tokens.weight"


@pytest.fixture(scope="module")
def models():
    """Two different tiny models of one config (old and new of an overwrite)."""
    cfg = tiny_config()
    return m3jax.init_random(cfg, seed=1), m3jax.init_random(cfg, seed=2)


def flat(params) -> dict[str, np.ndarray]:
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def which(loaded, models) -> str:
    """'old' or 'new' when every leaf of ``loaded`` equals that model's bitwise, else 'mixed'."""
    got = flat(loaded.params)
    for name, m in zip(("old", "new"), models):
        ref = flat(m.params)
        if all(np.array_equal(got[k], ref[k]) for k in ref):
            return name
    return "mixed"


def load(path):
    return m3jax.load_pretrained(path, dtype="float32", progress=False)


# --------------------------------------------------------------------------------------------------
# m3jax.atomic


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    atomic.atomic_write(target, "old")
    assert target.read_text() == "old"
    real_fsync = os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        atomic.atomic_write(target, "new" * 1000)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert target.read_text() == "old"  # the previous file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # no temp file left behind
    atomic.atomic_write(target, b"new")
    assert target.read_bytes() == b"new"


def test_folder_lock_refuses_a_second_writer(tmp_path):
    folder = tmp_path / "ckpt"
    with atomic.folder_lock(folder):
        with pytest.raises(atomic.FolderBusyError, match="ckpt"):
            with atomic.folder_lock(folder):
                pass
        # Another thread is refused the same way (flock is per open file, not per process).
        errors = []

        def other():
            try:
                with atomic.folder_lock(folder):
                    pass
            except atomic.FolderBusyError as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 1
    with atomic.folder_lock(folder):  # released with the block
        pass


def test_swap_in_exchanges_whole_folders(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "a").write_text("old")
    staging = atomic.staging_folder(target)
    (staging / "a").write_text("new")
    (staging / "b").write_text("new")
    atomic.swap_in(staging, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert (target / "a").read_text() == "new" and (target / "b").read_text() == "new"


def test_open_regular_refuses_fifo_and_folder(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(atomic.NotARegularFileError, match="FIFO"):
        atomic.open_regular(fifo)  # would block forever with a plain open
    with pytest.raises(atomic.NotARegularFileError, match="folder"):
        atomic.open_regular(tmp_path)


# --------------------------------------------------------------------------------------------------
# Checkpoint saves: atomic, single writer, never mixed


@pytest.mark.parametrize("shard_bytes", [4 << 30, 20_000], ids=["single-file", "sharded"])
def test_crash_at_every_write_point_leaves_old_or_new(models, tmp_path, monkeypatch, shard_bytes):
    """A save into a folder holding the old model dies at each of its write points in turn (one try
    per point); every folder left then loads as the old model, bitwise."""
    old, new = models
    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(old, folder, max_shard_bytes=shard_bytes)
    points = {"n": 0, "die_at": -1}

    class Killed(BaseException):
        pass

    def hook(real):
        def wrapped(*a, **k):
            points["n"] += 1
            if points["n"] == points["die_at"]:
                raise Killed
            return real(*a, **k)
        return wrapped

    import m3jax.checkpoint as ck
    for name, real in (("write_safetensors", ck.write_safetensors), ("swap_in", ck.swap_in)):
        monkeypatch.setattr(ck, name, hook(real))
    for cls in (Path,):
        for meth in ("write_text", "write_bytes", "rename"):
            monkeypatch.setattr(cls, meth, hook(getattr(cls, meth)))
    m3jax.save_pretrained(new, tmp_path / "count", max_shard_bytes=shard_bytes)
    n_points = points["n"]
    assert n_points >= (4 if shard_bytes < 1 << 20 else 3)
    for k in range(1, n_points + 1):
        points.update(n=0, die_at=k)
        with pytest.raises(Killed):
            m3jax.save_pretrained(new, folder, max_shard_bytes=shard_bytes, overwrite=True)
        assert which(load(folder), models) == "old", f"crash at write point {k} of {n_points}"
    points.update(n=0, die_at=-1)
    m3jax.save_pretrained(new, folder, max_shard_bytes=shard_bytes, overwrite=True)  # clears the staging left
    assert which(load(folder), models) == "new"
    assert [p.name for p in tmp_path.iterdir() if ".staging-" in p.name] == []


def test_full_disk_during_save_leaves_the_old_checkpoint(models, tmp_path, monkeypatch):
    import m3jax.checkpoint as ck

    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(models[0], folder, max_shard_bytes=20_000)
    calls = {"n": 0}
    real = ck.write_safetensors

    def full_after_two(path, *a, **k):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(ck, "write_safetensors", full_after_two)
    with pytest.raises(OSError, match="No space left"):
        m3jax.save_pretrained(models[1], folder, max_shard_bytes=20_000, overwrite=True)
    assert which(load(folder), models) == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", "ckpt"]  # the staging folder is gone


def test_concurrent_save_is_refused_and_folder_stays_whole(models, tmp_path):
    old, new = models
    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(old, folder)
    with atomic.folder_lock(folder):  # another writer holds the folder
        with pytest.raises(atomic.FolderBusyError, match="lock"):
            m3jax.save_pretrained(new, folder, overwrite=True)
    assert which(load(folder), models) == "old"


def test_save_keeps_other_files_and_carries_extra_files(models, tmp_path):
    old, new = models
    folder = tmp_path / "ckpt"
    save_checkpoint(old.params, old.config, folder, extra_files={"tokenizer.json": "{}"})
    (folder / "README.md").write_text("notes")
    save_checkpoint(new.params, new.config, folder, overwrite=True)
    assert (folder / "README.md").read_text() == "notes" and (folder / "tokenizer.json").read_text() == "{}"


@pytest.mark.parametrize("shard_bytes", [4 << 30, 20_000], ids=["single-file", "sharded"])
def test_loads_racing_overwrites_are_old_or_new(models, tmp_path, shard_bytes):
    """A thread overwrites the folder with the old and the new model in turn while loads run: each
    load returns one of the two bitwise, or refuses with CheckpointChanged; never a mix."""
    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(models[0], folder, max_shard_bytes=shard_bytes)
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            i += 1
            m3jax.save_pretrained(models[i % 2], folder, max_shard_bytes=shard_bytes, overwrite=True)

    t = threading.Thread(target=writer)
    t.start()
    counts = {"old": 0, "new": 0, "refused": 0, "mixed": 0}
    try:
        for _ in range(8):
            try:
                counts[which(load(folder), models)] += 1
            except CheckpointChanged:
                counts["refused"] += 1
    finally:
        stop.set()
        t.join()
    assert counts["mixed"] == 0, counts


def test_weights_of_another_save_are_refused(models, tmp_path):
    """config.json of one save over the weights of another (what a kill between the two writes of
    the old, non-atomic save left) is refused, not loaded with logits off."""
    a, b = tmp_path / "a", tmp_path / "b"
    m3jax.save_pretrained(models[0], a)
    m3jax.save_pretrained(models[1], b)
    os.replace(b / "config.json", a / "config.json")
    with pytest.raises(CheckpointChanged, match="save"):
        load(a)


def test_duplicate_tensor_across_shards_without_index_is_refused(models, tmp_path):
    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(models[0], folder)
    write_safetensors(folder / "extra.safetensors", {EMBED: np.zeros((4, 4), np.float32)})
    with pytest.raises(CheckpointError, match=r"extra\.safetensors.*model\.safetensors|model\.safetensors.*extra"):
        load(folder)


def test_fifo_in_place_of_a_checkpoint_file_is_refused(models, tmp_path):
    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(models[0], folder)
    for name in ("config.json", "model.safetensors"):
        (folder / name).rename(folder / (name + ".bak"))
        os.mkfifo(folder / name)
        with pytest.raises((CheckpointError, atomic.NotARegularFileError), match="FIFO"):
            load(folder)
        (folder / name).unlink()
        (folder / (name + ".bak")).rename(folder / name)


# --------------------------------------------------------------------------------------------------
# Non-finite guards


def test_nonfinite_weights_are_refused_by_name(models, tmp_path):
    m = models[0]
    params = jax.tree.map(lambda x: x, m.params)
    layer0, layer1 = params["text"]["layers"][0], params["text"]["layers"][1]
    layer1["moe"]["gate"] = layer1["moe"]["gate"].at[1, 3, 2].set(jnp.nan)  # expert 1's w1
    layer0["input_norm"] = layer0["input_norm"].at[5].set(jnp.inf)
    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(m3jax.M3Model(m.config, params), folder)
    with pytest.raises(NonFiniteError) as ei:
        load(folder)
    assert EXPERT in str(ei.value) and NORM in str(ei.value)
    assert "experts.0." not in str(ei.value)  # only the broken expert is named
    broken = m3jax.load_pretrained(folder, dtype="float32", progress=False, allow_nonfinite=True)
    assert np.isnan(np.asarray(broken.params["text"]["layers"][1]["moe"]["gate"])).sum() == 1


@pytest.mark.parametrize("temperature", [1e-39, 1e-30])
def test_tiny_temperature_is_greedy(temperature):
    logits = jax.random.normal(jax.random.key(3), (4, 97)) * 6.0
    got = sample(logits, jax.random.key(0), SamplingParams(temperature=temperature))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(logits, -1)))


def test_sampling_arguments_are_checked_before_any_work():
    assert SamplingParams(0.5, top_k=np.int64(3)).top_k == 3  # numpy integers are integers
    for bad in (dict(top_k=2.5), dict(temperature="1"), dict(top_p=None)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# --------------------------------------------------------------------------------------------------
# Runs are what they say


def test_unknown_config_key_warns_with_nearest():
    d = config_to_hf(tiny_config())
    d["text_config"]["num_hiden_layers"] = 7
    with pytest.warns(UserWarning, match="'num_hiden_layers'.*did you mean 'num_hidden_layers'"):
        config_from_hf(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_from_hf(config_to_hf(tiny_config()))  # a clean config warns about nothing


def test_engine_refuses_a_second_thread():
    from m3jax.engine import Engine

    # The guard and the argument checks run before the engine touches its model or cache: a bare
    # instance (no compiled programs) is enough.
    eng = Engine.__new__(Engine)
    eng.mesh, eng._busy = None, threading.RLock()
    with eng._busy:  # a generation in progress on this thread
        errors = []

        def other():
            try:
                eng.generate([[1, 2, 3]], max_new_tokens=1)
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert errors and "another thread" in errors[0]
    for bad in (dict(max_new_tokens=2.5), dict(max_new_tokens=1, eos_ids="2"), dict(max_new_tokens=1, eos_ids=[2.0])):
        with pytest.raises(ValueError):
            eng.generate([[1, 2, 3]], **bad)


# --------------------------------------------------------------------------------------------------
# Outputs never clobber inputs; one line for the environment


def test_output_json_over_an_input_is_refused_before_any_work(tmp_path, models):
    from m3jax import generate

    folder = tmp_path / "ckpt"
    m3jax.save_pretrained(models[0], folder)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello")
    before = {p: p.read_bytes() for p in (folder / "config.json", folder / "model.safetensors", prompt)}
    for target in before:
        with pytest.raises(cli.UsageError, match="would overwrite"):
            generate.main(["--checkpoint", str(folder), "--prompt-file", str(prompt), "--output-json", str(target)])
    assert {p: p.read_bytes() for p in before} == before


def _run_cli(main, capsys):
    with pytest.raises(SystemExit) as ei:
        cli.run(main, [])
    return ei.value.code, capsys.readouterr().err


def test_cli_one_line_for_os_errors_and_ctrl_c(capsys, tmp_path):
    def full_disk(_):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.json"))

    def interrupted(_):
        raise KeyboardInterrupt

    code, err = _run_cli(full_disk, capsys)
    assert code == 1 and err == f"error: No space left on device: {tmp_path / 'out.json'}\n"
    code, err = _run_cli(interrupted, capsys)
    assert code == 130 and err.count("\n") == 1


def test_broken_pipe_exits_quietly():
    code = ("from m3jax import cli\n"
            "def main(argv):\n"
            "    for i in range(200000):\n"
            "        print('line', i)\n"
            "cli.run(main)\n")
    p = subprocess.run(["bash", "-c", f"{sys.executable} -c \"{code}\" | head -1; echo rc=${{PIPESTATUS[0]}}"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout == "line 0\nrc=141\n" and p.stderr == ""


# --------------------------------------------------------------------------------------------------
# train: one run per --out, a resumed run is the same run, damaged steps skipped, divergence stops


class _Stop(Exception):
    pass


def _stop_at_data(monkeypatch):
    from m3jax import data

    def stop(*a, **k):
        raise _Stop
    monkeypatch.setattr(data, "prepare_corpus", stop)


def test_train_second_run_on_one_out_is_refused(tmp_path, monkeypatch):
    from m3jax import train as tr

    _stop_at_data(monkeypatch)
    out = tmp_path / "run"
    with atomic.folder_lock(out):  # a first run holds --out
        with pytest.raises(atomic.FolderBusyError, match="training run"):
            tr.main(["--out", str(out), "--resume"])


def test_train_resume_refuses_changed_arguments(tmp_path, monkeypatch):
    from m3jax import train as tr

    _stop_at_data(monkeypatch)
    out = tmp_path / "run"
    with pytest.raises(_Stop):
        tr.main(["--out", str(out), "--seed", "3", "--data-mb", "1"])
    for flag, value in (("--seed", "4"), ("--data-mb", "2"), ("--lr", "0.1"), ("--seq-len", "64")):
        argv = ["--out", str(out), "--resume", "--seed", "3", "--data-mb", "1"]
        with pytest.raises(cli.UsageError, match=f"--resume: .*{flag} \\S+ \\(the run used"):
            tr.main(argv + [flag, value])
    with pytest.raises(_Stop):  # --steps may change
        tr.main(["--out", str(out), "--resume", "--seed", "3", "--data-mb", "1", "--steps", "7"])


def test_train_out_over_an_input_is_refused(tmp_path, models):
    from m3jax import train as tr

    ckpt = tmp_path / "ckpt"
    m3jax.save_pretrained(models[0], ckpt)
    for out in (ckpt, ckpt / "run", tmp_path):
        with pytest.raises(cli.UsageError, match="overlaps --init-from"):
            tr.main(["--out", str(out), "--init-from", str(ckpt), "--overwrite"])


def test_train_divergence_stops_naming_the_step(tmp_path):
    from m3jax import train as tr

    mngr = tr.checkpoint_manager(tmp_path / "ckpt")
    with pytest.raises(SystemExit, match="step 7: loss nan.*diverged.*last good checkpoint, none"):
        tr.stop_if_diverged({"loss": np.float32("nan"), "grad_norm": np.float32(1.0)}, 7, mngr)
    tr.stop_if_diverged({"loss": np.float32(2.0), "grad_norm": np.float32(1.0)}, 8, mngr)


def test_resume_skips_a_damaged_orbax_step(tmp_path, capsys):
    from m3jax import train as tr

    cfg = tiny_config(num_hidden_layers=1, layer_types=("full_attention",), mlp_layer_types=("dense",))
    tx = tr.make_optimizer("sparse", steps=4, lr=1e-2, warmup=1)
    mngr = tr.checkpoint_manager(tmp_path / "ckpt")
    good = tr.init_state(tr.init_train_params(cfg, seed=0), tx)
    tr.save_state(mngr, tr.TrainState(good.params, good.opt_state, jnp.asarray(1, good.step.dtype)))
    bad_params = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), good.params)
    tr.save_state(mngr, tr.TrainState(bad_params, good.opt_state, jnp.asarray(2, good.step.dtype)))
    like = tr.init_state(tr.init_train_params(cfg, seed=1), tx)
    restored = tr.restore_intact_state(tr.checkpoint_manager(tmp_path / "ckpt"), like)
    assert int(restored.step) == 1
    assert "checkpoint step 2" in capsys.readouterr().err
    # Bytes of the intact step flipped as well: nothing intact is left, the run is refused.
    for f in (tmp_path / "ckpt" / "1").rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "manifest" not in f.name:
            data = bytearray(f.read_bytes())
            data[16:48] = bytes(32)
            f.write_bytes(bytes(data))
    with pytest.raises(cli.UsageError, match="no intact checkpoint"):
        tr.restore_intact_state(tr.checkpoint_manager(tmp_path / "ckpt"), like)


def test_media_inputs_must_be_float_pixels_and_integer_grids():
    model = m3jax.init_random(tiny_config(vision=True), seed=0)
    ids = np.array([[1, model.config.image_token_id, 2]])
    patch = model.config.vision.patch_dim
    with pytest.raises(ValueError, match="pixel_values must be floats"):
        m3jax.forward(model, ids, pixel_values=np.zeros((4, patch), np.uint8), image_grid_thw=[[1, 2, 2]])
    with pytest.raises(ValueError, match="must hold integers"):
        m3jax.forward(model, ids, pixel_values=np.zeros((4, patch), np.float32), image_grid_thw=[[1, 2.5, 2]])


def test_negative_seed_and_bad_dense_layers_are_handled():
    from m3jax.probe import with_dense_layers

    cfg = tiny_config()
    m3jax.init_random(cfg, seed=-1)  # --seed takes signed 64-bit values
    with pytest.raises(ValueError, match="layer 99"):
        with_dense_layers(cfg, [99])
