"""Model-level parity on the GPU: the kernels path (attention_impl="pallas") and the reference path in
fp32 and bf16, against the transformers oracle fixtures and against an exact fp32 CPU reference for
random configs (issue #14's closing table).

fp32 (the precision contract): each path's logits rel-L2 against the oracle (<= 1e-5,
m3jax/pallas/tolerances.py) and its MSA selections equal to the oracle's as sets in every row.
bf16: the kernels' selections against the reference's on the same inputs (m3jax.probe.
kernel_selection_agreement: the reference residual stream, both selections from each layer's own
iq / ik): rows whose selections differ, and how many of them are near-ties within m3jax.msa.compare's
bound (all should be); logits rel-L2 of both whole paths against the fp32 oracle (the kernels path held
to <= 2x the reference's, m3jax/pallas/tolerances.py).

Cases: the oracle fixtures under --fixtures (tests/fixtures is git-ignored: carry it), and random
configs: m3-small's shape (G = 4, head dim 64, block 64, top-8), a G = 16 / head dim 128 variant,
and block 32 / top-16 with the msa_force_in / msa_force_out interventions; batch 2 x 1,700 tokens.
Their oracle is the reference path on the host CPU in fp32 (exact fp32 dots there).

    PYTHONPATH=. python benchmarks/parity_gpu.py [--fixtures tests/fixtures] [--tokens 1700] [--only NAME]

Prints one markdown table and writes $OUT/parity_gpu.json (OUT defaults to benchmarks/out).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import jax
import numpy as np

import m3jax
from m3jax.msa import kernels
from m3jax.pallas.tolerances import TOL
from m3jax.probe import kernel_selection_agreement
from run_info import run_info
from tests.conftest import ORACLE_CONFIGS, rel_l2, same_sets


def random_cases(tokens: int):
    small = m3jax.preset("m3_small")
    g16 = small.replace_text(num_attention_heads=32, num_key_value_heads=2, head_dim=128, index_head_dim=128,
                             num_hidden_layers=4, layer_types=small.text.layer_types[1:5],
                             mlp_layer_types=small.text.mlp_layer_types[1:5])
    b32 = small.replace_text(index_block_size=32, index_topk_blocks=16, msa_force_in=((3, 2), (5, 7)),
                             msa_force_out=((2, 0), (4, 1), (6, 3)))
    rng = np.random.default_rng(0)
    for name, cfg in (("random m3-small G=4", small), ("random G=16 H=128", g16), ("random G=4 b32 k16 forced", b32)):
        ids = rng.integers(3, min(cfg.image_token_id, cfg.video_token_id), (2, tokens))  # text ids only
        yield name, cfg, ids


def cpu_oracle(cfg, params, ids):
    """fp32 logits and selections of the reference path on the host CPU (fp32 dots are exact there)."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        # The host CPU runs no kernel: both choices explicit (auto would take the kernels on this GPU host).
        model = m3jax.M3Model(cfg.replace(attention_impl="reference", moe_impl="ragged_dot"), jax.device_put(params, cpu))
        out = m3jax.forward(model, ids, return_block_indices=True)
        return np.asarray(out.logits), {k: np.asarray(v) for k, v in out.block_indices.items()}


