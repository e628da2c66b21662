"""Writes the notebooks from this source (cells as Python strings) so they stay reviewable in diffs.

    python notebooks/build_notebooks.py      # rewrites notebooks/*.ipynb (without outputs)
"""

from pathlib import Path

import nbformat as nbf

HERE = Path(__file__).parent

SETUP = '''# Any HF-layout M3 checkpoint works; None = the built-in random tiny preset (patterns are then noise).
CHECKPOINT = None
SEQ_LEN = 512
import numpy as np
import matplotlib.pyplot as plt
import m3jax
from m3jax import plots
from m3jax.probe import probe, with_dense_layers

if CHECKPOINT:
    model = m3jax.load_pretrained(CHECKPOINT, dtype="float32")
else:
    model = m3jax.init_random(m3jax.preset("m3_tiny"), seed=0)
cfg = model.config.text
ids = np.random.default_rng(0).integers(0, min(cfg.vocab_size, 256), (1, SEQ_LEN))
print(f"MSA block {cfg.index_block_size}, top-{cfg.index_topk_blocks}, MSA layers",
      [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_attention(i)])'''

NOTEBOOKS = {
    "01_sparsity_patterns.ipynb": [
        ("md", "# 01 — MSA sparsity patterns\n\nWhich KV blocks each layer and KV group selects, how much of the dense "
               "attention mass the selection keeps, how far back it reaches, and how much layers agree. "
               "Everything comes from `m3jax.probe.probe`, which streams over query chunks."),
        ("code", SETUP),
        ("code", "res = probe(model, ids, query_chunk=128)\nres.summary()"),
        ("md", "## Selection heatmaps (query position × key block)"),
        ("code", "layers = res.msa_layers[:4]\nfig, axes = plt.subplots(1, len(layers), figsize=(4 * len(layers), 3.5))\n"
                 "for ax, i in zip(np.atleast_1d(axes), layers):\n    plots.selection_heatmap(res, i, group=0, ax=ax)\nfig.tight_layout()"),
        ("md", "## Recall of the dense attention mass along the sequence"),
        ("code", "plots.recall_vs_position(res);"),
        ("md", "## Distance of the selected blocks from the query, and cross-layer overlap"),
        ("code", "fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.5))\nplots.distance_histograms(res, ax=a)\nplots.layer_overlap(res, ax=b)\nfig.tight_layout()"),
        ("code", "print('KV-group overlap, first MSA layer:')\nprint(np.round(res.jaccard_groups(res.msa_layers[0]), 3))"),
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
        ("code", "res_dense = probe(m3jax.M3Model(with_dense_layers(model.config, [first]), model.params), ids, query_chunk=128)\n"
                 "res = probe(model, ids, query_chunk=128)\n"
                 "delta = np.abs(res.logits - res_dense.logits).max()\nprint(f'max |logit change| from making layer {first} dense: {delta:.4f}')"),
    ],
}


def build():
    for name, cells in NOTEBOOKS.items():
        nb = nbf.v4.new_notebook()
        nb.cells = [nbf.v4.new_markdown_cell(src) if kind == "md" else nbf.v4.new_code_cell(src) for kind, src in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbf.write(nb, HERE / name)


if __name__ == "__main__":
    build()
