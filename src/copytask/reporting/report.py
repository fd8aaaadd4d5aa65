"""`python -m copytask report`: figures and report.md from a grid's run folders alone.

Every setting of the grid (a config key that varies between its runs, `tables.setting_keys`) is
shown, never pooled: the accuracy figure gives one row of panels per value of the settings it does
not draw as a line style, heatmaps and training curves are made per setting, and the analysis
tables group by the settings. `report.x` puts any swept numeric key on the accuracy figure's x axis.

Reads metrics.json, history.csv, attention_samples.json and analysis.json (written by
`copytask analyze`, which a sweep runs before its report); never trains or evaluates. Works on
partial results (a sweep still running, runs not analysed yet) and says what is missing; a run
whose files are corrupt is left out of what needs them, with a warning that names it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .. import console, store
from ..figures import model_order, plot_attention
from ..store.runs import GridRun, variable_length_runs
from . import analysis_tables, tables
from .analysis_figures import (
    plot_head_weights,
)
from .analysis_sections import Section, analysis_section, attention_section, evidence_section, missing_analysis
from .breakdown_section import breakdown_section
from .freshness import REPORT_DIR
from .result_figures import (
    LONGEST_FIGURE,
    SETTING_GRID_FIGURE,
    groups,
    label,
    longest_lengths,
    plot_accuracy,
    plot_curves,
    plot_setting_grid,
    setting_suffix,
    setting_title,
)
from .selective_section import selective_section
from .setup_section import setup_section
from .state_section import state_section
from .tables import markdown_table

CURVES_FIGURE = "training_curves"


def read_part(run: GridRun, name: str, reader) -> object | None:
    """A run file read by `reader`, or None with a warning naming the run if it is corrupt."""
    try:
        return reader(run.folder / name)
    except (OSError, ValueError, KeyError, TypeError) as error:  # pandas' parser errors are ValueErrors
        console.warn(f"skipping {name} of {run.folder}: {type(error).__name__}: {error}")
        return None


def run_histories(loaded: tables.Loaded, table: pd.DataFrame) -> list[tuple[int, str, pd.DataFrame]]:
    """(length, attention type, history.csv) of each run in `table` (rows of `loaded.table`) whose
    history is readable."""
    histories = []
    for row in table.itertuples():
        history = read_part(loaded.runs[row.run], store.HISTORY, pd.read_csv)
        if history is not None and {"step", "loss", "val_token_acc"} <= set(history.columns):
            histories.append((row.length, row.attention, history))
    return histories


def run_heading(row: dict, settings: list[str]) -> tuple[str, str]:
    """(`luong_general, length 40, model.hidden_size=16`, `_model.hidden_size16`): a results row's
    attention type, length and setting, for headings and titles, and its setting for file names."""
    values = tuple(row[key] for key in settings)
    heading = f"{row['attention']}, length {row['length']}"
    return (f"{heading}, {setting_title(settings, values)}" if settings else heading), setting_suffix(settings, values)


def first_runs(loaded: tables.Loaded) -> list[dict]:
    """The lowest seed's run of every setting, attention type and length, as results rows."""
    keys = [*loaded.settings, "attention", "length"]
    first = loaded.table.sort_values("seed").groupby(keys, sort=False, dropna=False).head(1)
    return first.sort_values(keys).to_dict("records")


def plot_heatmaps(loaded: tables.Loaded, out: Path) -> list[tuple[str, Path]]:
    """For every setting, attention type with weights and length: the first held-out example of
    the lowest seed's run. -> (heading, path) per map."""
    made = []
    for row in first_runs(loaded):
        samples = read_part(loaded.runs[row["run"]], store.ATTENTION, store.read_json)
        if samples is None or not samples.get("samples") or samples["samples"][0].get("weights") is None:
            continue  # the baseline has no attention (or the file was corrupt: warned above)
        heading, suffix = run_heading(row, loaded.settings)
        path = out / f"attention_{row['attention']}_length{row['length']}{suffix}.png"
        title = f"{heading}, seed {row['seed']} (run token acc {100 * row['token_acc']:.1f}%)"
        plot_attention(samples["samples"][0], int(row["vocab_size"]), row["task"], title, path)
        made.append((heading, path))
    return made


