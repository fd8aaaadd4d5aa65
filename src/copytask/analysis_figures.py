"""Figures for the analysis in report.md, drawn from the tables and analysis.json files of
`copytask.analysis` (run folders only: nothing here loads a model).

- `plot_counterfactual(analysis_table(analyses), path)`: accuracy vs length under each counterfactual
- `plot_length_generalisation(length_generalisation_table(analyses), path)`: train x test length
- `plot_per_length(ax, per_length_table(analyses))`: variable-length curves onto an accuracy-vs-length axis
- `plot_head_weights(read_json(run / "analysis.json"), path)`: one heatmap per attention head
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from .analysis import COUNTERFACTUALS  # noqa: E402

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


def _save(figure, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_counterfactual(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """Greedy token accuracy vs train length with the model's own attention and under each
    counterfactual, mean over seeds; one panel per attention type, task and value of `settings`
    (columns of `table`), fixed-length runs only."""
    table = table[table.train_length == table.length.astype(str)]
    keys = [*GROUP, *settings]
    groups = list(table.groupby(keys, dropna=False))
    figure, axes = _panels(len(groups))
    for ax, (values, runs) in zip(axes, groups):
        means = runs.groupby("length")[["own", *COUNTERFACTUALS]].mean()
        for name in ("own", *COUNTERFACTUALS):
            ax.plot(means.index, means[name], marker="o", label=name)
        ax.set(title=_title(keys, values), xlabel="sequence length", ylabel="greedy token accuracy", ylim=(0, 1.02))
        ax.set_xscale("log", base=2)
        ax.set_xticks(means.index, [str(n) for n in means.index])
    axes[0].legend(title="attention weights")
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


def plot_head_weights(analysis: dict, path: Path) -> Path:
    """One heatmap per head (output step x source position) for the first held-out example of a
    multi-head run, from its analysis.json."""
    sample = analysis["head_weights"]
    weights = np.asarray(sample["weights"])  # (heads, L + 1, L)
    figure, axes = _panels(weights.shape[0], width=3.2, height=3.4)
    for head, ax in enumerate(axes):
        ax.imshow(weights[head], vmin=0, vmax=1, cmap="Greys", aspect="auto")
        ax.set(title=f"head {head}", xlabel="source position", ylabel="output step")
    figure.suptitle(f"{analysis['attention']} ({analysis['task']}, length {analysis['length']})")
    return _save(figure, path)
