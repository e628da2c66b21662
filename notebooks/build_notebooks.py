"""Writes the notebooks from this source (cells as Python strings) so they stay reviewable in diffs.

    python notebooks/build_notebooks.py                        # rewrites notebooks/*.ipynb (without outputs)
    python notebooks/build_notebooks.py 02_ablations.ipynb     # only the named notebooks
"""

import sys
from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).parent

SETUP = '''# Any HF-layout M3 checkpoint works; the default is the built-in m3-small, trained on the Python
# standard library (m3jax/assets/m3-small). The text is held-out stdlib source, tokenized with the
# checkpoint's own tokenizer (random ids when the checkpoint has none).
from pathlib import Path
from m3jax.generate import DEFAULT_CHECKPOINT
CHECKPOINT = DEFAULT_CHECKPOINT
SEQ_LEN = 1024
import numpy as np
import matplotlib.pyplot as plt
import m3jax
from m3jax import plots
from m3jax.probe import probe, with_dense_layers
from m3jax.data import stdlib_files

model = m3jax.load_pretrained(CHECKPOINT, dtype="float32", progress=False)
cfg = model.config.text
if (Path(CHECKPOINT) / "tokenizer.json").exists():
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(CHECKPOINT) / "tokenizer.json"))
    text = "\\n".join(f.read_text(encoding="utf-8", errors="replace") for f in stdlib_files()[1][:8])
    ids = np.asarray(tok.encode(text).ids[:SEQ_LEN])[None]
else:
    ids = np.random.default_rng(0).integers(0, min(cfg.vocab_size, 256), (1, SEQ_LEN))
print(f"MSA block {cfg.index_block_size}, top-{cfg.index_topk_blocks}, MSA layers",
      [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)], "| tokens", ids.shape[1])'''

