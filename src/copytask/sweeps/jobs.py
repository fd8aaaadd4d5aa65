"""Runs through Hydra: the job (`hydra_job`, what `train` and every sweep's launcher run), how
a command line is handed to it (`run_hydra`), and the end of a sweep (`SweepSummary`, a Hydra
callback that analyses the grid's runs and writes results.csv and the report).

What they say as they go (each job's line, the summary's lines, failed jobs) goes to the `copytask`
logger (`console.log`), warnings through `console.warn`: the library prints nothing, the command line
prints the lines (`console.Lines`), and so does a job under Hydra's job logging
(configs/hydra/job_logging/copytask.yaml) in whichever process its launcher runs it.

A sweep is a Hydra multirun, so every launcher works (basic, joblib, submitit). Its grid is
`grid.compose_grid`'s, checked whole (`grid.check_grid`) before the first job starts. A sweeper
that proposes its jobs as it goes (Optuna: `hparams_search=baseline`) has no grid: each trial is
validated in its job, returns its objective and writes a trial record, and the summary reads the
records (`grid.search_trials`) for the trials' runs.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from .. import console, store
from ..config.checks import analysis_device, remote_launcher
from ..config.hydra_internals import configs_digest, override_args, own_global_hydra, proposes_jobs
from ..config.schema import config_dir
from ..console import TERMINAL_WIDTH, ConfigError
from ..store.runs import (
    OBJECTIVE,
    RECORDED_CONFIGS,
    RECORDED_RUNS,
    SWEEP_RECORD,
    TRAINED_BY,
    TRIAL_RECORD,
    GridRun,
    beside,
    beside_line,
    grid_record,
    record_failure,
)
from ..training import trackers
from .grid import QUIET_HYDRA, check_grid, expand, search_trials, sweep_command, trial_runs
from .progress import SweepProgress, TrialProgress, jobs_at_once


class SweepFailed(SystemExit):
    """Raised at the end of a sweep with failed jobs, after everything else is written. A
    SystemExit, because Hydra turns other exceptions into its own error report and returns
    nothing from a multirun: this is how the exit status reaches the shell (and `compare`)."""

    def __init__(self) -> None:
        super().__init__(1)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_job(cfg: DictConfig) -> float | None:
    """One job: train the run, log its line, and return its objective (metrics.json's OBJECTIVE,
    validation greedy token accuracy), also when the run was complete and is skipped: an optimising
    sweeper (hydra/sweeper=optuna) maximises it, the basic sweeper ignores it. Alone (`train`), a
    refusal exits 2 and a diverged run 1; in a sweep a failure is recorded in the run folder, the
    job returns None and the sweep goes on. (None, not NaN: Optuna's sweeper records a trial that
    returns no number as failed and goes on, but one that returns NaN makes optuna 2.10's
    `Study.tell` raise, which ends the search with a traceback.) A trial of a search also writes
    its TRIAL_RECORD, which is how the search's summary, compare and report find its runs."""
    hydra = HydraConfig.get()
    with console.one_line_warnings():  # a launcher's worker has none of the command's settings
        objective = run_job(cfg, multirun=hydra.mode == RunMode.MULTIRUN)
    if hydra.mode == RunMode.MULTIRUN and proposes_jobs(hydra):
        trial = {
            "trial": hydra.job.num,
            "run": store.run_dir(cfg).name,
            "overrides": list(hydra.overrides.task),
            "objective": objective,
        }
        store.write_json(Path(hydra.runtime.output_dir) / TRIAL_RECORD, trial)
    return objective


def run_job(cfg: DictConfig, multirun: bool) -> float | None:
    """`hydra_job`'s training: its objective, None for a job of a sweep that failed or that
    another process is training."""
    from ..training.loop import (  # torch and the model: only when something is trained
        NonFiniteLoss,
        RunInProgress,
        summary_line,
        train,
    )

    folder = store.run_dir(cfg)
    if multirun:
        with open_dict(cfg):
            cfg.train.progress = False  # the sweep has one bar for all its runs (SweepProgress)
    elif not cfg.retrain and (line := store.provenance.retrained_line([folder])):  # a sweep's: on_multirun_start
        console.log.info(line)
    skipped = store.provenance.reused(folder, cfg.retrain)
    try:
        metrics = train(cfg)  # validates first: a trial a search proposes that cannot run fails here, before training
    except RunInProgress as busy:
        console.warn(f"{busy}; skipped")
        return None
    except Exception as error:
        if multirun:  # recorded for the sweep summary, not swallowed
            record_failure(folder, error)
            console.log.error(f"copytask: job failed: {folder.name}: {error}")
            return None
        if not isinstance(error, (ConfigError, NonFiniteLoss)):
            raise
        console.log.error(f"copytask: error: {error}")
        sys.exit(2 if isinstance(error, ConfigError) else 1)
    console.log.info(
        f"{folder.name}: already complete, skipped (retrain=true trains it again)"
        if skipped
        else summary_line(metrics, folder)
    )
    return metrics[OBJECTIVE]


