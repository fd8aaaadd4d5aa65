"""Figures for the analysis in report.md, drawn from the tables and analysis.json files of
`copytask.analysis` (run folders only: nothing here loads a model).

- `plot_counterfactual(analysis_table(analyses), path)`: accuracy vs length under each counterfactual
- `plot_length_generalisation(length_generalisation_table(analyses), path)`: train x test length
- `plot_per_length(ax, per_length_table(analyses))`: variable-length curves onto an accuracy-vs-length axis
- `plot_head_weights(read_json(run / "analysis.json"), vocab_size, path)`: one heatmap per attention head
- `plot_attention(sample, vocab_size, task, title, path)`: the attention map of one example (or one
  per head), as the report and `copytask decode --png` draw it
- `draw_chance(ax, chance)`: the chance level on an accuracy axis in %
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from matplotlib.patches import Rectangle  # noqa: E402

from .analysis import COUNTERFACTUALS, copied_source_positions  # noqa: E402
from .vocab import symbol  # noqa: E402

GROUP = ["attention", "task"]  # one panel per attention type and task (and setting, where a grid has settings)
COLUMNS = 5  # panels per row


def _panels(count: int, width: float = 4.0, height: float = 3.2):
    """`count` panels, at most COLUMNS to a row; the unused ones are hidden."""
    rows, columns = -(-count // COLUMNS), min(count, COLUMNS)
    figure, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows), squeeze=False, layout="constrained")
    for axis in axes.flat[count:]:
        axis.set_visible(False)
    return figure, axes.flat[:count]


def _title(keys: list[str], values: tuple) -> str:
    """`luong_general (copy)`, then the setting on a second line: `model.hidden_size=16`."""
    attention, task, *setting = values
    title = f"{attention} ({task})"
    return title + ("\n" + ", ".join(f"{key}={value}" for key, value in zip(keys[len(GROUP):], setting)) if setting else "")


def _save(figure, path: Path, dpi: int = 120) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def draw_chance(ax: plt.Axes, chance: float) -> None:
    """The chance level (`chance`, a fraction) as a dashed grey line on an accuracy axis in %,
    labelled for the legend."""
    ax.axhline(100 * chance, color="grey", linestyle="--", label=f"chance ({100 * chance:.1f}%)")


def plot_counterfactual(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """Greedy token accuracy (%) vs train length with the model's own attention and under each
    counterfactual, mean over seeds, and the chance level (`table`'s `chance` column, from the
    results table); one panel per attention type, task and value of `settings` (columns of
    `table`), fixed-length runs only."""
    table = table[table.train_length == table.length.astype(str)]
    keys = [*GROUP, *settings]
    groups = list(table.groupby(keys, dropna=False))
    figure, axes = _panels(len(groups))
    for ax, (values, runs) in zip(axes, groups):
        means = runs.groupby("length")[["own", *COUNTERFACTUALS]].mean()
        for name in ("own", *COUNTERFACTUALS):
            ax.plot(means.index, 100 * means[name], marker="o", label=name)
        for chance in runs["chance"].unique():
            draw_chance(ax, chance)
        ax.set(title=_title(keys, values), xlabel="sequence length", ylabel="greedy token accuracy %", ylim=(-2, 102))
        ax.set_xscale("log", base=2)
        ax.set_xticks(means.index, [str(n) for n in means.index])
    axes[0].legend(title="attention weights", fontsize="small")
    return _save(figure, path)


def draw_matrix(ax: plt.Axes, matrix: pd.DataFrame, scale: float, number: str, fontsize: int, **imshow) -> plt.cm.ScalarMappable:
    """`matrix` (values in [0, 1]) times `scale` as an image on `ax`, each cell written with `number`
    (white on dark cells), its index and columns as tick labels. -> the image, for a colour bar."""
    values = scale * matrix.to_numpy()
    image = ax.imshow(values, vmin=0, vmax=scale, cmap="viridis", **imshow)
    for (i, j), value in np.ndenumerate(values):
        ax.text(j, i, number.format(value), ha="center", va="center", fontsize=fontsize, color="white" if value < 0.6 * scale else "black")
    ax.set_xticks(range(matrix.shape[1]), matrix.columns)
    ax.set_yticks(range(matrix.shape[0]), matrix.index)
    return image


def plot_length_generalisation(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """Train length (rows) x test length (columns) greedy token accuracy, mean over seeds;
    one panel per attention type, task and value of `settings` (columns of `table`)."""
    keys = [*GROUP, *settings]
    groups = list(table.groupby(keys, dropna=False))
    figure, axes = _panels(len(groups), width=4.4, height=3.8)
    for ax, (values, runs) in zip(axes, groups):
        matrix = runs.pivot_table(index="train_length", columns="test_length", values="token_acc", aggfunc="mean")
        # numeric order of the rows ("5" < "40" < "5-80"), not string order
        matrix = matrix.loc[sorted(matrix.index, key=lambda label: tuple(map(int, label.split("-")))[::-1])]
        image = draw_matrix(ax, matrix, scale=1, number="{:.2f}", fontsize=7)
        ax.set(title=_title(keys, values), xlabel="test length", ylabel="train length")
    figure.colorbar(image, ax=list(axes), shrink=0.8, label="greedy token accuracy")
    return _save(figure, path)


def plot_per_length(ax: plt.Axes, table: pd.DataFrame, metric: str = "token_acc", colours: dict[str, str] | None = None) -> plt.Axes:
    """Draw each variable-length model's `metric` (in %) at every length in its range (mean over
    seeds) onto `ax`, an accuracy-vs-length axis in % that may already hold the per-length models'
    points; dashed, in the colour `colours` gives its attention type (if any). No rows: nothing drawn."""
    if table.empty:
        return ax
    for (attention, task, lengths), runs in table.groupby([*GROUP, "train_length"]):
        curve = runs.groupby("test_length")[metric].mean()
        colour = (colours or {}).get(attention)
        ax.plot(curve.index, 100 * curve.to_numpy(), linestyle="--", color=colour, label=f"{attention} ({task}) trained on {lengths}")
    return ax


def draw_attention(ax: plt.Axes, weights: np.ndarray, sample: dict, vocab_size: int, task: str) -> plt.cm.ScalarMappable:
    """One attention map on `ax`: `weights` (T_dec, T_enc), output steps (rows) against the source
    positions of `sample` (its `source` and `target` tokens, and `output`, the greedy output, where
    known), symbols on both axes, one colour scale from 0 to 1 for every map. Output symbols that
    differ from the target are red; the source position each output step copies
    (`analysis.copied_source_positions`) is outlined. -> the image, for a colour bar."""
    rows, columns = weights.shape
    image = ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    font = 7 if max(rows, columns) > 30 else 9
    rows_symbols = sample.get("output", sample["target"])
    ax.set_xticks(range(columns), [symbol(t, vocab_size) for t in sample["source"]], fontsize=font)
    ax.set_yticks(range(rows), [symbol(t, vocab_size) for t in rows_symbols[:rows]], fontsize=font)
    for label, output, target in zip(ax.get_yticklabels(), rows_symbols, sample["target"]):
        if output != target:
            label.set_color("red")
    for step, position in enumerate(copied_source_positions(task, columns)):
        ax.add_patch(Rectangle((position - 0.5, step - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=0.8))
    ax.set(xlabel="source symbol", ylabel="output symbol (greedy; red: wrong)" if "output" in sample else "target symbol")
    return image


def plot_attention(sample: dict, vocab_size: int, task: str, title: str, path: Path) -> Path:
    """The attention map of one example (`draw_attention`): `sample["weights"]` (T_dec, T_enc), or
    (heads, T_dec, T_enc) for one panel per head."""
    weights = np.asarray(sample["weights"], dtype=float)
    maps = weights[None] if weights.ndim == 2 else weights
    size = max(4.0, 0.13 * max(maps.shape[1:]))  # about 9 pt per cell keeps a length-80 map readable
    figure, axes = _panels(len(maps), width=size + (1.5 if len(maps) == 1 else 0.5), height=size)
    for head, (ax, head_weights) in enumerate(zip(axes, maps)):
        image = draw_attention(ax, head_weights, sample, vocab_size, task)
        if len(maps) > 1:
            ax.set_title(f"head {head}")
    if len(maps) > 1:
        figure.suptitle(title)
    else:
        axes[0].set_title(title)
    figure.colorbar(image, ax=list(axes), fraction=0.04, label="attention weight")
    return _save(figure, path, dpi=100)


def plot_head_weights(analysis: dict, vocab_size: int, path: Path) -> Path:
    """One heatmap per head for the first held-out example of a multi-head run, from its analysis.json."""
    title = f"{analysis['attention']} ({analysis['task']}, length {analysis['length']})"
    return plot_attention(analysis["head_weights"], vocab_size, analysis["task"], title, path)
