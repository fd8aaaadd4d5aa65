"""Shared fixtures: the real Hydra configs composed and shrunk with overrides, and one tiny real
sweep through the CLI, reused (copied) by the tests that need finished runs."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from copytask.config.schema import config_dir

SRC = Path(__file__).resolve().parents[1] / "src"

# A budget small enough to train a run in about a second on a busy CPU; one torch thread so
# parallel test runs and other processes do not fight over cores. On the CPU, also on a machine with
# a GPU (where `auto` would pick it): these tests mean the CPU path, fused kernels included, and
# tests/test_cuda.py runs the device path on cuda where there is one.
TINY = [
    "train.device=cpu",
    "experiment=quick",
    "train.steps=10",
    "train.eval_every=5",
    "train.eval_size=16",
    "train.val_size=16",
    "train.batch_size=8",
    "model.hidden_size=8",
    "model.embedding_size=8",
    "train.threads=1",
    "train.progress=false",
]


def options(group: str) -> dict[str, DictConfig]:
    """Every option of a config group (configs/<group>/), by name, as Hydra composes it (an option may
    extend another): tests that cover every attention type or task iterate these (and the
    registries), so adding one edits no test."""
    names = sorted(path.stem for path in (Path(config_dir()) / group).glob("*.yaml"))
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        composed = {name: compose("config", overrides=[f"{group}={name}"])[group] for name in names}
    GlobalHydra.instance().clear()
    return composed


ATTENTION_OPTIONS = options("attention")
NO_ATTENTION = tuple(name for name, option in ATTENTION_OPTIONS.items() if option.score is None)  # no weights
TASK_OPTIONS = options("task")

# The grid: 2 attention types x 2 lengths x 2 seeds (two seeds give an interval).
GRID = ["attention=none,luong_general", "task.length=3,6", "seed=0,1"]


# Fixtures that train runs for the tests that read them: such a test is slow (the quick tier,
# `-m "not slow"`, leaves it out) wherever its fixture's cost falls.
TRAINING_FIXTURES = {
    "swept",
    "runs_copy",
    "settings_swept",
    "searched",
    "analysed_runs",
    "runs",
    "trained",
    "trained_run",
    "fixed_state_runs",
    "slurm",
    "trained_once",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if TRAINING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch CPU thread in each test process, as TINY gives the runs: torch's default, one per core,
    in each of pytest-xdist's workers (one per core too) spin-waits its threads for cores the other
    workers hold; the suite's models and decodings took about twice the CPU time for it. The tests'
    own process only: the library changes no process-wide state, and the commands the tests start
    keep torch's default."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def needs(module: str, install: str) -> pytest.MarkDecorator:
    """Skip, saying how to install it, where the optional package `module` is missing (the GPU machine's
    image has none of the extras). CI installs the test extra, so there a missing one fails the test."""
    missing = importlib.util.find_spec(module) is None and not os.environ.get("CI")
    return pytest.mark.skipif(missing, reason=f"needs {module}: {install}")


OPTUNA = needs("optuna", "pip install 'copytask[optuna]'")
TENSORBOARD = needs("tensorboard", "pip install 'copytask[tensorboard]'")
MLFLOW = needs("mlflow", "pip install 'copytask[mlflow]'")


def pythonpath(*first: Path | str) -> str:
    """A child process's PYTHONPATH: `first`, this checkout's sources, then the caller's own PYTHONPATH,
    where a machine may keep packages outside the environment (the GPU machine's set-up does)."""
    return os.pathsep.join(str(path) for path in (*first, SRC, os.environ.get("PYTHONPATH")) if path)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m copytask ARGS` with this checkout's sources, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-m", "copytask", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def overrides(runs_dir: Path, *extra: str) -> list[str]:
    return [*TINY, *GRID, f"runs_dir={runs_dir}", *extra]


@pytest.fixture
def make_config(tmp_path):
    """compose(*overrides) -> the real config with runs_dir in a temporary folder."""

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose("config", overrides=[f"runs_dir={tmp_path / 'runs'}", *overrides])

    yield _compose
    GlobalHydra.instance().clear()


def built_kernels() -> ModuleType:
    """The compiled C++ kernels (copytask.kernels), for a test of their path. CI must build them, so there a
    machine that does not fails the test; elsewhere one without a C++ compiler skips it, saying so."""
    from copytask.kernels import ops

    built = ops.kernel()
    if built is None:
        if os.environ.get("CI"):
            pytest.fail("the fused CPU kernels did not build (see the warning above)")
        pytest.skip("the fused CPU kernels do not build on this machine")
    return built


@pytest.fixture
def kernel() -> ModuleType:
    """`built_kernels()`, for a test that needs the kernels whatever its parameters."""
    return built_kernels()


class Recording:
    """A kernels module's library (what its `_library()` returns), recording the name of each function called."""

    def __init__(self, library: Callable[[], ModuleType], calls: set[str]):
        self.library, self.calls = library, calls

    def __getattr__(self, name: str):
        self.calls.add(name)
        return getattr(self.library(), name)


def record_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the C++ kernels' functions called while `monkeypatch` holds: which path ran, since the
    kernels and torch's ops give the same numbers to float rounding. Each kernels module reads the library
    through its own `_library`."""
    from copytask.kernels import mamba_ops, ops, transformer_ops

    calls: set[str] = set()
    for module in (ops, transformer_ops, mamba_ops):
        monkeypatch.setattr(module, "_library", functools.partial(Recording, module._library, calls))
    return calls


@pytest.fixture
def kernel_calls(monkeypatch) -> set[str]:
    """The names of the C++ kernels' functions called during the test (`record_kernel_calls`)."""
    return record_kernel_calls(monkeypatch)


class TrainedRun(NamedTuple):
    folder: Path  # the run folder
    metrics: dict  # what `copytask.train` returned
    kernel_calls: frozenset[str]  # the C++ kernels' functions its training called (`record_kernel_calls`)


@pytest.fixture(scope="session")
def trained_once(tmp_path_factory) -> Callable[[list[str]], TrainedRun]:
    """train(overrides) -> the run of `copytask.compose(overrides)` in a runs_dir of its own, trained the first
    time a test process asks for it and read after: tests/test_computation.py and test_analysis_computation.py
    check the same tiny runs, the one what training computed and the other what an analysis of them computes.
    The runs are read, never changed."""
    import copytask

    runs: dict[tuple[str, ...], TrainedRun] = {}

    def train(overrides: list[str]) -> TrainedRun:
        key = tuple(overrides)
        if key not in runs:
            runs_dir = tmp_path_factory.mktemp("trained_once") / "runs"
            with pytest.MonkeyPatch.context() as monkeypatch:
                calls = record_kernel_calls(monkeypatch)
                metrics = copytask.train(copytask.compose([*overrides, f"runs_dir={runs_dir}"]))
            [folder] = [path for path in runs_dir.iterdir() if not path.name.startswith(".")]  # not .locks
            runs[key] = TrainedRun(folder, metrics, frozenset(calls))
        return runs[key]

    return train


@pytest.fixture(scope="session")
def swept(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The tiny grid swept once through the real CLI: (runs_dir, the finished process)."""
    runs_dir = tmp_path_factory.mktemp("swept") / "runs"
    return runs_dir, run_cli("sweep", *overrides(runs_dir))


@pytest.fixture
def runs_copy(swept, tmp_path) -> Path:
    """A private copy of the swept runs folder, for tests that damage or extend it."""
    copy = tmp_path / "runs"
    shutil.copytree(swept[0], copy)
    return copy


@pytest.fixture
def fails_at_length_4(monkeypatch):
    """A job's training that raises for task.length=4 and trains every other run."""
    from copytask.training import loop

    real_train = loop.train

    def train(cfg):
        if cfg.task.length == 4:
            raise RuntimeError("injected failure at length 4")
        return real_train(cfg)

    monkeypatch.setattr(loop, "train", train)  # what the job imports when it runs


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """srun and sbatch on PATH (doing nothing), as on a cluster's login node: SLURM commands are checked as there."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    for command in ("srun", "sbatch"):
        (bin_dir / command).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
