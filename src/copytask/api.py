"""copytask's public functions: compose a run's config, train it, sweep a grid, read a sweep's
results and summary, write its report, load a trained model and decode with it.

    import copytask
    cfg = copytask.compose(["attention=bahdanau", "task.length=40"])
    metrics = copytask.train(cfg)
    copytask.compare("runs")

They return values (dicts, DataFrames, paths, arrays) and print nothing but progress bars (on
stderr); what a sweep says as it goes goes to the `copytask` logger (`console.log`), to which the
library adds no handler. The command line (`copytask.cli`) is a thin layer over the same
functions. Calling them changes no process-wide state: torch's thread count and random state,
matplotlib's backend and a Hydra instance the caller initialised are as they were. Bad input
raises `ConfigError`, whose message is the command line's one line; a run another process is
training raises `RunInProgress`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from .console import ConfigError, warn
from .sweeps.grid import Selection, check_grid, nothing_done, select_runs

if TYPE_CHECKING:  # heavy imports happen where they are needed: `import copytask` stays fast
    import pandas as pd

    from .evaluation.decode import Decoded
    from .models.build import Model
    from .reporting.freshness import DrawnFrom
    from .reporting.tables import Loaded


class SweepError(RuntimeError):
    """A sweep ended with failed jobs (each logged at ERROR to the `copytask` logger, with a
    failed.json in its run folder, or beside its replacement where the run's complete results stay);
    `table` holds the results of the runs that are complete."""

    def __init__(self, message: str, table: pd.DataFrame) -> None:
        super().__init__(message)
        self.table = table


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The config `python -m copytask train <overrides>` trains, composed from configs/ and
    validated. ConfigError (one line) for what cannot run."""
    [run] = check_grid(list(overrides), multirun=False)
    return run.config


def train(cfg: DictConfig | Sequence[str]) -> dict:
    """Train one run (a composed config, or overrides for `compose`) into runs_dir/<run name>/ and
    return its metrics.json; a run whose complete results exist is read, not trained again
    (`retrain=true` trains it again). RunInProgress if another process is training it now,
    NonFiniteLoss if it diverges."""
    from .training import loop

    return loop.train(cfg if isinstance(cfg, DictConfig) else compose(cfg))


def sweep(overrides: Sequence[str] = (), runs_dir: str | Path | None = None) -> pd.DataFrame:
    """Train the grid of `python -m copytask sweep <overrides>` (in `runs_dir`, if given), through
    Hydra's launcher as the command does (`hydra/launcher=parallel` for one job per core),
    skipping complete runs; every job is checked before the first starts. Ends with the sweep's
    analysis, results.csv and report, and returns the results table (`results`); the jobs' and the
    summary's lines go to the `copytask` logger only (Hydra configures no logging here). SweepError
    if any job failed, after everything else is written."""
    from .reporting.tables import load
    from .sweeps.jobs import SweepFailed, run_hydra

    overrides = [*overrides, *([runs_dir_override(runs_dir)] if runs_dir is not None else [])]
    try:
        run_hydra(
            overrides, multirun=True, quiet=True
        )  # the jobs' and the summary's lines go to the caller's logging only
        failed_jobs = False
    except SweepFailed:
        failed_jobs = True
    runs = select_runs(overrides).runs
    loaded = load(runs)
    if failed_jobs:  # a run another process is still training has not failed (the sweep's summary counts it apart)
        failed = [run.folder.name for run in runs if run.job_failure()]  # also a retraining's, its old results kept
        raise SweepError(f"{len(failed)} of {len(runs)} runs failed: {', '.join(failed)}", loaded.table)
    return loaded.table


def select(runs_dir: str | Path | None = None, overrides: Sequence[str] = (), all_runs: bool = False) -> Selection:
    """The runs that `results`, `compare` and `report` look at: the grid of `sweep <overrides>`;
    with no grid overrides, the last sweep recorded in runs_dir, or every complete run there
    where none was recorded (or with `all_runs`)."""
    overrides = [*overrides, *([runs_dir_override(runs_dir)] if runs_dir is not None else [])]
    return select_runs(overrides, every_run=all_runs, every_run_unless_recorded=True)


def load(selection: Selection, command: str = "read") -> Loaded:
    """The selection's complete runs as one table, and the rest with why each is missing.
    ConfigError, saying there is nothing to `command`, when none is complete."""
    from .reporting.tables import load as load_runs

    loaded = load_runs(selection.runs)
    if loaded.table.empty:
        raise ConfigError(nothing_done(command, selection))
    return loaded


def results(runs_dir: str | Path | None = None, overrides: Sequence[str] = (), all_runs: bool = False) -> pd.DataFrame:
    """One row per complete run of the selection (`select`): its metrics, steps to the target
    accuracy, alignment where analysed, and a column per setting that varies between the runs. Where
    the runs were made by different code (`store.provenance`), a CopytaskWarning says so, naming them; so
    does one where runs_dir holds complete runs that a grid leaves out (`said_if_beside`)."""
    return said_if_mixed(load(said_if_beside(select(runs_dir, overrides, all_runs)), "read")).table


def said_if_beside(selection: Selection) -> Selection:
    """`selection`, once a CopytaskWarning has named the complete runs in its runs_dir that it leaves out (runs
    trained beside a sweep's grid: `Selection.beside`)."""
    if beside := selection.beside("all_runs=True"):
        warn(beside)
    return selection


def said_if_mixed(loaded: Loaded) -> Loaded:
    """`loaded`, once a CopytaskWarning has given its `mixed` line where its runs were made by different code."""
    if loaded.mixed:
        warn(loaded.mixed)
    return loaded


def summary(loaded: Loaded) -> pd.DataFrame:
    """Per setting, length and attention type: seeds, means and interval bounds of the
    accuracies and of the steps to target, chance, params and the gaps to the baseline."""
    from .reporting.tables import summarise

    return summarise(loaded.table, loaded.settings)


def compare(runs_dir: str | Path | None = None, overrides: Sequence[str] = (), all_runs: bool = False) -> pd.DataFrame:
    """`python -m copytask compare`'s table as numbers: `summary` of the selection (`select`); for
    a search (`hparams_search=baseline`), its trials best first (`search.trial_table`: objective,
    best so far, the searched settings, the run's accuracies). Where the runs were made by different
    code, or runs_dir holds complete runs that the grid leaves out, a CopytaskWarning says so, naming them."""
    selection = said_if_beside(select(runs_dir, overrides, all_runs))
    return comparison(selection, said_if_mixed(load(selection, "compare")))


def comparison(selection: Selection, loaded: Loaded) -> pd.DataFrame:
    """`compare`'s table for a selection already loaded (what the command line prints, after it
    has said which runs these are and which are missing)."""
    if selection.is_search:
        from .reporting.search import ranked, trial_table

        return ranked(trial_table(selection.trials, loaded)).reset_index(drop=True)
    return summary(loaded)


def report(
    runs_dir: str | Path | None = None, overrides: Sequence[str] = (), all_runs: bool = False, x: str | None = None
) -> list[Path]:
    """Write results.csv and runs_dir/report/ (report.md and its figures) for the selection
    (`select`), with `x` (default: the config's report.x) on the accuracy figure's x axis (for a
    search: trials.csv too, and the search's report); -> the paths written, results.csv and
    report.md first. Never trains. Where the report there is up to date (`drawn_from`: drawn from
    the same runs, files, x axis and code) nothing is written again, and the paths are those written then.
    Complete runs in runs_dir that the grid leaves out are named in a CopytaskWarning and in report.md."""
    selection = said_if_beside(select(runs_dir, overrides, all_runs))
    drawn = drawn_from(selection, x)
    if drawn is not None and (current := drawn.current()) is not None:
        return current["written"]
    return write_report(selection, load(selection, "report"), x, drawn)


def drawn_from(selection: Selection, x: str | None = None) -> DrawnFrom | None:
    """What `report` draws the selection from now (`reporting.freshness`), with `x` (default: the
    config's report.x); taken before the runs are read. None for a search, whose report is always drawn."""
    if selection.is_search:
        return None
    from .reporting.freshness import drawn_from as inputs

    return inputs(selection.runs, Path(selection.master.runs_dir), x or selection.master.report.x)


def write_report(
    selection: Selection, loaded: Loaded, x: str | None = None, drawn: DrawnFrom | None = None
) -> list[Path]:
    """`report`'s work on a selection already loaded; a search's report (`search.write_report`:
    its best trials and the objective by trial and by searched key) has no x axis to choose. With
    `drawn` (`drawn_from`, taken before the selection was loaded), what the report was drawn from is
    recorded once it is written, so that a `report` with nothing changed draws nothing."""
    from .reporting.tables import save, x_column

    runs_dir = Path(selection.master.runs_dir)
    if selection.is_search:
        from .reporting import search

        return [save(loaded, runs_dir), *search.write_report(selection.trials, loaded, runs_dir)]
    x = x or selection.master.report.x
    x_column(x, loaded)  # ConfigError before anything is written, or matplotlib imported
    from .reporting import report

    if drawn is not None:
        drawn.forget()
    beside = selection.beside("report --all")
    written = [save(loaded, runs_dir), *report.write_report(selection.runs, loaded, runs_dir, x, beside)]
    if drawn is not None:
        drawn.record(written, loaded.missing, loaded.mixed)
    return written


def load_run(run_dir: str | Path, device: str = "cpu") -> tuple[Model, DictConfig]:
    """A finished run's trained model on `device`, in eval mode, and its resolved config."""
    from .evaluation.load import load_run as load

    return load(Path(run_dir), device)


def decode(
    run_dir: str | Path,
    symbols: str | None = None,
    random: int | None = None,
    length: int | None = None,
    seed: int = 0,
    beam: int = 1,
    length_normalise: bool = False,
) -> Decoded:
    """Greedy-decode `symbols` (`"g d d c"` or `gddc`), or `random` sequences of `length` symbols,
    with a finished run's model (`beam` K > 1: beam search of width K, its hypotheses ranked by
    log-probability / length with `length_normalise`): token ids, scores and attention weights as
    arrays (`evaluation.decode.Decoded`)."""
    from .evaluation.decode import decode as decode_run

    return decode_run(run_dir, symbols, random, length, seed, beam, length_normalise)


def runs_dir_override(runs_dir: str | Path) -> str:
    """`runs_dir=<path>` as a Hydra override, quoted where the path has characters Hydra's grammar reads."""
    path = str(runs_dir)
    if re.fullmatch(r"[\w./~-]+", path):
        return f"runs_dir={path}"
    return "runs_dir='" + path.replace("\\", "\\\\").replace("'", "\\'") + "'"
