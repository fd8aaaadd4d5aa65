"""Which runs a grid is made of, composed as Hydra composes them, checked whole before the first
job starts (`check_grid`, the launcher's checks among them), and which runs `compare`, `report` and
the API look at (`select_runs`).

The grid is expanded the way Hydra's basic sweeper does it (sweeper params, then command-line
overrides, which replace a swept key's list), and each job's config is composed with Hydra's own
config loader, so `store.run_dir` gives exactly the folders the sweep writes. `compare` and
`report` use the same expansion: they see the grid's runs and nothing else in runs_dir, and can
name the ones that are missing. Composing here leaves a Hydra instance the caller initialised as
it was.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hydra import initialize_config_dir
from omegaconf import DictConfig, open_dict

from .. import console, store
from ..config.checks import check_launcher, remote_job_check, remote_launcher, validate
from ..config.hydra_internals import (
    compose,
    compose_job,
    configs_digest,
    own_global_hydra,
    proposes_jobs,
    search_samples,
    search_space,
    sweep_jobs,
    swept_keys,
)
from ..config.parallel import check_n_jobs
from ..config.schema import config_dir, dotted_keys, hydra_errors
from ..console import ConfigError
from ..store.runs import (
    RECORDED_CONFIGS,
    SWEEP_RECORD,
    TRIAL_RECORD,
    GridRun,
    beside,
    beside_line,
    folder_runs,
    recorded_runs,
)

# What `copytask.sweep` adds to its Hydra command line so that Hydra configures no logging (jobs.run_hydra);
# not part of the command that starts the sweep (`sweep_command`)
QUIET_HYDRA = ("hydra/hydra_logging=none", "hydra/job_logging=none")


def expand(master: DictConfig, check: Callable[[DictConfig], None] | None = None) -> list[GridRun]:
    """The jobs Hydra's basic sweeper launches for `master` (a multirun config with its hydra
    node), in launch order; `check` is called on each job's config as it is composed. Every value
    of a swept key is composed first (`first_composed`), so that a bad one stops the expansion
    after a few compositions, not after every job launched before it. Needs an initialised
    GlobalHydra (inside a sweep, or `compose_grid`)."""
    batches, swept = sweep_jobs(master)
    configs: dict[tuple[str, ...], DictConfig] = {}
    given = {override.lstrip("+~").split("=", 1)[0] for override in master.hydra.overrides.task}
    for overrides in [*first_composed(batches, given), *batches]:
        if tuple(overrides) not in configs:
            config = compose_job(master, overrides)
            with open_dict(config):
                del config["hydra"]  # as Hydra does before calling the task function
            if check is not None:
                check(config)
            configs[tuple(overrides)] = config
    runs = []
    for overrides in batches:
        config = configs[tuple(overrides)]
        label = " ".join(o for o in overrides if o.split("=", 1)[0] in swept)
        runs.append(GridRun(tuple(overrides), label, config, store.run_dir(config)))
    return runs


def first_composed(batches: list[list[str]], given: set[str]) -> list[list[str]]:
    """The first job of a grid, then each job that differs from it in one override: together they
    hold every value of every swept key. Those that vary a key `given` on the command line come
    first, where a mistyped value most likely is."""
    if not batches:
        return []
    first, one_off = batches[0], []
    for job in batches[1:]:
        changed = [override for override, was in zip(job, first, strict=True) if override != was]
        if len(changed) == 1:
            one_off.append((changed[0].lstrip("+~").split("=", 1)[0] not in given, job))
    return [first, *(job for _, job in sorted(one_off, key=lambda entry: entry[0]))]


def check_search(master: DictConfig, check: Callable[[DictConfig], None]) -> None:
    """What can be checked of a search before its sweeper proposes the first trial: that the
    sweeper can read the search space (`search_samples`), that a trial composes (every searched key
    exists and takes the type of a value it may get), and `check` on the config the trials share
    (their fixed overrides, the searched keys at their defaults). Each trial is checked again as it
    comes, in its job: one that cannot run is a failed trial with its reason, not a crash."""
    fixed, _ = search_space(master)
    compose_job(master, [*fixed, *search_samples(master)])  # composition only: a sample need not be a good combination
    shared = compose_job(master, fixed)
    with open_dict(shared):
        del shared["hydra"]
    check(shared)


def search_trials(master: DictConfig) -> list[dict]:
    """The trials of the search recorded in `master`'s runs_dir (sweep.json), in trial order: the
    list written at its end, or while it runs (or once it was cut off) the trial records its jobs
    have written since it started. Empty where the last sweep recorded there is no search."""
    try:
        record = store.read_json(Path(master.runs_dir) / SWEEP_RECORD)
    except (OSError, ValueError):
        return []
    if "trials" in record:
        return record["trials"]
    if "search" not in record:
        return []
    trials = []
    for path in Path(master.hydra.sweep.dir).glob(f"*/{TRIAL_RECORD}"):
        try:
            if path.stat().st_mtime >= record["started_at"]:  # not a trial of an earlier sweep in this runs_dir
                trials.append(store.read_json(path))
        except (OSError, ValueError) as error:
            console.warn(f"skipping {path}: {type(error).__name__}: {error}")
    return sorted(trials, key=lambda trial: trial["trial"])


def trial_runs(master: DictConfig, trials: list[dict]) -> list[GridRun]:
    """The run of each trial, composed from the trial's overrides as its job was (so a trial
    refused before it trained has its folder too), once each where trials repeat a run, in trial
    order. Labelled by the searched keys' values."""
    _, searched = search_space(master)
    runs = {}
    for trial in trials:
        if trial["run"] in runs:
            continue
        config = compose_job(master, trial["overrides"])
        with open_dict(config):
            del config["hydra"]
        label = " ".join(o for o in trial["overrides"] if o.split("=", 1)[0] in searched)
        runs[trial["run"]] = GridRun(
            tuple(trial["overrides"]), f"trial {trial['trial']}: {label}", config, store.run_dir(config)
        )
    return list(runs.values())


