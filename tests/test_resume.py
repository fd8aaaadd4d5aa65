"""Resumable runs: a run killed (SIGKILL) between two evaluations continues from its checkpoint and
ends with exactly the numbers of the same run trained in one go; retrain=true, an unreadable
checkpoint and a changed config start from step 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch

from copytask import store
from copytask.console import CopytaskWarning
from copytask.training import checkpoints, loop
from copytask.training.loop import train

from .conftest import pythonpath, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

# Long enough for three evaluations and numbers above chance; no early stop, so every run trains its budget.
RUN = [
    "experiment=quick",
    "train.steps=60",
    "train.eval_every=20",
    "train.eval_size=32",
    "train.val_size=32",
    "train.batch_size=16",
    "train.threads=1",
    "train.progress=false",
    "train.patience=null",
]
# The numbers that must not change; `seconds` (wall time) and `resumed_from` are all that may.
SAME = [
    "token_acc",
    "seq_acc",
    "val_token_acc",
    "val_seq_acc",
    "ended_early",
    "final_loss",
    "steps",
    "params",
    "chance",
]

# `python -m copytask ARGS` that kills itself with SIGKILL right after writing its checkpoint at
# step KILL_AT: a kill between two evaluations, at a known step.
KILLED = """
import os, signal, sys
from copytask.training import checkpoints
from copytask import cli
save = checkpoints.save
def save_then_die(folder, cfg, progress, *args):
    save(folder, cfg, progress, *args)
    if progress["step"] >= int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
