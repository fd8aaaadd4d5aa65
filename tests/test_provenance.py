"""Issue 70: a run records what made it (copytask version, commit, torch, Python, `computation`), a
complete run computed by other code is trained again (saying so, in one line), and a table of runs
made by different code says so."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import copytask
from copytask import store
from copytask.store import provenance, replacement
from copytask.store.provenance import COMPUTATION, checkout_state, mixed_line
from copytask.sweeps.grid import compose_grid
from copytask.training import checkpoints, loop
from copytask.training.loop import train

from .conftest import TINY, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)


def record_computation(folder: Path, computation: int | None) -> None:
    """Make the complete run in `folder` look computed by other code: another `computation`, or none
    (a run from before copytask recorded it)."""
    metrics = store.read_json(folder / store.METRICS)
    if computation is None:
        for key in (*provenance.PROVENANCE_KEYS, *provenance.RECORDED_KEYS):
            del metrics[key]
    else:
        metrics["computation"] = computation
    store.write_json(folder / store.METRICS, metrics)


def test_a_run_records_what_made_it_and_its_name_does_not_change(make_config):
    cfg = make_config(*TINY)
    metrics = train(cfg)
    assert metrics["computation"] == COMPUTATION
    assert metrics["copytask_version"] == importlib.metadata.version("copytask")
    assert metrics["torch_version"] == torch.__version__
    assert metrics["torch_build"] == (f"cuda {torch.version.cuda}" if torch.version.cuda else "cpu")
    assert metrics["python_version"] == platform.python_version()
    assert (metrics["commit"], metrics["uncommitted_changes"]) == checkout_state(provenance.PACKAGE_DIR)
    assert store.read_json(store.run_dir(cfg) / store.METRICS) == metrics
    assert metrics["run"] == store.run_name(cfg)  # provenance is recorded, not part of the name


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A git repository whose src/copytask is committed: copytask run from a checkout."""
    package = tmp_path / "repo" / "src" / "copytask"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    repo = tmp_path / "repo"
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return repo


def test_the_commit_and_uncommitted_changes_of_a_checkout_and_none_elsewhere(checkout, monkeypatch):
    package = checkout / "src" / "copytask"
    assert checkout_state(package) == (git(checkout, "rev-parse", "HEAD"), False)
    (checkout / "notes.txt").write_text("untracked: not part of the code")
    assert checkout_state(package)[1] is False
    (package / "__init__.py").write_text("x = 1\n")
    assert checkout_state(package)[1] is True
    # an installed copy inside someone's repository (a virtual environment in a project) is no checkout of copytask
    installed = checkout / ".venv" / "site-packages" / "copytask"
    installed.mkdir(parents=True)
    assert checkout_state(installed) == (None, None)
    assert checkout_state(checkout.parent) == (None, None)  # not in a repository
    commit = git(checkout, "rev-parse", "HEAD")
    monkeypatch.setenv("GIT_DIR", str(checkout.parent / "elsewhere" / ".git"))  # the caller's git variables
    monkeypatch.setenv("GIT_WORK_TREE", str(checkout.parent / "elsewhere"))  # point at another repository
    assert checkout_state(package) == (commit, True)
    monkeypatch.setenv("PATH", "")  # no git at all
    assert checkout_state(package) == (None, None)


@pytest.mark.parametrize("recorded", [0, None], ids=["another_computation", "none_recorded"])
def test_a_run_computed_by_other_code_is_trained_again_beside_its_old_results(make_config, monkeypatch, recorded):
    cfg = make_config(*TINY)
    first = train(cfg)
    folder = store.run_dir(cfg)
    record_computation(folder, recorded)
    old = (folder / store.METRICS).read_text()
    train_locked = loop._train_locked

    def while_it_trains(cfg, into, *rest):
        assert into == replacement.staging(folder)  # training beside the old results, which stay where they were
        assert (folder / store.METRICS).read_text() == old
        return train_locked(cfg, into, *rest)

    monkeypatch.setattr(loop, "_train_locked", while_it_trains)
    again = train(cfg)
    assert again["computation"] == COMPUTATION and again["token_acc"] == first["token_acc"]
    assert store.read_json(folder / store.METRICS) == again
    assert not replacement.staging(folder).exists() and not replacement.set_aside(folder).exists()


def test_train_says_in_one_line_why_it_trains_a_complete_run_again(make_config):
    cfg = make_config(*TINY)
    train(cfg)
    record_computation(store.run_dir(cfg), 0)
    done = run_cli("train", *TINY, f"runs_dir={cfg.runs_dir}")
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if "computed by other code" in line]
    assert line.endswith(
        f"{store.run_name(cfg)}: computed by other code (1 run records computation 0; this code's is "
        f"{COMPUTATION}): trained again, old results kept until the new ones are complete"
    )
    assert store.read_json(store.run_dir(cfg) / store.METRICS)["computation"] == COMPUTATION


