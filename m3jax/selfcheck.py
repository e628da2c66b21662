"""Self-check of the Mosaic GPU kernels on a GPU we have never run on.

Every kernel of :mod:`m3jax.pallas` has canaries (:mod:`m3jax.pallas.canaries`: the kernel at each
tile path it takes, M3's included, against its jnp reference) and verdicts kept per canary, device,
driver, JAX version and kernel source (:mod:`m3jax.pallas.verdicts`, which the model consults: a
kernel that fails or hangs its canary is not used). Each canary runs in a worker process with a
deadline (``$M3JAX_SELFCHECK_DEADLINE`` seconds, default 180): a hang is a "hung" verdict, not a hang.

``python -m m3jax.selfcheck [--json FILE] [--force] [--kernels a,b]`` runs the canaries (cached
verdicts are reused unless ``--force``) and prints canary, target, verdict, max error and time.
``--full --report FILE [--fixture DIR]`` is the first run on a new node: every canary afresh, the
MSA kernels against their references at M3's shapes (:mod:`m3jax.pallas.gpu_checks`; off the GPU
they are skipped with the reason, or run at small shapes with ``--gpu-checks small``), the logits of
an oracle fixture through the kernels path against the oracle's (``--fixture``, a directory of
tests/fixtures), an 8-token greedy generate on the built-in model (m3jax/assets/m3-small), and the
device, versions and all these results written to one JSON file to attach to a bug report. Off the
GPU the canaries run in interpret mode. Exit status 1 when a canary fails or hangs (not when it is
"n/a": a path the target does not have), a GPU check or the generate fails or the parity misses its
bound (2: a bad argument).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

from m3jax.atomic import atomic_write
from m3jax.pallas import _backend
from m3jax.pallas.canaries import CANARIES
from m3jax.pallas.tolerances import TOL
from m3jax.pallas.verdicts import Verdict, cache_path, canaries_named, canary_workers, check, deadline_s, device_key


# ---- CLI --------------------------------------------------------------------------------------------


def _table(verdicts: list[Verdict]) -> str:
    rows = [("canary", "m3", "target", "verdict", "max error", "time")]
    for v in verdicts:
        err = "-" if v.max_error is None else f"{v.max_error:.3g}"
        t = f"{v.seconds:.1f} s" + (" (cached)" if v.cached else "")
        rows.append((v.canary, "m3" if CANARIES[v.canary].m3 else "", v.target,
                     v.status if v.sound else v.status.upper(), err, t))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += [f"{v.canary}: {v.error}" for v in verdicts if v.error]
    return "\n".join(lines)


def fixture_parity(fixture) -> dict:
    """The kernels path's fp32 logits on an oracle fixture (a tests/fixtures directory: a checkpoint and
    its fixture.npz) against the oracle's: relative L2 error, held to the fp32 model bound."""
    from m3jax import api

    t0 = time.perf_counter()
    fx = np.load(fixture / "fixture.npz")
    model = api.load_pretrained(fixture, dtype="float32", attention_impl="auto", progress=False)
    logits = np.asarray(api.forward(model, fx["input_ids"]).logits, np.float64)
    ref = np.asarray(fx["logits"], np.float64)
    rel = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
    bound = TOL[("model_logits", "float32")]
    return {"fixture": str(fixture), "attention_impl": model.config.attention_impl, "rel_l2": rel, "bound": bound, "passed": rel <= bound,
            "seconds": round(time.perf_counter() - t0, 3)}


def short_generate(tokens: int = 8) -> dict:
    """``tokens`` greedy tokens from the built-in model (the ``m3jax.generate`` command's defaults: its
    shipped checkpoint and prompt, the kernels where the model picks them)."""
    from m3jax import generate

    t0 = time.perf_counter()
    out = generate.main(["--max-new-tokens", str(tokens), "--temperature", "0", "--quiet"])
    ids = [int(i) for i in out["generated_ids"]]
    return {"config": str(out["config"]), "generated_ids": ids, "text": out["text"],
            "passed": len(ids) == tokens, "seconds": round(time.perf_counter() - t0, 3)}


def _gpu_check_report(size: str, dev: dict) -> dict:
    """The M3-shape GPU checks' rows (:mod:`m3jax.pallas.gpu_checks`), printed as they end."""
    from m3jax.pallas import gpu_checks

    if size == "auto":
        if dev["target"] == "interpret":
            return {"skipped": "M3-shape checks are sized for a GPU (minutes each in interpret mode on a CPU); "
                               "--gpu-checks small runs them at small shapes", "passed": True}
        size = "m3"
    if dev["target"] != "interpret" and _backend.current_target().refused:
        return {"skipped": f"the kernels are not used here: {_backend.current_target().refused}", "passed": True}

    def show(row):
        err = f"{row['err_over_tol']:.3g}" if "err_over_tol" in row else "-"
        print(f"  {row['check']:9} {row['kernel']:30} {'pass' if row['passed'] else 'FAIL'}  err/tol {err:>8}  "
              f"{row['seconds']:.1f} s  {row['case']}" + (f"  {row['error']}" if row.get("error") else ""), flush=True)

    print(f"GPU checks ({size} shapes):", flush=True)
    rows = gpu_checks.run(size=size, emit=show)
    return {"size": size, "rows": rows, "passed": all(r["passed"] for r in rows)}