checkpoints.save = save_then_die
sys.exit(cli.main(sys.argv[1:]))
"""


def killed_at(step: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": pythonpath(), "KILL_AT": str(step)}
    return subprocess.run([sys.executable, "-c", KILLED, *args], capture_output=True, text=True, env=env, timeout=600)


def history(folder) -> pd.DataFrame:
    return pd.read_csv(folder / store.HISTORY).drop(columns="seconds")


@pytest.mark.parametrize(
    "model",
    [
        ["attention=luong_general"],
        ["model=transformer", "model.dropout=0.1"],
        ["model=mamba", "model.d_model=8"],
        # issue 82: sources drawn with their noise placement, targets shorter than them, the LTI SSM
        ["model=mamba_lti", "model.d_model=8", "task=selective_copy", "task.length=9", "task.copied=3"],
    ],
    ids=["gru", "transformer-dropout", "mamba", "mamba_lti-selective_copy"],
)
def test_a_run_killed_between_evaluations_resumes_to_the_uninterrupted_numbers(tmp_path, model):
    whole = run_cli("train", *RUN, *model, f"runs_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr
    args = ["train", *RUN, *model, f"runs_dir={tmp_path / 'cut'}"]

    cut = killed_at(20, *args)
    assert cut.returncode == -9, cut.stderr
    (folder,) = [path for path in (tmp_path / "cut").iterdir() if not path.name.startswith(".")]
    assert not store.is_complete(folder) and (folder / store.RESUME).is_file()

    again = run_cli(*args)  # the same command
    assert again.returncode == 0, again.stderr
    assert "resumed from step 20" in again.stdout
    (reference,) = [path for path in (tmp_path / "whole").iterdir() if not path.name.startswith(".")]
    assert folder.name == reference.name
    resumed, uninterrupted = store.read_json(folder / store.METRICS), store.read_json(reference / store.METRICS)
    assert {key: resumed[key] for key in SAME} == {key: uninterrupted[key] for key in SAME}
    assert resumed["resumed_from"] == 20 and uninterrupted["resumed_from"] == 0
    pd.testing.assert_frame_equal(history(folder), history(reference), check_exact=True)
    weights = [torch.load(f / store.CHECKPOINT, weights_only=True)["model"] for f in (folder, reference)]
    assert weights[0].keys() == weights[1].keys() and all(
        torch.equal(weights[0][key], weights[1][key]) for key in weights[0]
    )
    assert not (folder / store.RESUME).exists()  # a complete run keeps no checkpoint


def test_the_checkpoint_holds_what_the_run_stood_at(make_config, monkeypatch):
    saved = []
    monkeypatch.setattr(
        checkpoints,
        "save",
        lambda folder, cfg, progress, *args: saved.append(dict(progress, history=list(progress["history"]))),
    )
    cfg = make_config(*RUN)
    train(cfg)
    assert [state["step"] for state in saved] == [
        20,
        40,
    ]  # at each evaluation but the last: the run is complete after it
    assert [len(state["history"]) for state in saved] == [1, 2]


def interrupted(make_config, *extra: str, at: int = 40):
    """The run of RUN + extra, stopped (an exception) right after its checkpoint at step `at`."""
    cfg = make_config(*RUN, *extra)
    save = checkpoints.save

    def save_then_stop(folder, cfg, progress, *args):
        save(folder, cfg, progress, *args)
        if progress["step"] == at:
            raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoints, "save", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    folder = store.run_dir(cfg)
    assert (folder / store.RESUME).is_file() and not store.is_complete(folder)
    return cfg, folder


def test_the_early_stopping_count_on_the_validation_set_goes_on_after_a_stop(make_config):
    stopping = ["train.target_acc=0.0", "train.patience=2"]  # every evaluation is at the target: stops at step 40
    cfg, folder = interrupted(make_config, *stopping, at=20)  # one evaluation at the target so far
    metrics = train(cfg)
    assert metrics["resumed_from"] == 20 and metrics["steps"] == 40  # not 60: the count did not start again


def test_retrain_starts_an_interrupted_run_from_step_0(make_config):
    cfg, folder = interrupted(make_config)
    assert train(make_config(*RUN, "retrain=true"))["resumed_from"] == 0
    assert train(make_config(*RUN))["resumed_from"] == 0  # complete now: read, not trained


@pytest.mark.parametrize("damage", ["cut off", "not a checkpoint", "another run's"])
def test_an_unreadable_checkpoint_is_set_aside_with_a_warning_and_the_run_starts_over(make_config, tmp_path, damage):
    reference = train(make_config(*RUN, f"runs_dir={tmp_path / 'whole'}"))
    cfg, folder = interrupted(make_config)
    path = folder / store.RESUME
    if damage == "cut off":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "not a checkpoint":
        path.write_text("{}")
    else:  # a checkpoint of a run with another learning rate, copied in
        _, other = interrupted(make_config, "train.lr=1e-3")
        path.write_bytes((other / store.RESUME).read_bytes())

    with pytest.warns(
        CopytaskWarning,
        match=rf"^{folder.name}: its checkpoint {store.RESUME} is unreadable \(.*\); "
        rf"set aside as {store.UNREADABLE_RESUME}, training from step 0$",
    ):
        metrics = train(cfg)
    assert metrics["resumed_from"] == 0
    assert {key: metrics[key] for key in SAME} == {key: reference[key] for key in SAME}  # never wrong numbers
    assert (folder / store.UNREADABLE_RESUME).is_file()


def test_a_checkpoint_that_does_not_fit_the_model_is_set_aside_and_the_run_starts_over(make_config, tmp_path):
    reference = train(make_config(*RUN, f"runs_dir={tmp_path / 'whole'}"))
    cfg, folder = interrupted(make_config)
    state = torch.load(folder / store.RESUME, weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(3)  # readable, this run's, but of another shape
    torch.save(state, folder / store.RESUME)

    with pytest.warns(CopytaskWarning, match="unreadable .*training from step 0"):
        metrics = train(cfg)
    assert metrics["resumed_from"] == 0 and {key: metrics[key] for key in SAME} == {key: reference[key] for key in SAME}


def test_a_changed_config_is_another_run_and_never_reads_the_checkpoint(make_config, monkeypatch):
    cfg, folder = interrupted(make_config)
    changed = make_config(*RUN, "train.lr=1e-3")
    assert store.run_dir(changed) != folder
    assert train(changed)["resumed_from"] == 0
    assert (folder / store.RESUME).is_file()  # the other run's checkpoint is left alone


def test_a_failed_run_resumes_and_its_failure_record_goes(make_config, monkeypatch):
    cfg, folder = interrupted(make_config)
    store.write_json(folder / store.FAILED, {"error": "RuntimeError: the node went away", "traceback": None})
    metrics = train(cfg)
    assert metrics["resumed_from"] == 40 and not (folder / store.FAILED).exists()


def test_a_run_in_training_is_never_cleared_by_another_process(make_config):
    cfg, folder = interrupted(make_config)
    with store.lock_run(folder):  # another process trains it now
        with pytest.raises(loop.RunInProgress):
            train(cfg)
    assert (folder / store.RESUME).is_file()  # untouched
