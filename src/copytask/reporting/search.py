"""A search's results: the trials an optimising sweeper (Optuna; `hparams_search=baseline`) ran,
as a table, the best of them for `compare` and `report`, and two figures: the objective by trial
with the best so far, and the objective against each searched key.

The trials come from the search's record (`sweeps.grid.search_trials`); each trial's run is an ordinary
run folder, read as every run is (`tables.load`), and trials that repeat a run share it. The
searched keys are the settings of the table, the keys whose values differ between the runs.
Figures are `matplotlib.figure.Figure`s (see `copytask.figures`).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator
from omegaconf import OmegaConf

from .. import store
from ..figures import draw_chance, panels, save
from ..store.runs import OBJECTIVE, SWEEP_RECORD, GridRun
from . import tables
from .freshness import REPORT_DIR
from .setup_section import trained_by
from .tables import markdown_table

TRIALS_CSV = "trials.csv"
BY_TRIAL_FIGURE = "search_objective_by_trial.png"
BY_KEY_FIGURE = "search_objective_by_key.png"
BEST = 10  # trials in compare's and the report's table
RUN_COLUMNS = ("token_acc", "seq_acc", "params", "steps", "train_seconds")


def trial_table(trials: list[dict], loaded: tables.Loaded) -> pd.DataFrame:
    """One row per trial, in trial order: its number, objective (NaN for a trial without one),
    the best objective so far, its run's status (`complete`, or why it has no results), the
    searched settings (`loaded.settings`, from the run's config, so a failed trial has them too),
    RUN_COLUMNS from its run's metrics, and the run folder's name."""
    results = loaded.table.set_index("run") if not loaded.table.empty else pd.DataFrame(columns=RUN_COLUMNS)
    runs: dict[str, GridRun] = {**{run.folder.name: run for run, _ in loaded.missing}, **loaded.runs}
    reasons = {run.folder.name: reason for run, reason in loaded.missing}
    rows = []
    for trial in trials:
        run = trial["run"]
        objective = trial.get("objective")
        row = {"trial": trial["trial"], "objective": math.nan if objective is None else float(objective)}
        row["status"] = "complete" if run in results.index else reasons.get(run, "not run")
        for key in loaded.settings:
            row[key] = OmegaConf.select(runs[run].config, key) if run in runs else None
        for column in RUN_COLUMNS:
            row[column] = results.at[run, column] if run in results.index else math.nan
        rows.append(row | {"run": run})
    table = pd.DataFrame(
        rows, columns=["trial", "objective", "best_so_far", "status", *loaded.settings, *RUN_COLUMNS, "run"]
    )
    table["best_so_far"] = table["objective"].cummax().ffill()  # a failed trial keeps the best before it
    return table


def ranked(table: pd.DataFrame) -> pd.DataFrame:
    """`trial_table` best first (the earlier trial first on a tie), trials without an objective last."""
    return table.sort_values(["objective", "trial"], ascending=[False, True], na_position="last", kind="stable")


def best(table: pd.DataFrame, count: int = BEST) -> pd.DataFrame:
    """The `count` trials with the highest objective, best first."""
    return ranked(table).dropna(subset=["objective"]).head(count)


def best_table(table: pd.DataFrame, settings: list[str], count: int = BEST) -> pd.DataFrame:
    """`best` as strings for a terminal or markdown, accuracies in percent."""
    top = best(table, count)
    return pd.DataFrame(
        {
            "trial": top["trial"],
            "val token acc %": top["objective"].map(tables.percent),  # what the search chose on
            "test token acc %": top["token_acc"].map(tables.percent),
            "test seq acc %": top["seq_acc"].map(tables.percent),
            **{key: top[key].map(tables.setting_value) for key in settings},
            "params": top["params"].map("{:,.0f}".format),
            "steps": top["steps"].map("{:,.0f}".format),
            "train s": top["train_seconds"].map("{:.1f}".format),
        }
    )


def best_line(table: pd.DataFrame, settings: list[str]) -> str:
    """`best validation greedy token accuracy 87.3% at trial 17 of 40 (train.lr=0.012, ...)`."""
    top = best(table, 1)
    if top.empty:
        return f"best: none, no trial of {len(table)} has an objective"
    row = top.iloc[0]
    values = ", ".join(f"{key}={tables.setting_value(row[key])}" for key in settings)
    return (
        f"best validation greedy token accuracy {tables.percent(row['objective'])}% "
        f"at trial {row['trial']} of {len(table)}" + (f" ({values})" if values else "")
    )


def plot_objective_by_trial(table: pd.DataFrame, chance: float, path: Path) -> Path:
    """The objective of each trial (dots) and the best so far (a step line), in %; a failed trial
    is an x on the bottom edge."""
    figure, [axis] = panels(1, width=7.5, height=4.0)
    done = table.dropna(subset=["objective"])
    axis.plot(done["trial"], 100 * done["objective"], "o", color="C0", label="trial")
    axis.step(table["trial"], 100 * table["best_so_far"], where="post", color="C1", label="best so far")
    failed = table[table["objective"].isna()]
    if len(failed):
        axis.plot(failed["trial"], np.zeros(len(failed)), "x", color="red", clip_on=False, label="failed trial")
    draw_chance(axis, chance)
    axis.set(
        xlabel="trial",
        ylabel="validation greedy token accuracy (%)",
        ylim=(0, 102),
        title="The search: objective by trial",
    )
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.grid(alpha=0.3)
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=4, fontsize="small")  # below: never over a trial
    return save(figure, path)


def plot_objective_by_key(table: pd.DataFrame, settings: list[str], chance: float, path: Path) -> Path:
    """One panel per searched key: each trial's objective against the key's value, coloured by
    trial number (late trials are where TPE exploits), the best trial as a star. A numeric key
    spanning a decade or more gets a log axis; any other key one position per value."""
    done = table.dropna(subset=["objective"])
    keys = settings or ["trial"]
    figure, axes = panels(len(keys), width=3.6, height=3.2)
    top = best(table, 1)
    image = None
    for axis, key in zip(axes, keys):
        values = done[key]
        if tables.numeric(values):
            x, best_x = values.astype(float), top[key].astype(float)
            positive = (x > 0).all()
            if positive and x.max() / x.min() >= 10:
                axis.set_xscale("log")
            else:
                axis.xaxis.set_major_locator(
                    MaxNLocator(4)
                )  # a learning rate's long tick labels would run into each other
        else:  # bool or text: one position per value
            order = sorted(values.map(tables.setting_value).unique())
            position = {value: i for i, value in enumerate(order)}
            x, best_x = values.map(tables.setting_value).map(position), top[key].map(tables.setting_value).map(position)
            axis.set_xticks(range(len(order)), order)
            axis.set_xlim(-0.5, len(order) - 0.5)
        image = axis.scatter(
            x, 100 * done["objective"], c=done["trial"], cmap="viridis", vmin=0, vmax=max(table["trial"].max(), 1), s=18
        )
        axis.plot(best_x, 100 * top["objective"], "*", color="C3", markersize=13, label="best trial")
        draw_chance(axis, chance)
        axis.set(xlabel=key, ylabel="objective (%)", ylim=(0, 102))
        axis.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize="small")
    if image is not None:
        figure.colorbar(image, ax=axes, fraction=0.04, label="trial").locator = MaxNLocator(integer=True)
    figure.suptitle("Held-out greedy token accuracy against each searched key")
    return save(figure, path)


def search_setup(table: pd.DataFrame, loaded: tables.Loaded, runs_dir: Path) -> list[str]:
    """What the search was: its command and sweeper, the task and what its trials share, the range
    each searched key took, the hardware and the wall time."""
    record_path = runs_dir / SWEEP_RECORD
    record = store.read_json(record_path) if record_path.is_file() else {}
    configs = [run.config for run in loaded.runs.values()]

    def shared(key: str) -> str:
        found = sorted({str(OmegaConf.select(cfg, key)) for cfg in configs})
        return found[0] if len(found) == 1 else ", ".join(found)

    ranges = []
    for key in loaded.settings:
        values = table[key].dropna()
        if tables.numeric(values):
            ranges.append(f"`{key}` {tables.setting_value(values.min())} to {tables.setting_value(values.max())}")
        else:
            ranges.append(f"`{key}` {', '.join(sorted(values.map(tables.setting_value).unique()))}")
    search = record.get("search", {})
    results = loaded.table
    lines = [
        "## Setup",
        "",
        f"- Search: `{record.get('command', '?')}`, {search.get('sweeper', 'an optimising')} sweeper, "
        f"{len(table)} trials ({len(loaded.runs)} complete runs); objective: greedy token accuracy on the "
        f"validation set (`{OBJECTIVE}` of each run's `{store.METRICS}`), maximised; the test set's accuracy is "
        f"reported beside it, never searched on. Per trial: [`{TRIALS_CSV}`](../{TRIALS_CSV}).",
        f"- Task: `{shared('task.name')}`, length {shared('task.length')}, {shared('task.vocab_size')} content symbols "
        f"(chance token accuracy {100 * results['chance'].iloc[0]:.1f}%); attention: {shared('attention.name')}; "
        f"seed {shared('seed')}.",
        f"- Shared by every trial: budget {shared('train.steps')} steps, {shared('train.schedule')} schedule, "
        f"embedding size {shared('model.embedding_size')}, batch size {shared('train.batch_size')} "
        "(the examples per step of the models it is compared with), "
        f"{shared('train.val_size')} validation sequences (seed {shared('train.val_seed')}) and "
        f"{shared('train.eval_size')} test sequences (seed {shared('train.eval_seed')}), "
        f"early stop at {shared('train.target_acc')} for {shared('train.patience')} evaluations.",
        f"- Searched (the values the trials took): {'; '.join(ranges) or 'nothing varied'}.",
        f"- Hardware (from the runs): device {', '.join(map(str, results['device'].unique()))}, torch threads "
        f"{', '.join(map(str, results['threads'].unique()))}; {results['train_seconds'].sum():.0f} s of training "
        "summed over the runs.",
    ]
    if "wall_seconds" in record and not record["trained"]:  # a search run again: its runs' own record kept
        lines.append(
            f"- The search trained none of its {record['jobs']} runs ({record['wall_seconds']:.0f} s wall time, "
            f"finished {record['finished']}). {trained_by(record)}"
        )
    elif "wall_seconds" in record:
        lines.append(
            f"- The search trained {record['trained']} of {record['jobs']} runs in "
            f"**{record['wall_seconds']:.0f} s wall time**, "
            f"finished {record['finished']} on {record['machine']} with {record['cpus']} CPUs "
            f"({record.get('launcher')} launcher)."
        )
    return lines


def write_report(trials: list[dict], loaded: tables.Loaded, runs_dir: Path) -> list[Path]:
    """Write runs_dir/trials.csv and runs_dir/report/ (report.md and the two figures) for a search
    whose runs `loaded` holds (not empty). -> report.md, then the figures."""
    runs_dir = Path(runs_dir)
    out = runs_dir / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    table = trial_table(trials, loaded)
    store.atomic_write(runs_dir / TRIALS_CSV, table.to_csv(index=False))
    chance = float(loaded.table["chance"].iloc[0])
    figures = [
        plot_objective_by_trial(table, chance, out / BY_TRIAL_FIGURE),
        plot_objective_by_key(table, loaded.settings, chance, out / BY_KEY_FIGURE),
    ]
    failed = table[table["status"] != "complete"]
    lines = [
        "# copytask search report",
        "",
        f"Made by `python -m copytask report` from the run folders in `{runs_dir}`. Regenerate it with "
        f"`python -m copytask report runs_dir={runs_dir}` (the last search there).",
        "",
        *search_setup(table, loaded, runs_dir),
        "",
        f"## The best {min(BEST, len(best(table)))} trials",
        "",
        f"The {best_line(table, loaded.settings)}.",
        "",
        markdown_table(best_table(table, loaded.settings)),
        "",
        "## Objective by trial",
        "",
        f"![objective by trial]({BY_TRIAL_FIGURE})",
        "",
        "## Objective against each searched key",
        "",
        f"![objective against each searched key]({BY_KEY_FIGURE})",
        "",
    ]
    if len(failed):
        lines += ["## Failed trials", "", "These trials have no objective (the sweeper recorded them as failed):", ""]
        lines += [f"- trial {row.trial} (`{row.run}`): {row.status}" for row in failed.itertuples()]
        lines.append("")
    store.atomic_write(out / "report.md", "\n".join(lines))
    return [out / "report.md", *figures]
