"""Fault injection: a real sweep killed with SIGKILL mid-run, then run again (docs/reliability.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pandas as pd
import pytest

from copytask import store
from copytask.sweeps.grid import compose_grid

from .conftest import TINY, pythonpath, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

# Four runs of about a second each, one after another (the basic launcher): long enough to be
# caught in the middle of one.
SWEEP = [
    *(o for o in TINY if not o.startswith("train.steps=")),
    "train.steps=100",
    "train.patience=null",  # no early stop: every run trains its 100 steps
    "attention=none",
    "task.length=3",
    "seed=0,1,2,3",
]


def test_a_sweep_killed_mid_run_resumes_without_retraining_or_duplicating(tmp_path):
    runs_dir = tmp_path / "runs"
    args = [*SWEEP, f"runs_dir={runs_dir}"]
    _, grid = compose_grid(args)
    with open(tmp_path / "stderr.txt", "w+") as stderr:
        sweep = subprocess.Popen(
            [sys.executable, "-m", "copytask", "sweep", *args],
            env={**os.environ, "PYTHONPATH": pythonpath()},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        try:
            deadline = time.monotonic() + 300
            while True:  # until two runs are finished and a third is being trained
                complete = [run for run in grid if store.is_complete(run.folder)]
                if len(complete) >= 2 and any(run.folder.is_dir() for run in grid if run not in complete):
                    break
                if sweep.poll() is not None:
                    stderr.seek(0)
                    pytest.fail(f"the sweep ended before it was killed: {stderr.read()}")
                assert time.monotonic() < deadline, "timed out"
                time.sleep(0.02)
        finally:
            sweep.kill()  # SIGKILL
            sweep.wait()
    finished = {run.folder: (run.folder / store.METRICS).read_bytes() for run in grid if store.is_complete(run.folder)}
    interrupted = [run.folder for run in grid if run.folder.is_dir() and run.folder not in finished]
    assert len(finished) >= 2 and interrupted

    again = run_cli("sweep", *args)  # the same command

    assert again.returncode == 0, again.stderr
    for folder, metrics in finished.items():  # not retrained: the same bytes, and said so
        assert (folder / store.METRICS).read_bytes() == metrics
        assert f"{folder.name}: already complete, skipped" in again.stdout
    trained = [line.split(":")[0] for line in again.stdout.splitlines() if "greedy token acc" in line]
    assert sorted(trained) == sorted(run.folder.name for run in grid if run.folder not in finished)
    assert set(folder.name for folder in interrupted) <= set(trained)
    table = pd.read_csv(runs_dir / "results.csv")
    assert sorted(table["run"]) == sorted(run.folder.name for run in grid)  # one row per run, none twice
    assert table[["token_acc", "seq_acc", "params"]].notna().all().all() and (table["steps"] == 100).all()