NOTEBOOKS = {
    "01_sparsity_patterns.ipynb": [
        ("md", "# 01 — MSA sparsity patterns\n\nWhich KV blocks each layer and KV group selects, how much of the dense "
               "attention mass the selection keeps, how far back it reaches, and how much layers agree. "
               "Everything comes from `m3jax.probe.probe`, which streams over query chunks."),
        ("code", SETUP),
        ("code", "res = probe(model, ids, query_chunk=256, share_compilation=True)  # one compilation per layer kind\n"
                 "res.summary()"),
        ("md", "## Selection heatmaps (query position × key block)"),
        ("code", "layers = res.msa_layers[:4]\nfig, axes = plt.subplots(1, len(layers), figsize=(4 * len(layers), 3.5))\n"
                 "for ax, i in zip(np.atleast_1d(axes), layers):\n    plots.selection_heatmap(res, i, group=0, ax=ax)\nfig.tight_layout()"),
        ("md", "## Recall of the dense attention mass along the sequence"),
        ("code", "plots.recall_vs_position(res);"),
        ("md", "## Distance of the selected blocks from the query, and cross-layer overlap"),
        ("code", "fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))\nplots.distance_histograms(res, ax=a)\nplots.layer_overlap(res, ax=b)\nfig.tight_layout()"),
        ("code", "print('KV-group overlap, first MSA layer:')\nprint(np.round(res.jaccard_groups(res.msa_layers[0]), 3))"),
        ("md", "## The fp8 indexer: where its selections differ from bf16's\n\n"
               "`index_score_dtype=\"float8_e4m3fn\"` scores blocks with an fp8 x fp8 product (index queries per row "
               "and keys per token quantised to e4m3 with a scale). Below, per MSA layer: the share of rows (query, KV "
               "group) whose selected sets are equal, and, by distance from the query's own block, the blocks the "
               "default selects that the fp8 indexer drops (per row). Each probe runs on its own residual stream, so "
               "later layers also see the earlier layers' changes. Numbers at 4K and on M3's shapes: "
               "`benchmarks/RESULTS.md`, section \"fp8 indexer against bf16 selections\"."),
        ("code", "res8 = probe(m3jax.M3Model(model.config.replace_text(index_score_dtype='float8_e4m3fn'), model.params),\n"
                 "             ids, query_chunk=256, share_compilation=True)  # one compilation per layer kind\n"
                 "bs = cfg.index_block_size\nnb = -(-ids.shape[1] // bs)\n"
                 "own = (np.arange(ids.shape[1]) // bs)[None, None, :, None]\n"
                 "fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))\nequal = []\n"
                 "for i in res.msa_layers:\n"
                 "    s16, s8 = res.layers[i].block_indices, res8.layers[i].block_indices  # [B, K, T, topk]\n"
                 "    dropped = (s16 >= 0) & ~(s16[..., :, None] == s8[..., None, :]).any(-1)  # bf16's, not fp8's\n"
                 "    equal.append(1 - dropped.any(-1).mean())\n"
                 "    b.plot(np.bincount((own - s16)[dropped], minlength=nb)[:nb] / dropped[..., 0].size, label=f'layer {i}')\n"
                 "a.bar([str(i) for i in res.msa_layers], equal)\n"
                 "a.set(xlabel='MSA layer', ylabel='rows with equal sets', ylim=(min(equal) - 0.05, 1))\n"
                 "b.set(xlabel='distance from the own block (blocks)', ylabel='dropped blocks per row', yscale='log')\n"
                 "b.legend(fontsize=7)\nfig.tight_layout()"),
    ],
    "03_what_if.ipynb": [
        ("md", "# 03 — What if?\n\nInterventions are configuration, not monkeypatching: switch a layer to dense "
               "attention (the in-model oracle), change top-k or block size at inference, force blocks in or out."),
        ("code", SETUP),
        ("code", "import jax\n\ndef nll(m):\n    logp = np.asarray(jax.nn.log_softmax(m3jax.forward(m, ids).logits[0, :-1]))\n"
                 "    return float(-np.take_along_axis(logp, ids[0, 1:, None], -1).mean())\n\n"
                 "base = nll(model)\nprint('as released:', base)"),
        ("code", "msa_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)]\n"
                 "dense_all = m3jax.M3Model(with_dense_layers(model.config, msa_layers), model.params)\n"
                 "rows = [('all layers dense', nll(dense_all))]\n"
                 "for k in (1, 2, cfg.index_topk_blocks * 2):\n"
                 "    rows.append((f'top-k {k}', nll(m3jax.M3Model(model.config.replace_text(index_topk_blocks=k), model.params))))\n"
                 "for name, v in rows:\n    print(f'{name:>18}: NLL {v:.4f} (delta {v - base:+.4f})')"),
        ("code", "first = msa_layers[0]\nforced = m3jax.M3Model(model.config.replace_text(msa_force_in=((first, 0),)), model.params)\n"
                 "out = m3jax.forward(forced, ids, return_block_indices=True)\n"
                 "print('block 0 in every selection of layer', first, ':', bool((np.asarray(out.block_indices[first]) == 0).any(-1).all()))\n"
                 "print('NLL with block 0 forced in:', nll(forced))"),
        ("code", "# share_compilation: one compilation per layer kind, the same numbers\n"
                 "res_dense = probe(m3jax.M3Model(with_dense_layers(model.config, [first]), model.params), ids, query_chunk=128,\n"
                 "                  share_compilation=True)\n"
                 "res = probe(model, ids, query_chunk=128, share_compilation=True)\n"
                 "delta = np.abs(res.logits - res_dense.logits).max()\nprint(f'max |logit change| from making layer {first} dense: {delta:.4f}')"),
    ],
}

ABLATIONS_SETUP = """# Reads the committed results of the block x top-k sweep: the 2026-12-01 retrieval sweep (the retrained
# m3-small at 16K, key/value needles) once its results/quality.jsonl is there, else the 2026-11-29 one.
# When neither is there (or QUICK = True) a --quick sweep runs here first on a tiny random model:
# CPU, 1-2 minutes, and its numbers are noise: only the plumbing is real.
QUICK = False
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, Markdown, display

import m3jax

EXPERIMENTS = Path(m3jax.__file__).resolve().parent.parent / "experiments"
SWEEPS = [EXPERIMENTS / "2026-12-01_block_topk_retrieval", EXPERIMENTS / "2026-11-29_block_topk"]
EXP = next((e for e in SWEEPS if (e / "results" / "quality.jsonl").exists()), SWEEPS[-1])
SWEEP = [sys.executable, str(EXP / "sweep.py")]
results = EXP / "results"
if QUICK or not (results / "quality.jsonl").exists():
    results = Path("block_topk_quick").resolve()
    subprocess.run(SWEEP + ["--quick", "--out", str(results)], check=True)
plots = Path("block_topk_plots").resolve()  # derived views go next to the notebook, not into the repo
subprocess.run(SWEEP + ["--plot", "--out", str(results), "--plots", str(plots)], check=True, capture_output=True)
rows = [json.loads(l) for l in (results / "quality.jsonl").read_text().splitlines() if l.strip()]
ok = [r for r in rows if "error" not in r]
setup_id = ok[-1]["setup_id"]  # the latest setup, as sweep.py --plot shows it
cells = {r["cell"]: r for r in ok if r["setup_id"] == setup_id}
print(f"{EXP.name} -> {results}: {len(cells)} cells of setup {setup_id}")
print(json.dumps(cells["dense"]["setup"] if "dense" in cells else ok[-1]["setup"], indent=1))"""

