"""Attention lab, part 2: still pictures of attention weights (L, H, T, T).

- `grid_figure`: the layers x heads grid of heatmaps, labelled, for slides and papers (matplotlib);
- `layer_figure`: one layer's heads side by side, with the tokens on the axes when they fit;
- `grid_image`: the same grid as a plain RGB array with no text, built with numpy in milliseconds: what
  training logs to TensorBoard at each validation.

Colour is sqrt(weight), so the small weights of a spread-out head still show.  The figures are matplotlib Figures
made without pyplot: importing this module leaves the process's backend (a notebook's inline one) and open figures
as they were.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path

import matplotlib
import numpy as np
import torch
from matplotlib.figure import Figure

__all__ = ["grid_figure", "layer_figure", "grid_image", "save_figures", "CMAP", "CELL_INCHES", "DPI"]

CMAP = "magma"
CELL_INCHES = 1.1  # one heatmap in the grid figure
DPI = 100
MARGIN_INCHES = (0.7, 0.5)  # (left, top) room for the row and column labels


def _masked(w: np.ndarray) -> np.ma.MaskedArray:
    """sqrt(weights) with the causal mask's upper triangle masked out (drawn in the background colour)."""
    T = w.shape[-1]
    return np.ma.masked_array(np.sqrt(np.clip(w, 0, 1)), mask=np.triu(np.ones((T, T), dtype=bool), 1))


def _short(token: str) -> str:
    return token.replace("\n", "\u23ce").replace("\t", "\u21e5").replace(" ", "\u00b7") or "\u2205"


def grid_figure(weights: torch.Tensor | np.ndarray, title: str = "") -> Figure:
    """weights (L, H, T, T) -> a figure of L rows x H columns of heatmaps (its axes in row-major order).
    Its size is exact: (H * CELL_INCHES + left margin) x (L * CELL_INCHES + top margin) inches at DPI."""
    w = np.asarray(weights, dtype=np.float32)
    L, H = w.shape[:2]
    left, top = MARGIN_INCHES
    fig = Figure(figsize=(H * CELL_INCHES + left, L * CELL_INCHES + top), dpi=DPI)
    fig.patch.set_facecolor("white")
    width, height = fig.get_size_inches()
    for layer in range(L):
        for head in range(H):
            x0 = (left + head * CELL_INCHES + 0.04) / width
            y0 = 1 - (top + (layer + 1) * CELL_INCHES - 0.04) / height
            ax = fig.add_axes((x0, y0, (CELL_INCHES - 0.08) / width, (CELL_INCHES - 0.08) / height))
            ax.imshow(_masked(w[layer, head]), cmap=CMAP, vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            for side in ax.spines.values():
                side.set_visible(False)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=9)
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=9)
    if title:
        fig.text(0.01, 1 - 0.12 / height, title, fontsize=9, va="top")
    return fig


def layer_figure(weights: torch.Tensor | np.ndarray, layer: int, tokens: list[str] | None = None) -> Figure:
    """One layer's heads in rows of up to 4, with the tokens on the axes when there are at most 40."""
    w = np.asarray(weights[layer], dtype=np.float32)  # (H, T, T)
    H, T = w.shape[0], w.shape[-1]
    cols = min(H, 4)
    rows = math.ceil(H / cols)
    labelled = tokens is not None and T <= 40
    size = 3.2 if labelled else 2.4
    fig = Figure(figsize=(cols * size, rows * size + 0.4), dpi=DPI)
    axes = fig.subplots(rows, cols, squeeze=False)
    fig.suptitle(
        f"layer {layer}: attention of each query (row) over the keys (columns), colour = \u221aweight", fontsize=10
    )
    for h, ax in enumerate(axes.flat):
        if h >= H:
            ax.axis("off")
            continue
        ax.imshow(_masked(w[h]), cmap=CMAP, vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(f"head {h}", fontsize=9)
        if labelled:
            labels = [_short(t) for t in tokens]
            ax.set_xticks(range(T), labels, fontsize=6, rotation=90)
            ax.set_yticks(range(T), labels, fontsize=6)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.tight_layout()
    return fig


def grid_image(weights: torch.Tensor | np.ndarray, min_cell: int = 48, gap: int = 2) -> np.ndarray:
    """weights (L, H, T, T) -> uint8 RGB (height, width, 3): the grid of heatmaps, each T x T upscaled to at
    least `min_cell` pixels, `gap` white pixels between them.  No text: cell (l, h) is row l, column h."""
    w = np.asarray(weights, dtype=np.float32)
    L, H, T = w.shape[0], w.shape[1], w.shape[-1]
    scale = max(1, math.ceil(min_cell / T))
    cell = T * scale
    lut = (matplotlib.colormaps[CMAP](np.linspace(0, 1, 256))[:, :3] * 255).astype(np.uint8)
    values = np.round(np.sqrt(np.clip(w, 0, 1)) * 255).astype(np.uint8)
    rgb = lut[values]  # (L, H, T, T, 3)
    rgb[..., np.triu(np.ones((T, T), dtype=bool), 1), :] = 235  # masked: light grey
    rgb = rgb.repeat(scale, axis=2).repeat(scale, axis=3)
    image = np.full((L * cell + (L + 1) * gap, H * cell + (H + 1) * gap, 3), 255, dtype=np.uint8)
    for layer in range(L):
        for head in range(H):
            y, x = gap + layer * (cell + gap), gap + head * (cell + gap)
            image[y : y + cell, x : x + cell] = rgb[layer, head]
    return image


def save_figures(
    weights: torch.Tensor | np.ndarray, tokens: list[str], out_dir: str | Path, title: str = ""
) -> list[Path]:
    """attention_grid.png and attention_layer{N}.png for each layer; returns their paths.  A previous capture's
    figures of layers this model lacks go: the folder's figures are then one capture's (the user's files stay)."""
    out_dir = Path(out_dir)
    for old in out_dir.glob("attention_layer*.png"):
        if (found := re.fullmatch(r"attention_layer(\d+)\.png", old.name)) and int(found[1]) >= len(weights):
            old.unlink()
    paths = []
    # a token the font cannot draw (CJK in DejaVu Sans) is a box in the labels, and the page shows it: no warning
    # with a source line for each figure (laying out and saving draw them; filtered here, not in the user's process)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"Glyph \d+ .*missing from font", UserWarning)
        figures = [("attention_grid.png", grid_figure(weights, title))]
        figures += [
            (f"attention_layer{layer}.png", layer_figure(weights, layer, tokens)) for layer in range(len(weights))
        ]
        for name, fig in figures:
            fig.savefig(out_dir / name, dpi=DPI, facecolor="white")
            paths.append(out_dir / name)
    return paths
