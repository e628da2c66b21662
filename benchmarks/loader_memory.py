"""Peak host memory of the checkpoint loader on a synthetic multi-shard checkpoint (>= 2 GB).

1. Builds a text-only MiniMax-M3-shaped checkpoint in bf16 (fp32 for the router, as released):
   hidden 1024, 64 experts of width 1024, ``--layers`` MoE layers, vocab 32000. Each expert stack
   ``moe.{gate,up,down}`` is 64 x 1024 x 1024 bf16 = 128 MiB, the largest leaf. Tensors are generated
   one name at a time following ``m3jax.checkpoint.tensor_plan`` (``Entry.hf_shape()``) and written
   shard by shard with ``write_safetensors``, so writing holds one shard (``--shard-mb``) at a time.
2. Loads it with ``m3jax.checkpoint.load_params(dir, cfg, dtype="bfloat16", progress=True)`` in a
   fresh subprocess and measures that process's memory: its RSS after ``import jax`` (and after the
   rest of the imports and CPU backend start-up: the baseline), ``ru_maxrss`` at the end (= peak
   VmRSS), and, sampled by the parent every few ms from ``/proc/<pid>/status``, the peak anonymous
   (RssAnon) and file-backed (RssFile: mapped checkpoint pages) parts of the RSS.

With the CPU backend ``jax.device_put`` would keep every loaded leaf in host memory, which would
measure the model, not the loader. So the child passes ``load_params`` a ``place`` function that
reduces each array to a tiny checksum and drops it: the numbers are of the loader alone (reading,
dequantising/transposing, stacking one leaf), as they would be when ``place`` ships each leaf to an
accelerator.

Prints a markdown table. The checkpoint is written to a temporary directory that is deleted at
the end, unless ``--dir`` is given (then it is kept, and reused if it already holds a checkpoint).
Note that the checkpoint was just written, so the load reads from the page cache.

    python benchmarks/loader_memory.py [--dir DIR] [--layers 6] [--shard-mb 256]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from m3jax.checkpoint import tensor_plan
from m3jax.config import M3Config, TextConfig, config_to_hf
from m3jax.safetensors_io import write_safetensors

MiB = 1 << 20


def bench_config(layers: int) -> M3Config:
    text = TextConfig(
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        layer_types=tuple("minimax_m3_sparse" if i % 2 else "full_attention" for i in range(layers)),
        mlp_layer_types=("sparse",) * layers,
        intermediate_size=1024,
        dense_intermediate_size=4096,
        shared_intermediate_size=1024,
        num_local_experts=64,
        num_experts_per_tok=4,
        rotary_dim=64,
        index_n_heads=2,
        index_head_dim=128,
        index_block_size=128,
        index_topk_blocks=16,
    )
    return M3Config(text=text, vision=None, projector_hidden_size=1024)


def storage_dtype(entry) -> np.dtype:
    return np.dtype(np.float32) if entry.spec.dtype == "float32" else np.dtype(ml_dtypes.bfloat16)


def sizes(cfg: M3Config) -> tuple[int, int, str]:
    """(total checkpoint bytes, largest loaded leaf bytes, its path)."""
    total, largest, where = 0, 0, ""
    for e in tensor_plan(cfg):
        isz = storage_dtype(e).itemsize
        total += len(e.names) * math.prod(e.hf_shape()) * isz
        leaf = math.prod(e.spec.shape) * isz  # bf16 load: same itemsize as storage
        if leaf > largest:
            largest, where = leaf, ".".join(map(str, e.path))
    return total, largest, where


def write_checkpoint(cfg: M3Config, directory: Path, shard_bytes: int, seed: int = 0) -> tuple[int, int]:
    """Generate tensors name by name and write shards one by one; returns (bytes, shards)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = [(n, e) for e in tensor_plan(cfg) for n in e.names]
    # First pass: assign names to shards (sizes are known up front, so "-of-N" is known too).
    shards: list[list] = [[]]
    size = 0
    for n, e in names:
        nbytes = math.prod(e.hf_shape()) * storage_dtype(e).itemsize
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((n, e))
        size += nbytes
    weight_map, total = {}, 0
    for k, members in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n, e in members:
            x = rng.standard_normal(e.hf_shape(), dtype=np.float32)
            x *= 0.02
            tensors[n] = x.astype(storage_dtype(e))
            del x
            weight_map[n] = fname
            total += tensors[n].nbytes
        write_safetensors(directory / fname, tensors)
        del tensors
        print(f"  wrote {fname} ({len(members)} tensors)", file=sys.stderr, flush=True)
    with open(directory / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(directory / "config.json", "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2)
    return total, len(shards)


# The measured process. Prints one JSON line at the end; memory figures are bytes.
CHILD = r"""
import json, resource, sys, time

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out

import jax
after_import_jax = status()["VmRSS"]
import numpy as np
import m3jax
from m3jax.checkpoint import load_params
from m3jax.config import load_config
jax.devices()  # start the CPU backend before the baseline
cfg = load_config(sys.argv[1])
baseline = status()
print("BASELINE", flush=True)

checksums = []
def place(path, a):
    # Reduce the leaf to a float and drop it: measure the loader, not the loaded model.
    s = float(a[..., :1].astype(np.float32).sum())
    checksums.append(s)
    return s

t0 = time.perf_counter()
tree = load_params(sys.argv[1], cfg, dtype="bfloat16", progress=True, place=place)
seconds = time.perf_counter() - t0
end = status()
print(json.dumps({
    "after_import_jax": after_import_jax,
    "baseline": baseline["VmRSS"],
    "baseline_anon": baseline["RssAnon"],
    "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "vmhwm": end["VmHWM"],
    "end_rss": end["VmRSS"],
    "seconds": seconds,
    "leaves": len(checksums),
    "checksum": sum(checksums),
}), flush=True)
"""


def measure(directory: Path, interval: float = 0.005) -> dict:
    """Run the loader in a fresh process, sampling its RssAnon / RssFile from here."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(directory)], stdout=subprocess.PIPE, env=env, text=True
    )
    peaks = {"RssAnon": 0, "RssFile": 0, "VmRSS": 0}
    baseline_seen = threading.Event()
    done = threading.Event()

    def sample():
        path = f"/proc/{proc.pid}/status"
        while not done.is_set():
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                break
            if baseline_seen.is_set():
                for line in text.splitlines():
                    k, _, v = line.partition(":")
                    if k in peaks:
                        peaks[k] = max(peaks[k], int(v.split()[0]) * 1024)
            time.sleep(interval)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    result = None
    for line in proc.stdout:
        if line.startswith("BASELINE"):
            baseline_seen.set()
        elif line.startswith("{"):
            result = json.loads(line)
    done.set()
    rc = proc.wait()
    t.join()
    if rc or result is None:
        raise SystemExit(f"loader subprocess failed (exit code {rc})")
    result.update({f"peak_{k}": v for k, v in peaks.items()})
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, help="write (or reuse) the checkpoint here and keep it")
    ap.add_argument("--layers", type=int, default=6, help="MoE layers (396 MiB each)")
    ap.add_argument("--shard-mb", type=int, default=256, help="shard size in MiB")
    args = ap.parse_args()

    cfg = bench_config(args.layers)
    total, largest, largest_path = sizes(cfg)
    tmp = None
    if args.dir is None:
        tmp = Path(tempfile.mkdtemp(prefix="m3jax-loader-memory-"))
        directory = tmp / "ckpt"
    else:
        directory = args.dir
    try:
        if (directory / "model.safetensors.index.json").exists():
            print(f"reusing checkpoint in {directory}", file=sys.stderr)
        else:
            print(f"writing {total / 1e9:.2f} GB checkpoint to {directory}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            written, _ = write_checkpoint(cfg, directory, args.shard_mb * MiB)
            assert written == total, (written, total)
            print(f"  written in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        files = sorted(directory.glob("*.safetensors"))
        on_disk = sum(p.stat().st_size for p in files)
        r = measure(directory)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    peak = r["ru_maxrss"]
    base = r["baseline"]
    rows = [
        ("checkpoint tensor bytes", f"{total / MiB:,.0f} MiB ({total / 1e9:.2f} GB; {on_disk / 1e9:.2f} GB on disk)"),
        ("shards", f"{len(files)} (~{args.shard_mb} MiB each)"),
        ("largest stacked leaf", f"{largest / MiB:,.0f} MiB (`{largest_path}`, bf16)"),
        ("leaves loaded", f"{r['leaves']} in {r['seconds']:.1f} s "
                          f"({total / r['seconds'] / 1e9:.2f} GB/s, warm page cache)"),
        ("RSS after `import jax`", f"{r['after_import_jax'] / MiB:,.0f} MiB"),
        ("baseline RSS (imports + CPU backend)", f"{base / MiB:,.0f} MiB (anon {r['baseline_anon'] / MiB:,.0f} MiB)"),
        ("peak RSS (`ru_maxrss`)", f"{peak / MiB:,.0f} MiB"),
        ("(peak - baseline) / largest leaf", f"**{(peak - base) / largest:.2f}**"),
        ("sampled peak RssAnon (heap)", f"{r['peak_RssAnon'] / MiB:,.0f} MiB"),
        ("(peak RssAnon - baseline anon) / largest leaf",
         f"**{(r['peak_RssAnon'] - r['baseline_anon']) / largest:.2f}**"),
        ("sampled peak RssFile (mapped shards)", f"{r['peak_RssFile'] / MiB:,.0f} MiB"),
        ("RSS at end of load", f"{r['end_rss'] / MiB:,.0f} MiB"),
    ]
    print("| quantity | value |")
    print("|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