def plot_head_heatmaps(loaded: tables.Loaded, out: Path) -> list[tuple[str, Path]]:
    """For every setting, multi-head attention type and length: each head's map of the lowest
    seed's run that has one. -> (heading, path) per figure."""
    made, seen = [], set()
    for row in loaded.table.sort_values([*loaded.settings, "attention", "length", "seed"]).to_dict("records"):
        analysed = loaded.analyses.get(row["run"])
        heading, suffix = run_heading(row, loaded.settings)
        if analysed is None or "head_weights" not in analysed or heading in seen:
            continue
        seen.add(heading)
        path = out / f"heads_{row['attention']}_length{row['length']}{suffix}.png"
        made.append((heading, plot_head_weights(analysed, int(row["vocab_size"]), path)))
    return made


def write_report(
    grid: list[GridRun], loaded: tables.Loaded, runs_dir: Path, x: str = "task.length", beside: str | None = None
) -> list[Path]:
    """Write runs_dir/report/ (figures and report.md) from `loaded`, which must not be empty, with
    `x` (`report.x`, checked by `tables.x_column`) on the accuracy figure's x axis, and `beside`, the note on
    the complete runs in runs_dir that the grid leaves out (`store.runs.beside_line`), under its opening.
    -> the figure files drawn."""
    runs_dir = Path(runs_dir)
    out = runs_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    x, settings = tables.x_column(x, loaded), loaded.settings
    summary = tables.summarise(loaded.table, settings)
    variable = variable_length_analyses(grid, loaded, runs_dir)
    variable_analyses = [analysis for analysis in variable.values() if analysis is not None]
    per_length = analysis_tables.per_length_table(variable_analyses)

    accuracy = accuracy_section(summary, settings, x, per_length, out, loaded.mixed)
    setting_grid = setting_grid_section(summary, settings, x, out)
    selective = selective_section(summary, settings, out)
    state = state_section(loaded, summary, out)
    evidence = evidence_section(loaded, out)
    analysis = analysis_section(loaded, variable_analyses, runs_dir, out)
    curves = curves_section(loaded, out)
    settings_table = loaded.table[["run", *settings]] if settings else None
    breakdown = Section(*breakdown_section(list(loaded.analyses.values()), settings_table, out, loaded.families()))
    heatmaps, head_heatmaps = plot_heatmaps(loaded, out), plot_head_heatmaps(loaded, out)
    lines = [
        *opening(grid, loaded, runs_dir, headline(summary, x)),
        *([beside, ""] if beside else []),
        *setup_section(loaded, runs_dir),
        "",
        *accuracy.lines,
        *setting_grid.lines,
        *selective.lines,
        *state.lines,
        *variable_length_notes(per_length, variable, runs_dir),
        *missing_runs_section(loaded),
        *curves.lines,
        *analysis.lines,
        *breakdown.lines,
        *attention_section(evidence.lines, heatmaps, head_heatmaps),
    ]
    store.atomic_write(out / "report.md", "\n".join(lines))
    sections = (accuracy, setting_grid, selective, state, evidence, analysis, breakdown, curves)
    figures = [figure for section in sections for figure in section.figures]
    return [out / "report.md", *figures, *(path for _, path in heatmaps + head_heatmaps)]


def variable_length_analyses(grid: list[GridRun], loaded: tables.Loaded, runs_dir: Path) -> dict[Path, dict | None]:
    """The analysis.json of every variable-length run drawn beside the grid (`variable_length_runs`,
    not a row of it), by run folder; None where there is none (or a corrupt one: warned)."""
    folders = [folder for folder in variable_length_runs(grid, runs_dir) if folder.name not in loaded.runs]
    return {folder: tables.read_analysis(folder) for folder in folders}


