"""Runs through Hydra: the job (`hydra_job`, what `train` and every sweep's launcher run), how
a command line is handed to it (`run_hydra`), and the end of a sweep (`SweepSummary`, a Hydra
callback that analyses the grid's runs and writes results.csv and the report).

A sweep is a Hydra multirun, so every launcher works (basic, joblib, submitit). Its grid is
`grid.compose_grid`'s, checked whole (`grid.check_grid`) before the first job starts.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from . import loggers, store
from .config import ConfigError, analysis_device, config_dir
from .grid import SWEEP_RECORD, GridRun, expand, sweep_command
from .hydra_internals import override_args, own_global_hydra


class SweepFailed(SystemExit):
    """Raised at the end of a sweep with failed jobs, after everything else is written. A
    SystemExit, because Hydra turns other exceptions into its own error report and returns
    nothing from a multirun: this is how the exit status reaches the shell (and `compare`)."""

    def __init__(self) -> None:
        super().__init__(1)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_job(cfg: DictConfig) -> None:
    """One job: train the run, print its line. Alone (`train`), a refusal exits 2 and a diverged
    run 1; in a sweep a failure is recorded in the run folder and the sweep goes on."""
    from .training import NonFiniteLoss, RunInProgress, summary_line, train  # torch and the model: only when something is trained

    folder = store.run_dir(cfg)
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        with open_dict(cfg):
            cfg.train.progress = False  # the sweep has one bar for all its runs (SweepProgress)
    skipped = store.is_complete(folder) and not cfg.retrain
    try:
        metrics = train(cfg)
    except RunInProgress as busy:
        store.warn(f"{busy}; skipped")
        return
    except Exception as error:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # recorded for the sweep summary, not swallowed
            store.write_json(folder / store.FAILED, {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()})
            print(f"copytask: job failed: {folder.name}: {error}", file=sys.stderr)
            return
        if not isinstance(error, (ConfigError, NonFiniteLoss)):
            raise
        print(f"copytask: error: {error}", file=sys.stderr)
        sys.exit(2 if isinstance(error, ConfigError) else 1)
    print(f"{folder.name}: already complete, skipped (retrain=true trains it again)" if skipped else summary_line(metrics, folder))


def run_hydra(args: list[str], multirun: bool = False) -> None:
    """`python -m copytask train <args>` (or `sweep`, with `multirun`) in this process: Hydra reads
    `args`, overrides and its own flags, as from the command line. sys.argv, the logging Hydra sets
    up and a Hydra instance the caller initialised are as they were afterwards. A sweep with failed
    jobs raises SweepFailed."""
    if multirun:
        # Hydra's parser accepts overrides before flags but not on both sides of one, so the mode
        # override goes after every flag. (Not `--multirun`: that clashes with `--cfg`.)
        overrides = override_args(args)
        flags = [arg for arg in args if arg not in overrides]
        args = [*flags, *overrides, "hydra.mode=MULTIRUN"]
    argv, root = sys.argv, logging.getLogger()
    handlers, level = root.handlers[:], root.level
    sys.argv = [argv[0] if argv else "copytask", *args]
    try:
        with own_global_hydra():
            hydra_job()
    finally:
        sys.argv = argv
        root.handlers[:], root.level = handlers, level


def cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    import torch  # by now the jobs have imported it, if they ran in this process

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def expected_cost(run: GridRun) -> float:
    """What a run is expected to cost, in units of one training step at length 1: its step budget
    times its mean length (a step's recurrences and attention grow with the length). Runs differ
    by 20x and more in a sweep, so a bar that counts runs gives an ETA that swings."""
    task = run.config.task
    mean_length = (task.min_length + task.length) / 2 if task.variable_length else task.length
    return run.config.train.steps * mean_length


class SweepProgress:
    """One progress bar for a whole sweep: the work done, each finished run (complete, or failed
    during this sweep) weighted by its `expected_cost`, so that the ETA follows the work left
    rather than the runs left; the runs finished of the grid beside it. A thread polls the run
    folders, so it works the same under every launcher, in-process or not."""

    def __init__(self, runs: list[GridRun], enabled: bool, interval: float = 2.0) -> None:
        from tqdm.auto import tqdm

        self.runs, self.started_at = runs, time.time()
        self.costs = [expected_cost(run) for run in runs]
        done, cost = self.finished()
        self.bar = tqdm(total=sum(self.costs), initial=cost, desc="sweep", disable=not enabled, dynamic_ncols=True,
                        mininterval=interval, bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix} [{elapsed}<{remaining}]")
        self.bar.set_postfix_str(self.runs_done(done), refresh=False)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, args=(interval,), daemon=True)
        self.thread.start()

    def runs_done(self, done: int) -> str:
        return f"{done}/{len(self.runs)} runs"

    def finished(self) -> tuple[int, float]:
        """How many runs have finished, and their expected cost together."""

        def done(run: GridRun) -> bool:
            status = run.status()
            return status == "complete" or status == "failed" and (run.folder / store.FAILED).stat().st_mtime >= self.started_at

        finished = [cost for run, cost in zip(self.runs, self.costs) if done(run)]
        return len(finished), sum(finished)

    def update(self) -> bool:
        """Move the bar to the runs finished now; whether anything changed."""
        done, cost = self.finished()
        if cost == self.bar.n:
            return False
        self.bar.set_postfix_str(self.runs_done(done), refresh=False)
        self.bar.update(cost - self.bar.n)
        return True

    def poll(self, interval: float, refresh_every: float = 30.0) -> None:
        """Update on every finished run, and redraw the clock now and then: a sweep's log stays small."""
        last_refresh = time.monotonic()
        while not self.stop.wait(interval):
            if not self.update():
                if time.monotonic() - last_refresh <= refresh_every:
                    continue
                self.bar.refresh()
            last_refresh = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.update()
        self.bar.close()


class SweepSummary(Callback):
    """At the end of a sweep: name the failed jobs, analyse the grid's complete runs (the report
    reads analysis.json, it never evaluates a model), write results.csv and the report (and give
    its figures to the experiment tracker), print the wall time, and exit non-zero if any job of
    this sweep has no results. At its start: record the sweep, and prepare the tracker's store."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()
        self.started_at = time.time()
        # Recorded now, so that `compare` and `report` find this grid even while it runs or if it is cut off.
        store.write_json(Path(config.runs_dir) / SWEEP_RECORD, self.record(config) | {"started": time.strftime("%Y-%m-%d %H:%M:%S")})
        loggers.prepare(config)
        self.progress = SweepProgress(expand(config), enabled=config.train.progress)

    def __getstate__(self) -> dict[str, Any]:
        # Launchers that run jobs in other processes (joblib, submitit) pickle the callbacks with
        # the job; the progress bar and its thread live in the launching process only.
        return {key: value for key, value in self.__dict__.items() if key != "progress"}

    @staticmethod
    def record(config: DictConfig) -> dict[str, Any]:
        return {"command": sweep_command(config), "overrides": list(config.hydra.overrides.task)}

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Hydra turns a callback's exception into a warning and exits 0: a sweep whose end fails must not look fine.
        try:
            self.summarise(config)
        except SweepFailed:
            raise
        except Exception as error:  # noqa: BLE001 - reported, then a non-zero exit
            traceback.print_exc()
            print(f"copytask: error: the end of the sweep failed: {type(error).__name__}: {error}", file=sys.stderr)
            raise SystemExit(1) from error

    def summarise(self, config: DictConfig) -> None:
        from . import analysis, devices, reporting, tables  # pandas, matplotlib, the model: only once the jobs are done

        self.progress.close()

        runs = expand(config)
        runs_dir = Path(config.runs_dir)
        statuses = [run.status() for run in runs]
        # Runs another process is training are neither failures of this sweep nor results yet.
        elsewhere = [run for run, status in zip(runs, statuses) if status == "running"]
        unfinished = [run for run, status in zip(runs, statuses) if status not in ("complete", "running")]
        for run in unfinished:  # first: nothing after this may hide which jobs failed
            print(f"copytask: job failed: {run.label or run.folder.name} ({run.folder}): {run.failure()}", file=sys.stderr)
        for run in elsewhere:
            store.warn(f"{run.label or run.folder.name}: {run.failure()}; not in these results (run the sweep again once it ends)")
        trained_on = [store.read_json(run.folder / store.METRICS).get("device") for run, status in zip(runs, statuses) if status == "complete"]
        if warning := devices.cpu_despite_gpus(config.hydra.launcher.get("gpus_per_node"), trained_on):
            store.warn(warning)
        trained = sum(
            store.is_complete(run.folder) and (run.folder / store.METRICS).stat().st_mtime >= self.started_at
            for run in runs
        )
        analysis_started = time.perf_counter()
        analysed = analysis.analyze(
            [run.folder for run in runs],
            lengths=list(config.analysis.lengths or sorted({run.config.task.length for run in runs})),
            eval_size=config.analysis.eval_size,
            threads=config.analysis.threads,
            progress=config.train.progress,
            device=analysis_device(config.train.device, config.hydra.launcher.get("_target_")),
        )
        analysis_seconds = time.perf_counter() - analysis_started
        print(f"analysis: {analysed} runs analysed in {analysis_seconds:.1f} s (eval_size {config.analysis.eval_size})")
        wall_seconds = time.perf_counter() - self.started
        store.write_json(
            runs_dir / SWEEP_RECORD,
            self.record(config)
            | {
                "jobs": len(runs),
                "trained": trained,
                "failed": len(unfinished),
                "training_elsewhere": len(elsewhere),
                "wall_seconds": round(wall_seconds, 1),
                "analysis_seconds": round(analysis_seconds, 1),
                "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                "launcher": config.hydra.runtime.choices.get("hydra/launcher"),
                "machine": cpu_model(),
                "cpus": os.cpu_count(),
                "gpu": gpu_name(),
                "python": platform.python_version(),
            },
        )
        loaded = tables.load(runs)
        if not loaded.table.empty:
            tables.save(loaded, runs_dir)
            try:
                reporting.x_column(config.report.x, loaded)
                x = config.report.x
            except ConfigError as error:
                store.warn(f"{error}; the report puts task.length on the x axis")
                x = "task.length"
            report_started = time.perf_counter()
            written = reporting.write_report(runs, loaded, runs_dir, x)
            print(reporting.written_line(written, time.perf_counter() - report_started))
            loggers.log_report(config, written)
        print(
            f"sweep: {len(runs) - len(unfinished) - len(elsewhere)}/{len(runs)} runs complete ({trained} trained now), "
            f"{len(unfinished)} failed" + (f", {len(elsewhere)} being trained by another process" if elsewhere else "")
            + f"; {wall_seconds:.1f} s wall time"
            + (f"; results in {runs_dir / tables.RESULTS_CSV}" if not loaded.table.empty else "")
        )
        if unfinished:
            raise SweepFailed()
