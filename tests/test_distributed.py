"""Several processes of one job (m3jax.distributed) on simulated CPU devices, jax.distributed over
localhost with gloo collectives:

* 2 processes x 4 devices and 1 process x 8 devices, each at two meshes (1x8 and 2x4, data x model)
  with the MSA prefill context parallel, against 1 process x 1 device (the plain path): greedy ids
  identical, logits within 1e-6 of their scale (fp32), probe selections identical, a 2-step train with
  the same losses and the same weights saved by orbax, and each process loads only its devices' slices;
  the state 2 processes saved restores in 1 process (what --resume in another process count does);
* different arguments on two processes are refused (status 2, naming the flag);
* a process killed with SIGKILL: the survivor exits 1 within the heartbeat timeout with one line naming it;
* run_args.json records the process count; --resume in another one goes on with a note.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import m3jax
from m3jax import cli, train
from tests.conftest import ROOT, tiny_config
from tests.multidevice import multihost_worker

PY = sys.executable


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env(devices: int = 1) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return env


def _job(argv, n: int, port: int, devices: int = 1, **kw) -> list[subprocess.Popen]:
    """``n`` processes of ``python argv... --coordinator localhost:port --num-processes n --process-id i``."""
    return [subprocess.Popen([PY, *argv, "--coordinator", f"localhost:{port}", "--num-processes", str(n),
                              "--process-id", str(i)], env=_env(devices), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, **kw) for i in range(n)]


@pytest.fixture(scope="module")
def two_layer_checkpoint(tmp_path_factory):
    """2 layers (full attention + dense MLP, MSA + MoE), 8 experts: they split over 4 devices."""
    cfg = tiny_config(num_hidden_layers=2, layer_types=("full_attention", "minimax_m3_sparse"),
                      mlp_layer_types=("dense", "sparse"), num_local_experts=8, num_experts_per_tok=2)
    path = tmp_path_factory.mktemp("mp") / "ckpt"
    m3jax.save_pretrained(m3jax.init_random(cfg, seed=3), path)
    return path


MESHES = ("1x8", "2x4")  # data x model over 8 devices


def _max_rel(got, ref) -> float:
    """max |got - ref| over max |ref|: the largest difference as a share of the values' scale."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def test_two_processes_equal_one(two_layer_checkpoint, tmp_path):
    """The issue's matrix: 2 processes x 4 devices and 1 process x 8 devices, each at two meshes (one
    worker start per configuration, all meshes in it), against 1 process x 1 device."""
    worker = ["-m", "tests.multidevice.multihost_worker", str(two_layer_checkpoint)]
    meshes = ["--meshes", ",".join(MESHES), "--train"]
    two = _job([*worker, str(tmp_path / "two.npz"), "--local-devices", "4", *meshes], 2, _port())
    eight = subprocess.Popen([PY, *worker, str(tmp_path / "eight.npz"), "--local-devices", "8", *meshes],
                             env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # the reference, one process x one device: this one, while the others run
    multihost_worker.main([str(two_layer_checkpoint), str(tmp_path / "one.npz"), "--local-devices", "1",
                           "--meshes", "1x1", "--train"])
    for p in [*two, eight]:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    one = np.load(tmp_path / "one.npz")
    ref = {k.split("/", 1)[1]: one[k] for k in one.files}
    runs = {f"{name} {mesh}": {k.split("/", 1)[1]: f[k] for k in f.files if k.startswith(mesh + "/")}
            for name, f in (("2x4 devices", np.load(tmp_path / "two.npz")), ("1x8 devices", np.load(tmp_path / "eight.npz")))
            for mesh in MESHES}
    weights = [k for k in ref if k.startswith("w/")]
    assert len(weights) > 10
    for name, r in runs.items():
        np.testing.assert_array_equal(r["ids"], ref["ids"], err_msg=name)
        assert _max_rel(r["logits"], ref["logits"]) <= 1e-6, name
        np.testing.assert_array_equal(r["selections"], ref["selections"], err_msg=name)  # probe: the same MSA blocks
        assert r["context_parallel_prefills"] > 0, name  # the MSA prefill ran context parallel over the model axis
        np.testing.assert_allclose(r["losses"], ref["losses"], rtol=1e-6, err_msg=name)
        # the weights orbax saved: fp32 rounding, which Adam's first steps scale up where a gradient is near 0
        assert max(_max_rel(r[k], ref[k]) for k in weights) <= 5e-5, name
    # --resume in another process count: the state 2 processes saved on the 2x4 mesh restores in this one
    # process on one device, bit for bit.
    m = m3jax.load_pretrained(two_layer_checkpoint, dtype="float32", attention_impl="reference", progress=False)
    like = train.init_state(m.params, multihost_worker.optimizer())
    state = train.restore_state(train.checkpoint_manager(tmp_path / "two.2x4"), like)
    assert int(state.step) == 2
    for path, x in jax.tree_util.tree_leaves_with_path(state.params):
        np.testing.assert_array_equal(np.asarray(x), runs["2x4 devices 2x4"][f"w/{jax.tree_util.keystr(path)}"])
    # Each process loaded only its devices' slices: the experts and split matrices of 4 of the 8 devices.
    assert all(len(runs[f"2x4 devices {m}"]["loaded_bytes"]) == 2 for m in MESHES)
    assert all(x < runs["2x4 devices 1x8"]["model_bytes"] for x in runs["2x4 devices 1x8"]["loaded_bytes"])
    assert ref["loaded_bytes"][0] == ref["model_bytes"]


def test_different_arguments_are_refused(tmp_path):
    argv = ["-m", "m3jax.generate", "--config", "m3_tiny", "--quiet", "--heartbeat-timeout", "5"]
    port = _port()
    procs = [subprocess.Popen([PY, *argv, "--ctx", str(ctx), "--coordinator", f"localhost:{port}",
                               "--num-processes", "2", "--process-id", str(i)], env=_env(), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i, ctx in enumerate((256, 512))]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2, err[-2000:]
        assert "arguments differ between processes: --ctx is" in err


def test_killed_process_stops_the_survivor(two_layer_checkpoint, tmp_path):
    heartbeat = 3
    procs = _job(["-m", "tests.multidevice.multihost_worker", str(two_layer_checkpoint), str(tmp_path / "x.npz"),
                  "--local-devices", "1", "--meshes", "1x2", "--heartbeat-timeout", str(heartbeat)], 2, _port())
    survivor, victim = procs
    for p in procs:  # both joined the job; the survivor goes on loading and compiling
        assert p.stdout.readline().strip() == "joined", p.stderr.read()[-2000:]
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    _, err = survivor.communicate(timeout=60)
    waited = time.monotonic() - t0
    victim.communicate()
    assert survivor.returncode == 1, err[-2000:]
    assert err.strip().splitlines()[-1] == ("error: process 0: stopping because process 1 stopped responding for 3 s "
                                            "(--heartbeat-timeout: killed, hung, or its host lost)")
    assert waited < heartbeat + 10, waited


def test_resume_records_the_process_count(tmp_path, capsys):
    """run_args.json records the job's process count, not how it was joined; a --resume in another
    process count goes on with a note naming both (the orbax restore across layouts is in
    test_two_processes_equal_one), and still refuses another run."""
    argv = ["--config", "m3_tiny", "--out", str(tmp_path), "--coordinator", "node-a:1234", "--num-processes", "1"]
    train.check_run_args(tmp_path, train.parse_args(argv))
    recorded = json.loads((tmp_path / "run_args.json").read_text())
    assert recorded["processes"] == 1 and not set(recorded) & {"coordinator", "num_processes", "process_id"}
    (tmp_path / "run_args.json").write_text(json.dumps({**recorded, "processes": 2}))
    train.check_run_args(tmp_path, train.parse_args([*argv[:-4], "--resume", "--coordinator", "node-b:99"]))
    assert f"the run in {tmp_path} ran as 2 process(es), this job has 1" in capsys.readouterr().err
    with pytest.raises(cli.UsageError, match="--seq-len 64 .the run used 256."):
        train.check_run_args(tmp_path, train.parse_args([*argv, "--resume", "--seq-len", "64"]))


def test_plan_hosts_is_one_mesh_over_all_devices(capsys):
    from m3jax import plan

    two = plan.main(["--config", "minimax_m3", "--hosts", "2", "--devices", "8", "--ctx", "1000000"])
    sixteen = plan.main(["--config", "minimax_m3", "--devices", "16", "--ctx", "1000000"])
    assert "16 devices (2 hosts x 8)" in capsys.readouterr().out
    assert (two["total"], two["weights"], two["fits"]) == (sixteen["total"], sixteen["weights"], sixteen["fits"])
