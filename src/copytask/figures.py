"""What every copytask figure is drawn with: panels, the chance line, an annotated matrix, and the
attention map of one example (a sample dict of attention_samples.json, analysis.json or decode).

Figures are `matplotlib.figure.Figure`s, drawn and saved without pyplot and without choosing a
backend, so that drawing one changes nothing in the caller's process (a notebook's inline figures
stay on); `save` writes the file.
"""

from __future__ import annotations

import textwrap
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from .data.batches import copied_source_positions
from .data.vocab import noise_token, symbol

COLUMNS = 3  # panels per row: five to a row made strips of panels too small to read

# One colour and marker per model, fixed by its name, so that a model looks the same in every figure of every
# report: the baseline black, attention in tab10's colours, the fixed-state and Transformer models apart. A name
# not listed (a type of the user's own, a multi-head label) draws its own from EXTRA_STYLES by a hash of the name.
MODEL_STYLES = {
    "none": ("black", "o"),
    "rnnencdec": ("tab:gray", "X"),
    "bahdanau": ("tab:blue", "s"),
    "luong_general": ("tab:orange", "^"),
    "luong_dot": ("tab:green", "v"),
    "luong_concat": ("tab:red", "D"),
    "scaled_dot": ("tab:purple", "<"),
    "multihead": ("tab:brown", ">"),
    "luong_local": ("tab:pink", "p"),
    "luong_local_m": ("tab:olive", "h"),
    "transformer": ("navy", "*"),
    "transformer_learned": ("slateblue", "d"),
    "linear": ("tab:cyan", "P"),
    "mamba": ("darkgreen", "H"),
    "mamba_lti": ("limegreen", "8"),  # Mamba with the selection ablated: its green, lighter
}
EXTRA_STYLES = list(
    zip(("goldenrod", "crimson", "teal", "sienna", "orchid", "yellowgreen", "steelblue", "salmon"), "8*pHd<>v")
)


def model_style(name: str) -> tuple[str, str]:
    """(colour, marker) of a model, by its name (MODEL_STYLES)."""
    if name in MODEL_STYLES:
        return MODEL_STYLES[name]
    return EXTRA_STYLES[zlib.crc32(name.encode()) % len(EXTRA_STYLES)]


def colours(names: list[str]) -> dict[str, str]:
    """Each model's colour, by its name (`model_style`): the same in every figure of every report."""
    return {name: model_style(name)[0] for name in names}


def model_order(names) -> list[str]:
    """Models in one order in every figure and legend: MODEL_STYLES' (the baseline first), then the others."""
    names = list(dict.fromkeys(names))
    listed = [name for name in MODEL_STYLES if name in names]
    return listed + sorted(name for name in names if name not in MODEL_STYLES)


def legend_outside(figure: Figure, axes: list[Axes], **options) -> None:
    """One legend for the whole figure, of every label its `axes` draw (once each), under the panels where it
    covers no data and no title (the figure's layout must be constrained); in at most four columns, and fewer
    where four are wider than the figure (one panel's five entries were cut off at both edges)."""
    handles = {}
    for axis in axes:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    for columns in range(min(len(handles), 4), 0, -1):
        legend = figure.legend(
            handles.values(), handles.keys(), loc="outside lower center", ncol=columns, fontsize="small", **options
        )
        if columns == 1 or legend.get_window_extent().width <= figure.bbox.width:
            return
        legend.remove()


