"""The breakdown's tables (`evaluation.breakdown`, `evaluation.probe`), read from the runs'
analysis.json files: greedy, teacher-forced and beam-search accuracy per run, accuracy by output
position, and the probe's accuracy by source position. Pandas over dicts: no model is loaded here."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from .analysis_tables import run_columns

DECODINGS = {"greedy": "greedy", "teacher_forced": "teacher-forced"}  # analysis.json key -> label
SUMMARIES = ("trained", "untrained")  # the probe's two models


def breakdown_columns(analysis: dict) -> dict:
    """One run's breakdown as results columns: `tf_token_acc`, `tf_seq_acc`, `beam{K}_token_acc` and
    `beam{K}_seq_acc` per width, `probe_acc` and `probe_untrained_acc` (mean over source positions),
    and `breakdown_sequences`, the held-out sequences they were scored on. Empty without a breakdown."""
    breakdown = analysis.get("breakdown")
    if breakdown is None:
        return {}
    tf = breakdown["teacher_forced"]
    columns = {
        "tf_token_acc": tf["token_acc"],
        "tf_seq_acc": tf["seq_acc"],
        "breakdown_sequences": breakdown["sequences"],
    }
    for row in breakdown["beam"]:
        columns |= {f"beam{row['width']}_token_acc": row["token_acc"], f"beam{row['width']}_seq_acc": row["seq_acc"]}
    if probe := breakdown.get("probe"):
        for name, column in zip(SUMMARIES, ("probe_acc", "probe_untrained_acc")):
            scored = [value for value in probe[name] if value is not None]
            columns[column] = sum(scored) / len(scored)
    return columns


def breakdown_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """One row per analysed run with a breakdown: `breakdown_columns` and the greedy accuracy on the same
    sequences (`greedy_token_acc`, `greedy_seq_acc`)."""
    rows = []
    for a in analyses:
        if "breakdown" in a:
            greedy = a["breakdown"]["greedy"]
            scores = {"greedy_token_acc": greedy["token_acc"], "greedy_seq_acc": greedy["seq_acc"]}
            rows.append(run_columns(a) | {"min_length": a["min_length"]} | scores | breakdown_columns(a))
    return pd.DataFrame(rows)


def position_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """Long form: one row per (run, decoding, output position) with token_acc; positions from 1."""
    rows = [
        run_columns(a) | {"decoding": label, "position": position + 1, "token_acc": value}
        for a in analyses
        if "breakdown" in a
        for key, label in DECODINGS.items()
        for position, value in enumerate(a["breakdown"][key]["by_position"])
    ]
    return pd.DataFrame(rows)


def probe_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """Long form: one row per (run, summary: trained | untrained, source position) with the probe's
    accuracy and chance; positions from 1. Runs without a probe (Transformers, probe_size null) have none."""
    rows = [
        run_columns(a) | {"summary": name, "position": position + 1, "accuracy": value, "chance": probe["chance"]}
        for a in analyses
        if (probe := a.get("breakdown", {}).get("probe"))
        for name in SUMMARIES
        for position, value in enumerate(probe[name])
        if value is not None
    ]
    return pd.DataFrame(rows)
