"""How many jobs `hydra/launcher=parallel` runs at once: one per core, fewer where memory holds fewer
(`config.parallel`), unless the user says; and the sweep's progress line says how many (`sweeps.progress`)."""

from __future__ import annotations

import joblib
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copytask.config import parallel
from copytask.config.parallel import JOB_MIB, parallel_jobs
from copytask.sweeps.grid import compose_grid
from copytask.sweeps.progress import SweepProgress, TrialProgress, jobs_at_once

from .conftest import OPTUNA, TINY


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    cores=st.integers(1, 1024),
    available=st.none() | st.floats(0, 4e6),  # MiB: up to 4 TiB
    job=st.floats(1, 1e5),
)
@pytest.mark.slow
def test_one_job_per_core_as_many_as_memory_holds_and_never_none(cores, available, job):
    jobs = parallel_jobs(cores, available, job)

    assert 1 <= jobs <= cores
    if available is None:
        assert jobs == cores  # memory not known: the cores decide
    else:
        assert jobs == 1 or jobs * job <= available  # the jobs fit
        assert jobs == cores or (jobs + 1) * job > available  # and one more would not, or there is no core for it


@pytest.mark.parametrize(
    "cores, available_gib, jobs",
    [
        (2, 18, 2),  # this machine: two, as before
        (8, 12, 8),  # a laptop: every core
        (16, 12, 8),  # a workstation short of memory: what memory holds
        (16, 1, 1),  # too little memory for one job: still one
    ],
)
def test_machines_with_the_default_budget_of_a_job(cores, available_gib, jobs):
    """1.5 GiB a job (docs/bench.md measures it): a workstation short of memory runs fewer jobs than cores."""
    assert parallel_jobs(cores, available_gib * 1024) == jobs


@pytest.fixture
def machine(monkeypatch):
    """This process on a machine with the given cores and MiB available, as the resolver sees it."""

    def set_machine(cores: int, available: float | None) -> None:
        monkeypatch.setattr(parallel, "usable_cores", lambda: cores)
        monkeypatch.setattr(parallel, "available_mib", lambda: available)

    return set_machine


def test_the_parallel_launcher_runs_what_the_machine_allows(machine):
    machine(16, 5 * JOB_MIB + 100)
    master, _ = compose_grid(["hydra/launcher=parallel"], expand_grid=False)
    assert master.hydra.launcher.n_jobs == 5  # memory for five of the sixteen cores

    machine(6, None)
    master, _ = compose_grid(["hydra/launcher=parallel"], expand_grid=False)
    assert master.hydra.launcher.n_jobs == 6


def test_the_users_n_jobs_wins(machine):
    machine(16, 64 * 1024)
    master, _ = compose_grid(["hydra/launcher=parallel", "hydra.launcher.n_jobs=3"], expand_grid=False)
    assert master.hydra.launcher.n_jobs == 3


def test_the_presets_that_run_in_parallel_use_the_machine(machine):
    machine(12, None)
    master, _ = compose_grid(["experiment=attention_zoo"], expand_grid=False)
    assert master.hydra.launcher.n_jobs == 12


@pytest.mark.parametrize(
    "overrides, jobs, at_once",
    [
        ([], 10, 1),  # Hydra's basic launcher: one at a time
        (["hydra/launcher=parallel"], 10, 6),
        (["hydra/launcher=parallel"], 4, 4),  # no more than the sweep has jobs
        (["hydra/launcher=parallel", "hydra.launcher.n_jobs=3"], 10, 3),
        (["hydra/launcher=parallel", "hydra.launcher.n_jobs=-1"], 1000, joblib.cpu_count()),  # joblib's: every core
        (["hydra/launcher=slurm"], 10, None),  # the queue decides
        pytest.param(["hparams_search=baseline", "task.length=20"], None, 2, marks=OPTUNA),  # two trials at a time
    ],
)
def test_how_many_jobs_a_sweep_runs_at_once(machine, overrides, jobs, at_once):
    machine(6, None)
    master, _ = compose_grid(overrides, expand_grid=False)
    assert jobs_at_once(master.hydra, jobs) == at_once


def test_the_progress_line_says_how_many_jobs_run_at_once(tmp_path):
    master, grid = compose_grid([*TINY, f"runs_dir={tmp_path}", "task.length=3,4", "attention=none", "seed=0"])
    for at_once, line in [(3, "sweep (0/2 runs, 3 jobs at a time)"), (1, "sweep (0/2 runs, 1 job at a time)")]:
        progress = SweepProgress(grid, enabled=False, at_once=at_once)
        progress.close()
        assert progress.runs_done(progress.done) == line
    progress = TrialProgress(tmp_path, trials=40, enabled=False, at_once=2)
    progress.close()
    assert progress.runs_done(0) == "search (0/40 trials, 2 jobs at a time)"
