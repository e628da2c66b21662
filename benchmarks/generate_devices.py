"""``python -m m3jax.generate`` on 1 device and on a mesh of several: speed, per-device peak memory, and
whether the greedy tokens agree with the 1-device run.

Runs the generate CLI (``m3jax.generate.main``) at M3's widths (``--config m3_width``: 3 of the 60
layers, random bf16 weights, kernels attention path) once per device count in ``--devices`` (default:
1, 2 and every visible device, those that exist), same prompt, greedy. Prints a table and writes
``$OUT/generate_devices_<ctx>.json`` and ``.md`` (``$OUT`` default benchmarks/out).

    PYTHONPATH=. python benchmarks/generate_devices.py                   # one H200: the 1-device run only
    PYTHONPATH=. python benchmarks/generate_devices.py --devices 1 8     # an 8-GPU node
    PYTHONPATH=. python benchmarks/generate_devices.py --dry             # CPU: tiny preset, 8 simulated devices

bf16 on GPUs: XLA partitions the projections differently per device count, so a near-tie between two
tokens may flip; the table shows how many leading tokens agree with the 1-device run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, nargs="+", default=None)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dry", action="store_true", help="CPU: m3_tiny at ctx 512 on 8 simulated devices")
    args = ap.parse_args(argv)
    if args.dry:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
        args.ctx, args.prefill_chunk, args.max_new_tokens = 512, 128, 8
    import jax

    from m3jax import generate

    visible = len(jax.devices())
    counts = args.devices or sorted({1, min(2, visible), visible})
    config = ["--config", "m3_tiny"] if args.dry else ["--config", "m3_width", "--attention-impl", "pallas"]
    rows = []
    for n in counts:
        if n > visible:
            print(f"skip --devices {n}: {visible} visible", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        r = generate.main([*config, "--ctx", str(args.ctx), "--fill", "--max-new-tokens", str(args.max_new_tokens),
                           "--temperature", "0", "--dtype", "bfloat16", "--prefill-chunk", str(args.prefill_chunk),
                           "--devices", str(n), "--quiet"])
        tm = r["timings"]
        rows.append({"devices": n, "mesh": r["mesh"], "ttft_s": tm["ttft_s"], "prefill_tok_per_s": tm["prefill_tok_per_s"],
                     "decode_ms_per_token": tm["decode_ms_per_token"], "compile_s": tm["compile_s"],
                     "peak_gib_max": r["peak_device_memory_bytes"] / 2**30,
                     "peak_gib_per_device": {d: b / 2**30 for d, b in r["peak_memory_per_device"].items()},
                     "planned_gib_per_device": r["memory_plan_per_device"]["total_bytes"] / 2**30,
                     "tokens": r["generated_ids"], "wall_s": time.perf_counter() - t0})
    ref = rows[0]["tokens"] if rows else []
    for row in rows:
        row["tokens_agree_with_first"] = next((i for i, (a, b) in enumerate(zip(row["tokens"], ref)) if a != b),
                                              min(len(row["tokens"]), len(ref)))
    from run_info import header, run_info

    info = run_info("generate_devices.py", argv)
    lines = [f"generate at ctx {args.ctx} ({' '.join(config)}, chunk {args.prefill_chunk}, "
             f"{args.max_new_tokens} new tokens, greedy)", "", header(info), "",
             "| devices | mesh | TTFT s | prefill tok/s | decode ms/token | compile s | peak GiB (max device) | "
             "planned GiB / device | tokens equal to first run |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['devices']} | {row['mesh']} | {row['ttft_s']:.2f} | {row['prefill_tok_per_s']:.0f} | "
                     f"{row['decode_ms_per_token']:.2f} | {row['compile_s']:.1f} | {row['peak_gib_max']:.2f} | "
                     f"{row['planned_gib_per_device']:.2f} | {row['tokens_agree_with_first']}/{len(row['tokens'])} |")
    text = "\n".join(lines)
    print(text)
    out = Path(os.environ.get("OUT", "benchmarks/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"generate_devices_{args.ctx}.md").write_text(text + "\n")
    (out / f"generate_devices_{args.ctx}.json").write_text(json.dumps({"run": info, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