NOTEBOOKS_02 = {
    "02_ablations.ipynb": [
        ("md", "# 02 — Ablations: MSA block size × top-k\n\nHow much quality does MSA give up against dense attention "
               "as the block size and the number of selected blocks change, and what does each choice buy in speed? "
               "Cells come from `experiments/2026-12-01_block_topk_retrieval/sweep.py` (the retrained m3-small at 16K) "
               "when its results are committed, else `experiments/2026-11-29_block_topk/sweep.py` (READMEs there: "
               "hypothesis, commands, metric definitions). Quality is measured on held-out long documents over the second half of the "
               "context, where the selection matters; the dense baseline is top-k over every block (exactly dense "
               "causal attention)."),
        ("code", ABLATIONS_SETUP),
        ("md", "## All cells\n\nΔ ll is the mean per-token log-likelihood minus the dense baseline's (negative = "
               "worse). Recall: share of the dense softmax mass inside the selected blocks. Needle: greedy retrieval "
               "of a planted key/value line (`KEY <k> = <v>` in the 2026-12-01 sweep, the format the model trained on; "
               "`SECRET_nnnn = \"value\"` in the 2026-11-29 one), the value's log-likelihood gain over a haystack without "
               "the needle, and how often the selection at the answer holds the needle's block."),
        ("code", "display(Markdown((plots / 'summary.md').read_text()))"),
        ("md", "## Quality over the grid"),
        ("code", "display(Image(str(plots / 'quality_heatmaps.png')))"),
        ("md", "## Equal token budget: fewer large blocks or more small ones?"),
        ("code", "if (plots / 'equal_budget.png').exists():\n    display(Image(str(plots / 'equal_budget.png')))"),
        ("md", "## Past the trained length: the same grid at 32K (2026-12-01 sweep)\n\nThe retrained m3-small saw 16K "
               "rows in training. At 32K (`results/32k/`, README \"At 32K\") dense attention stops retrieving while every "
               "MSA cell still does; accuracy then falls as the budget grows toward dense."),
        ("code", "long = SWEEPS[0] / 'results' / '32k'\n"
                 "if (long / 'quality.jsonl').exists():\n"
                 "    plots_32k = Path('block_topk_plots_32k').resolve()\n"
                 "    subprocess.run([sys.executable, str(SWEEPS[0] / 'sweep.py'), '--plot', '--out', str(long), '--plots', str(plots_32k)],\n"
                 "                   check=True, capture_output=True)\n"
                 "    display(Image(str(plots_32k / 'quality_heatmaps.png')))\n"
                 "else:\n    print('no 32K results committed')"),
        ("md", "## Recall per MSA layer\n\nWhich layers lose attention mass first as top-k shrinks (native block size)."),
        ("code", "native = cells['dense']['native_block_size'] if 'dense' in cells else None\n"
                 "line = sorted((r for r in cells.values() if r.get('topk') and r['block_size'] == native), key=lambda r: r['topk'])\n"
                 "line = line or sorted((r for r in cells.values() if r.get('topk')), key=lambda r: (r['block_size'], r['topk']))\n"
                 "fig, ax = plt.subplots(figsize=(6, 3.5))\n"
                 "for r in line:\n"
                 "    layers = sorted(r['per_layer'], key=int)\n"
                 "    ax.plot([int(l) for l in layers], [r['per_layer'][l]['recall_tail'] for l in layers], 'o-', label=r['cell'])\n"
                 "ax.set(xlabel='layer', ylabel='recall (tail)', ylim=(0, 1.02))\nax.legend(fontsize=7);"),
        ("md", "## fp8 e4m3 index keys against bf16 (2026-12-01 sweep)\n\nFrom `fp8_index.py` on the same checkpoint: "
               "share of selection rows with equal block sets, recall of the dense mass and needle accuracy per key dtype."),
        ("code", "fp8 = sorted((SWEEPS[0] / 'results').glob('fp8_index_*.json'))\n"
                 "for f in fp8:\n"
                 "    r = json.loads(f.read_text())\n"
                 "    print(f\"{f.name}: ctx {r['ctx']}, rows equal {r['rows_equal']:.4f} \"\n"
                 "          f\"(per layer {', '.join(f'{k}: {v:.3f}' for k, v in r['rows_equal_per_layer'].items())})\")\n"
                 "    for name in ('bfloat16', 'float8_e4m3fn'):\n"
                 "        print(f\"  {name:>14}: recall {r[name]['recall_mean']:.4f}, needle accuracy {r[name]['needle_accuracy']:.2f}\")\n"
                 "if not fp8:\n    print('no fp8_index results committed yet: run fp8_index.py (README of the 2026-12-01 sweep)')"),
        ("md", "## Speed of the whole MSA step vs cuDNN dense (128K context, M3 shapes)\n\nFrom `sweep.py --speed` on a "
               "GPU: random q/k/v and selections at M3 shapes, so the speed of a cell does not depend on the model; "
               "when the shown sweep has no speed run of its own, the 2026-11-29 sweep's (re-timed on the H200 on "
               "2026-12-01, every cell on the kernels) is shown."),
        ("code", "speed = next((p for p in (plots / 'speedup.png', SWEEPS[-1] / 'plots' / 'speedup.png') if p.exists()), None)\n"
                 "if speed:\n    print(speed.relative_to(EXPERIMENTS) if speed.is_relative_to(EXPERIMENTS) else speed.name)\n"
                 "    display(Image(str(speed)))\n"
                 "else:\n    print('no speed results yet: run sweep.py --speed on a GPU')"),
        ("md", "## Trained at the cell: inference-only against a retrained indexer (2026-12-05)\n\n"
               "The cells above change block size and top-k at inference on an indexer trained at 64 × 8. "
               "`experiments/2026-12-05_block_topk_retrained/retrain.py` retrains the indexer (`indexer_only`, main "
               "weights frozen) at each block size and scores the same cells on the same rows; top: the shipped "
               "indexer, bottom: the retrained one (README there: hypothesis, run, outcome). The committed run "
               "covers the 9 cells through the shipped one: the block-64 row and the top-8 column (blocks 32, "
               "64, 128 and 256)."),
        ("code", "retrained = EXPERIMENTS / '2026-12-05_block_topk_retrained'\n"
                 "side, png = retrained / 'results' / 'side_by_side.md', retrained / 'plots' / 'retrained_vs_inference.png'\n"
                 "if side.exists() and png.exists():\n"
                 "    display(Markdown(side.read_text()))\n"
                 "    display(Image(str(png)))\n"
                 "else:\n"
                 "    print('no retrained results committed yet: retrain.py runs on a GPU (its README gives the command)')"),
    ],
}
LONG_SETUP = """# Reads the committed results of experiments/2026-12-01_probe_long/probe_long.py: the longest-context
# JSON under its results/ (probe_128k.json from the H200 once committed). No model runs here.
import importlib.util
import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

import m3jax

EXP = Path(m3jax.__file__).resolve().parent.parent / "experiments" / "2026-12-01_probe_long"
spec = importlib.util.spec_from_file_location("probe_long", EXP / "probe_long.py")
probe_long = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = probe_long
spec.loader.exec_module(probe_long)
runs = [json.loads(p.read_text()) for p in sorted((EXP / "results").glob("probe_*.json"))]
res = max(runs, key=lambda r: r["ctx"])
figs = probe_long.figures(res)
plt.close("all")  # each figure is shown in its own section below, not all here
mem = res["memory"].get("peak_bytes_in_use")
print(f"{Path(res['checkpoint']).name} at {res['ctx']} tokens on {res['device']} ({res['attention_impl']} path, "
      f"{res['dtype']}): probe {res['seconds']['probe']} s, peak memory "
      + (f"{mem / 2**30:.1f} GiB" if mem else "n/a (CPU)"))"""

