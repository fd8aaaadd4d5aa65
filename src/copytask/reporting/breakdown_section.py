"""report.md's section on where a model's accuracy is lost, from the runs' breakdowns
(`evaluation.breakdown`, `evaluation.probe`; tables in `breakdown_tables`):

- a table per setting, length and attention type: greedy, teacher-forced and beam-search token
  accuracy on the same held-out sequences, and the probe's mean accuracy on the trained and untrained
  summary vector;
- `plot_by_position`: token accuracy by output position, greedy and teacher-forced;
- `plot_probe`: the probe's accuracy by source position, trained and untrained, with chance.

Each figure has one panel per (setting, train length), one colour per attention type, and the seeds
as a band (their lowest and highest) around their mean.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes

from ..figures import draw_chance, panels, save
from . import tables
from .breakdown_tables import breakdown_table, position_table, probe_table
from .result_figures import colours, setting_title

POSITION_FIGURE = "accuracy_by_position.png"
PROBE_FIGURE = "probe.png"
PANEL_WIDTH = 4.0


def _panels(table: pd.DataFrame, settings: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per setting and train length, shortest length first."""
    keys = [*settings, "train_length"]
    grouped = table.groupby(keys, dropna=False, sort=False)
    ordered = sorted(grouped, key=lambda item: (str(item[0][:-1]), int(str(item[0][-1]).split("-")[-1])))
    return [(setting_title(keys, values), rows) for values, rows in ordered]


def _band(ax: Axes, rows: pd.DataFrame, x: str, y: str, **style) -> None:
    """The mean over seeds of `y` against `x` in %, and the seeds' range as a band."""
    stats = rows.groupby(x)[y].agg(["mean", "min", "max"])
    (line,) = ax.plot(stats.index, 100 * stats["mean"], **style)
    ax.fill_between(stats.index, 100 * stats["min"], 100 * stats["max"], color=line.get_color(), alpha=0.2, lw=0)


def plot_by_position(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """`position_table`'s token accuracy (%) against output position: greedy solid, teacher-forced dashed."""
    groups = _panels(table, list(settings))
    colour = colours(list(dict.fromkeys(table["attention"])))
    figure, axes = panels(len(groups), width=PANEL_WIDTH)
    for ax, (title, rows) in zip(axes, groups):
        for (attention, decoding), runs in rows.groupby(["attention", "decoding"], sort=False):
            style = "-" if decoding == "greedy" else "--"
            _band(
                ax, runs, "position", "token_acc", color=colour[attention], ls=style, label=f"{attention}, {decoding}"
            )
        ax.set(title=title, xlabel="output position", ylabel="token accuracy %", ylim=(-2, 102))
    axes[0].legend(fontsize="x-small")
    return save(figure, path)


def plot_probe(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """`probe_table`'s accuracy (%) against source position: the trained model's summary vector solid,
    the untrained one's dotted, and chance."""
    groups = _panels(table, list(settings))
    colour = colours(list(dict.fromkeys(table["attention"])))
    figure, axes = panels(len(groups), width=PANEL_WIDTH)
    for ax, (title, rows) in zip(axes, groups):
        for (attention, summary), runs in rows.groupby(["attention", "summary"], sort=False):
            style = "-" if summary == "trained" else ":"
            _band(ax, runs, "position", "accuracy", color=colour[attention], ls=style, label=f"{attention}, {summary}")
        draw_chance(ax, rows["chance"].iloc[0])
        ax.set(title=title, xlabel="source position", ylabel="probe accuracy %", ylim=(-2, 102))
    axes[0].legend(fontsize="x-small")
    return save(figure, path)


def breakdown_summary(table: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """`breakdown_table` per setting, length and attention type: greedy and teacher-forced token accuracy
    with a 95% interval (widened to the scored tokens' Wilson interval, as `tables.interval`), the mean of
    each beam width's and of the probe's, in % as strings."""
    keys = [*settings, "train_length", "attention"]
    beams = sorted((c for c in table if c.startswith("beam") and c.endswith("_token_acc")), key=lambda c: int(c[4:-10]))
    rows = []
    for values, group in table.groupby(keys, dropna=False, sort=False):
        row = {key: tables.setting_value(value) for key, value in zip(keys, values)} | {"seeds": len(group)}
        tokens = tables.scored(group, "breakdown_sequences")["token_acc"]
        for column, name in (("greedy_token_acc", "greedy"), ("tf_token_acc", "teacher-forced")):
            row[f"{name} % [95% CI]"] = tables.with_interval(*tables.interval(group[column], tokens))
        row |= {f"beam {c[4:-10]} %": tables.percent(group[c].mean()) for c in beams}
        for column, name in (("probe_acc", "probe %"), ("probe_untrained_acc", "probe untrained %")):
            if column in group:
                row[name] = tables.percent(group[column].mean())
        rows.append(row)
    summary = pd.DataFrame(rows)
    length = summary["train_length"].map(lambda text: int(text.split("-")[-1]))
    return summary.assign(_length=length).sort_values([*settings, "_length"], kind="stable").drop(columns="_length")


def breakdown_section(analyses: list[dict], settings: pd.DataFrame | None, out: Path) -> tuple[list[str], list[Path]]:
    """Markdown lines and figures of the section; nothing where no run has a breakdown. `settings`:
    the results table's `run` and setting columns (None: no settings)."""
    table = breakdown_table(analyses)
    if table.empty:
        return [], []
    keys = [] if settings is None else list(settings.columns.drop("run"))
    with_settings = (lambda frame: frame) if settings is None else (lambda frame: frame.merge(settings, on="run"))
    figures = [plot_by_position(with_settings(position_table(analyses)), out / POSITION_FIGURE, keys)]
    lines = [
        "## Where the accuracy is lost: the summary or the decoding?",
        "",
        "A collapse under greedy decoding mixes two causes: the decoder does not get the information (for the "
        "baseline, it is not in the summary vector, the decoder's initial state), or it gets it and loses it as "
        "errors compound once it feeds on its own outputs. *Teacher-forced*: the argmax at each step given the "
        "true prefix, so no error compounds; *beam K*: beam search of width K (1 is greedy); both on the same "
        "held-out sequences as greedy here, scored up to the first EOS. Mean over seeds in %.",
        "",
        tables.markdown_table(breakdown_summary(with_settings(table), keys)),
        "",
        "Token accuracy by output position, greedy (solid) and teacher-forced (dashed), mean over seeds with the "
        "seeds' range as a band:",
        "",
        f"![accuracy by output position]({POSITION_FIGURE})",
        "",
    ]
    probes = probe_table(analyses)
    if not probes.empty:
        figures.append(plot_probe(with_settings(probes), out / PROBE_FIGURE, keys))
        lines += [
            "### What the summary vector holds: a linear probe",
            "",
            "A linear map from the summary vector (the GRU decoder's initial state) to the symbol at each source "
            "position, fitted by ridge regression on fresh sequences drawn as training batches are (none in the "
            "validation or test set) and scored on the held-out set; dotted: the same probe on the run's untrained "
            "model (its initial weights from its seed), the control (Hewitt and Liang, 2019). A linear probe is a "
            "lower bound: a symbol it cannot read may still be there in a form the decoder reads. A Transformer "
            "has no summary vector.",
            "",
            f"![probe accuracy by source position]({PROBE_FIGURE})",
            "",
        ]
    return lines, figures