def fp32_rows(name, model, ids, oracle_logits, oracle_sel):
    rows = []
    for impl in ("reference", "pallas"):
        t0 = time.time()
        row = dict(case=name, dtype="float32", impl=impl)
        if impl == "pallas" and (reason := kernels.unsupported_reason(model.config.text, "float32")):
            rows.append(dict(row, refused=reason, s=0.0))
            continue
        try:
            m = m3jax.M3Model(model.config.replace(attention_impl=impl), model.params)
            out = m3jax.forward(m, ids, return_block_indices=True)
            sel = {k: np.asarray(v) for k, v in out.block_indices.items()}
            total = sum(v[..., 0].size for v in sel.values())
            diff = sum(same_sets(sel[k], oracle_sel[k]) for k in oracle_sel)
            err = rel_l2(out.logits, oracle_logits)
            row.update(logits_rel_l2=err, rows=total, rows_differing=diff,
                       ok=bool(err <= TOL[("model_logits", "float32")] and diff == 0))
        except Exception as e:  # noqa: BLE001  (report, go on)
            row.update(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
            traceback.print_exc()
        row["s"] = time.time() - t0
        rows.append(row)
    return rows


def bf16_row(name, ref, ids, oracle_logits):
    """``ref``: the bf16 model (the fp32 one's weights rounded by the dtype policy) on the reference path."""
    t0 = time.time()
    row = dict(case=name, dtype="bfloat16", impl="pallas vs reference")
    if reason := kernels.unsupported_reason(ref.config.text, "bfloat16"):
        return dict(row, refused=reason, s=0.0)
    try:
        pal = m3jax.M3Model(ref.config.replace(attention_impl="pallas"), ref.params)
        err = rel_l2(m3jax.forward(pal, ids).logits, oracle_logits)
        err_ref = rel_l2(m3jax.forward(ref, ids).logits, oracle_logits)
        # Selections on the same inputs (the reference path's residual stream): a difference is the
        # kernels' score arithmetic, not one inherited from an earlier layer's other selection.
        diffs = list(kernel_selection_agreement(ref, ids).values())
        rows, differing = sum(d.rows for d in diffs), sum(d.differing for d in diffs)
        inside = sum(d.inside_bound for d in diffs)
        row.update(logits_rel_l2=err, reference_logits_rel_l2=err_ref, rows=rows, rows_differing=differing,
                   inside_bound=inside, worst_margin_rel=max(d.worst_margin_rel for d in diffs),
                   ok=bool(inside == differing and err <= TOL[("model_logits_vs_reference_error", "bfloat16")] * err_ref))
    except Exception as e:  # noqa: BLE001
        row.update(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
        traceback.print_exc()
    row["s"] = time.time() - t0
    return row


def fmt(r):
    if "refused" in r:
        return f"| {r['case']} | {r['dtype']} | {r['impl']} | kernels refuse: {r['refused']} | | | - | 0 |"
    if "error" in r:
        return f"| {r['case']} | {r['dtype']} | {r['impl']} | ERROR: {r['error']} | | | | {r['s']:.0f} |"
    extra = (f"{r['inside_bound']} / {r['rows_differing']} (worst {r['worst_margin_rel']:.1e})"
             if "inside_bound" in r else "")
    ref = f" (reference {r['reference_logits_rel_l2']:.1e})" if "reference_logits_rel_l2" in r else ""
    return (f"| {r['case']} | {r['dtype']} | {r['impl']} | {r['logits_rel_l2']:.2e}{ref} | "
            f"{r['rows_differing']} / {r['rows']} | {extra} | {'ok' if r['ok'] else 'FAIL'} | {r['s']:.0f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", type=Path, default=Path("tests/fixtures"))
    ap.add_argument("--tokens", type=int, default=1700)
    ap.add_argument("--only", default="", help="run the cases whose name contains this text (a quick check)")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "benchmarks/out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(jax.devices(), jax.__version__, "bf16 near-tie bound: m3jax.msa.compare.summation_bound (8 Hx 2^-24 x row scale)",
          flush=True)
    print("| case | dtype | impl | logits rel-L2 vs oracle | rows differing | near-ties / differing | verdict | s |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    rows, info = [], run_info("parity_gpu.py")

    def emit(r):
        print(fmt(r), flush=True)
        rows.append(r)
        (out_dir / "parity_gpu.json").write_text(json.dumps({"run": info, "rows": rows}, indent=1))

    for name in ORACLE_CONFIGS:
        if args.only not in name:
            continue
        path = args.fixtures / name
        if not (path / "fixture.npz").exists():
            emit(dict(case=name, dtype="-", impl="-", error=f"no fixture at {path}", s=0.0))
            continue
        fx = np.load(path / "fixture.npz")
        if any(k.startswith("pixel") for k in fx.files):
            continue  # vision fixtures: the vision tower has its own parity test; MSA is covered by the text ones
        model = m3jax.load_pretrained(path, dtype="float32", attention_impl="reference", progress=False)
        layers = [i for i in range(model.config.text.num_hidden_layers) if model.config.text.is_sparse_attention(i)]
        oracle_sel = {i: fx[f"block_indices_{i}"] for i in layers}
        for r in fp32_rows(name, model, fx["input_ids"], fx["logits"], oracle_sel):
            emit(r)
        bf16 = m3jax.load_pretrained(path, dtype="bfloat16", attention_impl="reference", progress=False)
        emit(bf16_row(name, bf16, fx["input_ids"], fx["logits"]))
    for name, cfg, ids in random_cases(args.tokens):
        if args.only not in name:
            continue
        t0 = time.time()
        model = m3jax.init_random(cfg.replace(attention_impl="reference"), seed=0, dtype="float32")
        oracle_logits, oracle_sel = cpu_oracle(model.config, model.params, ids)
        print(f"  ({name}: CPU oracle {time.time() - t0:.0f} s)", flush=True)
        for r in fp32_rows(name, model, ids, oracle_logits, oracle_sel):
            emit(r)
        bf16 = m3jax.init_random(cfg.replace(attention_impl="reference"), seed=0, dtype="bfloat16")
        emit(bf16_row(name, bf16, ids, oracle_logits))
    run = [r for r in rows if "refused" not in r]
    bad = [r for r in run if not r.get("ok")]
    print(f"\n{len(run) - len(bad)}/{len(run)} rows ok ({len(rows) - len(run)} refused by the kernels) -> "
          f"{out_dir / 'parity_gpu.json'}", flush=True)


if __name__ == "__main__":
    main()