def compose_grid(
    overrides: list[str],
    expand_grid: bool = True,
    multirun: bool = True,
    check: Callable[[DictConfig], None] | None = None,
    master: DictConfig | None = None,
) -> tuple[DictConfig, list[GridRun]]:
    """The master config and grid (empty unless `expand_grid`) of `python -m copytask sweep
    <overrides>`, or with `multirun=False` the config of `python -m copytask train <overrides>` and
    its one run, composed without running anything and without writing Hydra output folders;
    `check` is called on every job's config as it is composed; `master`: the sweep's master config
    where the caller has it already (`compose_grid(overrides, expand_grid=False)`). For a sweeper that
    proposes its jobs (Optuna) there is no grid before it runs: the runs are the trials recorded in
    runs_dir (`search_trials`), and `check` sees what can be checked up front (`check_search`). Raises
    ConfigError (one line) for what Hydra cannot compose: an unknown key, a group option that does
    not exist, an override it cannot parse."""
    with own_global_hydra():
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="copytask"):
            with hydra_errors(lambda: dotted_keys(compose([], multirun=True))):
                if multirun:
                    master = compose(overrides, multirun=True) if master is None else master
                    if not proposes_jobs(master.hydra):
                        return master, expand(master, check) if expand_grid else []
                    if check is not None:
                        check_search(master, check)
                    return master, trial_runs(master, search_trials(master)) if expand_grid else []
                config = compose(overrides, multirun=False)
                job = config.copy()
                with open_dict(job):
                    del job["hydra"]
                if check is not None:
                    check(job)
                return config, [GridRun(tuple(overrides), "", job, store.run_dir(job))]


def check_grid(overrides: list[str], multirun: bool = True) -> list[GridRun]:
    """Compose and check every job of `sweep <overrides>` (or the one run of `train <overrides>`)
    before anything runs: `validate` (`remote_job_check` for jobs that run elsewhere), then what only
    the attention classes know (`models.build.check_buildable`, which imports torch: only once every
    job has passed the torch-free checks, whose refusals stay immediate). -> the grid; ConfigError,
    naming the bad value and the grid entry it came from, for the first job that cannot run."""
    torch_free_check, searching, master = validate, False, None
    if multirun:  # jobs that run on other machines (SLURM) check the device there; submitting needs SLURM here
        master, _ = compose_grid(overrides, expand_grid=False)
        launcher = master.hydra.launcher.get("_target_")
        check_launcher(
            launcher, master.hydra.runtime.choices.get("hydra/launcher"), master.hydra.launcher.get("partition")
        )
        check_n_jobs(master.hydra.launcher)
        torch_free_check = remote_job_check if remote_launcher(launcher) else validate
        searching = proposes_jobs(master.hydra)
        if not searching:  # before any job is composed
            check_report_x(master.report.x, swept_keys(master))
    checked: list[DictConfig] = []  # each job's config (a search's: what its trials share), torch-free checks passed

    def check(job: DictConfig) -> None:
        torch_free_check(job)
        checked.append(job)

    try:  # stops at the first bad job; a search has no jobs yet, only what its trials share
        master, grid = compose_grid(overrides, expand_grid=not searching, multirun=multirun, check=check, master=master)
        from ..models.build import check_buildable

        for job in checked:
            check_buildable(job)
    except ConfigError as error:
        if not multirun:
            raise
        entries = [f"{key}={value}" for key, value in (master.hydra.sweeper.get("params") or {}).items()] + list(
            overrides
        )
        key = str(error).split()[0]
        given = [entry for entry in entries if entry.lstrip("+~").split("=", 1)[0] == key]
        raise ConfigError(f"{error} (in the grid: {given[-1]})" if given else str(error)) from None
    return grid


