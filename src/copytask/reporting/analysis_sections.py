"""report.md's sections on what the analysis found (`copytask analyze`'s analysis.json of each run):
length generalisation, what holding sequences out did, accuracy beyond the trained lengths, and the
evidence on attention (counterfactual weights, alignment) that comes before its maps. Each section is
its markdown lines and the figures it drew (`Section`)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pandas as pd

from .. import store
from ..evaluation import COUNTERFACTUALS
from . import analysis_tables, tables
from .analysis_figures import extrapolates, plot_counterfactual, plot_extrapolation, plot_length_generalisation
from .tables import markdown_table

COUNTERFACTUAL_FIGURE = "counterfactual.png"
GENERALISATION_FIGURE = "length_generalisation.png"
EXTRAPOLATION_FIGURE = "extrapolation.png"


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


def missing_analysis(folders: list[Path], total: int, what: str, runs_dir: Path) -> list[str]:
    """Markdown naming the complete runs without analysis.json (`what` they are left out of), and
    the command that makes it."""
    if not folders:
        return []
    names = ", ".join(f"`{folder.name}`" for folder in folders)
    return [
        f"**Analysis missing** for {len(folders)} of {total} runs ({names}): they have no `{store.ANALYSIS}`, "
        f"so {what} leave them out. Make it with `python -m copytask analyze runs_dir={runs_dir}` (a sweep does this "
        "itself at its end), then regenerate the report.",
        "",
    ]


class Section(NamedTuple):
    """A part of report.md: its markdown lines and the figure files they show, drawn when it was made."""

    lines: list[str]
    figures: list[Path]


def analysis_section(loaded: tables.Loaded, variable_analyses: list[dict], runs_dir: Path, out: Path) -> Section:
    """What `copytask analyze` found beyond the accuracy table: which runs it has not analysed yet,
    length generalisation, what holding sequences out did, and accuracy beyond the trained lengths."""
    analyses = [*loaded.analyses.values(), *variable_analyses]
    unanalysed = [loaded.runs[run].folder for run in loaded.table["run"] if run not in loaded.analyses]
    generalisation = with_settings(analysis_tables.length_generalisation_table(analyses), loaded)
    generalised = generalisation_section(generalisation, loaded.settings, out)
    beyond = extrapolation_section(generalisation, loaded, out)
    lines = [
        "## Analysis",
        "",
        *missing_analysis(
            unanalysed, len(loaded.table), "the counterfactual, alignment and length-generalisation results", runs_dir
        ),
        *generalised.lines,
        *heldout_lines(analyses),
        *beyond.lines,
    ]
    return Section(lines, generalised.figures + beyond.figures)


def generalisation_section(generalisation: pd.DataFrame, settings: list[str], out: Path) -> Section:
    """Accuracy of every trained length at every test length of the grid (`length_generalisation_table`
    rows with their settings); nothing if no run is analysed."""
    if generalisation.empty:
        return Section([], [])
    figure = plot_length_generalisation(generalisation, out / GENERALISATION_FIGURE, settings)
    lines = [
        "### Length generalisation",
        "",
        "Every trained model evaluated (greedy token accuracy, mean over seeds) at every length of the grid: train "
        "length (rows) against test length (columns). Evaluation only, nothing retrained.",
        "",
        f"![train length x test length accuracy]({GENERALISATION_FIGURE})",
        "",
    ]
    return Section(lines, [figure])


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
        "Every set scored here is held out: no sequence of it was in the run's training batches (replayed from its "
        "seed) or its validation set. Short lengths have few sequences, so:",
        "",
    ]
    for note, runs in fewer.items():
        several = len(runs) > 1
        lines.append(f"- {note} ({len(runs)} run{'s' * several}: `{runs[0]}`{', ...' * several})")
    for run, mix in mixes.items():
        shares = ", ".join(
            f"length {row['length']} {row['held_out']} of {row['sequences']:,} held out, trained on at "
            f"{100 * row['train_share']:.1f}% of rows instead of {100 * row['uniform_share']:.1f}%"
            for row in mix
        )
        lines.append(
            f"- `{run}`: holding the test and validation sets out of training changes its length mix: {shares}."
        )
    return [*lines, ""]


def extrapolation_section(generalisation: pd.DataFrame, loaded: tables.Loaded, out: Path) -> Section:
    """Accuracy against test length past the trained lengths, where the analysis tested some run
    there (`analysis.lengths`); nothing otherwise."""
    if not extrapolates(generalisation):
        return Section([], [])
    with_chance = generalisation.merge(loaded.table[["run", "chance"]], on="run", how="left")
    figure = plot_extrapolation(with_chance, out / EXTRAPOLATION_FIGURE, loaded.settings)
    lines = [
        "### Beyond the trained lengths",
        "",
        "Greedy token accuracy against test length (`analysis.lengths`), mean over seeds with their range as a band; "
        "the lengths the models were trained on are shaded. A model with learned positions is not defined past its "
        "table (`model.max_length`): its line stops there.",
        "",
        f"![accuracy against test length]({EXTRAPOLATION_FIGURE})",
        "",
    ]
    return Section(lines, [figure])


def evidence_section(loaded: tables.Loaded, out: Path) -> Section:
    """The counterfactual and alignment tables of the analysed runs, per setting, length and
    attention type, mean over seeds, and the counterfactual figure, whose x axis is the trained
    length: only where some run trained at a fixed length. Nothing if no run is analysed."""
    analysed = with_settings(analysis_tables.analysis_table(list(loaded.analyses.values())), loaded)
    if analysed.empty:
        return Section([], [])
    fixed_length = bool((analysed.train_length == analysed.length.astype(str)).any())
    means = seed_means(analysed, loaded.settings)
    families = loaded.families()
    notes = "".join(dict.fromkeys(families[label].counterfactual_note for label in means["attention"]))
    lines = [
        *counterfactual_lines(means, loaded.settings, fixed_length, notes),
        *alignment_lines(means, loaded.settings),
    ]
    if not fixed_length:
        return Section(lines, [])
    with_chance = analysed.merge(loaded.table[["run", "chance"]], on="run", how="left")
    return Section(lines, [plot_counterfactual(with_chance, out / COUNTERFACTUAL_FIGURE, loaded.settings)])


def seed_means(analysed: pd.DataFrame, settings: list[str]) -> pd.DataFrame:
    """The analysis numbers' means over seeds, one row per setting, length and attention type, with
    the number of seeds (`seeds`) and those keys as columns."""
    keys = [*settings, "length", "attention"]
    numbers = analysed.drop(columns=["run", "task", "train_length", "seed"])
    means = numbers.groupby(keys, dropna=False).mean().join(analysed.groupby(keys, dropna=False).size().rename("seeds"))
    return means.reset_index()


def described(means: pd.DataFrame, settings: list[str]) -> dict[str, pd.Series]:
    """The columns that say which runs a row of `seed_means` is: settings, length, attention, seeds."""
    columns = {key: means[key].map(tables.setting_value) for key in settings}
    return {**columns, "length": means["length"], "attention": means["attention"], "seeds": means["seeds"]}


def counterfactual_lines(means: pd.DataFrame, settings: list[str], figure: bool, notes: str = "") -> list[str]:
    """Markdown: accuracy with the model's own attention and with counterfactual weights, the
    drops, what they mean for the families of the rows where unlike a GRU model's (`notes`), and (with
    `figure`) the counterfactual figure."""
    replaced = COUNTERFACTUALS
    counterfactual = pd.DataFrame(
        {
            **described(means, settings),
            "own %": means["own"].map(tables.percent),
            **{f"{name} %": means[name].map(tables.percent) for name in replaced},
            **{f"drop {name}": means[f"drop_{name}"].map(lambda drop: f"{100 * drop:+.1f}") for name in replaced},
        }
    )
    return [
        "### Counterfactual attention",
        "",
        "Greedy token accuracy (%) with the model's own attention weights and with them replaced, at every decoding "
        "step, by uniform weights over the source, by the model's weights shuffled among the source positions, and by "
        "all weight on position 0; `drop` is own minus counterfactual, in points, mean over seeds. A large drop says "
        "the output depends on where the model attends. Measured on the first held-out sequences "
        "(`analysis.eval_size`), so `own` can differ a little from the accuracy table above." + notes,
        "",
        markdown_table(counterfactual),
        "",
        *([f"![accuracy under counterfactual attention]({COUNTERFACTUAL_FIGURE})", ""] if figure else []),
    ]


def alignment_lines(means: pd.DataFrame, settings: list[str]) -> list[str]:
    """Markdown: how often the attention argmax lands on the copied source position, or next to it."""
    alignment = pd.DataFrame(
        {
            **described(means, settings),
            "argmax on copied position %": means["align_hit"].map(tables.percent),
            "weight on copied position %": means["align_mass"].map(tables.percent),
            "argmax next to it %": means["align_adjacent"].map(tables.percent),
        }
    )
    return [
        "### Alignment",
        "",
        "How often the attention argmax at an output step lands on the source position that step copies, and the mean "
        "weight there (row t of the map produces output t, for both Bahdanau and Luong; EOS not scored), and how often "
        "the argmax lands on a neighbour of that position instead. The bidirectional encoder's state at a neighbouring "
        "position also carries the symbol, so a model can copy correctly while attending one position off: a diagonal "
        "that looks right can be shifted by one, another reason to read maps together with the counterfactual drops.",
        "",
        markdown_table(alignment),
        "",
    ]


def attention_section(
    evidence: list[str], heatmaps: list[tuple[str, Path]], head_heatmaps: list[tuple[str, Path]]
) -> list[str]:
    """The caution on reading attention maps, the `evidence` (counterfactual and alignment tables),
    then the maps (`plot_heatmaps`, `plot_head_heatmaps`); nothing if there is none of them."""
    lines = ["## Attention: the evidence, then the maps", "", CAUTION, "", *evidence] if heatmaps or evidence else []
    if heatmaps or head_heatmaps:
        lines += [
            "In each map a red outline marks the source position the output step copies (the diagonal for copy, the "
            "anti-diagonal for reverse, the t-th content symbol for selective copying, whose noise tokens `_` are "
            "grey: a row that jumps over the noise to its symbol has its weight in the outline), so attention that "
            "lands next to it shows; red output symbols are wrong.",
            "",
        ]
    for heading, path in heatmaps:
        lines += [f"### {heading}", "", f"![attention of {heading}]({path.name})", ""]
    for heading, path in head_heatmaps:
        lines += [f"### {heading}: each head", "", f"![heads of {heading}]({path.name})", ""]
    return lines
