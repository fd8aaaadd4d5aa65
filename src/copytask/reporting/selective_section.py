"""report.md's section on selective copying (Gu and Dao, 2023, section 3.1), where the grid varies k (`task.copied`):
is a model bounded by how long its source is, or by how much of it must be copied? Greedy token accuracy against the
length L at each k that has two lengths or more (the content fixed, the length growing), and against k at each L
that has two k or more (the length fixed, the content growing), one line per model with its 95% band; beside the
first, as hollow markers, the plain copy task at L = k, the same content with no noise to skip. A table gives every
(k, L) per model with its interval. The other settings that vary are shown, not pooled: a row of panels each.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from ..figures import colours, draw_chance, fitted, legend_outside, model_order, model_style, save
from . import tables
from .analysis_sections import Section
from .result_figures import draw_mean, groups, set_numeric_axis, setting_title
from .tables import markdown_table

COPIED = "task.copied"  # k, a setting where the grid varies it (NaN in the rows of a task without it)
TASK = "task.name"
REFERENCE = "copy"  # the task whose runs at L = k are the content with no noise
SELECTIVE_FIGURE = "selective_copying.png"


def panels(selective: pd.DataFrame) -> list[tuple[str, float]]:
    """The panels the selective-copying rows (`summary`'s with a k) make: ("k", k) for each k with two lengths
    or more, then ("L", L) for each length with two k or more."""
    by_k = [("k", k) for k, rows in selective.groupby(COPIED) if rows["length"].nunique() > 1]
    by_length = [("L", length) for length, rows in selective.groupby("length") if rows[COPIED].nunique() > 1]
    return by_k + by_length


def other_settings(settings: list[str]) -> list[str]:
    """The settings besides the task and k: each value a row of panels, never pooled."""
    return [key for key in settings if key not in (COPIED, TASK)]


def plot_selective(summary: pd.DataFrame, settings: list[str], path: Path) -> Path | None:
    """Mean greedy token accuracy (%) with its 95% band against L at fixed k and against k at fixed L (`panels`),
    one colour and marker per model, the plain copy task at L = k hollow beside the first; one row of panels per
    value of the other settings. None where there is no such panel."""
    selective = summary[summary[COPIED].notna()]
    shown = panels(selective)
    if not shown:
        return None
    facets = groups(summary, other_settings(settings))
    figure = Figure(figsize=(4.4 * len(shown), 0.9 + 3.6 * len(facets)), layout="constrained")
    axes = figure.subplots(len(facets), len(shown), squeeze=False)
    colour, order = colours(summary["attention"].unique()), model_order(summary["attention"])
    for (values, rows), row_axes in zip(facets, axes):
        facet = setting_title(other_settings(settings), values)
        chosen = rows[rows[COPIED].notna()]
        reference = rows[(rows[COPIED].isna()) & (rows.get(TASK, REFERENCE) == REFERENCE)]
        for axis, (fixed, value) in zip(row_axes, shown):
            x = "length" if fixed == "k" else COPIED
            series = chosen[chosen[COPIED if fixed == "k" else "length"] == value]
            for attention in (name for name in order if name in set(series["attention"])):
                line = series[series["attention"] == attention].sort_values(x)
                draw_mean(axis, line, x, "token_acc", colour[attention], ("-", model_style(attention)[1]), attention)
            xs = list(series[x].unique())
            if fixed == "k":
                xs += draw_reference(axis, reference[reference["length"] == value], colour)
            for chance in series["chance"].unique():
                draw_chance(axis, chance)
            set_numeric_axis(axis, xs)
            title = f"k = {value:g} copied: against the length L" if fixed == "k" else f"L = {value:g}: against k"
            axis.set(
                title=f"{title}\n{facet}" if facet else title,
                xlabel="L, source positions" if fixed == "k" else "k, content symbols copied",
                ylabel="greedy token accuracy % (held-out)",
                ylim=(-2, 102),
            )
            axis.grid(alpha=0.3)
    legend_outside(figure, list(axes.flat))
    figure.suptitle(
        fitted(
            "Selective copying, length or content: mean over seeds, band = 95% interval; hollow: plain copy at L = k "
            "(no noise)",
            figure.get_figwidth(),
            12,
        )
    )
    return save(figure, path)


def draw_reference(axis, rows: pd.DataFrame, colour: dict[str, str]) -> list[float]:
    """The plain copy task's `rows` (at L = the panel's k) as hollow markers with their interval, one legend entry
    for them all -> the lengths drawn (for the axis' ticks)."""
    for row in rows.itertuples():
        mean, low, high = 100 * row.token_acc, 100 * max(row.token_acc_lo, 0), 100 * min(row.token_acc_hi, 1)
        spread = None if pd.isna(row.token_acc_lo) else [[mean - low], [high - mean]]
        axis.errorbar(
            [row.length], [mean], yerr=spread, marker=model_style(row.attention)[1], mfc="none", capsize=3,
            color=colour[row.attention], linestyle="none", label="_nolegend_",
        )  # fmt: skip
    if len(rows):
        axis.plot([], [], marker="o", mfc="none", color="grey", linestyle="none", label="plain copy at L = k")
    return list(rows["length"].unique())


def selective_table(summary: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """Mean greedy token accuracy % [95% interval] per model (and other setting) and (k, L): a column per
    selective-copying (k, L) in order, the plain copy task's lengths first."""
    reference = summary[summary[COPIED].isna() & (summary.get(TASK, REFERENCE) == REFERENCE)]
    shown = pd.concat([reference, summary[summary[COPIED].notna()]])
    shown = shown.assign(
        column=[
            f"copy L={row.length}" if pd.isna(copied) else f"k={copied:g} L={row.length}"
            for row, copied in zip(shown.itertuples(), shown[COPIED])
        ],
        cell=[tables.with_interval(r.token_acc, r.token_acc_lo, r.token_acc_hi) for r in shown.itertuples()],
        order=[(0 if pd.isna(copied) else copied, length) for copied, length in zip(shown[COPIED], shown["length"])],
    )
    columns = list(dict.fromkeys(shown.sort_values("order")["column"]))
    index = [*other_settings(settings), "attention"]
    table = shown.pivot_table(index=index, columns="column", values="cell", aggfunc="first")[columns].fillna("")
    table = table.reset_index()
    table["attention"] = pd.Categorical(table["attention"], model_order(table["attention"]), ordered=True)
    return table.sort_values(index).astype({"attention": str})


def selective_section(summary: pd.DataFrame, settings: list[str], out: Path) -> Section:
    """The figure, its table and how to read them, where the grid varies k (`task.copied`); nothing otherwise."""
    if COPIED not in settings:
        return Section([], [])
    path = plot_selective(summary, settings, out / SELECTIVE_FIGURE)
    lines = [
        "## Selective copying: the length or the content?",
        "",
        "Gu and Dao's selective copying (2023, section 3.1): k content symbols (`task.copied`) at random positions, "
        "in order, among L - k noise tokens (`_`); the target is the k symbols, then EOS. Chance is still "
        "1 / vocabulary per symbol. Where accuracy falls as L grows at a fixed k, the model is bounded by the "
        "length of its source; where it falls as k grows at a fixed L, by how much it must hold. The plain copy "
        "task at L = k holds the same content with no noise to skip.",
        "",
    ]
    if path is not None:
        lines += [f"![selective copying, length or content]({path.name})", ""]
    lines += [
        "Mean greedy token accuracy % over seeds [95% interval] (the comparison table above has sequence accuracy "
        "and the rest):",
        "",
        markdown_table(selective_table(summary, settings)),
        "",
    ]
    return Section(lines, [] if path is None else [path])
