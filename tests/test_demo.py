"""The README's main command runs end to end on the built-in default preset."""

from m3jax import demo


def test_demo_main_job_runs(tmp_path):
    timings = demo.main(["--seq-len", "96", "--out", str(tmp_path / "ckpt")])
    assert {"init", "save", "load", "forward"} <= set(timings)
    assert (tmp_path / "ckpt" / "config.json").exists()