def run_hydra(args: list[str], multirun: bool = False, quiet: bool = False) -> None:
    """`python -m copytask train <args>` (or `sweep`, with `multirun`) in this process: Hydra reads
    `args`, overrides and its own flags, as from the command line, after every job's config is
    composed and validated (ConfigError, one line, before anything runs; unless a Hydra flag such as
    --cfg or --help asks for something else than a run). `quiet`: Hydra configures no logging, so
    that the lines go only where the caller's logging sends them (the library's sweep). sys.argv, the
    logging Hydra sets up and a Hydra instance the caller initialised are as they were afterwards.
    A sweep with failed jobs raises SweepFailed."""
    overrides = override_args(args)  # a flag Hydra does not have: one line, not argparse's usage block
    if len(overrides) == len(args):
        check_grid(args, multirun)
    if multirun:
        # Hydra's parser accepts overrides before flags but not on both sides of one, so the mode
        # override goes after every flag. (Not `--multirun`: that clashes with `--cfg`.)
        flags = [arg for arg in args if arg not in overrides]
        args = [*flags, *overrides, "hydra.mode=MULTIRUN"]
    if quiet:
        args = [*args, *QUIET_HYDRA]
    argv, root = sys.argv, logging.getLogger()
    handlers, level = root.handlers[:], root.level
    sys.argv = [argv[0] if argv else "copytask", *args]
    try:
        with own_global_hydra():
            hydra_job()
    finally:
        sys.argv = argv
        root.handlers[:], root.level = handlers, level


def builds_kernels_here(config: DictConfig) -> bool:
    """Whether a sweep's jobs train with the fused CPU kernels on this machine (not on a SLURM
    node, not on a GPU, not with train.fused=false), so that the sweep builds them first."""
    if not config.train.fused or remote_launcher(config.hydra.launcher.get("_target_")):
        return False
    from ..training.devices import resolve_device

    return resolve_device(config.train.device).type == "cpu"


