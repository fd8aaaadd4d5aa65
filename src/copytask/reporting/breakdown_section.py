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

import math
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes

from ..families import Family
from ..figures import colours, draw_chance, legend_outside, model_order, panels, save
from . import tables
from .breakdown_tables import breakdown_table, position_table, probe_table
from .result_figures import setting_title

POSITION_FIGURE = "accuracy_by_position.png"
PROBE_FIGURE = "probe.png"
PANEL_WIDTH = 4.0


def _panels(table: pd.DataFrame, settings: list[str]) -> list[tuple[str, pd.DataFrame]]:
    """(title, rows) per setting and train length, shortest length first."""
    keys = [*settings, "train_length"]
    grouped = table.groupby(keys, dropna=False, sort=False)
    ordered = sorted(grouped, key=lambda item: (str(item[0][:-1]), int(str(item[0][-1]).split("-")[-1])))
    return [
        (
            ", ".join(
                [f"trained at length {values[-1]}", *([setting_title(settings, values[:-1])] if settings else [])]
            ),
            rows,
        )
        for values, rows in ordered
    ]


def _band(ax: Axes, rows: pd.DataFrame, x: str, y: str, **style) -> None:
    """The mean over seeds of `y` against `x` in %, and the seeds' range as a band."""
    stats = rows.groupby(x)[y].agg(["mean", "min", "max"])
    (line,) = ax.plot(stats.index, 100 * stats["mean"], **style)
    ax.fill_between(stats.index, 100 * stats["min"], 100 * stats["max"], color=line.get_color(), alpha=0.2, lw=0)