def panels(count: int, width: float = 4.0, height: float = 3.2) -> tuple[Figure, list[Axes]]:
    """`count` panels, at most COLUMNS to a row; the unused ones are hidden."""
    rows, columns = -(-count // COLUMNS), min(count, COLUMNS)
    figure = Figure(figsize=(width * columns, height * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.flat[count:]:
        axis.set_visible(False)
    return figure, list(axes.flat[:count])


def save(figure: Figure, path: Path, dpi: int = 120) -> Path:
    """Write `figure` to `path` (its folder made if need be); the format follows the suffix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    return path


def fitted(title: str, width: float, fontsize: float = 10.0) -> str:
    """`title` broken into lines that fit a figure `width` inches wide (a character of a
    `fontsize`-point sans-serif font is about 0.6 of its size wide), so a small map's long title is
    not clipped at both ends."""
    characters = max(20, int(0.85 * width * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, width=characters) for line in title.split("\n"))


def draw_chance(ax: Axes, chance: float) -> None:
    """The chance level (`chance`, a fraction) as a dashed grey line on an accuracy axis in %,
    labelled for the legend."""
    ax.axhline(100 * chance, color="grey", linestyle="--", label=f"chance ({100 * chance:.1f}%)")


def draw_matrix(ax: Axes, matrix: pd.DataFrame, scale: float, number: str, fontsize: int, **imshow) -> ScalarMappable:
    """`matrix` (values in [0, 1]) times `scale` as an image on `ax`, each cell written with `number`
    (white on dark cells), its index and columns as tick labels. -> the image, for a colour bar."""
    values = scale * matrix.to_numpy()
    image = ax.imshow(values, vmin=0, vmax=scale, cmap="viridis", **imshow)
    for (i, j), value in np.ndenumerate(values):
        ax.text(
            j,
            i,
            number.format(value),
            ha="center",
            va="center",
            fontsize=fontsize,
            color="white" if value < 0.6 * scale else "black",
        )
    ax.set_xticks(range(matrix.shape[1]), matrix.columns)
    ax.set_yticks(range(matrix.shape[0]), matrix.index)
    return image


def draw_attention(ax: Axes, weights: np.ndarray, sample: dict, vocab_size: int, task: str) -> ScalarMappable:
    """One attention map on `ax`: `weights` (T_dec, T_enc), output steps (rows) against the source
    positions of `sample` (its `source` and `target` tokens, and `output`, the greedy output, where
    known), symbols on both axes, one colour scale from 0 to 1 for every map. Output symbols that
    differ from the target are red; selective copying's noise tokens (`_`) are grey; the source position
    each output step copies (`batches.copied_source_positions`) is outlined. -> the image, for a colour bar."""
    rows, columns = weights.shape
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    font = 7 if max(rows, columns) > 30 else 9
    rows_symbols = sample.get("output", sample["target"])
    ax.set_xticks(range(columns), [symbol(t, vocab_size) for t in sample["source"]], fontsize=font)
    ax.set_yticks(range(rows), [symbol(t, vocab_size) for t in rows_symbols[:rows]], fontsize=font)
    for label, token in zip(ax.get_xticklabels(), sample["source"]):
        if token == noise_token(vocab_size):
            label.set_color("grey")
    for label, output, target in zip(ax.get_yticklabels(), rows_symbols, sample["target"]):
        if output != target:
            label.set_color("red")
    for step, position in enumerate(copied_source_positions(task, sample["source"][:columns], vocab_size)):
        ax.add_patch(Rectangle((position - 0.5, step - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=0.8))
    ax.set(
        xlabel="source symbol", ylabel="output symbol (greedy; red: wrong)" if "output" in sample else "target symbol"
    )
    return image


def plot_attention(sample: dict, vocab_size: int, task: str, title: str, path: Path) -> Path:
    """The attention map of one example (`draw_attention`): `sample["weights"]` (T_dec, T_enc), or
    (heads, T_dec, T_enc) for one panel per head."""
    weights = np.asarray(sample["weights"], dtype=float)
    maps = weights[None] if weights.ndim == 2 else weights
    # about 9 pt per cell keeps a length-80 map readable; a target shorter than its source (selective copying)
    # gets a map as wide as its source and only as tall as its rows
    size = max(4.0, 0.13 * max(maps.shape[1:]))
    height = max(4.0, 0.13 * maps.shape[1] + 1.5) if maps.shape[1] < maps.shape[2] else size
    figure, axes = panels(len(maps), width=size + (1.5 if len(maps) == 1 else 0.5), height=height)
    for head, (ax, head_weights) in enumerate(zip(axes, maps)):
        image = draw_attention(ax, head_weights, sample, vocab_size, task)
        if len(maps) > 1:
            ax.set_title(f"head {head}")
    figure.suptitle(
        fitted(title, figure.get_figwidth())
    )  # over the whole figure: a small map's axes are narrower than the title
    figure.colorbar(image, ax=axes, fraction=0.04, label="attention weight")
    return save(figure, path, dpi=100)