class SweepSummary(Callback):
    """At the end of a sweep: name the failed jobs, analyse the grid's complete runs (the report
    reads analysis.json, it never evaluates a model), write results.csv and the report (and give
    its figures to the experiment tracker), log the wall time, and exit non-zero if any job of
    this sweep has no results. At its start: record the sweep, and prepare the tracker's store."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()
        self.started_at = time.time()
        searching = proposes_jobs(config.hydra)
        configs = configs_digest(config.hydra.searchpath)  # before the grid is composed from them
        self.runs = [] if searching else expand(config)
        # Recorded now, so that `compare` and `report` find this grid (or this search's trials so far) even
        # while it runs or if it is cut off, and name its runs without composing them again.
        self.begun = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "started_at": self.started_at}
        if not searching:  # with the configs they were composed from: where those change, the grid is composed anew
            self.begun |= {RECORDED_RUNS: grid_record(self.runs), RECORDED_CONFIGS: configs}
        record_path = Path(config.runs_dir) / SWEEP_RECORD
        try:  # the sweep before, which may have trained this one's runs (`training_record`)
            self.before = store.read_json(record_path) if record_path.is_file() else {}
        except (OSError, ValueError):
            self.before = {}
        store.write_json(record_path, self.record(config) | self.begun)
        trackers.prepare(config)
        if builds_kernels_here(config):
            from ..kernels import build

            # a fresh machine's one-time compile (30-80 s), before the bar starts, so its ETA measures training
            build.kernel()
        if searching:
            trials = config.hydra.sweeper.get("n_trials")
            self.at_once = jobs_at_once(config.hydra, trials)
            self.progress = TrialProgress(
                Path(config.hydra.sweep.dir), trials, enabled=config.train.progress, at_once=self.at_once
            )
        else:
            if not config.retrain and (line := store.provenance.retrained_line([run.folder for run in self.runs])):
                console.log.info(f"sweep: {line}")  # before the bar: why runs it counts as done train again
            self.at_once = jobs_at_once(config.hydra, len(self.runs))
            self.progress = SweepProgress(self.runs, enabled=config.train.progress, at_once=self.at_once)

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that run jobs in other processes (joblib, submitit) pickle the callbacks with
        # the job; the progress bar and its thread, and the grid, live in the launching process only.
        return {key: value for key, value in self.__dict__.items() if key not in ("progress", "runs")}

    @staticmethod
    def record(config: DictConfig) -> dict[str, Any]:
        # the options of the user's own that the grid names are found where hydra.searchpath says
        searchpath = [override for override in config.hydra.overrides.hydra if override.startswith("hydra.searchpath=")]
        record = {"command": sweep_command(config), "overrides": [*config.hydra.overrides.task, *searchpath]}
        if proposes_jobs(config.hydra):  # `search_trials` reads the trial records since `started_at`, then `trials`
            record["search"] = {
                "sweeper": config.hydra.runtime.choices.get("hydra/sweeper"),
                "n_trials": config.hydra.sweeper.get("n_trials"),
            }
        return record

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns a callback's exception into a warning and exits 0: a sweep whose end fails must not look fine.
        try:
            self.summarise(config)
        except SweepFailed:
            raise
        except Exception as error:  # noqa: BLE001 - reported, then a non-zero exit
            console.log.exception(f"copytask: error: the end of the sweep failed: {type(error).__name__}: {error}")
            raise SystemExit(1) from error

    def summarise(self, config: DictConfig) -> None:
        """The end of a sweep: its failed jobs named, every run analysed, sweep.json, results.csv and
        the report written, and one closing line. SweepFailed where a job failed."""
        self.progress.close()
        trials = search_trials(config) if proposes_jobs(config.hydra) else None
        runs = self.runs if trials is None else trial_runs(config, trials)  # the grid composed at the start
        unfinished, elsewhere = check_statuses(runs, config.hydra.launcher.get("gpus_per_node"))
        complete = sum(store.is_complete(run.folder) for run in runs)
        trained = sum(
            store.is_complete(run.folder) and (run.folder / store.METRICS).stat().st_mtime >= self.started_at
            for run in runs
        )
        analysis_seconds = analyse(runs, config)
        wall_seconds = time.perf_counter() - self.started
        outcome = {
            "jobs": len(runs),
            "trained": trained,
            "failed": len(unfinished),
            "training_elsewhere": len(elsewhere),
            "jobs_at_once": self.at_once,
            "wall_seconds": round(wall_seconds, 1),
            "analysis_seconds": round(analysis_seconds, 1),
        }
        if not trained and (before := training_record(self.before, runs)):
            outcome[TRAINED_BY] = before  # report.md's wall time is then that of the sweep that trained them
        record = self.record(config) | self.begun | ended(config, outcome, trials)
        store.write_json(Path(config.runs_dir) / SWEEP_RECORD, record)
        results = write_results(runs, trials, config)
        console.log.info(
            f"sweep: {complete}/{len(runs)} runs complete ({trained} trained now), "
            f"{len(unfinished)} failed"
            + (f", {len(elsewhere)} being trained by another process" if elsewhere else "")
            + f"; {wall_seconds:.1f} s wall time"
            + (f"; results in {results}" if results else "")
        )
        if config.report.note:
            # a path or run name in it stays whole, to be copied (breaking at its hyphens would split it)
            note = textwrap.fill(config.report.note, TERMINAL_WIDTH, break_long_words=False, break_on_hyphens=False)
            console.log.info(note)
        if unfinished:
            raise SweepFailed()


def check_statuses(runs: list[GridRun], gpus_per_node: int | None) -> tuple[list[GridRun], list[GridRun]]:
    """The runs whose job failed (each logged as an error first: nothing after may hide which jobs
    failed), also where it was to replace complete results, which stay; those another process is training
    (each warned: neither failures of this sweep nor results yet); a warning where runs trained on CPU
    although the jobs had GPUs."""
    from ..training import devices

    statuses = [run.status() for run in runs]
    elsewhere = [run for run, status in zip(runs, statuses) if status == "running"]
    failures = [(run, why) for run in runs if (why := run.job_failure())]
    for run, why in failures:
        console.log.error(f"copytask: job failed: {run.label or run.folder.name} ({run.folder}): {why}")
    unfinished = [run for run, _ in failures]
    for run in elsewhere:
        console.warn(
            f"{run.label or run.folder.name}: {run.failure()}; not in these results (run the sweep again once it ends)"
        )
    trained_on = [
        store.read_json(run.folder / store.METRICS).get("device")
        for run, status in zip(runs, statuses)
        if status == "complete"
    ]
    if warning := devices.cpu_despite_gpus(gpus_per_node, trained_on):
        console.warn(warning)
    return unfinished, elsewhere


def analyse(runs: list[GridRun], config: DictConfig) -> float:
    """Each complete run's analysis.json (`evaluation.analysis.analyze`), logged. -> its seconds."""
    from ..evaluation import analysis, breakdown  # pandas, matplotlib, the model: only once the jobs are done

    started = time.perf_counter()
    analysed = analysis.analyze(
        [run.folder for run in runs],
        lengths=list(config.analysis.lengths or sorted({run.config.task.length for run in runs})),
        eval_size=config.analysis.eval_size,
        threads=config.analysis.threads,
        progress=config.train.progress,
        device=analysis_device(config.train.device, config.hydra.launcher.get("_target_")),
        settings=breakdown.Settings.from_config(config.analysis),
    )
    seconds = time.perf_counter() - started
    console.log.info(f"analysis: {analysed} runs analysed in {seconds:.1f} s (eval_size {config.analysis.eval_size})")
    return seconds


