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

from . import analysis_tables
from .. import store
from ..config import messages
from . import tables
from .analysis_figures import extrapolates, plot_counterfactual, plot_extrapolation, plot_head_weights, plot_length_generalisation
from ..config.schema import ConfigError
from .figures import plot_attention
from ..store.grid import GridRun, variable_length_runs
from .setup import setup_section
from .result_figures import LONGEST_FIGURE, SETTING_GRID_FIGURE, groups, label, longest_lengths, plot_accuracy, plot_curves, plot_setting_grid, setting_suffix, setting_title

REPORT_DIR = "report"
CURVES_FIGURE = "training_curves"
COUNTERFACTUAL_FIGURE = "counterfactual.png"
GENERALISATION_FIGURE = "length_generalisation.png"
EXTRAPOLATION_FIGURE = "extrapolation.png"


def x_column(x: str, loaded: tables.Loaded) -> str:
    """The results column `report.x` names (`task.length` is `length`); ConfigError unless it is
    the length or a numeric setting of the grid."""
    column = "length" if x == "task.length" else x
    table = loaded.table
    numeric = [key for key in loaded.settings if tables.numeric(table[key])]
    if column != "length" and column not in numeric:
        raise ConfigError(f"report.x must be task.length or a numeric key swept in this grid ({', '.join(['task.length', *numeric])}), got {x!r}")
    return column


def read_part(run: GridRun, name: str, reader) -> object | None:
    """A run file read by `reader`, or None with a warning naming the run if it is corrupt."""
    try:
        return reader(run.folder / name)
    except (OSError, ValueError, KeyError, TypeError) as error:  # pandas' parser errors are ValueErrors
        messages.warn(f"skipping {name} of {run.folder}: {type(error).__name__}: {error}")
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
        made.append((heading, plot_head_weights(analysed, int(row["vocab_size"]), out / f"heads_{row['attention']}_length{row['length']}{suffix}.png")))
    return made


