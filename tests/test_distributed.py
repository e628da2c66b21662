"""Several processes of one job (m3jax.distributed) on simulated CPU devices, jax.distributed over
localhost with gloo collectives:

* 2 processes x 2 devices (one mesh of 4) against 1 process x 1 device (the plain path): greedy
  ids identical, logits within the fp32 tolerance, probe selections identical, and each process loads only its devices' slices;
* different arguments on two processes are refused (status 2, naming the flag);
* a process killed with SIGKILL: the survivor exits non-zero within the heartbeat timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import m3jax
from tests.conftest import ROOT, TOL, rel_l2, tiny_config
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


def test_two_processes_equal_one(two_layer_checkpoint, tmp_path):
    worker = ["-m", "tests.multidevice.multihost_worker", str(two_layer_checkpoint)]
    two = _job([*worker, str(tmp_path / "two.npz"), "--local-devices", "2", "--mesh", "1x4"], 2, _port())
    # the reference, one process x one device: this one, while the job runs
    multihost_worker.main([str(two_layer_checkpoint), str(tmp_path / "one.npz"), "--local-devices", "1",
                           "--mesh", "1x1"])
    for p in two:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    np.testing.assert_array_equal(b["ids"], a["ids"])
    assert rel_l2(b["logits"], a["logits"]) < TOL["float32"]
    np.testing.assert_array_equal(b["selections"], a["selections"])  # probe: the same MSA blocks
    # Each process loaded only its devices' slices: the experts and split matrices of 2 of the 4 devices.
    assert len(b["loaded_bytes"]) == 2 and all(x < b["model_bytes"] for x in b["loaded_bytes"])
    assert a["loaded_bytes"][0] == a["model_bytes"]


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
                  "--local-devices", "1", "--mesh", "1x2", "--heartbeat-timeout", str(heartbeat)], 2, _port())
    survivor, victim = procs
    for p in procs:  # both joined the job; the survivor goes on loading and compiling
        assert p.stdout.readline().strip() == "joined", p.stderr.read()[-2000:]
    victim.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    _, err = survivor.communicate(timeout=60)
    waited = time.monotonic() - t0
    victim.communicate()
    assert survivor.returncode != 0
    assert "stopped sending heartbeats" in err and "\n1\n" in err  # JAX's message names process 1
    assert waited < heartbeat + 10, waited


def test_plan_hosts_is_one_mesh_over_all_devices(capsys):
    from m3jax import plan

    two = plan.main(["--config", "minimax_m3", "--hosts", "2", "--devices", "8", "--ctx", "1000000"])
    sixteen = plan.main(["--config", "minimax_m3", "--devices", "16", "--ctx", "1000000"])
    assert "16 devices (2 hosts x 8)" in capsys.readouterr().out
    assert (two["total"], two["weights"], two["fits"]) == (sixteen["total"], sixteen["weights"], sixteen["fits"])
