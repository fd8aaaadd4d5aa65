"""`python -m copytask report`: figures and report.md from a grid's run folders alone.

Reads metrics.json, history.csv, attention_samples.json and analysis.json (written by
`copytask analyze`, which a sweep runs before its report); never trains or evaluates. Works on
partial results (a sweep still running, runs not analysed yet) and says what is missing; a run
whose files are corrupt is left out of what needs them, with a warning that names it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from . import analysis, results, store  # noqa: E402
from .analysis_figures import plot_counterfactual, plot_head_weights, plot_length_generalisation, plot_per_length  # noqa: E402
from .data import BOS, EOS, NUM_SPECIAL, PAD  # noqa: E402
from .sweep import SWEEP_RECORD, GridRun, compose_grid, sweep_command, variable_length_runs  # noqa: E402

REPORT_DIR = "report"
ACCURACY_FIGURE = "accuracy_vs_length"
CURVES_FIGURE = "training_curves.png"
COUNTERFACTUAL_FIGURE = "counterfactual.png"
GENERALISATION_FIGURE = "length_generalisation.png"
SPECIAL_SYMBOLS = {PAD: "·", BOS: "<s>", EOS: "</s>"}


def symbol(token: int, vocab_size: int) -> str:
    """Content symbols as letters a, b, c, ... (numbers past 26 symbols), specials by name."""
    if token in SPECIAL_SYMBOLS:
        return SPECIAL_SYMBOLS[token]
    index = token - NUM_SPECIAL
    return chr(ord("a") + index) if vocab_size <= 26 else str(index)


def colours(attentions: list[str]) -> dict[str, str]:
    """One colour per attention type, the same in every figure."""
    return {attention: f"C{i}" for i, attention in enumerate(attentions)}


def plot_accuracy(summary: pd.DataFrame, chance: float, stem: Path, per_length: pd.DataFrame) -> list[Path]:
    """Token and sequence accuracy against length (log axis), mean and 95% band over seeds, and
    the variable-length models' accuracy per length (`analysis.per_length_table`) dashed."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    lengths = sorted(summary["length"].unique())
    colour = colours(list(dict.fromkeys(summary["attention"])))
    for axis, metric, title in zip(axes, ("token_acc", "seq_acc"), ("greedy token accuracy", "exact-sequence accuracy")):
        for attention, rows in summary.groupby("attention", sort=False):
            axis.plot(rows["length"], 100 * rows[metric], "o-", color=colour[attention], label=attention)
            low, high = rows[f"{metric}_lo"].clip(lower=0), rows[f"{metric}_hi"].clip(upper=1)
            axis.fill_between(rows["length"], 100 * low, 100 * high, color=colour[attention], alpha=0.2, linewidth=0)
        plot_per_length(axis, per_length, metric, colour)
        if metric == "token_acc":
            axis.axhline(100 * chance, color="grey", linestyle="--", label=f"chance ({100 * chance:.1f}%)")
        axis.set_xscale("log")
        axis.set_xticks(lengths, [str(length) for length in lengths])
        axis.minorticks_off()
        axis.set(title=title, xlabel="sequence length", ylabel="% (held-out set, greedy decoding)", ylim=(-2, 102))
        axis.grid(alpha=0.3)
    axes[0].legend(loc="lower left")
    figure.suptitle("Copy accuracy against length: mean over seeds, band = 95% t-interval")
    figure.tight_layout()
    paths = [stem.with_suffix(".png"), stem.with_suffix(".svg")]
    for path in paths:
        figure.savefig(path, dpi=120)
    plt.close(figure)
    return paths


