"""Sweeps are Hydra multiruns. This module knows which runs a sweep is made of (the grid) and
reports on a sweep when it ends (`SweepSummary`, a Hydra callback).

The grid is expanded the way Hydra's basic sweeper does it (sweeper params, then command-line
overrides, which replace a swept key's list), and each job's config is composed with Hydra's own
config loader, so `store.run_dir` gives exactly the folders the sweep writes. `compare` and
`report` use the same expansion through the Compose API: they see the grid's runs and nothing
else in runs_dir, and can name the ones that are missing.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict

from . import loggers, store
from .config import ConfigError, analysis_device, check_launcher, config_dir, dotted_keys, hydra_errors, remote_job_check, remote_launcher, validate
from .hydra_internals import compose, sweep_jobs

SWEEP_RECORD = "sweep.json"  # runs_dir/sweep.json: the last sweep's command, wall time and machine


class SweepFailed(SystemExit):
    """Raised at the end of a sweep with failed jobs, after everything else is written. A
    SystemExit, because Hydra turns other exceptions into its own error report and returns
    nothing from a multirun: this is how the exit status reaches the shell (and `compare`)."""

    def __init__(self) -> None:
        super().__init__(1)


@dataclass(frozen=True)
class GridRun:
    """One job of a grid: its sweep overrides, its config as the task function sees it, and its folder."""

    overrides: tuple[str, ...]
    label: str  # the swept overrides only, e.g. "attention=none task.length=5 seed=0"
    config: DictConfig
    folder: Path

    @classmethod
    def from_folder(cls, folder: Path) -> GridRun:
        """A run found in a folder rather than in a grid (`--all`), with the config it was trained with."""
        return cls((), "", OmegaConf.load(folder / store.CONFIG), folder)

    def status(self) -> str:
        """complete | running (another process holds its lock) | failed | incomplete (folder
        without results: killed, or cut short) | not run."""
        if store.is_complete(self.folder):
            return "complete"
        if store.is_locked(self.folder):
            return "running"
        if (self.folder / store.FAILED).is_file():
            return "failed"
        return "incomplete" if self.folder.is_dir() else "not run"

    def failure(self) -> str:
        """Why this run has no results, in one line."""
        status = self.status()
        if status == "failed":
            try:
                return store.read_json(self.folder / store.FAILED)["error"]
            except (OSError, ValueError, KeyError, TypeError) as error:
                return f"failed (unreadable {store.FAILED}: {error})"
        if status == "incomplete":
            if (self.folder / store.METRICS).exists():
                return f"corrupt {store.METRICS} in {self.folder} (cut short by a crash; the next sweep trains it again)"
            return f"incomplete: {self.folder} has no {store.METRICS} (still running, or killed)"
        if status == "running":
            return f"being trained by another process (it holds {store.lock_path(self.folder)})"
        return status


def expand(master: DictConfig, check: Callable[[DictConfig], None] | None = None) -> list[GridRun]:
    """The jobs Hydra's basic sweeper launches for `master` (a multirun config with its hydra
    node), in launch order; `check` is called on each job's config as it is composed, so that a bad
    one stops the expansion at once. Needs an initialised GlobalHydra (inside a sweep, or `compose_grid`)."""
    jobs, swept = sweep_jobs(master)
    runs = []
    for overrides, config in jobs:
        with open_dict(config):
            del config["hydra"]  # as Hydra does before calling the task function
        if check is not None:
            check(config)
        label = " ".join(o for o in overrides if o.split("=", 1)[0] in swept)
        runs.append(GridRun(tuple(overrides), label, config, store.run_dir(config)))
    return runs


def _without_lengths(cfg: DictConfig) -> dict[str, Any]:
    """A run's identity less the task's lengths: what a variable-length run shares with the grid."""
    config = store.identity(cfg)
    for key in ("length", "min_length", "variable_length"):
        config["task"].pop(key, None)
    return config


def variable_length_runs(grid: list[GridRun], runs_dir: Path) -> list[Path]:
    """Complete variable-length runs in `runs_dir` whose settings, lengths aside, are those of a
    run of `grid`: their per-length curves belong on the grid's accuracy-vs-length figure."""
    settings = [_without_lengths(run.config) for run in grid]
    found = []
    for folder in sorted(Path(runs_dir).iterdir()) if Path(runs_dir).is_dir() else []:
        if not store.is_complete(folder) or not (folder / store.CONFIG).is_file():
            continue
        try:
            cfg = OmegaConf.load(folder / store.CONFIG)
            if cfg.task.variable_length and _without_lengths(cfg) in settings:
                found.append(folder)
        except Exception as error:  # noqa: BLE001 - a damaged folder must not stop the report (OmegaConf raises many types)
            store.warn(f"skipping {folder}: unreadable {store.CONFIG} ({type(error).__name__}: {error})")
    return found