def headline(summary: pd.DataFrame, x: str) -> list[str]:
    """report.md's finding first: each model's mean greedy token accuracy at the grid's largest `x` (the
    longest length, by default), with its interval, or its range where other settings vary there; and,
    against the length, the longest length at which each model's mean reaches 99% in some setting."""
    at = summary[summary[x] == summary[x].max()]
    models = []
    for model in model_order(at["attention"]):
        rows = at[at["attention"] == model]
        if len(rows) == 1:
            row = rows.iloc[0]
            models.append(f"{model} {tables.with_interval(row.token_acc, row.token_acc_lo, row.token_acc_hi)}")
        else:
            low, high = tables.percent(rows["token_acc"].min()), tables.percent(rows["token_acc"].max())
            models.append(f"{model} {low}-{high} (over its {len(rows)} settings)")
    chance = ", ".join(f"{tables.percent(value)}%" for value in sorted(at["chance"].unique()))
    counts = sorted(at["seeds"].unique())
    seeds = "one seed, no interval" if counts == [1] else f"mean of {'/'.join(map(str, counts))} seeds [95% interval]"
    where = f"length {at[x].iloc[0]}, the longest" if x == "length" else f"{x}={tables.setting_value(at[x].iloc[0])}"
    lines = [
        f"At {where} of the grid, the share of symbols copied right in % (greedy decoding, held-out test set, "
        f"{seeds}): {'; '.join(models)}; chance {chance}.",
    ]
    if x == "length" and summary["length"].nunique() > 1:
        reached = summary[summary["token_acc"] >= 0.99].groupby("attention")["length"].max()
        longest = [f"{model} {reached.get(model, 'no length')}" for model in model_order(summary["attention"])]
        # where other settings vary at a length (selective copying's k), one of them reaching 99% is all it says
        some = " in some setting" if summary.groupby(["attention", "length"]).size().max() > 1 else ""
        lines[0] += f" The longest length with a mean of at least 99%{some}: {', '.join(longest)}."
    return [*lines, ""]


def opening(grid: list[GridRun], loaded: tables.Loaded, runs_dir: Path, finding: list[str]) -> list[str]:
    """report.md's title, its headline `finding`, then what made it from which runs, and how to make it again."""
    return [
        "# copytask report",
        "",
        *(f"**Finding.** {line}" if line else line for line in finding),
        f"Made by `python -m copytask report` from the run folders in `{runs_dir}` "
        f"({len(loaded.table)} of {len(grid)} runs of the grid complete). "
        f"Regenerate it with `python -m copytask report runs_dir={runs_dir}` "
        "(the last sweep's grid there) or with the sweep's overrides.",
        "",
    ]


def accuracy_section(
    summary: pd.DataFrame, settings: list[str], x: str, per_length: pd.DataFrame, out: Path, mixed: str | None
) -> Section:
    """The accuracy figure against `x` (with the variable-length runs' `per_length` curves) and the
    comparison table: mean over seeds, interval, gap to the baseline; under it, the `mixed` line
    where the runs were made by different code."""
    stem = out / f"accuracy_vs_{x}"
    figures = plot_accuracy(summary, settings, x, stem, per_length)
    lines = [
        f"## Accuracy against {label(x)}",
        "",
        f"![accuracy against {label(x)}]({stem.name}.png) ([vector copy]({stem.name}.svg))",
        "",
        "Mean over seeds with a 95% t-interval (clipped to [0, 100]; none with a single seed), never narrower than the "
        "held-out set's own 95% Wilson interval for the tokens or sequences it scores; the gap is the attention type's "
        f"mean minus the `{tables.BASELINE}` baseline's with the same settings and length, in percentage points (empty "
        f"where there is no such baseline). Per-run numbers: [`{tables.RESULTS_CSV}`](../{tables.RESULTS_CSV}).",
        "",
        markdown_table(tables.comparison_table(summary, settings, wide=True)),
        "",
        *([mixed, ""] if mixed else []),
    ]
    return Section(lines, figures)


