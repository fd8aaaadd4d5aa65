"""The breakdown's tables (`evaluation.breakdown`, `evaluation.probe`), read from the runs'
analysis.json files: greedy, teacher-forced and beam-search accuracy per run, accuracy by output
position, and the probe's accuracy by source position. Pandas over dicts: no model is loaded here."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from .analysis_tables import run_columns

DECODINGS = {"greedy": "greedy", "teacher_forced": "teacher-forced"}  # analysis.json key -> label
SUMMARIES = ("trained", "untrained")  # the probe's two models, read for the symbols
PROBES = {"trained": "probe_acc", "untrained": "probe_untrained_acc", "control": "probe_control_acc"}


def breakdown_columns(analysis: dict) -> dict:
    """One run's breakdown as results columns: `tf_token_acc`, `tf_seq_acc` and `breakdown_sequences`,
    the test sequences they were scored on (all of them, as greedy's); `beam{K}_token_acc` and
    `beam{K}_seq_acc` per width, on `beam_sequences`; the probe's mean accuracy over source positions,
    `probe_acc`, `probe_untrained_acc` and `probe_control_acc` (the control task's),
    `probe_control_chance`, `probe_selectivity` (`probe_acc` - `probe_control_acc`) and `probe_sequences`.
    Empty without a breakdown."""
    breakdown = analysis.get("breakdown")
    if breakdown is None:
        return {}
    tf = breakdown["teacher_forced"]
    columns = {
        "tf_token_acc": tf["token_acc"],
        "tf_seq_acc": tf["seq_acc"],
        "breakdown_sequences": breakdown["sequences"],
        "beam_sequences": breakdown.get("beam_sequences", breakdown["sequences"]),
    }
    for row in breakdown["beam"]:
        columns |= {f"beam{row['width']}_token_acc": row["token_acc"], f"beam{row['width']}_seq_acc": row["seq_acc"]}
    if probe := breakdown.get("probe"):
        columns |= {column: mean(probe[name]) for name, column in PROBES.items() if name in probe}
        if "control" in probe:
            columns["probe_control_chance"] = sum(probe["control_chance"]) / len(probe["control_chance"])
            columns["probe_selectivity"] = columns["probe_acc"] - columns["probe_control_acc"]
        columns["probe_sequences"] = probe.get("scored", breakdown["sequences"])
    return columns


def mean(accuracies: list[float | None]) -> float:
    """The mean over the positions that were scored."""
    scored = [value for value in accuracies if value is not None]
    return sum(scored) / len(scored)


def breakdown_table(analyses: Iterable[dict]) -> pd.DataFrame:
    """One row per analysed run with a breakdown: `breakdown_columns` and the greedy accuracy on the same
    sequences as the teacher-forced one (`greedy_token_acc`, `greedy_seq_acc`)."""
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
    accuracy for the symbols and chance; positions from 1. Runs without a probe (Transformers,
    probe_size null) have none."""
    rows = [
        run_columns(a) | {"summary": name, "position": position + 1, "accuracy": value, "chance": probe["chance"]}
        for a in analyses
        if (probe := a.get("breakdown", {}).get("probe"))
        for name in SUMMARIES
        for position, value in enumerate(probe[name])
        if value is not None
    ]
    return pd.DataFrame(rows)
