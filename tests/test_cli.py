"""The command-line tools on bad input (issue #19): every mistake ends in one ``error:`` line and exit
status 2, before any work and without touching files; ``--debug`` / ``M3JAX_DEBUG=1`` keep the
traceback; ``m3jax.plan`` exits 1 when the plan does not fit; ``m3jax.train`` never writes over a
non-empty ``--out`` unless told to resume or overwrite.

Each tool runs in-process through :func:`m3jax.cli.run`, exactly as ``python -m`` runs it.
"""

from __future__ import annotations

import json

import pytest

import m3jax
from m3jax import cli, data, demo, generate, plan
from m3jax import train as tr

# Arguments that would run a quick generation if nothing were refused.
GEN = ["--config", "m3_tiny", "--ctx", "256", "--prefill-chunk", "64", "--max-new-tokens", "2", "--quiet",
       "--prompt-ids", "1,2,3"]


class Stop(Exception):
    """Raised by a patched stage to end a run once the behaviour under test has happened."""


def run_cli(main, argv, capsys, **kw) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of ``python -m <tool> argv``."""
    with pytest.raises(SystemExit) as ei:
        cli.run(main, argv, **kw)
    return ei.value.code, capsys.readouterr().err.strip().splitlines()


def _refused(main, argv, capsys, needle: str) -> str:
    code, err = run_cli(main, argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0], err
    return err[0]


# --------------------------------------------------------------------------------------------------
# generate


@pytest.mark.parametrize("flag, value, needle", [
    ("--temperature", "-1", "--temperature must be >= 0"),
    ("--temperature", "nan", "--temperature must be >= 0"),
    ("--top-p", "1.5", "--top-p must be in (0, 1]"),
    ("--top-p", "0", "--top-p must be in (0, 1]"),
    ("--top-k", "0", "--top-k must be an integer >= 1"),
    ("--top-k", "-3", "--top-k must be an integer >= 1"),
    ("--max-new-tokens", "-1", "argument --max-new-tokens: must be >= 0, got -1"),
    ("--ctx", "0", "argument --ctx: must be a positive integer, got 0"),
    ("--ctx", "-5", "argument --ctx: must be a positive integer, got -5"),
    ("--prefill-chunk", "0", "argument --prefill-chunk: must be a positive integer, got 0"),
    ("--prefill-chunk", "-4", "argument --prefill-chunk: must be a positive integer, got -4"),
    ("--video-fps", "0", "argument --video-fps: must be positive"),
    ("--seed", "99999999999999999999", "argument --seed: must fit in 64 bits"),
])
def test_generate_refuses_bad_numbers(capsys, flag, value, needle):
    _refused(generate.main, GEN + [flag, value], capsys, needle)


def test_generate_refuses_bad_prompt_ids(capsys):
    argv = [a for a in GEN if a != "1,2,3"]
    _refused(generate.main, argv + ["abc"], capsys, "argument --prompt-ids: expected comma-separated integer")
    _refused(generate.main, argv + ["1,-2"], capsys, "argument --prompt-ids: token ids must be >= 0, got -2")
    _refused(generate.main, argv + ["1,2,9999999"], capsys, "prompt ids must be in [0,")


def test_generate_refuses_unreadable_prompt_file(tmp_path, capsys):
    argv = GEN[:-2]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    line = _refused(generate.main, argv + ["--prompt-file", str(bad)], capsys, "argument --prompt-file:")
    assert "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3)" in line
    _refused(generate.main, argv + ["--prompt-file", str(tmp_path / "none.txt")], capsys, "none.txt: No such file")


def test_generate_checks_output_before_work(tmp_path, capsys, monkeypatch):
    """The folder of --output-json is checked while parsing: nothing is loaded or generated first."""
    monkeypatch.setattr(generate, "load_tokenizer", lambda *a: (_ for _ in ()).throw(Stop()))
    _refused(generate.main, GEN + ["--output-json", str(tmp_path / "missing" / "out.json")], capsys,
             f"argument --output-json: folder {tmp_path / 'missing'} does not exist")
    _refused(generate.main, GEN + ["--output-json", str(tmp_path)], capsys, "is a folder, not a file")


def test_generate_refuses_prompt_over_context_before_loading(capsys, monkeypatch):
    monkeypatch.setattr(generate.m3jax, "init_random", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    argv = GEN[:-1] + [",".join(["5"] * 255)]
    _refused(generate.main, argv, capsys, "prompt (255 tokens) + --max-new-tokens 2 exceed --ctx 256")


def test_checkpoint_and_config_errors_are_one_line(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": ')
    code, err = run_cli(generate.main, ["--checkpoint", str(ckpt), "--quiet"], capsys)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {ckpt / 'config.json'}: not a JSON file"), err
    code, err = run_cli(generate.main, ["--checkpoint", str(tmp_path / "nothere"), "--quiet"], capsys)
    assert (code, err) == (2, [f"error: no config.json at {tmp_path / 'nothere'}"])
    code, err = run_cli(plan.main, ["--config", "nope"], capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: unknown preset 'nope'"), err
    # The traceback on request: the exception itself propagates.
    with pytest.raises(m3jax.UnsupportedConfigError):
        cli.run(generate.main, ["--checkpoint", str(ckpt), "--quiet", "--debug"])
    monkeypatch.setenv("M3JAX_DEBUG", "1")
    with pytest.raises(m3jax.UnsupportedConfigError):
        cli.run(generate.main, ["--checkpoint", str(ckpt), "--quiet"])


# --------------------------------------------------------------------------------------------------
# plan


@pytest.mark.parametrize("argv, needle", [
    (["--devices", "-2"], "argument --devices: must be a positive integer, got -2"),
    (["--devices", "0"], "argument --devices: must be a positive integer, got 0"),
    (["--ctx", "-5"], "argument --ctx: must be a positive integer, got -5"),
    (["--chunk", "0"], "argument --chunk: must be a positive integer, got 0"),
    (["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    (["--hbm-gb", "-1"], "argument --hbm-gb: must be positive"),
])
def test_plan_refuses_nonsense(capsys, argv, needle):
    _refused(plan.main, argv, capsys, needle)


def test_plan_exit_status_says_whether_it_fits(capsys):
    argv = ["--config", "m3_tiny", "--devices", "1", "--ctx", "4096"]
    code, _ = run_cli(plan.main, argv, capsys, exit_code=plan.exit_status)
    assert code == 0
    # 1 GB per device is below the fixed workspace alone: no context fits
    with pytest.raises(SystemExit) as ei:
        cli.run(plan.main, ["--config", "m3_tiny", "--devices", "1", "--hbm-gb", "1"], exit_code=plan.exit_status)
    assert ei.value.code == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_demo_refuses_bad_numbers(capsys):
    _refused(demo.main, ["--seq-len", "0"], capsys, "argument --seq-len: must be a positive integer, got 0")


# --------------------------------------------------------------------------------------------------
# train: --out


def _stop_at_data(monkeypatch):
    """End a training run where it would start reading data (after --out is prepared)."""
    monkeypatch.setattr(data, "prepare_corpus", lambda *a: (_ for _ in ()).throw(Stop()))


def test_train_refuses_a_non_empty_out(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "train_log.csv").write_text("an earlier run's log")
    (out / "notes.txt").write_text("mine")
    line = _refused(tr.main, ["--out", str(out)], capsys, f"--out {out} is not empty (notes.txt, train_log.csv)")
    assert "--resume" in line and "--overwrite" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "train_log.csv"]
    assert (out / "train_log.csv").read_text() == "an earlier run's log"
    _refused(tr.main, ["--out", str(out / "notes.txt")], capsys, "is a file, not a folder")


def test_train_overwrite_removes_only_the_runs_files(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    (out / "ckpt" / "100").mkdir(parents=True)
    (out / "data.npz").write_bytes(b"old cache")
    (out / "notes.txt").write_text("mine")
    _stop_at_data(monkeypatch)
    with pytest.raises(Stop):
        tr.main(["--out", str(out), "--overwrite"])
    assert "removing the earlier run's ['ckpt', 'data.npz']" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "data.npz").exists() and not (out / "ckpt" / "100").exists()


def test_train_resume_without_a_checkpoint_says_so(tmp_path, capsys, monkeypatch):
    _stop_at_data(monkeypatch)
    with pytest.raises(Stop):
        tr.main(["--out", str(tmp_path / "run"), "--resume"])
    assert f"note: --resume: no checkpoint in {tmp_path / 'run' / 'ckpt'} yet; starting at step 0" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("argv, needle", [
    (["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    (["--steps", "-1"], "argument --steps: must be a positive integer, got -1"),
    (["--seq-len", "0"], "argument --seq-len: must be a positive integer, got 0"),
    (["--lr", "0"], "argument --lr: must be positive"),
    (["--dense-warmup-frac", "1.5"], "argument --dense-warmup-frac: must be in [0, 1)"),
    (["--steps", "10", "--dense-warmup-steps", "20"], "--dense-warmup-steps 20 exceeds --steps 10"),
    (["--batch", "3", "--data-parallel", "2"], "--batch 3 does not split over --data-parallel 2"),
    (["--resume", "--overwrite"], "not allowed with argument"),
    (["--stop-after", "-5"], "argument --stop-after: must be >= 0, got -5"),
    (["--seed", str(2**64)], "argument --seed: must fit in 64 bits"),
    (["--init-from", "/nonexistent/ckpt"], "--init-from /nonexistent/ckpt: no config.json there"),
    (["--tokenizer-from", "/nonexistent/tok"], "--tokenizer-from /nonexistent/tok: no tokenizer.json there"),
])
def test_train_refuses_bad_arguments_before_touching_out(tmp_path, capsys, argv, needle):
    _refused(tr.main, ["--out", str(tmp_path / "run")] + argv, capsys, needle)
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_tokenizer_larger_than_the_vocabulary(tmp_path, capsys):
    # the built-in checkpoint's tokenizer has more tokens than m3_tiny's vocabulary: its ids past the
    # vocabulary would be clamped by the embedding lookup, and the loss goes NaN
    from tokenizers import Tokenizer

    n = Tokenizer.from_file(str(generate.DEFAULT_CHECKPOINT / "tokenizer.json")).get_vocab_size()
    vocab = m3jax.config.preset("m3_tiny").text.vocab_size
    assert n > vocab
    _refused(tr.main, ["--out", str(tmp_path / "run"), "--config", "m3_tiny", "--tokenizer-from",
                       str(generate.DEFAULT_CHECKPOINT)], capsys,
             f"the tokenizer has {n} tokens, the model's vocab_size is {vocab}")
    assert not (tmp_path / "run").exists()


def test_writable_file_accepts_a_new_or_writable_file(tmp_path):
    """The check for --output-json accepts a new file in an existing folder and creates nothing."""
    path = cli.writable_file(str(tmp_path / "out.json"))
    assert path == tmp_path / "out.json" and not path.exists()
    path.write_text(json.dumps({}))
    assert cli.writable_file(str(path)) == path
