"""The runs a grid or a folder holds, as `compare`, `report`, the sweeps and the API see them: a run
with the overrides that made it and its status (`GridRun`), the records a sweep leaves in runs_dir
(`SWEEP_RECORD` with its grid's runs, `recorded_runs`; each trial's `TRIAL_RECORD`) and a failed job's
record (`record_failure`), and the variable-length runs whose curves belong on a grid's figure. Which
runs a grid is made of is the sweeps' (`sweeps.grid`); once a sweep has recorded them, its runs are
named from the record, without composing the grid again."""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from .. import console
from ..console import ConfigError
from . import folders, replacement
from .identity import identity
from .provenance import named

SWEEP_RECORD = "sweep.json"  # runs_dir/sweep.json: the last sweep's command, its grid's runs, wall time and machine
RECORDED_RUNS = "runs"  # sweep.json's list of the grid's runs, in launch order: each its folder's name and label
# sweep.json's record of the last sweep that trained any of the same runs, kept by a sweep that trained none of them
TRAINED_BY = "trained_by"
# sweep.json's digest of the config files its grid was composed from (config.hydra_internals.configs_digest)
RECORDED_CONFIGS = "configs"
OBJECTIVE = (
    "val_token_acc"  # what a job returns to an optimising sweeper: validation greedy token accuracy, from metrics.json
)
# <hydra.sweep.dir>/<job number>/trial.json: what each trial of a search ran and returned, written by its job
# (one file per job: jobs in other processes never append to one shared file)
TRIAL_RECORD = "trial.json"


@dataclass(frozen=True)
class GridRun:
    """One job of a grid: its sweep overrides, its config as the task function sees it, and its folder.
    A run found in a folder (`from_folder`) or in a sweep's record (`RecordedRun`) has no overrides and
    the config it was trained with."""

    overrides: tuple[str, ...]
    label: str  # the swept overrides only, e.g. "attention=none task.length=5 seed=0"
    config: DictConfig | None
    folder: Path

    @classmethod
    def from_folder(cls, folder: Path) -> GridRun:
        """A run found in a folder rather than in a grid (`--all`), with the config it was trained with."""
        return cls((), "", folders.read_config(folder), folder)

    @property
    def resolved(self) -> dict[str, Any] | None:
        """Its config as plain values (what its config.yaml holds); None where it has no config."""
        return None if self.config is None else OmegaConf.to_container(self.config, resolve=True)

    def config_failure(self) -> str:
        """Why it has no config (`resolved` is None), in one line."""
        return f"unreadable {folders.CONFIG}"

    def status(self) -> str:
        """complete | running (another process holds its lock) | failed | incomplete (folder
        without results: killed, or cut short) | not run."""
        if folders.is_complete(self.folder):
            return "complete"
        if folders.is_locked(self.folder):
            return "running"
        if (self.folder / folders.FAILED).is_file():
            return "failed"
        return "incomplete" if self.folder.is_dir() else "not run"

    def failure(self) -> str:
        """Why this run has no results, in one line."""
        status = self.status()
        if status == "failed":
            return read_failure(self.folder)
        if status == "incomplete":
            if (self.folder / folders.METRICS).exists():
                return (
                    f"corrupt {folders.METRICS} in {self.folder} (cut short by a crash; the next sweep trains it again)"
                )
            return f"incomplete: {self.folder} has no {folders.METRICS} (still running, or killed)"
        if status == "running":
            return f"being trained by another process (it holds {folders.lock_path(self.folder)})"
        return status

    def job_failure(self) -> str | None:
        """Why this run's last job failed, in one line; None where it did not (or another process trains
        it). Where it was to replace complete results, which stay complete, the failure is recorded
        beside their replacement (`record_failure`)."""
        status = self.status()
        if status in ("running", "complete"):
            new = replacement.staging(self.folder)
            failed = status == "complete" and (new / folders.FAILED).is_file()
            return f"{read_failure(new)}; its results from before are kept" if failed else None
        return self.failure()


def describe_missing(missing: list[tuple[GridRun, str]], total: int) -> str:
    """`N of M runs missing:` and one line per run (its overrides, folder and why)."""
    lines = [f"{len(missing)} of {total} runs missing:"]
    lines += [f"  {run.label or run.folder.name}  ({run.folder.name}): {reason}" for run, reason in missing]
    return "\n".join(lines)


def grid_record(runs: list[GridRun]) -> list[dict[str, str]]:
    """What sweep.json records of a grid's runs as the sweep starts (RECORDED_RUNS): each run's folder
    name and label, in launch order."""
    return [{"run": run.folder.name, "label": run.label} for run in runs]