def compose_grid(
    overrides: list[str], expand_grid: bool = True, multirun: bool = True, check: Callable[[DictConfig], None] | None = None
) -> tuple[DictConfig, list[GridRun]]:
    """The master config and grid (empty unless `expand_grid`) of `python -m copytask sweep
    <overrides>`, or with `multirun=False` the config of `python -m copytask train <overrides>` and
    its one run, composed without running anything and without writing Hydra output folders;
    `check` is called on every job's config as it is composed. Raises ConfigError (one line) for what Hydra cannot compose: an unknown key, a group option
    that does not exist, an override it cannot parse."""
    GlobalHydra.instance().clear()  # a sweep earlier in this process leaves Hydra initialised
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="copytask"):
            with hydra_errors(dotted_keys(compose([], multirun=True))):
                if multirun:
                    master = compose(overrides, multirun=True)
                    return master, expand(master, check) if expand_grid else []
                config = compose(overrides, multirun=False)
                job = config.copy()
                with open_dict(job):
                    del job["hydra"]
                if check is not None:
                    check(job)
                return config, [GridRun(tuple(overrides), "", job, store.run_dir(job))]
    finally:
        GlobalHydra.instance().clear()  # a library call leaves no global Hydra behind


def check_grid(overrides: list[str], multirun: bool = True) -> list[GridRun]:
    """Compose and validate every job of `sweep <overrides>` (or the one run of `train
    <overrides>`) before anything runs. -> the grid; ConfigError, naming the bad value and the
    grid entry it came from, for the first job that cannot run."""
    check = validate
    if multirun:  # jobs that run on other machines (SLURM) check the device there; submitting needs SLURM here
        master, _ = compose_grid(overrides, expand_grid=False)
        launcher = master.hydra.launcher.get("_target_")
        check_launcher(launcher, master.hydra.runtime.choices.get("hydra/launcher"))
        check = remote_job_check if remote_launcher(launcher) else validate
    try:
        master, grid = compose_grid(overrides, multirun=multirun, check=check)  # stops at the first bad job
    except ConfigError as error:
        if not multirun:
            raise
        entries = [f"{key}={value}" for key, value in (master.hydra.sweeper.params or {}).items()] + list(overrides)
        key = str(error).split()[0]
        given = [entry for entry in entries if entry.lstrip("+~").split("=", 1)[0] == key]
        raise ConfigError(f"{error} (in the grid: {given[-1]})" if given else str(error)) from None
    swept = {override.split("=", 1)[0] for run in grid for override in run.label.split()}
    if multirun and master.report.x != "task.length" and master.report.x not in swept:
        choices = ", ".join(["task.length", *sorted(swept - {"attention", "seed", "task.length"})])
        raise ConfigError(f"report.x must be task.length or a numeric key this sweep varies ({choices}), got {master.report.x!r}")
    return grid


# Overrides that say where runs live and how they are analysed or drawn, not which runs a grid has.
VIEW_KEYS = (*store.NOT_IDENTITY, "hydra")


def is_grid_override(override: str) -> bool:
    """Whether `override` (`key=value`, `+key=value`, `group=option`) changes which runs a grid has."""
    key = override.lstrip("+~").split("=", 1)[0]
    return not any(key == view or key.startswith((f"{view}.", f"{view}/")) for view in VIEW_KEYS)


def recorded_overrides(runs_dir: Path) -> list[str] | None:
    """The overrides of the last sweep recorded in runs_dir/sweep.json; None without a readable record."""
    try:
        record = store.read_json(Path(runs_dir) / SWEEP_RECORD)
    except (OSError, ValueError):
        return None
    if "overrides" in record:
        return list(record["overrides"])
    command = shlex.split(record.get("command", ""))  # a record written before `overrides` was
    if command[:4] != ["python", "-m", "copytask", "sweep"]:
        return None
    return [arg for arg in command[4:] if not arg.lstrip("+~").startswith("hydra")]


def folder_runs(folders: list[Path]) -> list[GridRun]:
    """`GridRun.from_folder` of each folder; one with an unreadable config.yaml is skipped with a warning."""
    runs = []
    for folder in folders:
        try:
            runs.append(GridRun.from_folder(folder))
        except Exception as error:  # noqa: BLE001 - a damaged folder must not stop the others (OmegaConf raises many types)
            store.warn(f"skipping {folder}: unreadable {store.CONFIG} ({type(error).__name__}: {error})")
    return runs


@dataclass
class Selection:
    """The runs `compare` and `report` look at, and how they were chosen."""

    master: DictConfig
    runs: list[GridRun]
    overrides: list[str]  # the sweep overrides that make `runs` (empty for every run in a folder)
    source: str  # one line for the user: which grid this is