def check_report_x(x: str, swept: set[str]) -> None:
    """ConfigError unless the report's x axis, `x`, is the length or a key the sweep varies (`swept`)."""
    if x != "task.length" and x not in swept:
        choices = ", ".join(["task.length", *sorted(swept - {"attention", "seed", "task.length"})])
        raise ConfigError(f"report.x must be task.length or a numeric key this sweep varies ({choices}), got {x!r}")


# Overrides that say where runs live and how they are analysed or drawn, not which runs a grid has.
VIEW_KEYS = (*store.NOT_IDENTITY, "hydra")


def is_grid_override(override: str) -> bool:
    """Whether `override` (`key=value`, `+key=value`, `group=option`) changes which runs a grid has:
    `hydra.searchpath` does, since it adds options of the user's own (docs/models.md)."""
    key = override.lstrip("+~").split("=", 1)[0]
    if key == "hydra.searchpath":
        return True
    return not any(key == view or key.startswith((f"{view}.", f"{view}/")) for view in VIEW_KEYS)


def sweep_record(runs_dir: Path) -> dict | None:
    """The last sweep's record in runs_dir (sweep.json); None without a readable one."""
    try:
        record = store.read_json(Path(runs_dir) / SWEEP_RECORD)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def recorded_overrides(record: dict) -> list[str] | None:
    """The overrides of the sweep a record (`sweep_record`) describes; None where it does not say."""
    if "overrides" in record:
        return list(record["overrides"])
    command = shlex.split(record.get("command", ""))  # a record written before `overrides` was
    if command[:4] != ["python", "-m", "copytask", "sweep"]:
        return None
    return [arg for arg in command[4:] if not arg.lstrip("+~").startswith("hydra")]


@dataclass
class Selection:
    """The runs `compare` and `report` look at, and how they were chosen."""

    master: DictConfig
    runs: list[GridRun]
    overrides: list[str]  # the sweep overrides that make `runs` (empty for every run in a folder)
    source: str  # one line for the user: which grid this is
    trials: list[dict] | None = None  # a search's trials (`search_trials`), in trial order; None for a grid
    every_run: bool = False  # every complete run in runs_dir, not a grid's
    configs_changed: bool = False  # `runs` are a recorded sweep's, and the configs changed since it composed them

    @property
    def is_search(self) -> bool:
        return self.trials is not None

    def beside(self, include: str) -> str | None:
        """The note on the complete runs in runs_dir that this grid or search leaves out, with what `include`s them
        (`compare --all`); None where there are none, or where these are every complete run there."""
        if self.every_run:
            return None
        names = beside(self.runs, Path(self.master.runs_dir))
        return beside_line(names, self.master.runs_dir, "search" if self.is_search else "grid", include)


def replaced(recorded: list[str], given: list[str]) -> list[str]:
    """The recorded overrides less those whose key a given `key=value` sets again, then the given ones
    (what Hydra would compose from both, written once: a folder's sweep may name another runs_dir)."""
    keys = {override.split("=", 1)[0] for override in given if "=" in override and override[0] not in "+~"}
    return [*(override for override in recorded if override.split("=", 1)[0] not in keys), *given]


