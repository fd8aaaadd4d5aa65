"""A grid's finished runs as one table, and its summary over seeds (mean and 95% t-interval).

Each run's metrics.json, and its analysis.json where `copytask analyze` has written one, is read
here; a run whose metrics.json is corrupt is skipped with a warning that names it (a corrupt
analysis.json only loses its analysis), so a half-written or damaged folder never stops
`compare` or `report`. Runs are labelled by `store.attention_label`: multi-head runs stand apart.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from . import store
from .sweep import GridRun, SweepFailed, compose_grid

RESULTS_CSV = "results.csv"
COLUMNS = ("attention", "length", "seed", "token_acc", "seq_acc", "chance", "params", "steps", "train_seconds", "run")
ALIGNMENT_COLUMNS = ("align_hit", "align_mass", "align_adjacent")  # from analysis.json, empty for runs without attention or analysis
BASELINE = "none"
CONFIDENCE = 0.95


@dataclass
class Loaded:
    """The grid's usable runs, and the rest with the reason each one is left out."""

    table: pd.DataFrame  # one row per complete run, COLUMNS plus the rest of metrics.json and ALIGNMENT_COLUMNS
    runs: dict[str, GridRun]  # run folder name -> grid run, for the rows of `table`
    missing: list[tuple[GridRun, str]]
    analyses: dict[str, dict]  # run folder name -> its analysis.json, for the rows of `table` that have one


def read_analysis(folder: Path) -> dict | None:
    """A run's analysis.json, or None if it has none (or a corrupt one: warned, naming the run)."""
    path = folder / store.ANALYSIS
    if not path.is_file():
        return None
    try:
        return store.read_json(path)
    except (OSError, ValueError) as error:
        store.warn(f"skipping {store.ANALYSIS} of {folder}: {type(error).__name__}: {error}")
        return None


def load(grid: list[GridRun]) -> Loaded:
    """Read metrics.json (and analysis.json) of every complete run in `grid`; warn about and skip the rest."""
    rows, runs, missing, analyses = [], {}, [], {}
    for run in grid:
        status = run.status()
        if status == "complete":
            try:
                metrics = store.read_json(run.folder / store.METRICS)
                missing_keys = [key for key in COLUMNS if key not in metrics]
                if missing_keys:
                    raise ValueError(f"no {', '.join(missing_keys)}")
            except (OSError, ValueError, TypeError) as error:
                reason = f"corrupt {store.METRICS} ({error})"
                store.warn(f"skipping {run.folder}: {reason}")
                missing.append((run, reason))
                continue
            metrics["attention"] = store.attention_label(metrics["attention"], metrics.get("heads", 1))
            analysis = read_analysis(run.folder)
            if analysis is not None:
                analyses[metrics["run"]] = analysis
                metrics |= {f"align_{key}": value for key, value in analysis.get("alignment", {}).items()}
            rows.append(metrics)
            runs[metrics["run"]] = run
        else:
            if status == "incomplete":  # a half-written folder; failed runs are named by their sweep
                store.warn(f"skipping {run.folder}: {run.failure()}")
            missing.append((run, run.failure()))
    table = pd.DataFrame(rows)
    if not table.empty:
        table = table.reindex(columns=[*COLUMNS, *ALIGNMENT_COLUMNS, *(c for c in table.columns if c not in COLUMNS + ALIGNMENT_COLUMNS)])
    return Loaded(table, runs, missing, analyses)


def save(table: pd.DataFrame, runs_dir: Path) -> Path:
    """runs_dir/results.csv: one row per run, written atomically."""
    path = Path(runs_dir) / RESULTS_CSV
    store.atomic_write(path, table[[*COLUMNS, *ALIGNMENT_COLUMNS]].to_csv(index=False))
    return path


@lru_cache(maxsize=None)
def t_quantile(probability: float, df: int) -> float:
    """Student-t quantile for `df` degrees of freedom, from the density integrated numerically
    (numpy and pandas have no t distribution; scipy is not worth a dependency for this)."""
    x = np.linspace(0.0, 200.0, 800_001)
    log_density = (
        math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi) - (df + 1) / 2 * np.log1p(x * x / df)
    )
    density = np.exp(log_density)
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(x))])
    return float(np.interp(probability, cdf, x))


def interval(values: pd.Series) -> tuple[float, float, float]:
    """Mean and 95% t-interval over seeds; the interval is NaN with a single seed."""
    n, mean = len(values), float(values.mean())
    if n < 2:
        return mean, math.nan, math.nan
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * float(values.std(ddof=1)) / math.sqrt(n)
    return mean, mean - half, mean + half