def select_runs(overrides: list[str], every_run: bool = False) -> Selection:
    """The grid of `python -m copytask sweep <overrides>`; with no grid overrides (only `runs_dir`,
    `report.*` and the like), the grid of the last sweep recorded in runs_dir; with `every_run`,
    every complete run in runs_dir, whatever grid it came from."""
    grid_given = [override for override in overrides if is_grid_override(override)]
    if every_run:
        if grid_given:
            raise ConfigError(f"--all takes every complete run in runs_dir; give it no grid overrides (got {' '.join(grid_given)})")
        master, _ = compose_grid(overrides, expand_grid=False)
        runs = folder_runs(store.complete_runs(Path(master.runs_dir)))
        return Selection(master, runs, [], f"every complete run in {master.runs_dir}: {len(runs)} runs")
    if not grid_given:  # runs_dir first (cheap: no job composed), then the grid recorded there, expanded once
        master, _ = compose_grid(overrides, expand_grid=False)
        if (recorded := recorded_overrides(Path(master.runs_dir))) is not None:
            master, grid = compose_grid([*recorded, *overrides])
            command = shlex.join(["python", "-m", "copytask", "sweep", *recorded])
            return Selection(master, grid, [*recorded, *overrides], f"the grid of the last sweep in {master.runs_dir}: {command}")
    master, grid = compose_grid(overrides)
    return Selection(master, grid, overrides, f"the grid of: {sweep_command(master)}")


def nothing_done(command: str, selection: Selection) -> str:
    """The error for `compare` or `report` on runs none of which is complete (or readable)."""
    runs_dir = Path(selection.master.runs_dir)
    what = "does not exist" if not runs_dir.is_dir() else "has no finished run of this grid"
    return (
        f"copytask: error: nothing to {command}: {runs_dir} {what} (0 of {len(selection.runs)} runs complete); "
        f"train them with: {sweep_command(selection.master)}"
    )


def sweep_command(master: DictConfig) -> str:
    """The command line that starts this sweep."""
    hydra_overrides = [o for o in master.hydra.overrides.hydra if o != "hydra.mode=MULTIRUN"]
    return shlex.join(["python", "-m", "copytask", "sweep", *master.hydra.overrides.task, *hydra_overrides])


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


class SweepProgress:
    """One progress bar for a whole sweep: runs finished (complete, or failed during this sweep)
    of the grid, with elapsed time and ETA. A thread polls the run folders, so it works the same
    under every launcher, in-process or not."""

    def __init__(self, runs: list[GridRun], enabled: bool, interval: float = 2.0) -> None:
        from tqdm.auto import tqdm

        self.runs, self.started_at = runs, time.time()
        self.bar = tqdm(total=len(runs), initial=self.finished(), desc="sweep", unit="run", disable=not enabled,
                        dynamic_ncols=True, mininterval=interval)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, args=(interval,), daemon=True)
        self.thread.start()

    def finished(self) -> int:
        def done(run: GridRun) -> bool:
            status = run.status()
            return status == "complete" or status == "failed" and (run.folder / store.FAILED).stat().st_mtime >= self.started_at

        return sum(map(done, self.runs))

    def poll(self, interval: float, refresh_every: float = 30.0) -> None:
        """Update on every finished run, and redraw the clock now and then: a sweep's log stays small."""
        last_refresh = time.monotonic()
        while not self.stop.wait(interval):
            if (finished := self.finished()) != self.bar.n:
                self.bar.update(finished - self.bar.n)
            elif time.monotonic() - last_refresh > refresh_every:
                self.bar.refresh()
            else:
                continue
            last_refresh = time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.bar.update(self.finished() - self.bar.n)
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
        from . import analysis, devices, report, results  # pandas, matplotlib, the model: only once the jobs are done

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
            lengths=sorted({run.config.task.length for run in runs}),
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
        loaded = results.load(runs)
        if not loaded.table.empty:
            results.save(loaded, runs_dir)
            try:
                report.x_column(config.report.x, loaded)
                x = config.report.x
            except ConfigError as error:
                store.warn(f"{error}; the report puts task.length on the x axis")
                x = "task.length"
            loggers.log_report(config, report.write_report(runs, loaded, runs_dir, x))
        print(
            f"sweep: {len(runs) - len(unfinished) - len(elsewhere)}/{len(runs)} runs complete ({trained} trained now), "
            f"{len(unfinished)} failed" + (f", {len(elsewhere)} being trained by another process" if elsewhere else "")
            + f"; {wall_seconds:.1f} s wall time"
            + (f"; results in {runs_dir / results.RESULTS_CSV}" if not loaded.table.empty else "")
        )
        if unfinished:
            raise SweepFailed()