class RecordedRun(GridRun):
    """A run of a grid as its sweep recorded it (`recorded_runs`): its label and folder, and the config it
    was trained with (its config.yaml: the identity its folder's name stands for, so the settings that
    composing its job again gives) read when first asked for; None where it has none (not run yet, or
    unreadable)."""

    def __init__(self, label: str, folder: Path) -> None:  # GridRun's fields, set as its frozen __init__ does
        for name, value in (("overrides", ()), ("label", label), ("folder", folder)):
            object.__setattr__(self, name, value)

    @functools.cached_property
    def read(self) -> tuple[dict[str, Any] | None, str | None]:
        """(its config.yaml's values, None), or (None, why it has none, in one line)."""
        try:
            return folders.read_resolved(self.folder), None
        except Exception as error:  # noqa: BLE001 - none yet, or damaged (PyYAML raises many types)
            return None, unreadable_config(error)

    @property
    def resolved(self) -> dict[str, Any] | None:  # what a table of runs reads: no DictConfig made
        return self.read[0]

    def config_failure(self) -> str:
        return self.read[1] or super().config_failure()

    @functools.cached_property
    def config(self) -> DictConfig | None:
        try:
            return None if self.resolved is None else OmegaConf.create(self.resolved)
        except Exception:  # noqa: BLE001 - values OmegaConf cannot hold: its reader names it (it raises many types)
            return None


def unreadable_config(error: Exception) -> str:
    """Why a run's config.yaml could not be read (`error`), in one line: a ConfigError names the file and
    what OmegaConf refuses in it (`folders.read_resolved`)."""
    if isinstance(error, ConfigError):
        return str(error)
    return f"unreadable {folders.CONFIG} ({type(error).__name__}: {' '.join(str(error).split())})"


def recorded_runs(runs_dir: Path, record: dict[str, Any]) -> list[GridRun] | None:
    """The runs of the grid a sweep recorded (`record`, its sweep.json) in `runs_dir`, named from the
    record without composing a job (`RecordedRun`); None where the record names no runs (a search, or a
    sweep recorded before copytask recorded them)."""
    if not isinstance(record.get(RECORDED_RUNS), list):
        return None
    return [RecordedRun(entry["label"], Path(runs_dir) / entry["run"]) for entry in record[RECORDED_RUNS]]


def beside(runs: list[GridRun], runs_dir: Path) -> list[str]:
    """The complete runs in `runs_dir` that are not among `runs` (a grid's or a search's), by folder name: what
    `--all` adds to them. A dot folder (.locks, .sweep, a retraining's `.<run>.new`) is no run of its own, and a
    folder without results no run that --all reads."""
    shown = {run.folder.name for run in runs}
    return [folder.name for folder in folders.complete_runs(runs_dir) if folder.name not in shown]


def beside_line(names: list[str], runs_dir: Path | str, what: str, include: str) -> str | None:
    """The note on the complete runs `names` in runs_dir that are not of the `what` shown ("grid", "search"): how
    many, a few by name, and what `include`s them (`compare --all`); None where there are none. A table of the grid
    stays the grid's whatever lands beside it, but not silently."""
    if not names:
        return None
    runs, are, them = ("run", "is", "it") if len(names) == 1 else ("runs", "are", "them")
    return (
        f"note: {len(names)} complete {runs} in {runs_dir} {are} not of this {what}: {named(names)}; "
        f"{include} includes {them}"
    )


def record_failure(folder: Path, error: BaseException) -> None:
    """Record why the job of the run in `folder` failed (FAILED: the error and its traceback), where it
    makes no complete results look failed (`replacement.failure_folder`)."""
    trace = "".join(traceback.format_exception(error))
    folders.write_json(
        replacement.failure_folder(folder) / folders.FAILED,
        {"error": f"{type(error).__name__}: {error}", "traceback": trace},
    )


def read_failure(folder: Path) -> str:
    """The error a failed job recorded in `folder`, in one line."""
    try:
        return folders.read_json(folder / folders.FAILED)["error"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"failed (unreadable {folders.FAILED}: {error})"


def _without_lengths(cfg: DictConfig) -> dict[str, Any]:
    """A run's identity less the task's lengths: what a variable-length run shares with the grid."""
    config = identity(cfg)
    for key in ("length", "min_length", "variable_length"):
        config["task"].pop(key, None)
    return config


def variable_length_runs(grid: list[GridRun], runs_dir: Path) -> list[Path]:
    """Complete variable-length runs in `runs_dir` whose settings, lengths aside, are those of a
    run of `grid`: their per-length curves belong on the grid's accuracy-vs-length figure."""
    settings = [_without_lengths(run.config) for run in grid if run.config is not None]
    found = []
    for folder in folders.complete_runs(runs_dir):  # not a replacement's staging folder, complete before its swap
        if not (folder / folders.CONFIG).is_file():
            continue
        try:
            cfg = folders.read_config(folder)
            if cfg.task.variable_length and _without_lengths(cfg) in settings:
                found.append(folder)
        except Exception as error:  # noqa: BLE001 - a damaged folder must not stop the report (OmegaConf raises many types)
            console.warn(f"skipping {folder}: {unreadable_config(error)}")
    return found


def folder_runs(folders: list[Path]) -> list[GridRun]:
    """`GridRun.from_folder` of each folder; one with an unreadable config.yaml is skipped with a warning."""
    runs = []
    for folder in folders:
        try:
            runs.append(GridRun.from_folder(folder))
        except Exception as error:  # noqa: BLE001 - a damaged folder must not stop the others (OmegaConf raises many types)
            console.warn(f"skipping {folder}: {unreadable_config(error)}")
    return runs