def plot_heatmap(sample: dict, vocab_size: int, title: str, path: Path) -> None:
    """Attention weights of one held-out example: output steps (rows) against source positions
    (columns), symbols on both axes, one colour scale from 0 to 1 for every map. Output symbols
    that differ from the target are red."""
    weights = sample["weights"]  # (T_dec, T_enc)
    rows, columns = len(weights), len(weights[0])
    size = max(4.0, 0.13 * max(rows, columns))  # about 9 pt per cell keeps a length-80 map readable
    figure, axis = plt.subplots(figsize=(size + 1.5, size))
    image = axis.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    font = 7 if max(rows, columns) > 30 else 9
    axis.set_xticks(range(columns), [symbol(t, vocab_size) for t in sample["source"]], fontsize=font)
    axis.set_yticks(range(rows), [symbol(t, vocab_size) for t in sample["output"][:rows]], fontsize=font)
    for label, output, target in zip(axis.get_yticklabels(), sample["output"], sample["target"]):
        if output != target:
            label.set_color("red")
    axis.set(xlabel="source symbol", ylabel="output symbol (greedy; red: wrong)", title=title)
    figure.colorbar(image, ax=axis, fraction=0.04, label="attention weight")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def read_part(run: GridRun, name: str, reader) -> object | None:
    """A run file read by `reader`, or None with a warning naming the run if it is corrupt."""
    try:
        return reader(run.folder / name)
    except (OSError, ValueError, KeyError, TypeError) as error:  # pandas' parser errors are ValueErrors
        store.warn(f"skipping {name} of {run.folder}: {type(error).__name__}: {error}")
        return None


def plot_curves(loaded: results.Loaded, path: Path) -> Path | None:
    """Training loss and held-out greedy token accuracy against step: one row per length,
    one colour per attention type, one line per seed."""
    histories = []
    for row in loaded.table.itertuples():
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
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def plot_heatmaps(loaded: results.Loaded, out: Path) -> list[tuple[str, int, Path]]:
    """For every attention type with weights and every length: the first held-out example of
    the lowest seed's run."""
    made = []
    first_runs = loaded.table.sort_values("seed").groupby(["attention", "length"], sort=False).head(1)
    for row in first_runs.sort_values(["attention", "length"]).itertuples():
        samples = read_part(loaded.runs[row.run], store.ATTENTION, store.read_json)
        if samples is None or not samples.get("samples") or samples["samples"][0].get("weights") is None:
            continue  # the baseline has no attention (or the file was corrupt: warned above)
        path = out / f"attention_{row.attention}_length{row.length}.png"
        title = f"{row.attention}, length {row.length}, seed {row.seed} (run token acc {100 * row.token_acc:.1f}%)"
        plot_heatmap(samples["samples"][0], int(row.vocab_size), title, path)
        made.append((row.attention, row.length, path))
    return made


def plot_head_heatmaps(loaded: results.Loaded, out: Path) -> list[tuple[str, int, Path]]:
    """For every multi-head attention type and length: each head's map of the lowest seed's run."""
    made = []
    for row in loaded.table.sort_values(["attention", "length", "seed"]).itertuples():
        analysed = loaded.analyses.get(row.run)
        if analysed is None or "head_weights" not in analysed or (row.attention, row.length) in {m[:2] for m in made}:
            continue
        path = plot_head_weights(analysed, out / f"heads_{row.attention}_length{row.length}.png")
        made.append((row.attention, row.length, path))
    return made


