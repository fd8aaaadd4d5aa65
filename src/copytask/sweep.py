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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import run_and_report
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from . import store

SWEEP_RECORD = "sweep.json"  # runs_dir/sweep.json: the last sweep's command, wall time and machine


class SweepFailed(SystemExit):
    """Raised at the end of a sweep with failed jobs, after everything else is written. A
    SystemExit, because Hydra turns other exceptions into its own error report and returns
    nothing from a multirun: this is how the exit status reaches the shell (and `compare`)."""

    def __init__(self) -> None:
        super().__init__(1)


@dataclass(frozen=True)
class GridRun:
    """One job of a grid: its sweep overrides and its config as the task function sees it."""

    overrides: tuple[str, ...]
    label: str  # the swept overrides only, e.g. "attention=none task.length=5 seed=0"
    config: DictConfig

    @property
    def folder(self) -> Path:
        return store.run_dir(self.config)

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


def expand(master: DictConfig) -> list[GridRun]:
    """The jobs Hydra's basic sweeper launches for `master` (a multirun config with its hydra
    node), in launch order. Needs an initialised GlobalHydra (inside a sweep, or `compose_grid`)."""
    loader = GlobalHydra.instance().config_loader()
    params = [f"{key}={value}" for key, value in (master.hydra.sweeper.params or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(params + list(master.hydra.overrides.task))
    [batches] = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    runs = []
    for overrides in batches:
        config = loader.load_sweep_config(master, overrides)
        with open_dict(config):
            del config["hydra"]  # as Hydra does before calling the task function
        label = " ".join(o for o in overrides if o.split("=", 1)[0] in swept)
        runs.append(GridRun(tuple(overrides), label, config))
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


def compose_grid(overrides: list[str]) -> tuple[DictConfig, list[GridRun]]:
    """The master config and grid of `python -m copytask sweep <overrides>`, composed without
    running anything and without writing Hydra output folders."""
    from .cli import config_dir  # the one place that knows where configs live (checkout or wheel)

    GlobalHydra.instance().clear()  # a sweep earlier in this process leaves Hydra initialised

    def compose() -> tuple[DictConfig, list[GridRun]]:
        master = GlobalHydra.instance().hydra.compose_config(
            "config", ["hydra.mode=MULTIRUN", *overrides], run_mode=RunMode.MULTIRUN
        )
        return master, expand(master)

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="copytask"):
        return run_and_report(compose)  # a bad override: Hydra's one-line error and exit 1, as with sweep


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


class SweepSummary(Callback):
    """At the end of a sweep: name the failed jobs, analyse the grid's complete runs (the report
    reads analysis.json, it never evaluates a model), write results.csv and the report, print the
    wall time, and exit non-zero if any job of this sweep has no results."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()
        self.started_at = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from . import analysis, report, results  # pandas, matplotlib, the model: only once the jobs are done

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
        )
        analysis_seconds = time.perf_counter() - analysis_started
        print(f"analysis: {analysed} runs analysed in {analysis_seconds:.1f} s (eval_size {config.analysis.eval_size})")
        wall_seconds = time.perf_counter() - self.started
        store.write_json(
            runs_dir / SWEEP_RECORD,
            {
                "command": sweep_command(config),
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
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                "python": platform.python_version(),
            },
        )
        loaded = results.load(runs)
        if not loaded.table.empty:
            results.save(loaded.table, runs_dir)
            report.write_report(runs, loaded, runs_dir)
        print(
            f"sweep: {len(runs) - len(unfinished) - len(elsewhere)}/{len(runs)} runs complete ({trained} trained now), "
            f"{len(unfinished)} failed" + (f", {len(elsewhere)} being trained by another process" if elsewhere else "")
            + f"; {wall_seconds:.1f} s wall time"
            + (f"; results in {runs_dir / results.RESULTS_CSV}" if not loaded.table.empty else "")
        )
        if unfinished:
            raise SweepFailed()