def training_record(before: dict[str, Any], runs: list[GridRun]) -> dict[str, Any] | None:
    """What a sweep that trains none of `runs` keeps of the record `before` it in runs_dir: that record,
    or the one it kept, where it was of the same runs, finished, and trained some of them; None otherwise
    (nothing known of the sweep that trained them)."""
    listed = before.get(RECORDED_RUNS) or before.get("trials") or []
    if {entry["run"] for entry in listed} != {run.folder.name for run in runs} or "wall_seconds" not in before:
        return None
    if TRAINED_BY in before:
        return before[TRAINED_BY]
    kept = {key: value for key, value in before.items() if key not in (RECORDED_RUNS, "trials", "overrides")}
    return kept if before.get("trained") else None


def ended(config: DictConfig, outcome: dict[str, Any], trials: list[dict] | None) -> dict[str, Any]:
    """What sweep.json adds at the end: the sweep's `outcome` (counts and seconds), when and where it
    ran, and a search's trials."""
    from ..cpu_dispatch import cpu_model
    from ..training.devices import gpu_name  # torch: not for a refusal, which comes before any job

    return (
        outcome
        | {
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
            "launcher": config.hydra.runtime.choices.get("hydra/launcher"),
            "machine": cpu_model(),
            "cpus": os.cpu_count(),
            "gpu": gpu_name(),
            "python": platform.python_version(),
        }
        | ({"trials": trials} if trials is not None else {})
    )


def write_results(runs: list[GridRun], trials: list[dict] | None, config: DictConfig) -> Path | None:
    """results.csv and the report (a search's, for `trials`) of the runs that are complete, logged,
    and handed to the tracker. A grid's report records what it was drawn from (`reporting.freshness`),
    so that `report` after the sweep draws nothing; the sweep itself always draws it (its report.md
    gives this sweep's wall time). -> results.csv's path; None where no run is complete."""
    from ..reporting import freshness, report, search, tables

    runs_dir = Path(config.runs_dir)
    # what the report draws, taken before any run is read
    drawn = None if trials is not None else freshness.drawn_from(runs, runs_dir, config.report.x)
    loaded = tables.load(runs)
    results = None
    if not loaded.table.empty:
        results = tables.save(loaded, runs_dir)
        started = time.perf_counter()
        if trials is not None:
            written = search.write_report(trials, loaded, runs_dir)
        else:
            others = beside(runs, runs_dir)  # complete runs in runs_dir that are not of the grid
            drawn.forget()
            try:
                tables.x_column(config.report.x, loaded)
                x = config.report.x
            except ConfigError as error:
                console.warn(f"{error}; the report puts task.length on the x axis")
                x, drawn = "task.length", None  # not the report `report` would draw: left unrecorded
            noted = beside_line(others, runs_dir, "grid", "report --all")
            written = report.write_report(runs, loaded, runs_dir, x, noted)
            if drawn is not None:
                drawn.record([results, *written], loaded.missing, loaded.mixed)
        console.log.info(report.written_line(written, time.perf_counter() - started))
        trackers.log_report(config, written)
        if trials is None:  # the result on the terminal, as `compare` prints it, and the report's finding
            summary = tables.summarise(loaded.table, loaded.settings)
            chance = sorted(set(loaded.table["chance"]))
            console.log.info(tables.narrow_note(list(dict.fromkeys(loaded.table["task"])), chance))
            console.log.info(tables.comparison_table(summary, loaded.settings).to_string(index=False))
            if note := beside_line(others, runs_dir, "grid", "compare --all"):
                console.log.info(textwrap.fill(note, TERMINAL_WIDTH, break_long_words=False, break_on_hyphens=False))
            finding = " ".join(report.headline(summary, tables.x_column(x, loaded))).strip()
            console.log.info(textwrap.fill(finding, TERMINAL_WIDTH))
    if trials is not None:
        console.log.info(f"search: {search.best_line(search.trial_table(trials, loaded), loaded.settings)}")
    return results