def select_runs(
    overrides: list[str],
    every_run: bool = False,
    every_run_unless_recorded: bool = False,
    master: DictConfig | None = None,
    current: bool = False,
) -> Selection:
    """The grid of `python -m copytask sweep <overrides>`; with no grid overrides (only `runs_dir`,
    `report.*` and the like), the grid of the last sweep recorded in runs_dir (where none is: the
    default grid, or with `every_run_unless_recorded` every complete run there); with `every_run`,
    every complete run in runs_dir, whatever grid it came from. `master`: the config of
    `sweep <overrides>` where the caller has composed it already. `current` (to list or train what a
    grid lacks): the grid the configs compose now, where they changed since the sweep recorded it.

    The grid is composed at most once, and not at all where it is the grid of the sweep recorded in
    runs_dir: its runs are then named from the record (`store.runs.recorded_runs`), even where the
    configs changed since (the Selection says so), unless `current`."""
    grid_given = [override for override in overrides if is_grid_override(override)]
    if every_run and grid_given:
        raise ConfigError(
            f"--all takes every complete run in runs_dir; give it no grid overrides (got {' '.join(grid_given)})"
        )
    if master is None:  # runs_dir first (cheap: no job composed)
        master, _ = compose_grid(overrides, expand_grid=False)
    record = None if every_run else sweep_record(Path(master.runs_dir))
    recorded = None if record is None else recorded_overrides(record)
    if not grid_given and recorded is not None:  # the grid recorded there
        combined = replaced(recorded, overrides)
        if combined != overrides:
            master, _ = compose_grid(combined, expand_grid=False)
        command = shlex.join(["python", "-m", "copytask", "sweep", *recorded])
        runs = recorded_grid(master, record, combined)
        return selection(master, runs, combined, command, recorded_in=master.runs_dir, record=record, current=current)
    if not grid_given and (every_run or every_run_unless_recorded):
        runs = folder_runs(store.complete_runs(Path(master.runs_dir)))
        return Selection(master, runs, [], f"every complete run in {master.runs_dir}: {len(runs)} runs", every_run=True)
    runs = recorded_grid(master, record, overrides) if recorded is not None else None
    return selection(master, runs, overrides, sweep_command(master), record=record, current=current)


def recorded_grid(master: DictConfig, record: dict, overrides: list[str]) -> list[GridRun] | None:
    """The runs of the grid of `sweep <overrides>` (`master`) as `record` names them, where it is the
    grid that sweep recorded (the same grid overrides, view keys such as runs_dir aside) and the record
    names its runs; None otherwise (compose it)."""
    if proposes_jobs(master.hydra):
        return None
    same = [o for o in recorded_overrides(record) or [] if is_grid_override(o)] == [
        o for o in overrides if is_grid_override(o)
    ]
    return recorded_runs(Path(master.runs_dir), record) if same else None


# What compare and report say of a recorded sweep's grid whose configs changed since it ran (Selection.configs_changed)
CONFIGS_CHANGED = (
    "note: the configs changed since this sweep ran: these are the runs it recorded; compare --missing lists "
    "the grid they compose now, compare --train-missing trains its missing runs"
)


def configs_changed(master: DictConfig, record: dict) -> bool | None:
    """Whether the config files changed since the sweep of `record` composed its grid from them (its digest
    against `configs_digest` of `master`'s search path, today's); None where the record does not say."""
    if RECORDED_CONFIGS not in record:
        return None
    return record[RECORDED_CONFIGS] != configs_digest(master.hydra.searchpath)


def selection(
    master: DictConfig,
    runs: list[GridRun] | None,
    overrides: list[str],
    command: str,
    recorded_in: str | None = None,
    record: dict | None = None,
    current: bool = False,
) -> Selection:
    """The Selection of the grid, or of the search's trials, that `command` sweeps (`runs`, or where
    None the runs of `master`'s grid composed from `overrides`), with its line for the user (which
    says so when the sweep was the last one recorded in a runs_dir). `runs` named from `record` are the
    grid the configs compose now unless they changed since (or the record does not say): then, with
    `current`, the grid is composed anew, and without it the Selection says they changed."""
    changed = None if runs is None or record is None else configs_changed(master, record)
    anew = current and runs is not None and changed is not False
    if runs is None or anew:
        master, runs = compose_grid(overrides, master=master)
    if not proposes_jobs(master.hydra):
        of = f" the last sweep in {recorded_in}: {command}" if recorded_in is not None else f": {command}"
        now = ", composed from the configs as they are now" if anew else ""
        return Selection(master, runs, overrides, f"the grid of{of}{now}", configs_changed=bool(changed) and not anew)
    trials = search_trials(master)
    of = f"the last search in {recorded_in}: {command}" if recorded_in is not None else f"the search: {command}"
    return Selection(master, runs, overrides, f"the {len(trials)} trials ({len(runs)} runs) of {of}", trials)


def nothing_done(command: str, selection: Selection) -> str:
    """The error for `compare` or `report` on runs none of which is complete (or readable)."""
    runs_dir = Path(selection.master.runs_dir)
    what = "does not exist" if not runs_dir.is_dir() else "has no finished run of this grid"
    return (
        f"nothing to {command}: {runs_dir} {what} (0 of {len(selection.runs)} runs complete); "
        f"train them with: {sweep_command(selection.master)}"
    )


def sweep_command(master: DictConfig) -> str:
    """The command line that starts this sweep."""
    hydra_overrides = [o for o in master.hydra.overrides.hydra if o != "hydra.mode=MULTIRUN" and o not in QUIET_HYDRA]
    return shlex.join(["python", "-m", "copytask", "sweep", *master.hydra.overrides.task, *hydra_overrides])
