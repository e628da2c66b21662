"""The README's main command runs end to end on the built-in default preset."""

import pytest

from m3jax import demo
from m3jax.safetensors_io import CheckpointError


def test_demo_main_job_runs(tmp_path):
    timings = demo.main(["--seq-len", "96", "--out", str(tmp_path / "ckpt")])
    assert {"init", "save", "load", "forward"} <= set(timings)
    assert (tmp_path / "ckpt" / "config.json").exists()


def test_demo_replaces_its_checkpoint_only_when_told(tmp_path):
    out = ["--seq-len", "32", "--out", str(tmp_path / "ckpt")]
    demo.main(out)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        demo.main(out)
    assert {"save", "load"} <= set(demo.main(out + ["--overwrite"]))