def markdown_table(frame: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def setup_section(config: DictConfig, grid: list[GridRun], table: pd.DataFrame, runs_dir: Path) -> list[str]:
    """The settings every run shares, what varies, the hardware and the wall time."""
    task, model, train = config.task, config.model, config.train
    attentions = ", ".join(dict.fromkeys(store.attention_label(run.config.attention.name, run.config.attention.get("heads", 1)) for run in grid))
    lengths = ", ".join(map(str, sorted({run.config.task.length for run in grid})))
    seeds = ", ".join(map(str, sorted({run.config.seed for run in grid})))
    swept = ", ".join(f"`{key}`" for key in dict.fromkeys(o.split("=", 1)[0] for run in grid for o in run.label.split()))
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
    if record_path.is_file():
        record = store.read_json(record_path)
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


def evidence_tables(analyses: list[dict]) -> list[str]:
    """Markdown: the counterfactual table and the alignment table, per length and attention type,
    mean over seeds (runs with attention and an analysis.json only)."""
    table = analysis.analysis_table(analyses)
    if table.empty:
        return []
    means = table.groupby(["length", "attention"]).mean(numeric_only=True).join(table.groupby(["length", "attention"]).size().rename("seeds"))
    means = means.reset_index()
    counterfactual = pd.DataFrame(
        {
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


def write_report(grid: list[GridRun], loaded: results.Loaded, runs_dir: Path) -> Path:
    """Write runs_dir/report/ (figures and report.md) from `loaded`, which must not be empty."""
    started = time.perf_counter()
    runs_dir = Path(runs_dir)
    out = runs_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    analyses = list(loaded.analyses.values())
    unanalysed = [loaded.runs[run].folder for run in loaded.table["run"] if run not in loaded.analyses]
    variable_folders = variable_length_runs(grid, runs_dir)
    variable = {folder: results.read_analysis(folder) for folder in variable_folders}
    variable_analyses = [a for a in variable.values() if a is not None]
    per_length = analysis.per_length_table(variable_analyses)

    summary = results.summarise(loaded.table)
    chance = float(loaded.table["chance"].iloc[0])
    figures = plot_accuracy(summary, chance, out / ACCURACY_FIGURE, per_length)
    curves = plot_curves(loaded, out / CURVES_FIGURE)
    heatmaps = plot_heatmaps(loaded, out)
    head_heatmaps = plot_head_heatmaps(loaded, out)
    evidence = evidence_tables(analyses)
    if evidence:
        figures.append(plot_counterfactual(analysis.analysis_table(analyses), out / COUNTERFACTUAL_FIGURE))
    generalisation = analysis.length_generalisation_table(analyses + variable_analyses)
    if not generalisation.empty:
        figures.append(plot_length_generalisation(generalisation, out / GENERALISATION_FIGURE))

    lines = [
        "# copytask report",
        "",
        f"Made by `python -m copytask report` from the run folders in `{runs_dir}` "
        f"({len(loaded.table)} of {len(grid)} runs of the grid complete). Regenerate it with the same overrides as the sweep.",
        "",
        *setup_section(grid[0].config, grid, loaded.table, Path(runs_dir)),
        "",
        "## Accuracy against length",
        "",
        f"![accuracy against length]({ACCURACY_FIGURE}.png) ([vector copy]({ACCURACY_FIGURE}.svg))",
        "",
        "Mean over seeds with a 95% t-interval (clipped to [0, 100]; none with a single seed); the gap is the attention type's mean minus "
        f"the `{results.BASELINE}` baseline's at the same length, in percentage points. Per-run numbers: "
        f"[`{results.RESULTS_CSV}`](../{results.RESULTS_CSV}).",
        "",
        markdown_table(results.comparison_table(summary)),
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
        figures.append(curves)
        lines += ["## Training curves", "", f"![training curves]({CURVES_FIGURE})", ""]
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
    for attention, length, path in heatmaps:
        lines += [f"### {attention}, length {length}", "", f"![{attention} attention, length {length}]({path.name})", ""]
    for attention, length, path in head_heatmaps:
        lines += [f"### {attention}, length {length}: each head", "", f"![{attention} heads, length {length}]({path.name})", ""]
    store.atomic_write(out / "report.md", "\n".join(lines))
    figures += [path for *_, path in heatmaps + head_heatmaps]
    print(f"report: {out / 'report.md'} and {len(figures)} figures in {time.perf_counter() - started:.1f} s")
    return out / "report.md"


def report_command(overrides: list[str]) -> int:
    """`python -m copytask report [overrides]`: results.csv and report/ for the grid of
    `python -m copytask sweep [overrides]`; exit status 1 when no run of it is complete."""
    master, grid = compose_grid(overrides)
    runs_dir = Path(master.runs_dir)
    loaded = results.load(grid)
    if loaded.table.empty:
        what = "does not exist" if not runs_dir.is_dir() else "has no finished run of this grid"
        print(
            f"copytask: error: nothing to report: {runs_dir} {what} (0 of {len(grid)} runs complete); "
            f"train them with: {sweep_command(master)}",
            file=sys.stderr,
        )
        return 1
    if loaded.missing:
        print(results.describe_missing(loaded.missing, len(grid)))
    print(f"results: {results.save(loaded.table, runs_dir)}")
    write_report(grid, loaded, runs_dir)
    return 0
