"""Shared test setup: fixture locations, the model-level tolerances (read from the one tolerance table,
m3jax/pallas/tolerances.py), and small config builders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

from m3jax.config import M3Config, TextConfig, VisionConfig
from m3jax.pallas.tolerances import TOL as TOLERANCES

# CPU computations run inline, not dispatched to XLA's worker pool. The Mosaic GPU interpreter's host
# callbacks dispatch JAX ops of their own (jax 0.11.2: barrier deallocation indexes a jax.Array); with
# async dispatch on two cores, a callback waiting on the pool while the test's next op held it
# deadlocked a clean-clone run (test_moe_layer_warp_specialized_matches_ragged_dot, all threads in
# futex waits).
jax.config.update("jax_cpu_enable_async_dispatch", False)

# Kernels with several warpgroups (the warp-specialised grouped GEMM, the two-warpgroup MSA backward)
# run in interpret mode as one thread per warpgroup, each executing its kernel body as an XLA program
# whose barrier waits are blocking host callbacks. XLA's CPU client runs those programs on a worker
# pool of one thread per core: on two cores the interpreter's own callback and one waiting warpgroup
# fill it, the warpgroup it waits for never runs, and the test hangs (the two-warpgroup backward hung in
# about 1 run in 3; in 0 of 10 with a pool of 8). PJRT_NPROC sizes the pool when the CPU client starts,
# which is after this file is imported.
os.environ.setdefault("PJRT_NPROC", "8")

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(os.environ.get("M3JAX_FIXTURES", Path(__file__).parent / "fixtures"))
ORACLE_CONFIGS = ("text_mixed", "text_wide_block", "image", "video", "mxfp8", "kernel_g8", "kernel_g2")

# Relative-L2 bounds of model-level comparisons (against the oracle, between implementations, sharded
# against unsharded), by dtype. The values live in the one tolerance table: fp32 its model-logits row,
# bf16 its bf16 attention row (two bf16 roundings of 2^-8 relative each).
TOL = {
    "float32": TOLERANCES[("model_logits", "float32")],
    "bfloat16": TOLERANCES[("attention", "bfloat16")]["rtol"],
}


def rel_l2(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(got, ref, dtype="float32", what=""):
    err = rel_l2(got, ref)
    assert err <= TOL[dtype], f"{what}: relative L2 error {err:.3e} > {TOL[dtype]:.0e} ({dtype})"


def same_sets(got, ref) -> int:
    """Number of (…, row) entries whose valid (>= 0) block ids differ as sets."""
    got, ref = np.asarray(got), np.asarray(ref)
    assert got.shape[:-1] == ref.shape[:-1], (got.shape, ref.shape)
    bad = 0
    for idx in np.ndindex(ref.shape[:-1]):
        g, r = got[idx], ref[idx]
        if set(g[g >= 0].tolist()) != set(r[r >= 0].tolist()):
            bad += 1
    return bad


@pytest.fixture(scope="session")
def oracle_dir() -> Path:
    missing = [n for n in ORACLE_CONFIGS if not (FIXTURES / n / "fixture.npz").exists()]
    if missing:
        pytest.fail(
            f"oracle fixtures {missing} not found under {FIXTURES}; generate them with "
            "`bash tests/run_tests.sh` (builds the Python 3.11 oracle venv) or "
            "`<oracle-venv>/bin/python tests/oracle/make_fixtures.py --out tests/fixtures`"
        )
    return FIXTURES


def tiny_text(**kw) -> TextConfig:
    base = dict(
        vocab_size=97,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        layer_types=("full_attention", "minimax_m3_sparse", "minimax_m3_sparse"),
        mlp_layer_types=("dense", "sparse", "sparse"),
        intermediate_size=16,
        dense_intermediate_size=48,
        shared_intermediate_size=16,
        num_local_experts=6,
        num_experts_per_tok=3,
        rotary_dim=4,
        index_n_heads=2,
        index_head_dim=8,
        index_block_size=4,
        index_topk_blocks=3,
    )
    base.update(kw)
    return TextConfig(**base)


def tiny_config(vision: bool = False, **text_kw) -> M3Config:
    v = VisionConfig(hidden_size=40, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2) if vision else None
    return M3Config(text=tiny_text(**text_kw), vision=v, image_token_id=90, video_token_id=91, projector_hidden_size=24)


@pytest.fixture(scope="session")
def byte_text_checkpoint(tmp_path_factory) -> Path:
    """A tiny random checkpoint (read-only for its users) whose text goes through the byte fallback:
    vocab >= 256 so UTF-8 bytes are ids, media placeholders outside the byte range; MSA block 16, top-2."""
    import m3jax

    cfg = tiny_config(vocab_size=300, index_block_size=16, index_topk_blocks=2).replace(image_token_id=298,
                                                                                        video_token_id=299)
    path = tmp_path_factory.mktemp("byte_text") / "tiny"
    m3jax.save_pretrained(m3jax.init_random(cfg, seed=0), path)
    return path


class MultideviceRun:
    """``tests/multidevice/sharding_checks.py`` on 8 simulated CPU devices, in a subprocess of its own
    (the device count is fixed when JAX starts; this process keeps one device). Its output and the
    generate CLI runs' compile caches live in a fresh folder: a hit from the user's cache would skip the
    tracing that the context-parallel checks count."""

    TIMEOUT_S = 1800

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="m3jax-multidevice-"))
        self.out = self.folder / "results.json"
        env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"),
                   JAX_PLATFORMS="cpu", M3JAX_CACHE_DIR=str(self.folder / "m3jax_cache"))
        self.log = open(self.folder / "log.txt", "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.multidevice.sharding_checks", str(self.out),
                                      "--devices", "8"], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self._results = None

    def results(self) -> dict:
        if self._results is None:
            try:
                self.proc.wait(timeout=self.TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.log.flush()
            if not self.out.exists():
                log = (self.folder / "log.txt").read_text()[-6000:]
                pytest.fail(f"multi-device checks did not run (exit {self.proc.returncode}):\n{log}")
            self._results = json.loads(self.out.read_text())
        return self._results

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


MULTIDEVICE_RUN = pytest.StashKey[MultideviceRun]()


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: deselected checks are not started
def pytest_collection_modifyitems(config, items):
    """Start the multi-device checks (~7 minutes on two cores) as soon as a collected test reads them,
    so that they run beside the rest of the suite instead of after it. Under pytest-xdist every worker
    collects every test, and only the one given those tests may start the checks (in their fixture):
    they go first instead, in the same order in every worker, so they still run beside the rest."""
    def reads(item) -> bool:
        return "multidevice_results" in getattr(item, "fixturenames", ())

    if any(reads(item) for item in items):
        if os.environ.get("PYTEST_XDIST_WORKER"):
            items.sort(key=lambda item: not reads(item))  # stable: the rest keep their order
        else:
            config.stash[MULTIDEVICE_RUN] = MultideviceRun()


def pytest_unconfigure(config):
    run = config.stash.get(MULTIDEVICE_RUN, None)
    if run is not None:
        run.close()