def summarise(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (length, attention), baseline first: seeds, mean and interval of token and
    sequence accuracy, chance, params, and the gap of each mean to the baseline's."""
    rows = []
    for (length, attention), group in table.groupby(["length", "attention"], sort=False):
        row = {"length": length, "attention": attention, "seeds": len(group)}
        for metric in ("token_acc", "seq_acc"):
            row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"] = interval(group[metric])
        row["chance"] = group["chance"].iloc[0]
        row["params"] = group["params"].iloc[0]
        rows.append(row)
    summary = pd.DataFrame(rows)
    order = [BASELINE] + [a for a in dict.fromkeys(table["attention"]) if a != BASELINE]
    summary["attention"] = pd.Categorical(summary["attention"], categories=order, ordered=True)
    summary = summary.sort_values(["length", "attention"]).reset_index(drop=True)
    summary["attention"] = summary["attention"].astype(str)
    baseline = summary[summary["attention"] == BASELINE].set_index("length")
    for metric in ("token_acc", "seq_acc"):
        summary[f"{metric}_gap"] = summary[metric] - summary["length"].map(baseline[metric])
        summary.loc[summary["attention"] == BASELINE, f"{metric}_gap"] = math.nan
    return summary


def percent(value: float) -> str:
    return "" if math.isnan(value) else f"{100 * value:.1f}"


def with_interval(mean: float, low: float, high: float) -> str:
    """`99.8 [99.5, 100.0]` in percent; the interval is clipped to [0, 100] (accuracies)."""
    if math.isnan(low):
        return percent(mean)
    return f"{percent(mean)} [{percent(max(low, 0.0))}, {percent(min(high, 1.0))}]"


def comparison_table(summary: pd.DataFrame) -> pd.DataFrame:
    """`summarise`'s numbers as strings for a terminal or markdown, accuracies in percent."""

    def gap(value: float) -> str:
        return "" if math.isnan(value) else f"{100 * value:+.1f}"

    return pd.DataFrame(
        {
            "length": summary["length"],
            "attention": summary["attention"],
            "seeds": summary["seeds"],
            "token acc % [95% CI]": [with_interval(r.token_acc, r.token_acc_lo, r.token_acc_hi) for r in summary.itertuples()],
            "seq acc % [95% CI]": [with_interval(r.seq_acc, r.seq_acc_lo, r.seq_acc_hi) for r in summary.itertuples()],
            "chance %": summary["chance"].map(percent),
            "params": summary["params"].map("{:,}".format),
            f"token gap vs {BASELINE}": summary["token_acc_gap"].map(gap),
            f"seq gap vs {BASELINE}": summary["seq_acc_gap"].map(gap),
        }
    )


def describe_missing(missing: list[tuple[GridRun, str]], total: int) -> str:
    """`N of M runs missing:` and one line per run (its overrides, folder and why)."""
    lines = [f"{len(missing)} of {total} runs missing:"]
    lines += [f"  {run.label or run.folder.name}  ({run.folder.name}): {reason}" for run, reason in missing]
    return "\n".join(lines)


def compare(overrides: list[str], missing_only: bool, run_sweep: Callable[[], object]) -> int:
    """`python -m copytask compare [--missing] [overrides]`: per length, the baseline and each
    attention type side by side. Missing runs are first trained by `run_sweep` (the same
    resumable sweep), unless `missing_only`, which lists them and trains nothing."""
    master, grid = compose_grid(overrides)
    unfinished = [(run, run.failure()) for run in grid if run.status() != "complete"]
    if missing_only:
        print(describe_missing(unfinished, len(grid)) if unfinished else f"all {len(grid)} runs complete in {master.runs_dir}")
        return 0
    status = 0
    if unfinished:
        print(f"{len(unfinished)} of {len(grid)} runs missing: running the sweep first")
        try:
            run_sweep()
        except SweepFailed:  # it has named the failed jobs; compare what there is
            status = 1
        master, grid = compose_grid(overrides)
    loaded = load(grid)
    if loaded.table.empty:
        print(f"copytask: error: no finished run of this grid in {master.runs_dir}", file=sys.stderr)
        return 1
    if loaded.missing:
        print(describe_missing(loaded.missing, len(grid)))
    print(f"{master.task.name} task, mean over seeds with 95% t-interval (none with one seed), accuracies in %; gap = mean - {BASELINE}'s mean")
    print(comparison_table(summarise(loaded.table)).to_string(index=False))
    return status
