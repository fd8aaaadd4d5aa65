"""The analysis' tables, read from the runs' analysis.json files (`evaluation.analysis` writes
them): counterfactual accuracy and alignment per run, length generalisation, accuracy per length of
variable-length runs, and the held-out notes. Pandas over dicts: no model is loaded here."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from ..evaluation import COUNTERFACTUALS

ALIGNMENT = ("hit", "mass", "adjacent")  # how attention's argmax and mass fall on the copied position


def run_columns(analysis: dict) -> dict:
    """The columns that identify a run in every table; `train_length` reads 5-80 for a variable-length run."""
    low, high = analysis["min_length"], analysis["length"]
    identity = {key: analysis[key] for key in ("run", "attention", "task", "length", "seed")}
    return identity | {"train_length": str(high) if low == high else f"{low}-{high}"}


def analysis_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """One row per analysed run with attention: accuracy under each counterfactual, the drops,
    and the alignment (hit rate and mass). Join on `run` with the results table."""
    rows = [
        run_columns(a)
        | {name: a["counterfactual"][name] for name in ("own", *COUNTERFACTUALS)}
        | {f"drop_{name}": a["drop"][name] for name in COUNTERFACTUALS}
        | {f"align_{key}": a["alignment"].get(key) for key in ALIGNMENT}
        for a in analyses
        if "counterfactual" in a
    ]
    return pd.DataFrame(rows)


def length_generalisation_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """Long form: one row per (analysed run, test length) with token_acc and seq_acc."""
    rows = [run_columns(a) | row for a in analyses for row in a["length_generalisation"]]
    return pd.DataFrame(rows)


def per_length_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """Long form: one row per (variable-length run, test_length) with count, token_acc and seq_acc."""
    rows = [run_columns(a) | row for a in analyses if "per_length" in a for row in a["per_length"]]
    return pd.DataFrame(rows)


def heldout_notes(analyses: Iterable[dict]) -> dict[str, list[str]]:
    """Each note of a length scored on fewer held-out sequences than asked (or not at all), with the
    runs it is about (`length_generalisation` and `per_length_notes`)."""
    fewer = {}
    for a in analyses:
        notes = [
            row["note"]
            for row in a["length_generalisation"]
            if "note" in row and not row["note"].startswith("not defined")
        ]
        for note in [*notes, *a.get("per_length_notes", [])]:
            fewer.setdefault(note, []).append(a["run"])
    return fewer


def _by_length(level: pd.Index) -> pd.Index:
    """Sort key: train lengths ("5", "10", "5-80") by their longest length, not as text."""
    return level.map(lambda value: int(value.split("-")[-1])) if level.name == "train_length" else level


def summary(analyses: list[dict], settings: pd.DataFrame | None = None) -> str:
    """The tables `python -m copytask analyze` prints: counterfactuals and alignment per setting
    (the columns of `settings` besides `run`, where given), attention, task and train length (mean
    over seeds), then the train length x test length token accuracy."""
    keys, number = ["attention", "task", "train_length"], "{:.1f}".format  # every share in %
    generalisation, table = length_generalisation_table(analyses), analysis_table(analyses)
    if generalisation.empty:
        return "no analysed runs"
    if settings is not None:
        keys = [*settings.columns.drop("run"), *keys]
        generalisation = generalisation.merge(settings, on="run", how="left")
        table = table.merge(settings, on="run", how="left") if not table.empty else table
    parts = []
    if not table.empty:
        columns = [
            "own",
            *COUNTERFACTUALS,
            *(f"drop_{n}" for n in COUNTERFACTUALS),
            *(f"align_{key}" for key in ALIGNMENT),
        ]
        grouped = table.groupby(keys, dropna=False)  # a setting a run does not use (NaN) is a value of its own
        counterfactual = (100 * grouped[columns].mean()).join(grouped.size().rename("seeds"))
        counterfactual = counterfactual.sort_index(key=_by_length)
        parts.append(
            "greedy token accuracy in % with the model's own attention and under each counterfactual, the drops in "
            "points and\nthe alignment in % (mean over seeds)\n" + counterfactual.to_string(float_format=number)
        )
    matrix = generalisation.groupby([*keys, "test_length"], dropna=False)["token_acc"].mean().unstack("test_length")
    matrix = (100 * matrix).sort_index(key=_by_length)
    parts.append(
        "length generalisation: greedy token accuracy in %, train length (rows) x test length (columns)\n"
        + matrix.to_string(float_format=number)
    )
    if fewer := heldout_notes(analyses):
        parts.append(
            "held-out sets at short lengths:\n"
            + "\n".join(f"{note} ({len(runs)} runs)" for note, runs in fewer.items())
        )
    return "\n\n".join(parts)