def markdown_table(frame: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


CAUTION = (
    "**A caution on reading these maps.** An attention map shows where the model put weight, not "
    "why it produced its output. Jain and Wallace (2019, *Attention is not Explanation*) show that "
    "quite different weights can give the same predictions, so a clean diagonal is a hint, not a "
    "proof, that the model copies by looking at the right position. Back a map with "
    "counterfactual checks (replace the weights by uniform or permuted ones and measure the "
    "accuracy drop) before reading it as an explanation: they come first below, then the maps."
)


def with_settings(table: pd.DataFrame, loaded: tables.Loaded) -> pd.DataFrame:
    """An analysis table (one row per run) with the settings of each run from the results table."""
    if table.empty:
        return table
    return table.merge(loaded.table[["run", *loaded.settings]], on="run", how="left")


def evidence_tables(analysed: pd.DataFrame, settings: list[str], figure: bool = True) -> list[str]:
    """Markdown: the counterfactual table and the alignment table, per setting, length and
    attention type, mean over seeds, from `with_settings(analysis_tables.analysis_table(...))`."""
    if analysed.empty:
        return []
    keys = [*settings, "length", "attention"]
    numbers = analysed.drop(columns=["run", "task", "train_length", "seed"])
    means = numbers.groupby(keys, dropna=False).mean().join(analysed.groupby(keys, dropna=False).size().rename("seeds"))
    means = means.reset_index()
    columns = {key: means[key].map(tables.setting_value) for key in settings}
    counterfactual = pd.DataFrame(
        {
            **columns,
            "length": means["length"],
            "attention": means["attention"],
            "seeds": means["seeds"],
            "own %": means["own"].map(tables.percent),
            **{f"{name} %": means[name].map(tables.percent) for name in analysis_tables.COUNTERFACTUALS},
            **{f"drop {name}": means[f"drop_{name}"].map(lambda drop: f"{100 * drop:+.1f}") for name in analysis_tables.COUNTERFACTUALS},
        }
    )
    alignment = pd.DataFrame(
        {
            **columns,
            "length": means["length"],
            "attention": means["attention"],
            "seeds": means["seeds"],
            "argmax on copied position %": means["align_hit"].map(tables.percent),
            "weight on copied position %": means["align_mass"].map(tables.percent),
            "argmax next to it %": means["align_adjacent"].map(tables.percent),
        }
    )
    return [
        "### Counterfactual attention",
        "",
        "Greedy token accuracy (%) with the model's own attention weights and with them replaced, at every decoding step, by "
        "uniform weights over the source, by the model's weights shuffled among the source positions, and by all weight on "
        "position 0; `drop` is own minus counterfactual, in points, mean over seeds. A large drop says the output depends on "
        "where the model attends. Measured on the first held-out sequences (`analysis.eval_size`), so `own` can differ a "
        "little from the accuracy table above. A Transformer's drops mean something else than a GRU model's: its "
        "counterfactual replaces the weights of every cross-attention layer (the map shown is the last layer's), and its "
        "encoder's self-attention has already mixed the source into every memory position, so uniform or fixed "
        "cross-attention does not cut its access to the source, where a GRU attention model is left with its decoder's "
        "initial state. Compare drops within an architecture, not across.",
        "",
        markdown_table(counterfactual),
        "",
        *([f"![accuracy under counterfactual attention]({COUNTERFACTUAL_FIGURE})", ""] if figure else []),
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


def write_report(grid: list[GridRun], loaded: tables.Loaded, runs_dir: Path, x: str = "task.length") -> list[Path]:
    """Write runs_dir/report/ (figures and report.md) from `loaded`, which must not be empty, with
    `x` (`report.x`, checked by `x_column`) on the accuracy figure's x axis. -> the figure files drawn."""
    runs_dir = Path(runs_dir)
    out = runs_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    x, settings = x_column(x, loaded), loaded.settings
    analyses = list(loaded.analyses.values())
    unanalysed = [loaded.runs[run].folder for run in loaded.table["run"] if run not in loaded.analyses]
    variable_folders = [folder for folder in variable_length_runs(grid, runs_dir) if folder.name not in loaded.runs]
    variable = {folder: tables.read_analysis(folder) for folder in variable_folders}
    variable_analyses = [a for a in variable.values() if a is not None]
    per_length = analysis_tables.per_length_table(variable_analyses)

    summary = tables.summarise(loaded.table, settings)
    accuracy_stem = out / f"accuracy_vs_{x}"
    figures = plot_accuracy(summary, settings, x, accuracy_stem, per_length)
    others = [key for key in [*settings, "length"] if key != x and summary[key].nunique() > 1]
    setting_grid = x == "length" and len(others) == 1 and pd.api.types.is_numeric_dtype(summary[others[0]])
    if setting_grid:
        figures += plot_setting_grid(summary, others[0], out)
    curves, attentions = [], list(dict.fromkeys(loaded.table["attention"]))
    for values, runs in groups(loaded.table, settings):
        suffix, title = setting_suffix(settings, values), setting_title(settings, values)
        if histories := run_histories(loaded, runs):
            curves.append((title, plot_curves(histories, attentions, title, out / f"{CURVES_FIGURE}{suffix}.png")))
    heatmaps = plot_heatmaps(loaded, out)
    head_heatmaps = plot_head_heatmaps(loaded, out)
    analysed = with_settings(analysis_tables.analysis_table(analyses), loaded)
    # the figure's x axis is the trained length: fixed-length runs only (a grid of variable-length runs has the table alone)
    fixed_length = not analysed.empty and bool((analysed.train_length == analysed.length.astype(str)).any())
    evidence = evidence_tables(analysed, settings, figure=fixed_length)
    if evidence and fixed_length:
        with_chance = analysed.merge(loaded.table[["run", "chance"]], on="run", how="left")
        figures.append(plot_counterfactual(with_chance, out / COUNTERFACTUAL_FIGURE, settings))
    generalisation = analysis_tables.length_generalisation_table(analyses + variable_analyses)
    if not generalisation.empty:
        generalisation = with_settings(generalisation, loaded)
        figures.append(plot_length_generalisation(generalisation, out / GENERALISATION_FIGURE, settings))
    extrapolation = extrapolates(generalisation)
    if extrapolation:
        with_chance = generalisation.merge(loaded.table[["run", "chance"]], on="run", how="left")
        figures.append(plot_extrapolation(with_chance, out / EXTRAPOLATION_FIGURE, settings))

    lines = [
        "# copytask report",
        "",
        f"Made by `python -m copytask report` from the run folders in `{runs_dir}` "
        f"({len(loaded.table)} of {len(grid)} runs of the grid complete). Regenerate it with `python -m copytask report runs_dir={runs_dir}` "
        "(the last sweep's grid there) or with the sweep's overrides.",
        "",
        *setup_section(loaded, runs_dir),
        "",
        f"## Accuracy against {label(x)}",
        "",
        f"![accuracy against {label(x)}]({accuracy_stem.name}.png) ([vector copy]({accuracy_stem.name}.svg))",
        "",
        "Mean over seeds with a 95% t-interval (clipped to [0, 100]; none with a single seed), never narrower than the held-out set's own "
        "95% Wilson interval for the tokens or sequences it scores; the gap is the attention type's mean minus "
        f"the `{tables.BASELINE}` baseline's with the same settings and length, in percentage points (empty where there is no such "
        f"baseline). Per-run numbers: [`{tables.RESULTS_CSV}`](../{tables.RESULTS_CSV}).",
        "",
        markdown_table(tables.comparison_table(summary, settings)),
        "",
    ]
    if setting_grid:
        longest = longest_lengths(summary, others[0])
        lines += [
            f"### Accuracy over ({others[0]}, length)",
            "",
            f"![accuracy over {others[0]} and length]({SETTING_GRID_FIGURE})",
            "",
            *([f"![longest length copied against {others[0]}]({LONGEST_FIGURE})", ""] if any(path.name == LONGEST_FIGURE for path in figures) else []),
            "The longest length of the grid at which the mean greedy token accuracy reaches each threshold (`-`: none does):",
            "",
            markdown_table(longest.assign(**{c: longest[c].map(tables.setting_value) for c in longest.columns[1:]})),
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
    lines += heldout_lines(analyses + variable_analyses)
    if extrapolation:
        lines += [
            "### Beyond the trained lengths",
            "",
            "Greedy token accuracy against test length (`analysis.lengths`), mean over seeds with their range as a band; "
            "the lengths the models were trained on are shaded. A model with learned positions is not defined past its "
            "table (`model.max_length`): its line stops there.",
            "",
            f"![accuracy against test length]({EXTRAPOLATION_FIGURE})",
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
    return [out / "report.md", *figures]


def heldout_lines(analyses: list[dict]) -> list[str]:
    """report.md's account of what holding sequences out did: the lengths scored on fewer held-out
    sequences than asked (or not at all, where training drew every one) and, for variable-length
    runs, how the held-out sets changed training's length mix. Nothing where neither happened."""
    fewer = analysis_tables.heldout_notes(analyses)
    mixes = {a["run"]: a["length_mix"] for a in analyses if a.get("length_mix")}
    if not fewer and not mixes:
        return []
    lines = [
        "### Held-out sets at short lengths",
        "",
        "Every set scored here is held out: no sequence of it was in the run's training batches (replayed from its seed) or "
        "its validation set. Short lengths have few sequences, so:",
        "",
    ]
    lines += [f"- {note} ({len(runs)} run{'s' * (len(runs) > 1)}: `{runs[0]}`{', ...' * (len(runs) > 1)})" for note, runs in fewer.items()]
    for run, mix in mixes.items():
        shares = ", ".join(
            f"length {row['length']} {row['held_out']} of {row['sequences']:,} held out, trained on at "
            f"{100 * row['train_share']:.1f}% of rows instead of {100 * row['uniform_share']:.1f}%"
            for row in mix
        )
        lines.append(f"- `{run}`: holding the test and validation sets out of training changes its length mix: {shares}.")
    return [*lines, ""]


def written_line(written: list[Path], seconds: float) -> str:
    """What the command line says once `write_report` has written `written` (report.md first): the
    figures counted once each (the accuracy figure's SVG is a copy of its PNG)."""
    figures = [path for path in written[1:] if path.suffix == ".png"]
    return f"report: {written[0]} and {len(figures)} figures in {seconds:.1f} s"
