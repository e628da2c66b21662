"""Fault loops against checkpoint saves, in real processes: kill -9 at random points of an overwrite,
loads racing a process that keeps overwriting, and two processes saving into one folder at once.

Each load is classed as "old" or "new" (bitwise equal to one of the two models), "refused" (an error
naming the problem) or "mixed" (it loaded, and equals neither: the fault the saves must never give).

    PYTHONPATH=. python scripts/fault_loops.py --tries 20            # this tree
    PYTHONPATH=OTHER python scripts/fault_loops.py --tries 20        # another checkout, to compare
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import m3jax
from m3jax.config import M3Config, TextConfig

# Enough weights (about 20 MB in fp32) that a save takes long enough to be cut at many points.
CFG = M3Config(text=TextConfig(
    vocab_size=512, hidden_size=256, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    layer_types=("full_attention", "minimax_m3_sparse", "minimax_m3_sparse"), mlp_layer_types=("dense", "sparse", "sparse"),
    intermediate_size=256, dense_intermediate_size=512, shared_intermediate_size=256, num_local_experts=8,
    num_experts_per_tok=2, rotary_dim=32, index_n_heads=2, index_head_dim=64, index_block_size=16,
    index_topk_blocks=2), vision=None, projector_hidden_size=64)

CHILD = """
import sys, time, m3jax
from fault_loops import CFG
mode, folder, shard = sys.argv[1], sys.argv[2], int(sys.argv[3])
models = [m3jax.init_random(CFG, seed=s) for s in (1, 2)]
print("ready", flush=True)
if mode == "once":              # overwrite with the new model once (the parent kills it somewhere)
    sys.stdin.readline()
    m3jax.save_pretrained(models[1], folder, max_shard_bytes=shard, overwrite=True)
elif mode == "loop":            # overwrite with new, old, new, ... until killed
    i = 1
    while True:
        m3jax.save_pretrained(models[i % 2], folder, max_shard_bytes=shard, overwrite=True)
        i += 1
elif mode == "race":            # one save of model 1 or 2 at a signal; prints ok or the error's class
    which = int(sys.argv[4])
    sys.stdin.readline()
    try:
        m3jax.save_pretrained(models[which], folder, max_shard_bytes=shard, overwrite=True)
        print("ok", flush=True)
    except Exception as e:
        print("refused", type(e).__name__, str(e)[:200], flush=True)
"""


def flat(params) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(params)]


REFUSALS: dict[str, int] = {}  # error class -> count, over every refused load


def classify(folder: Path, refs: list[list[np.ndarray]]) -> str:
    try:
        got = flat(m3jax.load_pretrained(folder, dtype="float32", progress=False).params)
    except Exception as e:  # noqa: BLE001  (any clear refusal counts as refused)
        REFUSALS[type(e).__name__] = REFUSALS.get(type(e).__name__, 0) + 1
        return "refused"
    for name, ref in zip(("old", "new"), refs):
        if all(np.array_equal(a, b) for a, b in zip(got, ref)):
            return name
    return "mixed"


def child(mode: str, folder: Path, shard: int, *extra) -> subprocess.Popen:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(Path(__file__).resolve().parent)])
    p = subprocess.Popen([sys.executable, "-c", CHILD, mode, str(folder), str(shard), *map(str, extra)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "ready"
    return p


def kill_loop(tmp: Path, template: Path, refs, shard: int, tries: int, save_s: float, rng) -> dict:
    counts = {"tries": tries, "old": 0, "new": 0, "refused": 0, "mixed": 0}
    for _ in range(tries):
        folder = tmp / "ckpt"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(template, folder)
        p = child("once", folder, shard)
        p.stdin.write("go\n")
        p.stdin.flush()
        time.sleep(rng.uniform(0, save_s))
        p.send_signal(signal.SIGKILL)
        p.wait()
        counts[classify(folder, refs)] += 1
    return counts


def race_loop(tmp: Path, template: Path, refs, shard: int, tries: int) -> dict:
    counts = {"tries": tries, "old": 0, "new": 0, "refused": 0, "mixed": 0}
    folder = tmp / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(template, folder)
    p = child("loop", folder, shard)
    try:
        for _ in range(tries):
            counts[classify(folder, refs)] += 1
    finally:
        p.kill()
        p.wait()
    return counts


def concurrent_saves(tmp: Path, template: Path, refs, shard: int, tries: int) -> dict:
    counts = {"tries": tries, "one_refused": 0, "both_ok": 0, "both_refused": 0, "folder_whole": 0, "folder_mixed": 0}
    for _ in range(tries):
        folder = tmp / "ckpt"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(template, folder)
        ps = [child("race", folder, shard, which) for which in (0, 1)]
        for p in ps:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate()[0].strip() for p in ps]
        ok = sum(o.startswith("ok") for o in outs)
        counts["both_ok" if ok == 2 else "one_refused" if ok == 1 else "both_refused"] += 1
        counts["folder_mixed" if classify(folder, refs) in ("mixed", "refused") else "folder_whole"] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        models = [m3jax.init_random(CFG, seed=s) for s in (1, 2)]
        refs = [flat(m.params) for m in models]
        for layout, shard in (("single-file", 4 << 30), ("sharded", 2 << 20)):
            template = tmp / f"template-{layout}"
            m3jax.save_pretrained(models[0], template, max_shard_bytes=shard)
            t0 = time.perf_counter()
            m3jax.save_pretrained(models[1], tmp / "timing", max_shard_bytes=shard, overwrite=True)
            save_s = (time.perf_counter() - t0) * 1.5  # kills land over the whole save and a little after
            results[f"kill9_{layout}"] = kill_loop(tmp, template, refs, shard, args.tries, save_s, rng)
            print(layout, "kill -9:", results[f"kill9_{layout}"], flush=True)
            results[f"race_{layout}"] = race_loop(tmp, template, refs, shard, args.tries)
            print(layout, "racing loads:", results[f"race_{layout}"], flush=True)
            results[f"concurrent_{layout}"] = concurrent_saves(tmp, template, refs, shard, max(args.tries // 2, 1))
            print(layout, "two saves at once:", results[f"concurrent_{layout}"], flush=True)
    results["refusals_by_error"] = REFUSALS
    print("refused loads by error:", REFUSALS, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
