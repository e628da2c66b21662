"""Recall of the dense attention mass vs indexer-only training step, one line per block size."""

import csv
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
fig, ax = plt.subplots(figsize=(6, 3.5))
rows = []
for d in sorted((here / "results").glob("b*_k*")):
    log = [r for r in csv.DictReader(open(d / "train_log.csv")) if r.get("recall")]
    ax.plot([int(r["step"]) for r in log], [float(r["recall"]) for r in log], "o-", ms=3, label=d.name)
    s = json.loads((d / "summary.json").read_text())
    before = sum(s["recall_initial_index"].values()) / len(s["recall_initial_index"])
    after = sum(s["recall_trained_index"].values()) / len(s["recall_trained_index"])
    rows.append(f"| {s['block_size']} | {s['topk']} | {s['steps']} | {before:.3f} | {after:.3f} |")
ax.set_xlabel("indexer-only step (batch 8 x 4096 tokens)")
ax.set_ylabel("held-out recall (mean over MSA layers)")
ax.legend()
fig.tight_layout()
fig.savefig(here / "recall_recovery.png", dpi=120)
table = "| block | top-k | steps | recall before | recall after |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
(here / "results" / "table.md").write_text(table)
print(table)
