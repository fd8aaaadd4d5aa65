"""A retraining never hides the results it replaces (store.replacement): whatever stops it, kill -9
included, the old results stay where every reader (compare, results, a run's status) finds them
until the new ones are complete; the next run finishes what was begun (resumes the retraining from
its checkpoint, or finishes its swap) and leaves nothing behind; a failed retraining in a sweep makes
no complete results look failed, and the sweep still reports it."""

from __future__ import annotations

import json
import shutil
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import DictConfig

import copytask
from copytask import api, store
from copytask.store import replacement
from copytask.training import checkpoints, loop
from copytask.training.loop import train

from .conftest import TINY
from .test_resume import SAME, killed_at

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

# Ten steps with one checkpoint (at step 5, the evaluation before the last): the least a resumed retraining needs.
# The grid's keys pinned, so that a sweep of these overrides is this one run.
RUN = [*TINY, "train.patience=null", "attention=none", "task.length=3", "seed=0"]
LEAST_ANALYSIS = ["analysis.eval_size=16", "analysis.beam_widths=[]", "analysis.probe_size=null"]  # a sweep's end


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A runs_dir holding the complete run of RUN, trained once for the module: what a retraining replaces."""
    runs_dir = tmp_path_factory.mktemp("trained") / "runs"
    train(copytask.compose([*RUN, f"runs_dir={runs_dir}"]))
    return runs_dir


@pytest.fixture
def old(trained, tmp_path, make_config) -> tuple[Callable[..., DictConfig], Path, bytes]:
    """A private copy of the trained run: (its config with more overrides, its folder, its metrics.json's bytes)."""
    shutil.copytree(trained, tmp_path / "runs")  # make_config's runs_dir
    folder = store.run_dir(make_config(*RUN))
    return lambda *extra: make_config(*RUN, *extra), folder, (folder / store.METRICS).read_bytes()


def read_by_everyone(folder: Path) -> bytes:
    """The metrics.json every reader gets of the run in `folder`, checked to agree: the file, the
    run's status, and the runs that the library's results and compare load (the command line's too)."""
    selection = api.select(folder.parent)
    (run,) = selection.runs
    assert run.folder == folder and run.status() == "complete"
    loaded = api.load(selection)
    metrics = store.read_json(folder / store.METRICS)
    assert loaded.table["run"].tolist() == [folder.name]
    assert loaded.table["train_seconds"].tolist() == [metrics["train_seconds"]]
    assert len(api.comparison(selection, loaded)) == 1
    return (folder / store.METRICS).read_bytes()


def left_behind(folder: Path) -> list[str]:
    """What a replacement may leave: the run's dot folders beside it and files in it that a run trained
    in one go has not."""
    hidden = [path.name for path in folder.parent.iterdir() if path.name.startswith(f".{folder.name}")]
    whole = {store.CONFIG, store.HISTORY, store.CHECKPOINT, store.ATTENTION, store.METRICS}
    return sorted(hidden + [path.name for path in folder.iterdir() if path.name not in whole])


def same_numbers(new: dict, old: bytes) -> bool:
    """Whether `new` has the numbers of the metrics.json whose bytes are `old` (the same computation)."""
    return {key: new[key] for key in SAME} == {key: json.loads(old)[key] for key in SAME}


class Killed(BaseException):
    """A kill, as far as the files show: nothing after it runs (a BaseException: no `except Exception` stops it)."""


def stop(*args, **kwargs):
    raise Killed


def untrained(*args, **kwargs):
    raise AssertionError("trained again")


def test_a_retraining_killed_by_sigkill_keeps_the_old_results_for_every_reader_and_the_rerun_completes_it(old):
    compose, folder, old_metrics = old
    uninterrupted = pd.read_csv(folder / store.HISTORY).drop(columns="seconds")
    weights = torch.load(folder / store.CHECKPOINT, weights_only=True)["model"]

    # SIGKILL, by the process itself right after its checkpoint at step 5
    cut = killed_at(5, "train", *RUN, f"runs_dir={folder.parent}", "retrain=true")
    assert cut.returncode == -9, cut.stderr
    assert read_by_everyone(folder) == old_metrics  # not "nothing to compare": the old results, whole
    assert (replacement.staging(folder) / store.RESUME).is_file()  # the retraining's checkpoint, beside them

    again = train(compose("retrain=true"))  # the same command
    assert again["resumed_from"] == 5 and same_numbers(again, old_metrics)  # resumed, to the numbers of one go
    pd.testing.assert_frame_equal(pd.read_csv(folder / store.HISTORY).drop(columns="seconds"), uninterrupted)
    resumed = torch.load(folder / store.CHECKPOINT, weights_only=True)["model"]
    assert all(torch.equal(resumed[key], weights[key]) for key in weights)
    assert read_by_everyone(folder) != old_metrics and store.read_json(folder / store.METRICS) == again
    assert left_behind(folder) == []


def test_exchange_trades_two_folders_in_one_step_where_the_system_can(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        (folder / "name").write_text(folder.name)
    swapped = replacement.exchange(first, second)
    names = [(folder / "name").read_text() for folder in (first, second)]
    assert names == (["second", "first"] if swapped else ["first", "second"])  # or nothing changed
    if sys.platform.startswith("linux"):  # glibc's renameat2 on a local file system: the one-step path
        assert swapped, f"{tmp_path} cannot exchange two folders in one step (RENAME_EXCHANGE)"
        with pytest.raises(FileNotFoundError):
            replacement.exchange(first, tmp_path / "none")


def kill_before_the_mark(monkeypatch, folder):
    monkeypatch.setattr(replacement, "mark", stop)


def kill_at_the_checkpoint(monkeypatch, folder):
    save = checkpoints.save

    def save_then_stop(*args):
        save(*args)
        stop()

    monkeypatch.setattr(checkpoints, "save", save_then_stop)


def kill_before_the_swap(monkeypatch, folder):
    monkeypatch.setattr(replacement, "exchange", stop)


def kill_deleting_the_old(monkeypatch, folder):
    """Killed with the old results half deleted (their metrics.json gone, the rest not)."""

    def half(path):
        (path / store.METRICS).unlink()
        stop()

    monkeypatch.setattr(replacement, "shutil", types.SimpleNamespace(rmtree=half))


def kill_after_deleting_the_old(monkeypatch, folder):
    def whole(path):
        shutil.rmtree(path)
        stop()

    monkeypatch.setattr(replacement, "shutil", types.SimpleNamespace(rmtree=whole))


def two_renames(monkeypatch):
    """A file system that cannot swap two directories in one step."""
    monkeypatch.setattr(replacement, "exchange", lambda first, second: False)


def kill_between_the_renames(monkeypatch, folder):
    two_renames(monkeypatch)
    rename = Path.rename

    def rename_unless_swapping_in(path, target):
        if path == replacement.staging(folder):
            stop()
        return rename(path, target)

    monkeypatch.setattr(Path, "rename", rename_unless_swapping_in)


def kill_after_the_renames(monkeypatch, folder):
    two_renames(monkeypatch)
    kill_deleting_the_old(monkeypatch, folder)


# kill -> (what every reader finds while it is killed: the old results, the new, or none; what the next run is
# asked: the same command, or a plain train; the step its training resumes from, None: it trains nothing)
KILLS = {
    kill_before_the_mark: ("old", "retrain=true", 0),  # a staging folder without its mark, deleted
    kill_at_the_checkpoint: ("old", "retrain=false", 5),  # a stopped retraining goes on, asked again or not
    kill_before_the_swap: ("old", "retrain=true", None),  # complete, not trained again: only swapped in
    kill_deleting_the_old: ("new", "retrain=false", None),
    kill_after_deleting_the_old: ("new", "retrain=false", None),  # only the mark is left
    kill_between_the_renames: ("none", "retrain=false", None),  # the swap finished
    kill_after_the_renames: ("new", "retrain=false", None),
}


@pytest.mark.parametrize("kill", KILLS, ids=[kill.__name__ for kill in KILLS])
def test_a_retraining_stopped_at_any_step_keeps_results_readable_and_the_next_run_finishes_it(old, monkeypatch, kill):
    compose, folder, old_metrics = old
    finds, asked, resumes_from = KILLS[kill]
    with monkeypatch.context() as patch:
        kill(patch, folder)
        with pytest.raises(Killed):
            train(compose("retrain=true"))
    if finds == "none":  # only where two renames swap: between them no run folder, until the next run
        assert not folder.exists() and store.complete_runs(folder.parent) == []
    else:
        assert (read_by_everyone(folder) == old_metrics) == (finds == "old")
    completed = folder if finds == "new" else replacement.staging(folder)  # where the new results are, if complete
    new_metrics = (completed / store.METRICS).read_bytes() if store.is_complete(completed) else None

    if resumes_from is None:
        monkeypatch.setattr(loop, "_train_locked", untrained)
    again = train(compose(asked))
    assert same_numbers(again, old_metrics) and read_by_everyone(folder) != old_metrics  # the retraining's results
    if resumes_from is None:
        assert (folder / store.METRICS).read_bytes() == new_metrics  # those the killed process completed
    else:
        assert again["resumed_from"] == resumes_from
    assert left_behind(folder) == []


def test_a_retraining_killed_under_the_copytask_before_this_gets_its_old_results_back_and_goes_on(old, monkeypatch):
    """What copytask did before: the old results set aside as .<run>.replaced, the retraining in the run
    folder; killed, no reader found any results. The next run puts them back while it resumes."""
    compose, folder, old_metrics = old
    folder.rename(folder.parent / "kept")
    with monkeypatch.context() as patch:
        kill_at_the_checkpoint(patch, folder)
        with pytest.raises(Killed):
            train(compose())
    (folder.parent / "kept").rename(replacement.set_aside(folder))
    assert sorted(path.name for path in folder.iterdir()) == [store.CONFIG, store.PROGRESS, store.RESUME]
    train_locked = loop._train_locked

    def while_it_trains(cfg, into, *rest):
        assert into == replacement.staging(folder) and read_by_everyone(folder) == old_metrics
        return train_locked(cfg, into, *rest)

    monkeypatch.setattr(loop, "_train_locked", while_it_trains)
    again = train(compose())
    assert again["resumed_from"] == 5 and same_numbers(again, old_metrics) and left_behind(folder) == []


def test_a_failure_record_beside_complete_results_from_the_copytask_before_this_goes(old):
    compose, folder, old_metrics = old
    store.write_json(folder / store.FAILED, {"error": "RuntimeError: a retraining failed", "traceback": None})
    assert train(compose()) == json.loads(old_metrics)  # read, not trained again
    assert left_behind(folder) == []


def test_a_failed_retraining_in_a_sweep_leaves_complete_results_unfailed_and_is_reported(old, monkeypatch, caplog):
    compose, folder, old_metrics = old

    def fail(cfg, into, *rest):
        assert into == replacement.staging(folder)
        raise RuntimeError("injected failure of the retraining")

    monkeypatch.setattr(loop, "_train_locked", fail)
    with (
        caplog.at_level("INFO", logger="copytask"),
        pytest.raises(copytask.SweepError, match=rf"^1 of 1 runs failed: {folder.name}$") as failed,
    ):
        copytask.sweep([*RUN, "retrain=true", *LEAST_ANALYSIS], runs_dir=folder.parent)
    said = [record.getMessage() for record in caplog.records]
    assert [line for line in said if line.startswith("sweep: ")][-1].startswith(
        "sweep: 1/1 runs complete (0 trained now), 1 failed;"
    )
    why = f"({folder}): RuntimeError: injected failure of the retraining; its results from before are kept"
    assert [line for line in said if line.endswith(why)]  # the summary's error line
    assert store.read_json(folder.parent / "sweep.json")["failed"] == 1
    assert not (folder / store.FAILED).exists() and (replacement.staging(folder) / store.FAILED).is_file()
    monkeypatch.undo()
    assert failed.value.table["run"].tolist() == [folder.name] and read_by_everyone(folder) == old_metrics

    again = train(compose())  # the failed retraining goes on, and its failure record goes
    (run,) = api.select(folder.parent).runs
    assert same_numbers(again, old_metrics) and left_behind(folder) == [] and run.job_failure() is None