NOTEBOOKS_04 = {
    "04_long_context.ipynb": [
        ("md", "# 04 — MSA at long context\n\nOne probe pass over a long held-out row with key/value needles planted "
               "at several depths and queried at the end (`experiments/2026-12-01_probe_long`, README there: hypothesis, "
               "commands). On the GPU the selections come from the index kernels (the model's own path), and the "
               "recall of the dense attention mass is computed per query chunk, streamed over key tiles, so no "
               "[T, T] array exists. This notebook only reads the committed JSON."),
        ("code", LONG_SETUP),
        ("md", "## Summary: recall per MSA layer, and the needles\n\nRecall: share of each query head's dense softmax "
               "mass inside its group's selected blocks. A needle is retrieved when greedy decoding reproduces its "
               "value; *block sel.* is how often the selection at the value-predicting positions holds the needle's "
               "block (mean over KV groups)."),
        ("code", "display(Markdown(probe_long.summary_markdown(res)))"),
        ("md", "## Selection maps\n\nShare of (query, key block) pairs selected, queries and blocks pooled into at "
               "most 128 x 128 cells (log colour scale); the red lines are the needles' blocks. The bright diagonal is "
               "the forced own block; columns are blocks many queries come back to."),
        ("code", "figs['selection_maps']"),
        ("md", "## Recall vs query-to-block distance\n\nFor each log2 bin of the distance between a query's block "
               "and a key block: the share of the dense mass there that the selection keeps (left), how the dense "
               "mass spreads over distance (middle), and where the selected blocks lie (right)."),
        ("code", "figs['recall_vs_distance']"),
        ("md", "## Needle blocks at the answer"),
        ("code", "figs['needles']"),
        ("code", "for n in res['needles']:\n"
                 "    print(f\"depth {n['depth']:>5}: {n['distance_blocks']:>5} blocks back, retrieved {n['correct']}, \"\n"
                 "          f\"recall at the answer {[round(v, 2) for v in n['recall_at_answer'].values()]}\")"),
    ],
}
NOTEBOOKS_05 = {
    "05_flax_nnx.ipynb": [
        ("md", "# 05 — The model as Flax NNX modules\n\n`m3jax.nnx.from_model` wraps a model's arrays (no copy) in "
               "NNX modules that call the same functions as `m3jax.forward`. Here: browse m3-small with "
               "`nnx.display`, swap one layer's MSA top-k rule for a subclass, compare the selections before "
               "and after with `m3jax.probe`, and generate with the engine."),
        ("code", "from pathlib import Path\nimport numpy as np\nimport jax\nimport matplotlib.pyplot as plt\n"
                 "import optax\nfrom flax import nnx\nimport m3jax\nfrom m3jax import nnx as mnnx, plots\n"
                 "from m3jax.generate import DEFAULT_CHECKPOINT\nfrom m3jax.msa import layer as msa_layer, reference\n"
                 "from m3jax.data import stdlib_files\nfrom m3jax.engine import Engine, SamplingParams\n"
                 "from m3jax.probe import probe\n\n"
                 "CHECKPOINT = DEFAULT_CHECKPOINT  # any HF-layout M3 checkpoint\nSEQ_LEN = 768\n"
                 "model = m3jax.load_pretrained(CHECKPOINT, dtype='float32', progress=False)\ncfg = model.config.text\n"
                 "if (Path(CHECKPOINT) / 'tokenizer.json').exists():\n"
                 "    from tokenizers import Tokenizer\n"
                 "    tok = Tokenizer.from_file(str(Path(CHECKPOINT) / 'tokenizer.json'))\n"
                 "    text = '\\n'.join(f.read_text(encoding='utf-8', errors='replace') for f in stdlib_files()[1][:4])\n"
                 "    ids = np.asarray(tok.encode(text).ids[:SEQ_LEN])[None]\n"
                 "else:\n"
                 "    ids = np.random.default_rng(0).integers(0, min(cfg.vocab_size, 256), (1, SEQ_LEN))\n"
                 "m = mnnx.from_model(model)\n"
                 "same = all(a is b for a, b in zip(jax.tree.leaves(mnnx.to_model(m).params), jax.tree.leaves(model.params)))\n"
                 "print('round trip shares every buffer:', same)"),
        ("md", "## Browse the parameters\n\nThe state has the paths, shapes and dtypes of the parameter tree "
               "(`m3jax/params.py`); the logical axes ride along as `out_sharding` metadata, and MXFP8 weights are "
               "two Params (`values`, `scales`)."),
        ("code", "nnx.display(m.text.layers[2])"),
        ("md", "## Swap one layer's top-k rule\n\nA selection rule is a function of the index block scores, registered by "
               "name (`m3jax.msa.layer.register_selection_rule`); an `MSA` module's `rule` names it. This rule keeps "
               "the scores' visibility but ranks visible blocks by recency: a sliding window of blocks. Only the "
               "last MSA layer gets it. `to_model` writes the rule into the config (`msa_selection_rules`), so "
               "`m3jax.probe` and the engine run it too: the layers before it see the same input, so their "
               "selections must not move."),
        ("code", "@msa_layer.register_selection_rule('recent_blocks')\n"
                 "def recent_blocks(block_scores, q_pos, cfg, layer):\n"
                 "    recency = np.arange(block_scores.shape[-1], dtype=np.float32)\n"
                 "    ranked = jax.numpy.where(block_scores > reference.NEG_INF, recency, block_scores)  # -inf: not visible\n"
                 "    return reference.select_blocks(ranked, q_pos, block_size=cfg.index_block_size, topk=cfg.index_topk_blocks)\n\n"
                 "class RecentBlocks(mnnx.MSA):\n    rule = 'recent_blocks'\n\n"
                 "msa = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)]\nlast = msa[-1]\n"
                 "before = probe(mnnx.to_model(m), ids, share_compilation=True)\n"
                 "m.text.layers[last].attn = mnnx.swap(m.text.layers[last].attn, RecentBlocks)\n"
                 "swapped = mnnx.to_model(m)\nprint('config:', swapped.config.text.msa_selection_rules)\n"
                 "after = probe(swapped, ids, share_compilation=True)\n\n"
                 "def nll(logits):\n"
                 "    logp = np.asarray(jax.nn.log_softmax(logits[0, :-1]))\n"
                 "    return float(-np.take_along_axis(logp, ids[0, 1:, None], -1).mean())\n\n"
                 "def changed_rows(a, b):  # share of (group, query) rows whose selected set changed\n"
                 "    return float((np.sort(a, -1) != np.sort(b, -1)).any(-1).mean())\n\n"
                 "changed = {i: changed_rows(before.layers[i].block_indices, after.layers[i].block_indices) for i in msa}\n"
                 "for i in msa:\n    print(f'layer {i}: {changed[i]:.1%} of the rows select other blocks')\n"
                 "delta = float(np.abs(after.logits - before.logits).max())\n"
                 "print(f'NLL {nll(before.logits):.5f} -> {nll(after.logits):.5f}, max |logit change| {delta:.4f}')"),
        ("code", "fig, axes = plt.subplots(1, 3, figsize=(14, 4))\n"
                 "axes[0].bar([str(i) for i in msa], [100 * changed[i] for i in msa])\n"
                 "axes[0].set(xlabel='MSA layer', ylabel='% rows with other blocks', title='probe: before vs after')\n"
                 "for ax, res, name in zip(axes[1:], (before, after), ('learned index top-k', 'recent_blocks')):\n"
                 "    plots.selection_heatmap(res, last, group=0, ax=ax)\n"
                 "    ax.set_title(f'layer {last}, KV group 0: {name}')\nfig.tight_layout()"),
        ("md", "The engine (paged KV + index cache, chunked prefill, compiled decode) runs the swapped model, the "
               "rule's layer over its gathered cache (`tests/test_nnx.py` checks its tokens against the module's "
               "cache-free `mnnx.generate`)."),
        ("code", "prompt = ids[0, :128].tolist()\n"
                 "engine = Engine(swapped.params, swapped.config, batch=1, capacity=len(prompt) + 8, prefill_chunk=128)\n"
                 "print(engine.generate([prompt], max_new_tokens=8, sampling=SamplingParams(temperature=0.0)).generated[0])"),
        ("md", "## Train one group\n\n`param_group` names the training parameter groups (`m3jax.params.param_labels`: main, index, "
               "frozen) as Flax filters: this optimizer holds state for the index branch only, and an update leaves "
               "every other Param as it is."),
        ("code", "opt = nnx.Optimizer(m, optax.adamw(1e-3), wrt=mnnx.param_group('index'))\n"
                 "count = lambda f: sum(x.size for x in jax.tree.leaves(nnx.state(m, f)))\n"
                 "print({g: count(mnnx.param_group(g)) for g in ('main', 'index', 'frozen')})"),
    ],
}
NOTEBOOKS = {**{k: v for k, v in NOTEBOOKS.items() if k < "02"}, **NOTEBOOKS_02,
             **{k: v for k, v in NOTEBOOKS.items() if k > "02"}, **NOTEBOOKS_04,
             **NOTEBOOKS_05}


def build(names=None):
    for name, cells in NOTEBOOKS.items():
        if names and name not in names:
            continue
        nb = nbf.v4.new_notebook()
        nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbf.write(nb, HERE / name)


if __name__ == "__main__":
    build(sys.argv[1:])
