"""The store's guarantees: durable atomic writes with the umask's permissions, unfinished runs
recognised as such, and one process per run (docs/reliability.md)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
from omegaconf import OmegaConf

from copytask import cli, store
from copytask.console import ConfigError, CopytaskWarning
from copytask.store.runs import GridRun, beside, beside_line
from copytask.training.loop import train

from .conftest import TINY, pythonpath, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)], ids=["022", "027", "002"])
def test_atomic_write_gives_the_permissions_the_umask_gives(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        store.atomic_write(tmp_path / "results.csv", "a,b\n1,2\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "results.csv").stat().st_mode) == mode


def test_atomic_write_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    data = b"x" * 10_000
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.fstat(fd).st_size))  # the whole content has reached the file
        fsync(fd)

    def recording_replace(source, target):
        events.append(("replace", os.stat(source).st_size))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    store.atomic_write(tmp_path / "checkpoint.pt", data)

    assert events == [("fsync", len(data)), ("replace", len(data))]
    assert (tmp_path / "checkpoint.pt").read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.parametrize("keep", [0, 40], ids=["empty", "truncated"])
def test_cut_short_metrics_is_unfinished_and_the_run_is_trained_again(make_config, keep):
    cfg = make_config(*TINY)
    first = train(cfg)
    folder = store.run_dir(cfg)
    metrics = folder / store.METRICS
    metrics.write_text(metrics.read_text()[:keep])  # what a crash before the data reached the disk leaves

    assert not store.is_complete(folder)
    assert GridRun((), "", cfg, folder).status() == "incomplete"  # the sweep's summary agrees
    again = train(cfg)  # trained again from scratch, to the same result
    assert {key: again[key] for key in ("run", "steps", "final_loss", "token_acc")} == {
        key: first[key] for key in ("run", "steps", "final_loss", "token_acc")
    }
    assert store.read_json(metrics) == again


# `python -m copytask train ...` that, once it has trained a few steps, hangs until killed: a run
# in training, holding its lock, for as long as the test needs.
HANGS_IN_TRAINING = """
import sys, time
import copytask.training.loop
copytask.training.loop.evaluate = lambda *args, **kwargs: time.sleep(600)
from copytask.cli import main
sys.exit(main(sys.argv[1:]))
"""


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_run_in_training_is_left_alone_and_a_killed_ones_lock_is_taken_over(make_config, tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    cfg = make_config(*TINY)  # the run both processes are asked for
    folder = store.run_dir(cfg)
    run = GridRun((), "", cfg, folder)
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    first = subprocess.Popen(
        [sys.executable, "-c", HANGS_IN_TRAINING, "train", *TINY, f"runs_dir={runs_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: (folder / store.CONFIG).is_file(), first)
        started = (folder / store.CONFIG).stat().st_ino
        assert run.status() == "running"

        second = run_cli("train", *TINY, f"runs_dir={runs_dir}")
        assert second.returncode == 0, second.stderr
        assert f"{folder.name}: being trained by another process" in second.stderr
        assert "greedy token acc" not in second.stdout  # it trained nothing ...
        assert (folder / store.CONFIG).stat().st_ino == started and first.poll() is None  # ... and deleted nothing

        # A sweep over a grid with that run: not a failure, not complete, and says so.
        with pytest.warns(CopytaskWarning) as warned:  # in this process: warnings, as the library gives them
            assert (
                cli.main(
                    ["sweep", *TINY, f"runs_dir={runs_dir}", "task.length=5,3", "attention=luong_general", "seed=0"]
                )
                == 0
            )
        out, err = capsys.readouterr()
        assert "sweep: 1/2 runs complete (1 trained now), 0 failed, 1 being trained by another process" in out
        assert "job failed" not in err
        messages = [str(warning.message) for warning in warned]
        [skipped] = [line for line in messages if "being trained by another process" in line and "skipped" in line]
        [summary] = [
            line for line in messages if "being trained by another process" in line and "not in these results" in line
        ]
        assert folder.name in skipped and "task.length=5" in summary
        assert store.read_json(runs_dir / "sweep.json")["training_elsewhere"] == 1
    finally:
        first.kill()  # SIGKILL: no clean-up runs, the OS drops the lock
        first.communicate()

    assert run.status() == "incomplete"  # the dead process's lock is not mistaken for a live one
    third = run_cli("train", *TINY, f"runs_dir={runs_dir}")
    assert third.returncode == 0, third.stderr
    assert f"{folder.name}: greedy token acc" in third.stdout and store.is_complete(folder)


# A run's identity: the computation, in one spelling.


def test_one_computation_is_one_run_however_it_is_spelled(make_config):
    name = store.run_name(make_config())
    assert store.run_name(make_config("train.clip=1")) == name  # the default is 1.0
    assert store.run_name(make_config("train.lr=0.006")) == name  # 6.0e-3
    assert store.run_name(make_config("attention.heads=1")) == name  # the default, given explicitly
    assert store.run_name(make_config("attention=none", "attention.heads=1")) == store.run_name(
        make_config("attention=none")
    )
    assert store.run_name(make_config("attention.window=4")) == name  # used only with attention.local
    assert store.run_name(make_config("task.min_length=3")) == name  # used only with task.variable_length
    assert store.run_name(make_config("train.schedule=constant", "train.warmup=0.1")) == store.run_name(
        make_config("train.schedule=constant")
    )
    # what is saved, where and how fast: not what is computed
    for extra in (
        "train.attention_samples=0",
        "train.threads=1",
        "train.progress=false",
        "train.fused=false",
        "runs_dir=elsewhere",
    ):
        assert store.run_name(make_config(extra)).split("-")[-1] == name.split("-")[-1], extra


def test_what_changes_the_computation_changes_the_run(make_config):
    names = {
        store.run_name(make_config(*extra))
        for extra in (
            [],
            ["train.clip=2"],
            ["attention.heads=2"],
            ["task.variable_length=true"],
            ["task.variable_length=true", "task.min_length=3"],
            ["train.warmup=0.1"],
            ["train.eval_seed=1"],
        )
    }
    assert len(names) == 7


def test_a_key_added_at_its_neutral_value_renames_no_existing_run(make_config, monkeypatch):
    """A later version adds a key whose default is what the code computed before: the runs made
    before it keep their names."""

    def with_label_smoothing(value: float):
        cfg = OmegaConf.create(OmegaConf.to_container(make_config()))  # untyped, as a later schema's would be
        cfg.train.label_smoothing = value
        return cfg

    before = store.run_name(make_config())
    monkeypatch.setitem(store.NEUTRAL, "train.label_smoothing", 0.0)
    assert store.run_name(with_label_smoothing(0.0)) == before
    assert store.run_name(with_label_smoothing(0.1)) != before


def test_a_runs_config_reads_as_omegaconf_load_reads_it(swept, tmp_path):
    runs_dir, _ = swept
    folders = store.complete_runs(runs_dir)
    assert folders and all(store.read_config(f) == OmegaConf.load(f / store.CONFIG) for f in folders)
    # what a config.yaml edited by hand may hold: OmegaConf's floats without a dot, dates kept as strings
    text = "a: 1e-3\nb: '1e-3'\nc: 2001-12-14\nd: yes\ne: null\nf: .5\ng: 1_000\nh: [1, 2.0, x]\nk: 1.0e-05\n"
    (tmp_path / store.CONFIG).write_text(text)
    read, loaded = store.read_config(tmp_path), OmegaConf.load(tmp_path / store.CONFIG)
    assert read == loaded and [type(v) for v in read.values()] == [type(v) for v in loaded.values()]


def test_a_config_edited_by_hand_reads_as_omegaconf_resolves_it_or_is_refused_in_one_line_naming_it(tmp_path):
    path = tmp_path / store.CONFIG
    path.write_text("train:\n  eval_size: 16\n  val_size: ${train.eval_size}\n  note: x${train.eval_size}\\${y}\n")
    assert store.read_resolved(tmp_path) == OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    assert store.read_resolved(tmp_path)["train"] == {"eval_size": 16, "val_size": 16, "note": "x16${y}"}
    for text, says in [
        ("train:\n  val_size: 16\n  val_size: 7\n", "found duplicate key val_size (line 3, column 3)"),
        ("train:\n  val_size: ${train.val_size}\n", "train.val_size: Recursive interpolation detected"),
        ("- 16\n", "it holds no mapping"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as refused:
            store.read_resolved(tmp_path)
        assert str(refused.value) == f"unreadable {path}: {says}"


def test_the_runs_beside_a_grid_are_named_a_few_then_counted_in_one_line(tmp_path):
    """Complete runs in runs_dir that a grid leaves out: a dot folder (a retraining's staging folder) and a folder
    without results are none of them, and a hundred of them are a line, not a page (issue 88, part 5)."""
    for name in ("grid-run", "b-run", "c-run", "d-run", "e-run", "f-run", ".grid-run.new"):
        store.write_json(tmp_path / name / store.METRICS, {"run": name.strip(".")})
    (tmp_path / "g-run").mkdir()  # killed before it wrote results
    grid = [GridRun((), "", None, tmp_path / "grid-run")]

    names = beside(grid, tmp_path)

    assert names == ["b-run", "c-run", "d-run", "e-run", "f-run"]
    assert beside_line(names, tmp_path, "grid", "compare --all") == (
        f"note: 5 complete runs in {tmp_path} are not of this grid: b-run, c-run and 3 more; "
        "compare --all includes them"
    )
    assert beside_line(names[:1], tmp_path, "search", "all_runs=True") == (
        f"note: 1 complete run in {tmp_path} is not of this search: b-run; all_runs=True includes it"
    )
    assert beside_line([], tmp_path, "grid", "compare --all") is None
