"""`python -m copytask report`: figures and report.md from a grid's run folders alone.

Every setting of the grid (a config key that varies between its runs, `results.setting_keys`) is
shown, never pooled: the accuracy figure gives one row of panels per value of the settings it does
not draw as a line style, heatmaps and training curves are made per setting, and the analysis
tables group by the settings. `report.x` puts any swept numeric key on the accuracy figure's x axis.

Reads metrics.json, history.csv, attention_samples.json and analysis.json (written by
`copytask analyze`, which a sweep runs before its report); never trains or evaluates. Works on
partial results (a sweep still running, runs not analysed yet) and says what is missing; a run
whose files are corrupt is left out of what needs them, with a warning that names it.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from . import analysis, results, store  # noqa: E402
from .analysis_figures import (  # noqa: E402
    draw_chance,
    draw_matrix,
    plot_attention,
    plot_counterfactual,
    plot_head_weights,
    plot_length_generalisation,
    plot_per_length,
)
from .sweep import SWEEP_RECORD, GridRun, Selection, nothing_done, variable_length_runs  # noqa: E402
from .config import ConfigError  # noqa: E402

REPORT_DIR = "report"
CURVES_FIGURE = "training_curves"
SETTING_GRID_FIGURE = "accuracy_grid.png"
LONGEST_FIGURE = "longest_length.png"
LONGEST_THRESHOLDS = (0.99, 0.5)
LINE_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1, 1, 1)), "v")]  # one per value of a styled setting
COUNTERFACTUAL_FIGURE = "counterfactual.png"
GENERALISATION_FIGURE = "length_generalisation.png"


def colours(attentions: list[str]) -> dict[str, str]:
    """One colour per attention type, the same in every figure."""
    return {attention: f"C{i}" for i, attention in enumerate(attentions)}


def x_column(x: str, loaded: results.Loaded) -> str:
    """The results column `report.x` names (`task.length` is `length`); ConfigError unless it is
    the length or a numeric setting of the grid."""
    column = "length" if x == "task.length" else x
    table = loaded.table
    numeric = [key for key in loaded.settings if pd.api.types.is_numeric_dtype(table[key]) and not pd.api.types.is_bool_dtype(table[key])]
    if column != "length" and column not in numeric:
        raise ConfigError(f"report.x must be task.length or a numeric key swept in this grid ({', '.join(['task.length', *numeric])}), got {x!r}")
    return column


def label(column: str) -> str:
    return "sequence length" if column == "length" else column


def setting_title(keys: list[str], values: tuple) -> str:
    """`model.hidden_size=16, length=40`: one facet's or one run's setting, for titles."""
    return ", ".join(f"{key}={results.setting_value(value)}" for key, value in zip(keys, values))


def setting_suffix(keys: list[str], values: tuple) -> str:
    """`_model.hidden_size16`: a setting in file names (empty without settings)."""
    return "".join(f"_{key}{results.setting_value(value)}" for key, value in zip(keys, values))


def groups(table: pd.DataFrame, keys: list[str]) -> list[tuple[tuple, pd.DataFrame]]:
    """(values, rows) per combination of `keys`, in sorted order; one group of everything without keys."""
    if not keys:
        return [((), table)]
    return [(values if isinstance(values, tuple) else (values,), rows) for values, rows in table.groupby(keys, dropna=False)]


def set_numeric_axis(axis: plt.Axes, values: list[float]) -> None:
    """Ticks at the values; a log scale where they are powers of two or span a decade."""
    values = sorted(values)
    powers_of_two = all(v > 0 and float(v).is_integer() and int(v) & (int(v) - 1) == 0 for v in values)
    if len(values) > 1 and values[0] > 0 and (powers_of_two or values[-1] / values[0] >= 10):
        axis.set_xscale("log", base=2 if powers_of_two else 10)
    axis.set_xticks(values, [results.setting_value(v) for v in values])
    axis.minorticks_off()


def plot_accuracy(summary: pd.DataFrame, settings: list[str], x: str, stem: Path, per_length: pd.DataFrame) -> list[Path]:
    """Token and sequence accuracy against `x` (a column of `summary`), mean and 95% band over
    seeds, one colour per attention type. The other keys that vary are shown, not pooled: the last
    one as a line style when there are two or more, the rest as one row of panels per value. The
    variable-length models' accuracy per length (`analysis.per_length_table`) is dashed, when
    nothing else varies."""
    others = [key for key in [*settings, "length"] if key != x and summary[key].nunique(dropna=False) > 1]
    style_key = others[-1] if len(others) >= 2 else None
    facet_keys = [key for key in others if key != style_key]
    style_values = sorted(summary[style_key].unique()) if style_key else [None]
    style = {value: LINE_STYLES[i % len(LINE_STYLES)] for i, value in enumerate(style_values)}
    facets = groups(summary, facet_keys)
    figure, axes = plt.subplots(len(facets), 2, figsize=(11, 0.8 + 3.6 * len(facets)), sharex=True, squeeze=False)
    colour = colours(list(dict.fromkeys(summary["attention"])))
    for (values, rows), row_axes in zip(facets, axes):
        facet = setting_title(facet_keys, values)
        for axis, metric, title in zip(row_axes, ("token_acc", "seq_acc"), ("greedy token accuracy", "exact-sequence accuracy")):
            for (attention, *style_value), series in rows.groupby(["attention", *([style_key] if style_key else [])], sort=False):
                series = series.sort_values(x)
                linestyle, marker = style[style_value[0] if style_key else None]
                name = f"{attention}, {style_key}={results.setting_value(style_value[0])}" if style_key else attention
                axis.plot(series[x], 100 * series[metric], linestyle=linestyle, marker=marker, color=colour[attention], label=name)
                low, high = series[f"{metric}_lo"].clip(lower=0), series[f"{metric}_hi"].clip(upper=1)
                axis.fill_between(series[x], 100 * low, 100 * high, color=colour[attention], alpha=0.2, linewidth=0)
            if x == "length" and not others:
                plot_per_length(axis, per_length, metric, colour)
            if metric == "token_acc":
                for chance in rows["chance"].unique():
                    draw_chance(axis, chance)
            set_numeric_axis(axis, list(summary[x].unique()))
            axis.set(title=f"{title}, {facet}" if facet else title, ylabel="% (held-out set, greedy decoding)", ylim=(-2, 102))
            axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel(label(x))
    handles, names = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(names, handles))
    axes[0][0].legend(unique.values(), unique.keys(), loc="lower left", fontsize="small")
    figure.suptitle(f"Copy accuracy against {label(x)}: mean over seeds, band = 95% t-interval")
    figure.tight_layout()
    paths = [stem.parent / f"{stem.name}.{suffix}" for suffix in ("png", "svg")]  # not with_suffix: a stem may hold a dotted key
    for path in paths:
        figure.savefig(path, dpi=120)
    plt.close(figure)
    return paths


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
    reaching each of LONGEST_THRESHOLDS against the setting."""
    attentions = list(dict.fromkeys(summary["attention"]))
    figure, axes = plt.subplots(1, len(attentions), figsize=(4.2 * len(attentions) + 1, 3.8), squeeze=False, layout="constrained")
    for axis, attention in zip(axes[0], attentions):
        matrix = summary[summary["attention"] == attention].pivot_table(index=key, columns="length", values="token_acc")
        matrix.index = matrix.index.map(results.setting_value)
        image = draw_matrix(axis, matrix, scale=100, number="{:.0f}", fontsize=8, origin="lower", aspect="auto")
        axis.set(title=attention, xlabel="sequence length", ylabel=key)
    figure.colorbar(image, ax=list(axes[0]), shrink=0.8, label="greedy token accuracy % (mean over seeds)")
    grid_path = out / SETTING_GRID_FIGURE
    figure.savefig(grid_path, dpi=120)
    plt.close(figure)

    longest = longest_lengths(summary, key)
    colour = colours(attentions)
    figure, axis = plt.subplots(figsize=(6.5, 4.2))
    for (attention, rows), threshold in ((group, threshold) for group in longest.groupby("attention", sort=False) for threshold in LONGEST_THRESHOLDS):
        linestyle, marker = LINE_STYLES[LONGEST_THRESHOLDS.index(threshold)]
        axis.plot(rows[key], rows[f"longest at {threshold:.0%}"], linestyle=linestyle, marker=marker, color=colour[attention],
                  label=f"{attention}, >= {threshold:.0%}")
    set_numeric_axis(axis, list(summary[key].unique()))
    lengths = sorted(summary["length"].unique())
    axis.set_yscale("log")
    axis.set_yticks(lengths, [str(length) for length in lengths])
    axis.minorticks_off()
    axis.set(xlabel=key, ylabel="longest length reached (grid lengths)", title="Longest length copied at a token accuracy")
    axis.grid(alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    longest_path = out / LONGEST_FIGURE
    figure.savefig(longest_path, dpi=120)
    plt.close(figure)
    return [grid_path, longest_path]


def read_part(run: GridRun, name: str, reader) -> object | None:
    """A run file read by `reader`, or None with a warning naming the run if it is corrupt."""
    try:
        return reader(run.folder / name)
    except (OSError, ValueError, KeyError, TypeError) as error:  # pandas' parser errors are ValueErrors
        store.warn(f"skipping {name} of {run.folder}: {type(error).__name__}: {error}")
        return None


def plot_curves(loaded: results.Loaded, table: pd.DataFrame, title: str, path: Path) -> Path | None:
    """Training loss and held-out greedy token accuracy against step for the runs in `table` (rows
    of `loaded.table`, one setting): one row per length, one colour per attention type, one line per seed."""
    histories = []
    for row in table.itertuples():
        history = read_part(loaded.runs[row.run], store.HISTORY, pd.read_csv)
        if history is not None and {"step", "loss", "token_acc"} <= set(history.columns):
            histories.append((row.length, row.attention, history))
    if not histories:
        return None
    lengths = sorted({length for length, _, _ in histories})
    colour = colours(list(dict.fromkeys(loaded.table["attention"])))
    figure, axes = plt.subplots(len(lengths), 2, figsize=(11, 2.6 * len(lengths)), squeeze=False)
    for length, attention, history in histories:
        loss_axis, acc_axis = axes[lengths.index(length)]
        loss_axis.plot(history["step"], history["loss"], color=colour[attention], alpha=0.7, label=attention)
        acc_axis.plot(history["step"], 100 * history["token_acc"], color=colour[attention], alpha=0.7, label=attention)
    for (loss_axis, acc_axis), length in zip(axes, lengths):
        loss_axis.set(yscale="log", ylabel=f"length {length}\ntraining loss")
        acc_axis.set(ylabel="held-out token acc %", ylim=(-2, 102))
        for axis in (loss_axis, acc_axis):
            axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel("step")
    handles, labels = axes[0][1].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axes[0][1].legend(unique.values(), unique.keys(), loc="lower right")
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def run_heading(row: dict, settings: list[str]) -> tuple[str, str]:
    """(`luong_general, length 40, model.hidden_size=16`, `_model.hidden_size16`): a results row's
    attention type, length and setting, for headings and titles, and its setting for file names."""
    values = tuple(row[key] for key in settings)
    heading = f"{row['attention']}, length {row['length']}"
    return (f"{heading}, {setting_title(settings, values)}" if settings else heading), setting_suffix(settings, values)


def first_runs(loaded: results.Loaded) -> list[dict]:
    """The lowest seed's run of every setting, attention type and length, as results rows."""
    keys = [*loaded.settings, "attention", "length"]
    first = loaded.table.sort_values("seed").groupby(keys, sort=False, dropna=False).head(1)
    return first.sort_values(keys).to_dict("records")


def plot_heatmaps(loaded: results.Loaded, out: Path) -> list[tuple[str, Path]]:
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


def plot_head_heatmaps(loaded: results.Loaded, out: Path) -> list[tuple[str, Path]]:
    """For every setting, multi-head attention type and length: each head's map of the lowest
    seed's run that has one. -> (heading, path) per figure."""
    made, seen = [], set()
    for row in loaded.table.sort_values([*loaded.settings, "attention", "length", "seed"]).to_dict("records"):
        analysed = loaded.analyses.get(row["run"])
        heading, suffix = run_heading(row, loaded.settings)
        if analysed is None or "head_weights" not in analysed or heading in seen:
            continue
        seen.add(heading)
        made.append((heading, plot_head_weights(analysed, int(row["vocab_size"]), out / f"heads_{row['attention']}_length{row['length']}{suffix}.png")))
    return made


def markdown_table(frame: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def setup_section(config: DictConfig, loaded: results.Loaded, runs_dir: Path) -> list[str]:
    """The settings every run shares (those of `config`, one run's), what varies, the hardware and the wall time."""
    task, model, train, table = config.task, config.model, config.train, loaded.table
    attentions = ", ".join(dict.fromkeys(table["attention"]))
    lengths = ", ".join(map(str, sorted(table["length"].unique())))
    seeds = ", ".join(map(str, sorted(table["seed"].unique())))
    varying = [key for key in ("attention", "length", "seed") if table[key].nunique() > 1] + loaded.settings
    swept = ", ".join(f"`{key}` ({', '.join(map(results.setting_value, sorted(table[key].unique())))})" for key in varying)
    early_stop = (
        f"stops early once held-out token accuracy is >= {train.target_acc:.0%} at {train.patience} evaluations in a row"
        if train.patience
        else "no early stop"
    )
    lines = [
        "## Setup",
        "",
        f"- Task: `{task.name}`, {task.vocab_size} content symbols (chance token accuracy {1 / task.vocab_size:.1%}), "
        f"lengths {lengths}.",
        f"- Attention types: {attentions}; seeds: {seeds}. Swept: {swept or 'nothing'}; the settings below are shared by every run "
        "unless swept.",
        f"- Model: GRU encoder-decoder, hidden size {model.hidden_size}, embedding size {model.embedding_size}, "
        f"{'bidirectional' if model.bidirectional else 'unidirectional'} encoder.",
        f"- Training: budget {train.steps} steps of batch {train.batch_size}, Adam, {train.schedule} schedule peaking at "
        f"lr {train.lr}, gradient clipping {train.clip}; {early_stop}. The same for every attention type.",
        f"- Evaluation: greedy decoding (no teacher forcing) on {train.eval_size} held-out sequences (seed {train.eval_seed}).",
        f"- Hardware (from the runs): device {', '.join(map(str, table['device'].unique()))}, "
        f"torch threads {', '.join(map(str, table['threads'].unique()))}.",
        f"- Compute: {table['train_seconds'].sum():.0f} s of training summed over {len(table)} runs.",
    ]
    record_path = runs_dir / SWEEP_RECORD
    record = store.read_json(record_path) if record_path.is_file() else {}
    if "wall_seconds" in record:  # a finished sweep's record, not one still running
        lines.append(
            f"- Last sweep in `{runs_dir}`: `{record['command']}` ({record.get('launcher')} launcher) trained "
            f"{record['trained']} of {record['jobs']} runs in **{record['wall_seconds']:.0f} s wall time**, "
            f"finished {record['finished']} on {record['machine']} with {record['cpus']} CPUs"
            + (f" and a {record['gpu']}" if record.get("gpu") else "")
            + (f"; its analysis took {record['analysis_seconds']:.0f} s of that." if "analysis_seconds" in record else ".")
        )
    return lines


CAUTION = (
    "**A caution on reading these maps.** An attention map shows where the model put weight, not "
    "why it produced its output. Jain and Wallace (2019, *Attention is not Explanation*) show that "
    "quite different weights can give the same predictions, so a clean diagonal is a hint, not a "
    "proof, that the model copies by looking at the right position. Back a map with "
    "counterfactual checks (replace the weights by uniform or permuted ones and measure the "
    "accuracy drop) before reading it as an explanation: they come first below, then the maps."
)


def with_settings(table: pd.DataFrame, loaded: results.Loaded) -> pd.DataFrame:
    """An analysis table (one row per run) with the settings of each run from the results table."""
    if table.empty:
        return table
    return table.merge(loaded.table[["run", *loaded.settings]], on="run", how="left")


def evidence_tables(analysed: pd.DataFrame, settings: list[str]) -> list[str]:
    """Markdown: the counterfactual table and the alignment table, per setting, length and
    attention type, mean over seeds, from `with_settings(analysis.analysis_table(...))`."""
    if analysed.empty:
        return []
    keys = [*settings, "length", "attention"]
    numbers = analysed.drop(columns=["run", "task", "train_length", "seed"])
    means = numbers.groupby(keys, dropna=False).mean().join(analysed.groupby(keys, dropna=False).size().rename("seeds"))
    means = means.reset_index()
    columns = {key: means[key].map(results.setting_value) for key in settings}
    counterfactual = pd.DataFrame(
        {
            **columns,
            "length": means["length"],
            "attention": means["attention"],
            "seeds": means["seeds"],
            "own %": means["own"].map(results.percent),
            **{f"{name} %": means[name].map(results.percent) for name in analysis.COUNTERFACTUALS},
            **{f"drop {name}": means[f"drop_{name}"].map(lambda drop: f"{100 * drop:+.1f}") for name in analysis.COUNTERFACTUALS},
        }
    )
    alignment = pd.DataFrame(
        {
            **columns,
            "length": means["length"],
            "attention": means["attention"],
            "seeds": means["seeds"],
            "argmax on copied position %": means["align_hit"].map(results.percent),
            "weight on copied position %": means["align_mass"].map(results.percent),
            "argmax next to it %": means["align_adjacent"].map(results.percent),
        }
    )
    return [
        "### Counterfactual attention",
        "",
        "Greedy token accuracy (%) with the model's own attention weights and with them replaced, at every decoding step, by "
        "uniform weights over the source, by the model's weights shuffled among the source positions, and by all weight on "
        "position 0; `drop` is own minus counterfactual, in points, mean over seeds. A large drop says the output depends on "
        "where the model attends. Measured on the first held-out sequences (`analysis.eval_size`), so `own` can differ a "
        "little from the accuracy table above.",
        "",
        markdown_table(counterfactual),
        "",
        f"![accuracy under counterfactual attention]({COUNTERFACTUAL_FIGURE})",
        "",
        "### Alignment",
        "",
        "How often the attention argmax at an output step lands on the source position that step copies, and the mean "
        "weight there (row t of the map produces output t, for both Bahdanau and Luong; EOS not scored), and how often the "
        "argmax lands on a neighbour of that position instead. The bidirectional encoder's state at a neighbouring position "
        "also carries the symbol, so a model can copy correctly while attending one position off: a diagonal that looks "
        "right can be shifted by one, another reason to read maps together with the counterfactual drops.",
        "",
        markdown_table(alignment),
        "",
    ]


def missing_analysis(folders: list[Path], total: int, what: str, runs_dir: Path) -> list[str]:
    """Markdown naming the complete runs without analysis.json (`what` they are left out of), and
    the command that makes it."""
    if not folders:
        return []
    names = ", ".join(f"`{folder.name}`" for folder in folders)
    return [
        f"**Analysis missing** for {len(folders)} of {total} runs ({names}): they have no `{store.ANALYSIS}`, so {what} "
        f"leave them out. Make it with `python -m copytask analyze runs_dir={runs_dir}` (a sweep does this itself at its "
        "end), then regenerate the report.",
        "",
    ]


def write_report(grid: list[GridRun], loaded: results.Loaded, runs_dir: Path, x: str = "task.length") -> list[Path]:
    """Write runs_dir/report/ (figures and report.md) from `loaded`, which must not be empty, with
    `x` (`report.x`, checked by `x_column`) on the accuracy figure's x axis. -> the figure files drawn."""
    started = time.perf_counter()
    runs_dir = Path(runs_dir)
    out = runs_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    x, settings = x_column(x, loaded), loaded.settings
    analyses = list(loaded.analyses.values())
    unanalysed = [loaded.runs[run].folder for run in loaded.table["run"] if run not in loaded.analyses]
    variable_folders = [folder for folder in variable_length_runs(grid, runs_dir) if folder.name not in loaded.runs]
    variable = {folder: results.read_analysis(folder) for folder in variable_folders}
    variable_analyses = [a for a in variable.values() if a is not None]
    per_length = analysis.per_length_table(variable_analyses)

    summary = results.summarise(loaded.table, settings)
    accuracy_stem = out / f"accuracy_vs_{x}"
    figures = plot_accuracy(summary, settings, x, accuracy_stem, per_length)
    others = [key for key in [*settings, "length"] if key != x and summary[key].nunique() > 1]
    setting_grid = x == "length" and len(others) == 1 and pd.api.types.is_numeric_dtype(summary[others[0]])
    if setting_grid:
        figures += plot_setting_grid(summary, others[0], out)
    curves = []
    for values, runs in groups(loaded.table, settings):
        suffix, title = setting_suffix(settings, values), setting_title(settings, values)
        if (path := plot_curves(loaded, runs, title, out / f"{CURVES_FIGURE}{suffix}.png")) is not None:
            curves.append((title, path))
    heatmaps = plot_heatmaps(loaded, out)
    head_heatmaps = plot_head_heatmaps(loaded, out)
    analysed = with_settings(analysis.analysis_table(analyses), loaded)
    evidence = evidence_tables(analysed, settings)
    if evidence:
        with_chance = analysed.merge(loaded.table[["run", "chance"]], on="run", how="left")
        figures.append(plot_counterfactual(with_chance, out / COUNTERFACTUAL_FIGURE, settings))
    generalisation = analysis.length_generalisation_table(analyses + variable_analyses)
    if not generalisation.empty:
        generalisation = with_settings(generalisation, loaded)
        figures.append(plot_length_generalisation(generalisation, out / GENERALISATION_FIGURE, settings))

    lines = [
        "# copytask report",
        "",
        f"Made by `python -m copytask report` from the run folders in `{runs_dir}` "
        f"({len(loaded.table)} of {len(grid)} runs of the grid complete). Regenerate it with `python -m copytask report runs_dir={runs_dir}` "
        "(the last sweep's grid there) or with the sweep's overrides.",
        "",
        *setup_section(loaded.runs[loaded.table["run"].iloc[0]].config, loaded, runs_dir),
        "",
        f"## Accuracy against {label(x)}",
        "",
        f"![accuracy against {label(x)}]({accuracy_stem.name}.png) ([vector copy]({accuracy_stem.name}.svg))",
        "",
        "Mean over seeds with a 95% t-interval (clipped to [0, 100]; none with a single seed); the gap is the attention type's mean minus "
        f"the `{results.BASELINE}` baseline's with the same settings and length, in percentage points (empty where there is no such "
        f"baseline). Per-run numbers: [`{results.RESULTS_CSV}`](../{results.RESULTS_CSV}).",
        "",
        markdown_table(results.comparison_table(summary, settings)),
        "",
    ]
    if setting_grid:
        longest = longest_lengths(summary, others[0])
        lines += [
            f"### Accuracy over ({others[0]}, length)",
            "",
            f"![accuracy over {others[0]} and length]({SETTING_GRID_FIGURE})",
            "",
            f"![longest length copied against {others[0]}]({LONGEST_FIGURE})",
            "",
            "The longest length of the grid at which the mean greedy token accuracy reaches each threshold (`-`: none does):",
            "",
            markdown_table(longest.assign(**{c: longest[c].map(results.setting_value) for c in longest.columns[1:]})),
            "",
        ]
    if not per_length.empty:
        lines += [
            "Dashed lines: models trained on variable lengths (same settings otherwise), evaluated at every length of their "
            "range on one mixed-length held-out set; their train length reads `min-max`.",
            "",
        ]
    lines += missing_analysis([f for f, a in variable.items() if a is None], len(variable), "the dashed per-length curves", runs_dir)
    if loaded.missing:
        lines += ["## Missing runs", "", "These runs of the grid have no usable results and are left out:", ""]
        lines += [f"- `{run.label or run.folder.name}` (`{run.folder.name}`): {reason}" for run, reason in loaded.missing]
        lines.append("")
    if curves:
        lines += ["## Training curves", ""]
        for title, path in curves:
            lines += [*([f"### {title}", ""] if title else []), f"![training curves{', ' + title if title else ''}]({path.name})", ""]
    lines += ["## Analysis", ""]
    lines += missing_analysis(unanalysed, len(loaded.table), "the counterfactual, alignment and length-generalisation results", runs_dir)
    if not generalisation.empty:
        lines += [
            "### Length generalisation",
            "",
            "Every trained model evaluated (greedy token accuracy, mean over seeds) at every length of the grid: train length "
            "(rows) against test length (columns). Evaluation only, nothing retrained.",
            "",
            f"![train length x test length accuracy]({GENERALISATION_FIGURE})",
            "",
        ]
    if heatmaps or evidence:
        lines += ["## Attention: the evidence, then the maps", "", CAUTION, "", *evidence]
    if heatmaps or head_heatmaps:
        lines += [
            "In each map a red outline marks the source position the output step copies (the diagonal for copy, the "
            "anti-diagonal for reverse), so attention that lands next to it shows; red output symbols are wrong.",
            "",
        ]
    for heading, path in heatmaps:
        lines += [f"### {heading}", "", f"![attention of {heading}]({path.name})", ""]
    for heading, path in head_heatmaps:
        lines += [f"### {heading}: each head", "", f"![heads of {heading}]({path.name})", ""]
    store.atomic_write(out / "report.md", "\n".join(lines))
    figures += [path for _, path in curves + heatmaps + head_heatmaps]
    print(f"report: {out / 'report.md'} and {len(figures)} figures in {time.perf_counter() - started:.1f} s")
    return figures


def report_command(selection: Selection) -> int:
    """`python -m copytask report [--all] [overrides]`: results.csv and report/ for the runs
    `sweep.select_runs` picked; exit status 1 when none of them is complete, 2 (ConfigError) for a
    `report.x` that is not swept, before anything is written."""
    runs_dir, grid = Path(selection.master.runs_dir), selection.runs
    loaded = results.load(grid)
    if loaded.table.empty:
        print(nothing_done("report", selection), file=sys.stderr)
        return 1
    x_column(selection.master.report.x, loaded)
    if loaded.missing:
        print(results.describe_missing(loaded.missing, len(grid)))
    print(f"results: {results.save(loaded, runs_dir)}")
    write_report(grid, loaded, runs_dir, selection.master.report.x)
    return 0
