"""Figures for the analysis in report.md, drawn from `analysis_tables`' tables of the runs'
analysis.json files (run folders only: nothing here loads a model).

- `plot_counterfactual(analysis_table(analyses), path)`: accuracy vs length under each counterfactual
- `plot_length_generalisation(length_generalisation_table(analyses), path)`: train x test length
- `plot_extrapolation(length_generalisation_table(analyses), path)`: accuracy vs test length, the trained range shaded
- `plot_per_length(ax, per_length_table(analyses))`: variable-length curves onto an accuracy-vs-length axis
- `plot_head_weights(read_json(run / "analysis.json"), vocab_size, path)`: one heatmap per attention head
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes

from ..figures import (
    draw_chance,
    draw_matrix,
    fitted,
    legend_outside,
    model_order,
    model_style,
    panels,
    plot_attention,
    save,
)
from .analysis_tables import COUNTERFACTUALS
from .tables import setting_value

REPLACED_STYLES = [("dimgray", ":"), ("darkgray", "-."), ("silver", "-")]  # not the chance line's dashes
GROUP = ["attention", "task"]  # one panel per attention type and task (and setting, where a grid has settings)
PANEL_WIDTH, MATRIX_WIDTH = 4.0, 4.4  # inches per panel


def _model_groups(table: pd.DataFrame, keys: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """`table` grouped by `keys` (the model, `attention`, first), in the one model order of every figure."""
    order = model_order(table["attention"])
    return sorted(table.groupby(keys, dropna=False), key=lambda group: order.index(group[0][0]))


def _title(keys: list[str], values: tuple, width: float) -> str:
    """`luong_general (copy)`, then the setting on a second line: `model.hidden_size=16`, fitted to a
    panel `width` inches wide."""
    attention, task, *setting = values
    title = f"{attention} ({task})"
    setting_line = ", ".join(f"{key}={setting_value(value)}" for key, value in zip(keys[len(GROUP) :], setting))
    return fitted(f"{title}\n{setting_line}" if setting else title, 0.75 * width)  # the axes: the panel less its labels


def plot_counterfactual(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """Greedy token accuracy (%) vs train length with the model's own attention and under each
    counterfactual, mean over seeds, and the chance level (`table`'s `chance` column, from the
    results table); one panel per attention type, task and value of `settings` (columns of
    `table`), fixed-length runs only."""
    table = table[table.train_length == table.length.astype(str)]
    keys = [*GROUP, *settings]
    groups = _model_groups(table, keys)
    figure, axes = panels(len(groups), width=PANEL_WIDTH)
    for ax, (values, runs) in zip(axes, groups):
        means = runs.groupby("length")[["own", *COUNTERFACTUALS]].mean()
        colour, marker = model_style(values[0])
        ax.plot(means.index, 100 * means["own"], color=colour, marker=marker, label="own")
        for name, (shade, line) in zip(COUNTERFACTUALS, REPLACED_STYLES):  # greys: no model's colour
            ax.plot(means.index, 100 * means[name], color=shade, linestyle=line, marker="o", markersize=3, label=name)
        for chance in runs["chance"].unique():
            draw_chance(ax, chance)
        ax.set(
            title=_title(keys, values, PANEL_WIDTH),
            xlabel="sequence length",
            ylabel="greedy token accuracy %",
            ylim=(-2, 102),
        )
        ax.set_xscale("log", base=2)
        ax.set_xticks(means.index, [str(n) for n in means.index])
    legend_outside(figure, axes, title="attention weights")
    return save(figure, path)


def plot_length_generalisation(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """Train length (rows) x test length (columns) greedy token accuracy in %, mean over seeds;
    one panel per attention type, task and value of `settings` (columns of `table`), the baseline first."""
    keys = [*GROUP, *settings]
    groups = _model_groups(table, keys)
    figure, axes = panels(len(groups), width=MATRIX_WIDTH, height=3.8)
    for ax, (values, runs) in zip(axes, groups):
        matrix = runs.pivot_table(index="train_length", columns="test_length", values="token_acc", aggfunc="mean")
        # numeric order of the rows ("5" < "40" < "5-80"), not string order
        matrix = matrix.loc[sorted(matrix.index, key=lambda label: tuple(map(int, label.split("-")))[::-1])]
        image = draw_matrix(ax, matrix, scale=100, number="{:.0f}", fontsize=7)
        ax.set(title=_title(keys, values, MATRIX_WIDTH), xlabel="test length", ylabel="train length")
    figure.colorbar(image, ax=axes, shrink=0.8, label="greedy token accuracy % (mean over seeds)")
    figure.suptitle(
        fitted(
            "Each model trained at the length of its row (a range such as 5-80: at every length in it at "
            "once), tested at the length of its column",
            figure.get_figwidth(),
            11,
        )
    )
    return save(figure, path)


def extrapolates(table: pd.DataFrame) -> bool:
    """Whether `length_generalisation_table` rows test some run beyond every length its grid trained at."""
    if table.empty:
        return False
    trained = table["train_length"].map(lambda lengths: int(lengths.split("-")[-1]))
    return table["test_length"].max() > trained.max()


def plot_extrapolation(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """Greedy token accuracy (%) against test length, one line per attention type (mean over seeds,
    the band their range), the trained lengths shaded and the chance level (a `chance` column, where
    `table` has one); one panel per task, train length and value of `settings`. A length a model is
    not defined at (learned positions past their table) is left out."""
    keys = ["task", "train_length", *settings]
    groups = list(table.groupby(keys, dropna=False))
    figure, axes = panels(len(groups), width=1.5 * PANEL_WIDTH, height=4.0)
    for ax, (values, runs) in zip(axes, groups):
        task, train_length, *setting = values
        bounds = [int(n) for n in train_length.split("-")]  # "40" or "5-40"
        ax.axvspan(bounds[0], bounds[-1], color="0.9", label="trained lengths")
        for (attention,), rows in _model_groups(runs, ["attention"]):
            accuracy = 100 * rows.dropna(subset=["token_acc"]).groupby("test_length")["token_acc"].agg(
                ["mean", "min", "max"]
            )
            colour, marker = model_style(attention)
            ax.plot(accuracy.index, accuracy["mean"], marker=marker, markersize=4, color=colour, label=attention)
            ax.fill_between(accuracy.index, accuracy["min"], accuracy["max"], color=colour, alpha=0.15, linewidth=0)
        for chance in runs["chance"].dropna().unique() if "chance" in runs else []:
            draw_chance(ax, chance)
        setting_line = ", ".join(f"{key}={value}" for key, value in zip(settings, setting))
        title = f"{task}, trained on lengths {train_length}" + (f"\n{setting_line}" if setting else "")
        ax.set(
            title=fitted(title, 1.1 * PANEL_WIDTH),
            xlabel="test length",
            ylabel="greedy token accuracy %",
            ylim=(-2, 102),
        )
    legend_outside(figure, axes)
    return save(figure, path)


def plot_per_length(
    ax: Axes, table: pd.DataFrame, metric: str = "token_acc", colours: dict[str, str] | None = None
) -> Axes:
    """Draw each variable-length model's `metric` (in %) at every length in its range (mean over
    seeds) onto `ax`, an accuracy-vs-length axis in % that may already hold the per-length models'
    points; dashed, in the colour `colours` gives its attention type (if any). No rows: nothing drawn."""
    if table.empty:
        return ax
    for (attention, task, lengths), runs in table.groupby([*GROUP, "train_length"]):
        curve = runs.groupby("test_length")[metric].mean()
        colour = (colours or {}).get(attention)
        ax.plot(
            curve.index,
            100 * curve.to_numpy(),
            linestyle="--",
            color=colour,
            label=f"{attention} ({task}) trained on {lengths}",
        )
    return ax


def plot_head_weights(analysis: dict, vocab_size: int, path: Path) -> Path:
    """One heatmap per head for the first held-out example of a multi-head run, from its analysis.json."""
    title = f"{analysis['attention']} ({analysis['task']}, length {analysis['length']})"
    return plot_attention(analysis["head_weights"], vocab_size, analysis["task"], title, path)
