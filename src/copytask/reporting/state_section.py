"""report.md's section on how much state copying takes, where a grid sweeps a size that sets it (the
baseline's hidden size, linear attention's feature size, ...): greedy accuracy against the floats per
sequence each run's decoder can read of the source (metrics.json's `state_floats`), one line per model and
length, with the information bound each length sets (Jelassi et al., ICML 2024: a state of b bits holds at
most b / log2 V symbols of V); and, where the report holds linear attention, its accuracy on either side of
L = d_k, past which its weights (rank <= d_k) cannot be the copy's one-hot alignment.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure
from omegaconf import DictConfig

from ..families import family_of
from ..figures import colours, draw_chance, fitted, legend_outside, model_order, model_style, save
from . import tables
from .analysis_sections import Section
from .result_figures import LINE_STYLES, draw_mean, groups, setting_title
from .tables import STATE_FLOATS, markdown_table

STATE_FIGURE = "accuracy_vs_state_floats.png"
FLOAT_BITS = 32  # a state float's bits: float32


def least_state(length: int, vocab_size: int) -> float:
    """The fewest floats that can hold a sequence of `length` symbols of `vocab_size`: length x log2(V) bits,
    in FLOAT_BITS-bit floats (Jelassi et al., 2024: a state of b bits copies at most b / log2 V symbols)."""
    return length * math.log2(vocab_size) / FLOAT_BITS


def facet_keys(summary: pd.DataFrame, settings: list[str]) -> list[str]:
    """The settings that vary between rows of one model, length and state: they would pool, so they facet."""
    keyed = summary.dropna(subset=[STATE_FLOATS])
    by = keyed.groupby(["attention", "length", STATE_FLOATS])
    return [key for key in settings if (by[key].nunique(dropna=False) > 1).any()]


def fixed_part(cfg: DictConfig) -> tuple[int, str] | None:
    """The part of a run's state floats that its family's size key does not set, and what it is (Mamba's
    convolution windows, linear attention's hand-over: `Family.fixed_state`); None where the size key sets it all."""
    return family_of(cfg).fixed_state(cfg)


def plot_state(
    summary: pd.DataFrame, settings: list[str], path: Path, fixed: dict[str, set[tuple[int, str]]] | None = None
) -> Path:
    """Token and sequence accuracy (mean over seeds, 95% band) against state floats on a log axis: one colour per
    model, one line style per length; each length's `least_state` a grey vertical line in its style, and each
    model's `fixed` part of its state (`fixed_part`, by model) a dotted line in its colour. One row of panels per
    value of the settings that vary at a fixed state (`facet_keys`)."""
    known = summary.dropna(subset=[STATE_FLOATS]).assign(**{STATE_FLOATS: lambda s: s[STATE_FLOATS].astype(float)})
    keys = facet_keys(known, settings)
    facets = groups(known, keys)
    lengths = sorted(known["length"].unique())
    style = {length: LINE_STYLES[i % len(LINE_STYLES)] for i, length in enumerate(lengths)}
    colour, order = colours(known["attention"].unique()), model_order(known["attention"])
    figure = Figure(figsize=(13, 0.8 + 3.8 * len(facets)), layout="constrained")
    axes = figure.subplots(len(facets), 2, sharex=True, squeeze=False)
    for (values, rows), row_axes in zip(facets, axes):
        facet = setting_title(keys, values)
        for axis, metric, title in zip(
            row_axes, ("token_acc", "seq_acc"), ("greedy token accuracy", "exact-sequence accuracy")
        ):
            lines = sorted(rows.groupby(["attention", "length"], sort=False), key=lambda line: order.index(line[0][0]))
            for (attention, length), series in lines:
                name, line = f"{attention}, length {length}", (style[length][0], model_style(attention)[1])
                draw_mean(axis, series.sort_values(STATE_FLOATS), STATE_FLOATS, metric, colour[attention], line, name)
            for length, chance in rows[["length", "chance"]].drop_duplicates().itertuples(index=False):
                bound = least_state(length, round(1 / chance))
                axis.axvline(
                    bound, color="grey", linestyle=style[length][0], linewidth=1, label=f"bound, length {length}"
                )
            for attention in order:
                for floats, what in sorted((fixed or {}).get(attention, ())):
                    axis.axvline(
                        floats, color=colour[attention], linestyle=":", linewidth=1.5, label=f"{attention}: {what}"
                    )
            if metric == "token_acc":
                for chance in rows["chance"].unique():
                    draw_chance(axis, chance)
            axis.set_xscale("log")
            axis.set(title=f"{title}, {facet}" if facet else title, ylabel="% (held-out set, greedy)", ylim=(-2, 102))
            axis.grid(alpha=0.3)
    for axis in axes[-1]:
        axis.set_xlabel("state floats per sequence (what the decoder can read of the source)")
    legend_outside(figure, list(axes.flat))
    figure.suptitle(
        fitted(
            "Copy accuracy against state size: mean over seeds, band = 95% interval; grey lines: the least state "
            "that holds a sequence of each length",
            figure.get_figwidth(),
            12,
        )
    )
    return save(figure, path)


def fixed_words(fixed: dict[str, set[tuple[int, str]]]) -> str:
    """The sentence on the figure's dotted lines (`fixed_part` of each model); empty where there are none."""
    if not fixed:
        return ""
    parts = "; ".join(
        f"{label}'s {what}, {floats:,} floats" for label, each in fixed.items() for floats, what in sorted(each)
    )
    return (
        f" Dotted lines in a model's colour: the part of its state that its size key does not set ({parts}); "
        "the state right of it is what the size adds."
    )


def what_is_read(cfg: DictConfig) -> str:
    """What a run's decoder can read of the source, in the words of its config (`Family.reads`)."""
    return family_of(cfg).reads(cfg)


def rank_table(loaded: tables.Loaded) -> pd.DataFrame:
    """Linear attention's mean greedy token accuracy (%) per feature size d_k (`attention.size`) and length, with
    the mean weight on the copied position where the runs were analysed (`align_mass`: 1 is one-hot), a cell
    marked `*` where L > d_k; empty where the report holds no linear attention."""
    rows = []
    for row in loaded.table.to_dict("records"):
        cfg = loaded.runs[row["run"]].config
        if family_of(cfg).reads_attention and cfg.attention.score == "linear":
            mass = row.get("align_mass", math.nan)
            rows.append(
                {"model": row["attention"], "d_k": cfg.attention.size, "length": row["length"], "acc": row["token_acc"]}
                | {"mass": math.nan if mass is None else mass}
            )
    if not rows:
        return pd.DataFrame()
    means = pd.DataFrame(rows).groupby(["model", "d_k", "length"], as_index=False)[["acc", "mass"]].mean()
    means["cell"] = [
        tables.percent(r.acc) + ("" if math.isnan(r.mass) else f" ({r.mass:.2f})") + (" *" if r.length > r.d_k else "")
        for r in means.itertuples()
    ]
    table = means.pivot(index=["model", "d_k"], columns="length", values="cell").fillna("")
    table.columns = [f"length {length}" for length in table.columns]
    return table.reset_index()


def state_section(loaded: tables.Loaded, summary: pd.DataFrame, out: Path) -> Section:
    """The figure and its words where the grid varies the state (`tables.state_varies`); nothing otherwise."""
    if not tables.state_varies(summary):
        return Section([], [])
    read, fixed = {}, {}
    for run, label in zip(loaded.table["run"], loaded.table["attention"]):
        read.setdefault(label, what_is_read(loaded.runs[run].config))
        if part := fixed_part(loaded.runs[run].config):
            fixed.setdefault(label, set()).add(part)
    path = plot_state(summary, loaded.settings, out / STATE_FIGURE, fixed)
    vocab = ", ".join(map(str, sorted(loaded.table["vocab_size"].unique())))
    lines = [
        "## Accuracy against state size",
        "",
        f"![accuracy against state floats]({path.name})",
        "",
        "Each run's state is what its decoder can read of a source of the run's length, in floats per sequence "
        f"(`{STATE_FLOATS}` in `{tables.RESULTS_CSV}`): "
        + "; ".join(f"{label}: {what}" for label, what in read.items())
        + ". Mean over seeds, band = 95% interval. Grey vertical lines (one per length, in its line style): the "
        "information bound of Jelassi et al. (ICML 2024), a state of b bits holds at most b / log2 V symbols, so a "
        f"sequence of L symbols of V = {vocab} needs at least L log2 V / {FLOAT_BITS} floats of {FLOAT_BITS} bits. "
        "Left of its line no model can copy that length; right of it the bound allows it but does not promise it."
        + fixed_words(fixed),
        "",
    ]
    ranks = rank_table(loaded)
    if not ranks.empty:
        lines += [
            "### Linear attention past its feature size",
            "",
            "Linear attention's weights over an output (T_dec x T_enc) have rank at most its feature size d_k "
            "(`attention.size`), so once the length L exceeds d_k they cannot give every output step its own one-hot "
            "alignment, which copying by position would use. Mean greedy token accuracy % over seeds, in brackets the "
            "mean weight on the copied position (`align_mass`; 1 would be one-hot) where analysed; `*`: L > d_k.",
            "",
            markdown_table(ranks),
            "",
        ]
    return Section(lines, [path])