def plot_by_position(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """`position_table`'s token accuracy (%) against output position: greedy solid, teacher-forced dashed."""
    groups = _panels(table, list(settings))
    colour, order = colours(table["attention"].unique()), model_order(table["attention"])
    figure, axes = panels(len(groups), width=PANEL_WIDTH)
    for ax, (title, rows) in zip(axes, groups):
        lines = sorted(rows.groupby(["attention", "decoding"], sort=False), key=lambda line: order.index(line[0][0]))
        for (attention, decoding), runs in lines:
            style = "-" if decoding == "greedy" else "--"
            _band(
                ax, runs, "position", "token_acc", color=colour[attention], ls=style, label=f"{attention}, {decoding}"
            )
        ax.set(title=title, xlabel="output position", ylabel="token accuracy %", ylim=(-2, 102))
    legend_outside(figure, axes)
    return save(figure, path)


def plot_probe(table: pd.DataFrame, path: Path, settings: list[str] = ()) -> Path:
    """`probe_table`'s accuracy (%) against source position (the j-th copied symbol: `evaluation.probe`), the
    trained model's summary vector solid,
    the untrained one's dotted, and chance."""
    groups = _panels(table, list(settings))
    colour, order = colours(table["attention"].unique()), model_order(table["attention"])
    figure, axes = panels(len(groups), width=PANEL_WIDTH)
    for ax, (title, rows) in zip(axes, groups):
        lines = sorted(rows.groupby(["attention", "summary"], sort=False), key=lambda line: order.index(line[0][0]))
        for (attention, summary), runs in lines:
            style = "-" if summary == "trained" else ":"
            _band(ax, runs, "position", "accuracy", color=colour[attention], ls=style, label=f"{attention}, {summary}")
        draw_chance(ax, rows["chance"].iloc[0])
        ax.set(
            title=title,
            xlabel="source position (selective copying: content symbol)",
            ylabel="probe accuracy %",
            ylim=(-2, 102),
        )
    legend_outside(figure, axes)
    return save(figure, path)


def missing_share(table: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Of each attention type's gain over the baseline, the share the baseline still misses given the true
    prefix: (attention greedy - baseline teacher-forced) / (attention greedy - baseline greedy), token
    accuracy, per seed against the baseline run of the same seed (same training stream, same test set),
    with its mean and 95% t-interval over the seeds -> one row per `keys` (settings, train_length) and
    attention: `share`, `share_lo`, `share_hi`, `pairs`. None where the gain is not there to share: a seed
    whose gain is not above zero, or a gain whose interval holds zero."""
    rows = []
    for values, group in table.groupby(keys, dropna=False, sort=False):
        baseline = group[group["attention"] == tables.BASELINE].set_index("seed")
        for attention, runs in group[group["attention"] != tables.BASELINE].groupby("attention", sort=False):
            runs = runs.set_index("seed")
            seeds = runs.index.intersection(baseline.index)
            if seeds.empty:
                continue
            gain = runs.loc[seeds, "greedy_token_acc"] - baseline.loc[seeds, "greedy_token_acc"]
            missing = runs.loc[seeds, "greedy_token_acc"] - baseline.loc[seeds, "tf_token_acc"]
            _, gain_low, _ = tables.interval(gain)
            shared = (gain > 0).all() and not gain_low <= 0
            share, low, high = tables.interval(missing / gain) if shared else (math.nan,) * 3
            rows.append(dict(zip(keys, values)) | {"attention": attention, "share": share, "share_lo": low,
                                                  "share_hi": high, "pairs": len(seeds)})  # fmt: skip
    return pd.DataFrame(rows, columns=[*keys, "attention", "share", "share_lo", "share_hi", "pairs"])


def breakdown_summary(table: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """`breakdown_table` per setting, length and attention type: greedy and teacher-forced token accuracy
    with a 95% interval (widened to the scored tokens' Wilson interval, as `tables.interval`), the share of
    an attention type's gain the baseline misses given the true prefix (`missing_share`), and the mean of
    each beam width's, in % as strings."""
    keys = [*settings, "train_length", "attention"]
    beams = sorted((c for c in table if c.startswith("beam") and c.endswith("_token_acc")), key=lambda c: int(c[4:-10]))
    shares = missing_share(table, keys[:-1]).set_index(keys)
    rows = []
    for values, group in table.groupby(keys, dropna=False, sort=False):
        row = {key: tables.setting_value(value) for key, value in zip(keys, values)} | {"seeds": len(group)}
        tokens = tables.scored(group, "breakdown_sequences")["token_acc"]
        for column, name in (("greedy_token_acc", "greedy"), ("tf_token_acc", "teacher-forced")):
            row[f"{name} % [95% CI]"] = tables.with_interval(*tables.interval(group[column], tokens))
        share = shares.loc[values] if values in shares.index else None
        row[f"{MISSING} % [95% CI]"] = "" if share is None else shown_share(share)
        beam_sequences = int(group["beam_sequences"].min()) if beams else 0
        row |= {f"beam {c[4:-10]} % (first {beam_sequences})": tables.percent(group[c].mean()) for c in beams}
        rows.append(row)
    return by_length(pd.DataFrame(rows), settings)


MISSING = "gain missing given the true prefix"  # `missing_share`'s column


def shown_share(share: pd.Series) -> str:
    """`missing_share`'s row as a table shows it: `36.0 [30.1, 41.9]`, `no gain` where there is none to share."""
    if math.isnan(share["share"]):
        return "no gain"
    mean, low, high = (tables.percent(share[key]) for key in ("share", "share_lo", "share_hi"))
    return mean if not low else f"{mean} [{low}, {high}]"


PROBE_COLUMNS = {"probe_acc": "trained", "probe_untrained_acc": "untrained", "probe_control_acc": "control task"}


def probe_summary(table: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """The probe's columns of `breakdown_table` per setting, length and attention type, over the runs that
    have them: its mean accuracy over source positions on the trained and the untrained model's summary
    vector and for the control task, each with a 95% interval (widened to the scored symbols' Wilson
    interval), the control task's chance, and selectivity (the trained accuracy minus the control task's)
    with its t-interval over seeds, in % as strings; empty where no run has a probe."""
    if "probe_acc" not in table:
        return pd.DataFrame()
    table = table[table["probe_acc"].notna()]
    keys = [*settings, "train_length", "attention"]
    rows = []
    for values, group in table.groupby(keys, dropna=False, sort=False):
        row = {key: tables.setting_value(value) for key, value in zip(keys, values)} | {"seeds": len(group)}
        symbols = tables.scored(group, "probe_sequences")["token_acc"]
        for column, name in PROBE_COLUMNS.items():
            row[f"{name} % [95% CI]"] = tables.with_interval(*tables.interval(group[column], symbols))
        row["control chance %"] = tables.percent(group["probe_control_chance"].mean())
        mean, low, high = tables.interval(group["probe_selectivity"])
        row["selectivity % [95% CI]"] = (
            f"{100 * mean:+.1f}" if math.isnan(low) else f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"
        )
        rows.append(row)
    return by_length(pd.DataFrame(rows), settings)


def by_length(summary: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """`summary`'s rows in order of their settings and train length (its longest length, not as text)."""
    length = summary["train_length"].map(lambda text: int(text.split("-")[-1]))
    return summary.assign(_length=length).sort_values([*settings, "_length"], kind="stable").drop(columns="_length")


def breakdown_section(
    analyses: list[dict], settings: pd.DataFrame | None, out: Path, families: dict[str, Family]
) -> tuple[list[str], list[Path]]:
    """Markdown lines and figures of the section; nothing where no run has a breakdown. `settings`:
    the results table's `run` and setting columns (None: no settings); `families`: each model label's family
    (`tables.Loaded.families`), which says what its summary vector is."""
    table = breakdown_table(analyses)
    if table.empty:
        return [], []
    keys = [] if settings is None else list(settings.columns.drop("run"))
    with_settings = (lambda frame: frame) if settings is None else (lambda frame: frame.merge(settings, on="run"))
    table = with_settings(table)
    figures = [plot_by_position(with_settings(position_table(analyses)), out / POSITION_FIGURE, keys)]
    lines = [
        "## Where the accuracy is lost: the summary or the decoding?",
        "",
        "A collapse under greedy decoding mixes two causes: the decoder does not get the information (for the "
        "baseline, it is not in the summary vector, the decoder's initial state), or it gets it and loses it as "
        "errors compound once it feeds on its own outputs. *Teacher-forced*: the argmax at each step given the "
        "true prefix, so no error compounds, on the same test sequences as greedy; *beam K*: beam search of width "
        "K (1 is greedy decoding run as a beam search) on the first of them; all scored up to the first EOS. "
        f"*{MISSING.capitalize()}*: of an attention type's gain in greedy token accuracy over the baseline, the "
        "share the baseline still misses when fed the true prefix, (attention greedy - baseline teacher-forced) / "
        "(attention greedy - baseline greedy), per seed against the baseline of the same seed, with its 95% "
        "t-interval over seeds (`no gain` where a seed's gain is not above zero or the gain's interval holds "
        "zero). Mean over seeds in %.",
        "",
        tables.markdown_table(breakdown_summary(table, keys)),
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
        without = sorted(set(table["attention"]) - set(probes["attention"]))
        handed = "; ".join(dict.fromkeys(families[label].handed_over for label in probes["attention"]))
        lines += [
            "### What the summary vector holds: a linear probe",
            "",
            f"A linear map from the summary vector (what the model hands its decoder of the source: {handed}) to "
            "each symbol the decoder must copy, in source order (for copy and reverse the symbol at each source "
            "position; for selective copying the k content symbols, not the noise), fitted by ridge regression (its "
            "penalty chosen "
            "on a quarter of the fitting sequences held out of the fit) on sequences the run never saw (none of "
            "its training batches, validation or test set) and scored on the test set. Two controls: the same probe "
            "on the run's untrained model (its initial weights from its seed; dotted), as Conneau et al. (2018) read "
            "untrained encoders, and a control task (Hewitt and Liang, 2019): the trained vector read for a random "
            "label of each (position, symbol), with selectivity the accuracy minus the control task's. Drawn per "
            "pair, the labels merge symbols at a position (hence its higher chance), and a least-squares probe's "
            "score for a merged label is the sum of its scores for the symbols it merges: the control task reads "
            "the symbols' probe at a coarser grain, right in cells where the symbols are read wrong and wrong in "
            "some where they are read right, not what a probe memorises. A control with the task's chance (a "
            "bijection of the symbols at each position) is read exactly as the symbols, selectivity 0 by "
            "construction, so on this task selectivity cannot inform; the untrained model is the control of what "
            "training put there. A linear probe is a lower bound: a symbol it cannot read may still be there in a "
            "form the decoder reads. " + (f"No summary vector to probe: {', '.join(without)}." if without else ""),
            "",
            tables.markdown_table(probe_summary(table, keys)),
            "",
            f"![probe accuracy by source position]({PROBE_FIGURE})",
            "",
        ]
    return lines, figures