def setting_grid_section(summary: pd.DataFrame, settings: list[str], x: str, out: Path) -> Section:
    """Where the x axis is the length and one numeric setting varies beside it: accuracy over
    (setting, length) and the longest length reaching each threshold; nothing otherwise."""
    others = [key for key in [*settings, "length"] if key != x and summary[key].nunique() > 1]
    if not (x == "length" and len(others) == 1 and pd.api.types.is_numeric_dtype(summary[others[0]])):
        return Section([], [])
    key = others[0]
    figures = plot_setting_grid(summary, key, out)
    longest = longest_lengths(summary, key)
    longest = longest.assign(**{name: longest[name].map(tables.setting_value) for name in longest.columns[1:]})
    drew_longest = any(path.name == LONGEST_FIGURE for path in figures)
    lines = [
        f"### Accuracy over ({key}, length)",
        "",
        f"![accuracy over {key} and length]({SETTING_GRID_FIGURE})",
        "",
        *([f"![longest length copied against {key}]({LONGEST_FIGURE})", ""] if drew_longest else []),
        "The longest length of the grid at which the mean greedy token accuracy reaches each threshold "
        "(`-`: none does):",
        "",
        markdown_table(longest),
        "",
    ]
    return Section(lines, figures)


def variable_length_notes(per_length: pd.DataFrame, variable: dict[Path, dict | None], runs_dir: Path) -> list[str]:
    """What the accuracy figure's dashed lines are, where it has some, and which of the
    variable-length runs (`variable_length_analyses`) it leaves out for want of analysis."""
    lines = []
    if not per_length.empty:
        lines += [
            "Dashed lines: models trained on variable lengths (same settings otherwise), evaluated at every length of "
            "their range on one mixed-length held-out set; their train length reads `min-max`.",
            "",
        ]
    unanalysed = [folder for folder, analysis in variable.items() if analysis is None]
    return lines + missing_analysis(unanalysed, len(variable), "the dashed per-length curves", runs_dir)


def missing_runs_section(loaded: tables.Loaded) -> list[str]:
    """The grid's runs without usable results, each with the reason; nothing if there are none."""
    if not loaded.missing:
        return []
    return [
        "## Missing runs",
        "",
        "These runs of the grid have no usable results and are left out:",
        "",
        *(f"- `{run.label or run.folder.name}` (`{run.folder.name}`): {reason}" for run, reason in loaded.missing),
        "",
    ]


def curves_section(loaded: tables.Loaded, out: Path) -> Section:
    """The training curves (loss and validation accuracy against step), one figure per setting."""
    curves, attentions = [], list(dict.fromkeys(loaded.table["attention"]))
    for values, runs in groups(loaded.table, loaded.settings):
        suffix, title = setting_suffix(loaded.settings, values), setting_title(loaded.settings, values)
        if histories := run_histories(loaded, runs):
            curves.append((title, plot_curves(histories, attentions, title, out / f"{CURVES_FIGURE}{suffix}.png")))
    if not curves:
        return Section([], [])
    lines = ["## Training curves", ""]
    for title, path in curves:
        heading = [f"### {title}", ""] if title else []
        lines += [*heading, f"![training curves{', ' + title if title else ''}]({path.name})", ""]
    return Section(lines, [path for _, path in curves])


def written_line(written: list[Path], seconds: float) -> str:
    """What the command line says once `write_report` has written `written` (report.md first): the
    figures counted once each (the accuracy figure's SVG is a copy of its PNG)."""
    figures = [path for path in written[1:] if path.suffix == ".png"]
    return f"report: {written[0]} and {len(figures)} figures in {seconds:.1f} s"
