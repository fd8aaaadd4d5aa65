"""The results figures of a report, drawn from `tables.summarise`'s table (and the runs'
histories): accuracy against the x key (`report.x`) with every other varying key shown, never
pooled; the (setting, length) grid with the longest length copied; training curves.

Figures are `matplotlib.figure.Figure`s (see `copytask.figures`): no pyplot, no backend chosen.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..figures import colours, draw_chance, draw_matrix, fitted, legend_outside, model_order, model_style, save
from .analysis_figures import plot_per_length
from .tables import setting_value

SETTING_GRID_FIGURE = "accuracy_grid.png"
LONGEST_FIGURE = "longest_length.png"
LONGEST_THRESHOLDS = (0.99, 0.5)
LINE_STYLES = [
    ("-", "o"),
    ("--", "s"),
    (":", "^"),
    ("-.", "D"),
    ((0, (5, 1, 1, 1)), "v"),
]  # one per value of a styled setting


def label(column: str) -> str:
    return "sequence length" if column == "length" else column


def setting_title(keys: list[str], values: tuple) -> str:
    """`model.hidden_size=16, length=40`: one facet's or one run's setting, for titles."""
    return ", ".join(f"{key}={setting_value(value)}" for key, value in zip(keys, values))


def setting_suffix(keys: list[str], values: tuple) -> str:
    """`_model.hidden_size16`: a setting in file names (empty without settings)."""
    return "".join(f"_{key}{setting_value(value)}" for key, value in zip(keys, values))


def groups(table: pd.DataFrame, keys: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """(values, rows) per combination of `keys`, in sorted order; one group of everything without keys."""
    if not keys:
        return [((), table)]
    return [
        (values if isinstance(values, tuple) else (values,), rows) for values, rows in table.groupby(keys, dropna=False)
    ]


def set_numeric_axis(axis: Axes, values: list[float]) -> None:
    """Ticks at the values; a log scale where they are powers of two or span a decade."""
    values = sorted(values)
    powers_of_two = all(v > 0 and float(v).is_integer() and int(v) & (int(v) - 1) == 0 for v in values)
    if len(values) > 1 and values[0] > 0 and (powers_of_two or values[-1] / values[0] >= 10):
        axis.set_xscale("log", base=2 if powers_of_two else 10)
    axis.set_xticks(values, [setting_value(v) for v in values])
    axis.minorticks_off()


def draw_mean(
    axis: Axes, series: pd.DataFrame, x: str, metric: str, colour: str, style: tuple[str, str], name: str
) -> None:
    """`series`' mean `metric` against `x` in % (line style and marker `style`), its 95% interval as a
    band, or as an error bar where there is one point (a band over one point is not drawn at all)."""
    linestyle, marker = style
    mean, low, high = (
        100 * series[metric],
        100 * series[f"{metric}_lo"].clip(lower=0),
        100 * series[f"{metric}_hi"].clip(upper=1),
    )
    if len(series) > 1:
        axis.plot(series[x], mean, linestyle=linestyle, marker=marker, color=colour, label=name)
        axis.fill_between(series[x], low, high, color=colour, alpha=0.2, linewidth=0)
    else:
        # arrays: pandas 2.x warns at matplotlib's float() of a Series
        spread = None if low.isna().all() else [(mean - low).to_numpy(), (high - mean).to_numpy()]
        axis.errorbar(series[x], mean, yerr=spread, marker=marker, capsize=4, color=colour, label=name)


def plot_accuracy(
    summary: pd.DataFrame, settings: list[str], x: str, stem: Path, per_length: pd.DataFrame
) -> list[Path]:
    """Token and sequence accuracy against `x` (a column of `summary`), mean and 95% band over
    seeds, one colour per attention type. The other keys that vary are shown, not pooled: the last
    one as a line style when there are two or more, the rest as one row of panels per value. The
    variable-length models' accuracy per length (`analysis_tables.per_length_table`) is dashed, when
    nothing else varies."""
    others = [key for key in [*settings, "length"] if key != x and summary[key].nunique(dropna=False) > 1]
    style_key = others[-1] if len(others) >= 2 else None
    facet_keys = [key for key in others if key != style_key]
    # keyed by how a value reads: a setting some runs lack (NaN: `task.copied` of copy beside selective copying)
    # is a style of its own, not a line dropped
    style_values = [None]
    if style_key:
        values = summary[style_key]
        style_values = sorted(values.dropna().unique()) + ([math.nan] if values.isna().any() else [])
    style = {setting_value(value): LINE_STYLES[i % len(LINE_STYLES)] for i, value in enumerate(style_values)}
    facets = groups(summary, facet_keys)
    figure = Figure(figsize=(12, 0.8 + 3.6 * len(facets)), layout="constrained")
    axes = figure.subplots(len(facets), 2, sharex=True, squeeze=False)
    colour = colours(summary["attention"].unique())
    order = model_order(summary["attention"])
    for (values, rows), row_axes in zip(facets, axes):
        facet = setting_title(facet_keys, values)
        for axis, metric, title in zip(
            row_axes, ("token_acc", "seq_acc"), ("greedy token accuracy", "exact-sequence accuracy")
        ):
            lines = rows.groupby(["attention", *([style_key] if style_key else [])], sort=False, dropna=False)
            for (attention, *style_value), series in sorted(lines, key=lambda line: order.index(line[0][0])):
                line = (style[setting_value(style_value[0] if style_key else None)][0], model_style(attention)[1])
                name = f"{attention}, {style_key}={setting_value(style_value[0])}" if style_key else attention
                draw_mean(axis, series.sort_values(x), x, metric, colour[attention], line, name)
            if x == "length" and not others:
                plot_per_length(axis, per_length, metric, colour)
            if metric == "token_acc":
                for chance in rows["chance"].unique():
                    draw_chance(axis, chance)
            set_numeric_axis(axis, list(summary[x].unique()))
            axis.set(
                title=f"{title}, {facet}" if facet else title,
                ylabel="% (held-out set, greedy decoding)",
                ylim=(-2, 102),
            )
            axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel(label(x))
    legend_outside(figure, list(axes.flat))
    figure.suptitle(fitted(f"Copy accuracy against {label(x)}: {drawn_interval(summary, x)}", 9, 12))
    paths = [
        stem.parent / f"{stem.name}.{suffix}" for suffix in ("png", "svg")
    ]  # not with_suffix: a stem may hold a dotted key
    for path in paths:
        save(figure, path)
    return paths


def drawn_interval(summary: pd.DataFrame, x: str) -> str:
    """What an accuracy figure's title says of the spread it draws: a 95% band (or bar, at one x) only where
    some point has more than one seed."""
    if (summary["seeds"] < 2).all():
        return "one seed per point, no interval"
    interval = "band" if summary[x].nunique() > 1 else "bar"
    return f"mean over seeds, {interval} = 95% interval"


def longest_lengths(summary: pd.DataFrame, key: str) -> pd.DataFrame:
    """Per attention type and value of `key`: the longest length whose mean greedy token accuracy
    is at least each of LONGEST_THRESHOLDS (NaN where no length reaches it)."""
    rows = []
    for (attention, value), runs in summary.groupby(["attention", key], sort=False):
        row = {"attention": attention, key: value}
        for threshold in LONGEST_THRESHOLDS:
            reached = runs.loc[runs["token_acc"] >= threshold, "length"]
            row[f"longest at {threshold:.0%}"] = reached.max() if len(reached) else math.nan
        rows.append(row)
    return pd.DataFrame(rows)


def plot_setting_grid(summary: pd.DataFrame, key: str, out: Path) -> list[Path]:
    """For one numeric setting beside the length (say `model.hidden_size`): mean greedy token
    accuracy over (setting, length) as a heatmap per attention type, and the longest length
    reaching each of LONGEST_THRESHOLDS against the setting, where the grid has lengths to compare
    and some length reaches a threshold (no figure is drawn empty). -> the files drawn."""
    attentions = model_order(summary["attention"])
    figure = Figure(figsize=(4.2 * len(attentions) + 1, 3.8), layout="constrained")
    axes = figure.subplots(1, len(attentions), squeeze=False)
    for axis, attention in zip(axes[0], attentions):
        matrix = summary[summary["attention"] == attention].pivot_table(index=key, columns="length", values="token_acc")
        matrix.index = matrix.index.map(setting_value)
        image = draw_matrix(axis, matrix, scale=100, number="{:.0f}", fontsize=8, origin="lower", aspect="auto")
        axis.set(title=attention, xlabel="sequence length", ylabel=key)
    figure.colorbar(image, ax=list(axes[0]), shrink=0.8, label="greedy token accuracy % (mean over seeds)")
    grid_path = save(figure, out / SETTING_GRID_FIGURE)

    longest = longest_lengths(summary, key)
    if summary["length"].nunique() < 2 or longest.filter(like="longest at").isna().all(axis=None):
        return [grid_path]
    figure = Figure(figsize=(8, 4.2), layout="constrained")
    axis = figure.subplots()
    by_model = dict(list(longest.groupby("attention", sort=False)))
    for attention, threshold in ((name, threshold) for name in attentions for threshold in LONGEST_THRESHOLDS):
        rows = by_model[attention]
        colour, marker = model_style(attention)
        axis.plot(
            rows[key],
            rows[f"longest at {threshold:.0%}"],
            linestyle=LINE_STYLES[LONGEST_THRESHOLDS.index(threshold)][0],
            marker=marker,
            color=colour,
            label=f"{attention}, >= {threshold:.0%}",
        )
    set_numeric_axis(axis, list(summary[key].unique()))
    lengths = sorted(summary["length"].unique())
    axis.set_yscale("log")
    axis.set_yticks(lengths, [str(length) for length in lengths])
    axis.minorticks_off()
    axis.set(
        xlabel=key, ylabel="longest length reached (grid lengths)", title="Longest length copied at a token accuracy"
    )
    axis.grid(alpha=0.3)
    legend_outside(figure, [axis])
    longest_path = save(figure, out / LONGEST_FIGURE)
    return [grid_path, longest_path]


def plot_curves(histories: list[tuple[int, str, pd.DataFrame]], attentions: list[str], title: str, path: Path) -> Path:
    """Training loss and validation greedy token accuracy against step: `histories` holds (length,
    attention type, history.csv) per run; one row of panels per length, one colour per attention
    type (in the order of `attentions`, as in every figure), one line per seed."""
    lengths = sorted({length for length, _, _ in histories})
    colour = colours(attentions)
    figure = Figure(figsize=(12, 2.6 * len(lengths)), layout="constrained")
    axes = figure.subplots(len(lengths), 2, squeeze=False)
    for length, attention, history in histories:
        loss_axis, acc_axis = axes[lengths.index(length)]
        loss_axis.plot(history["step"], history["loss"], color=colour[attention], alpha=0.7, label=attention)
        acc_axis.plot(
            history["step"], 100 * history["val_token_acc"], color=colour[attention], alpha=0.7, label=attention
        )
    for (loss_axis, acc_axis), length in zip(axes, lengths):
        loss_axis.set(yscale="log", ylabel=f"length {length}\ntraining loss")
        acc_axis.set(ylabel="validation token acc %", ylim=(-2, 102))
        for axis in (loss_axis, acc_axis):
            axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel("step")
    legend_outside(figure, list(axes.flat))
    if title:
        figure.suptitle(title)
    return save(figure, path, dpi=100)