def test_a_sweep_trains_runs_computed_by_other_code_again_and_says_how_many_and_why(runs_copy, caplog):
    grid = [*TINY, "attention=none,luong_general", "task.length=3", "seed=0,1"]  # four of the swept runs
    folders = [store.run_dir(run.config) for run in compose_grid([*grid, f"runs_dir={runs_copy}"])[1]]
    assert all(map(store.is_complete, folders))
    record_computation(folders[0], 0)
    record_computation(folders[1], None)
    kept = [(folder / store.METRICS).stat().st_mtime_ns for folder in folders[2:]]
    with caplog.at_level("INFO", logger="copytask"):
        table = copytask.sweep(grid, runs_dir=runs_copy)
    lines = [record.getMessage() for record in caplog.records if "computed by other code" in record.getMessage()]
    assert lines == [
        "sweep: 2 complete runs: computed by other code (1 run records computation 0, 1 run records no "
        f"computation (made before copytask recorded it); this code's is {COMPUTATION}): trained again, old "
        "results kept until the new ones are complete"
    ]
    assert (table["computation"] == COMPUTATION).all() and len(table) == 4
    assert [(folder / store.METRICS).stat().st_mtime_ns for folder in folders[2:]] == kept  # this code's: reused


def test_a_checkpoint_of_other_code_is_set_aside_not_resumed(make_config, monkeypatch):
    cfg = make_config(*TINY)
    folder = store.run_dir(cfg)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    progress = {"step": 5, "history": [], "hits": 0, "seconds": 1.0}
    checkpoints.save(folder, cfg, progress, model, optimizer, schedule, torch.Generator(), torch.device("cpu"))
    monkeypatch.setattr(checkpoints, "COMPUTATION", COMPUTATION + 1)
    with pytest.warns(UserWarning, match=f"computed by other code \\(computation {COMPUTATION}, not"):
        assert checkpoints.load(folder, cfg) is None
    assert (folder / store.UNREADABLE_RESUME).is_file()


def test_the_mixed_line_names_the_runs_made_by_each_code():
    same = {"computation": 1, "copytask_version": "0.1", "commit": "abc", "torch_version": "2.13"}
    assert mixed_line({"a": same, "b": dict(same)}) is None
    runs = {"a": same, "b": same | {"torch_version": "2.9"}, "c": {"run": "c"}, "d": same}
    assert mixed_line(runs) == (
        "note: these runs were made by different code (computation 1, copytask_version 0.1, commit abc, "
        "torch_version 2.13: a, d; computation 1, copytask_version 0.1, commit abc, torch_version 2.9: b; "
        "computation none, copytask_version none, commit none, torch_version none: c)"
    )


def test_the_mixed_line_stays_short_for_a_large_table():
    same = {"computation": 1, "commit": "abc"}
    runs = {f"run{i:02d}": same for i in range(40)} | {"other": same | {"commit": "def"}}
    line = mixed_line(runs)
    assert "commit abc: run00, run01 and 38 more" in line and "commit def: other" in line and len(line) < 120


def test_a_table_of_runs_made_by_different_code_says_so_naming_them(swept, tmp_path, recwarn):
    """compare and report (a line under the table, and in report.md) and the library's results and
    compare (a CopytaskWarning) name the runs made by each code; a table of one code says nothing."""
    for folder in sorted(store.complete_runs(swept[0]))[:3]:  # three of the swept runs, no sweep record
        shutil.copytree(folder, tmp_path / folder.name)
    copytask.results(tmp_path)
    assert not [w for w in recwarn if issubclass(w.category, copytask.CopytaskWarning)]
    first, second, third = sorted(folder.name for folder in tmp_path.iterdir() if store.is_complete(folder))
    record_computation(tmp_path / first, 0)
    record_computation(tmp_path / second, None)
    made_by = [(0, first), (None, second), (COMPUTATION, third)]

    def names_each_code(line: str) -> bool:
        return line.startswith("note: these runs were made by different code (") and all(
            re.search(rf"(\(|; )computation {'none' if value is None else value}, [^;]*: {run}[;)]", line)
            for value, run in made_by
        )

    for read in (copytask.results, copytask.compare):
        with pytest.warns(copytask.CopytaskWarning) as said:
            read(tmp_path)
        assert [names_each_code(str(w.message)) for w in said if "different code" in str(w.message)] == [True]
    compared = run_cli("compare", f"runs_dir={tmp_path}")
    assert compared.returncode == 0, compared.stderr
    assert names_each_code(compared.stdout.splitlines()[-1])  # under the table
    reported = run_cli("report", f"runs_dir={tmp_path}")
    assert reported.returncode == 0, reported.stderr
    assert sum(map(names_each_code, reported.stdout.splitlines())) == 1
    markdown = (tmp_path / "report" / "report.md").read_text().splitlines()
    (at,) = [i for i, text in enumerate(markdown) if names_each_code(text)]
    assert markdown[at - 1] == "" and markdown[at - 2].startswith("|")  # under the comparison table
