"""Matplotlib views of a :class:`m3jax.probe.ProbeResult` (used by the notebooks and sweeps)."""

from __future__ import annotations

import numpy as np

from m3jax.probe import ProbeResult


def _plt():
    import matplotlib.pyplot as plt  # imported lazily: matplotlib is only needed for plots

    return plt


def selection_heatmap(res: ProbeResult, layer: int, group: int = 0, batch: int = 0, ax=None):
    """Query position (rows) x key block (columns): 1 where the block is selected."""
    plt = _plt()
    sel = res.layers[layer].block_indices[batch, group]  # [T, topk]
    t = sel.shape[0]
    nb = -(-t // res.block_size)
    grid = np.zeros((t, nb))
    rows = np.repeat(np.arange(t), sel.shape[1])
    cols = sel.ravel()
    keep = cols >= 0
    grid[rows[keep], cols[keep]] = 1
    ax = ax or plt.subplots(figsize=(5, 4))[1]
    ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="Blues")
    ax.set(xlabel="key block", ylabel="query position", title=f"layer {layer}, KV group {group}")
    return ax


def recall_vs_position(res: ProbeResult, ax=None, smooth: int = 16):
    """Attention-mass recall (mean over batch and heads) along the sequence, one line per MSA layer."""
    plt = _plt()
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for i in res.msa_layers:
        r = res.layers[i].recall.mean(axis=(0, 1))
        if smooth > 1 and len(r) > smooth:
            r = np.convolve(r, np.ones(smooth) / smooth, mode="valid")
        ax.plot(r, label=f"layer {i}")
    ax.set(xlabel="query position", ylabel="recall of dense attention mass", ylim=(0, 1.02))
    ax.legend(fontsize=7)
    return ax


def distance_histograms(res: ProbeResult, ax=None):
    """How far back (in blocks) the selected blocks lie, per MSA layer (own block excluded)."""
    plt = _plt()
    ax = ax or plt.subplots(figsize=(6, 3.5))[1]
    for i in res.msa_layers:
        h = res.distance_histogram(i)[1:]
        ax.plot(np.arange(1, len(h) + 1), h / max(h.sum(), 1), label=f"layer {i}")
    ax.set(xlabel="distance from the query's block (blocks)", ylabel="share of selections", xscale="log")
    ax.legend(fontsize=7)
    return ax


def layer_overlap(res: ProbeResult, ax=None):
    """Jaccard overlap of selections between MSA layers."""
    plt = _plt()
    layers, m = res.jaccard_layers()
    ax = ax or plt.subplots(figsize=(4, 3.5))[1]
    im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis")
    ax.set_xticks(range(len(layers)), layers)
    ax.set_yticks(range(len(layers)), layers)
    ax.set(title="selection overlap (Jaccard)", xlabel="layer", ylabel="layer")
    ax.figure.colorbar(im, ax=ax)
    return ax