def _fixture_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "fixture.npz").is_file() or not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path} is not an oracle fixture directory (needs config.json and "
                                         "fixture.npz)")
    return path


def main(argv=None) -> int:
    from m3jax import cli

    ap = cli.ArgumentParser(prog="python -m m3jax.selfcheck", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=cli.writable_file, help="also write the verdicts to this JSON file")
    ap.add_argument("--force", action="store_true", help="rerun every canary, ignoring cached verdicts")
    ap.add_argument("--kernels", help="comma-separated kernels (all their paths) or kernel@path canaries, of: "
                                      f"{', '.join(CANARIES)}")
    ap.add_argument("--full", action="store_true", help="first run on a new node: every canary afresh, and "
                                                        "--fixture's parity; needs --report")
    ap.add_argument("--report", type=cli.writable_file, help="with --full: write the report (JSON) here")
    ap.add_argument("--fixture", type=_fixture_dir, help="with --full: an oracle fixture directory whose "
                                                        "fp32 logits the kernels path must match")
    ap.add_argument("--gpu-checks", choices=["auto", "m3", "small", "none"], default="auto",
                    help="with --full: the MSA kernels against their references at M3's shapes (auto: on a GPU; "
                         "skipped off it), at small shapes, or not at all")
    ap.add_argument("--no-generate", action="store_true", help="with --full: skip the 8-token generate")
    args = ap.parse_args(argv)
    if args.full != bool(args.report):
        ap.error("--full and --report go together")
    if not args.full and (args.fixture or args.gpu_checks != "auto" or args.no_generate):
        ap.error("--fixture, --gpu-checks and --no-generate need --full")
    try:
        canaries = canaries_named(args.kernels.split(",")) if args.kernels else list(CANARIES.values())
        deadline = deadline_s()
        canary_workers()  # read when the canaries run: a bad value is refused here, in one line
    except ValueError as e:
        ap.error(str(e))
    dev = device_key()
    target = _backend.current_target()
    print(f"m3jax self-check on {dev['device']}, target {dev['target']}, jax {jax.__version__}, "
          f"deadline {deadline:g} s per canary, cache {cache_path()}", flush=True)
    if dev["target"] != "interpret" and target.refused:
        print(f"the kernels are not used here: {target.refused}")
    verdicts = check(canaries, force=args.force or args.full, dev=dev)
    print(_table(verdicts), flush=True)
    ok = all(v.sound for v in verdicts)
    rows = [dict(dataclasses.asdict(v), kernel=v.kernel, m3=CANARIES[v.canary].m3) for v in verdicts]
    if args.json:
        atomic_write(args.json, json.dumps({"device": dev["device"], "jax": jax.__version__, "verdicts": rows}, indent=1))
    if args.full:
        report = {"device": dev, "target": dataclasses.asdict(target), "jax": jax.__version__,
                  "jaxlib": getattr(__import__("jaxlib"), "__version__", "?"), "python": sys.version.split()[0],
                  "platform": platform.platform(), "deadline_s": deadline, "verdicts": rows}
        if args.fixture:
            try:
                report["parity"] = fixture_parity(args.fixture)
            except Exception as e:  # noqa: BLE001  (the report says what broke; the command goes on)
                report["parity"] = {"fixture": str(args.fixture), "passed": False, "error": f"{type(e).__name__}: {e}"}
            p = report["parity"]
            print(f"parity {p['fixture']}: " + (f"rel L2 {p['rel_l2']:.3g} (bound {p['bound']:g}, "
                                                 f"{p['attention_impl']} path)" if "rel_l2" in p else p["error"]))
            ok = ok and p["passed"]
        if args.gpu_checks != "none":
            report["gpu_checks"] = _gpu_check_report(args.gpu_checks, dev)
            ok = ok and report["gpu_checks"]["passed"]
        if not args.no_generate:
            try:
                report["generate"] = short_generate()
            except Exception as e:  # noqa: BLE001  (the report says what broke; the command goes on)
                report["generate"] = {"passed": False, "error": f"{type(e).__name__}: {e}"}
            g = report["generate"]
            print("generate: " + (f"{len(g['generated_ids'])} tokens in {g['seconds']:.1f} s: {g['text']!r}"
                                  if "generated_ids" in g else g["error"]), flush=True)
            ok = ok and g["passed"]
        report["passed"] = ok
        atomic_write(args.report, json.dumps(report, indent=1))
        print(f"report written to {args.report}")
    return 0 if ok else 1


if __name__ == "__main__":
    from m3jax import cli

    cli.run(main)
