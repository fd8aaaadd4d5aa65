"""Hydra's optimising sweepers (Optuna) drive copytask: the job returns its objective, trials are
ordinary run folders, and a search resumes, compares and reports like a grid."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

import copytask
from copytask import api, cli, store
from copytask.config.schema import config_dir
from copytask.console import ConfigError
from copytask.sweeps.grid import compose_grid
from copytask.sweeps.jobs import hydra_job

from .conftest import OPTUNA, TINY, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)


def test_a_complete_run_skipped_by_a_job_still_returns_its_objective(tmp_path):
    overrides = [*TINY, f"runs_dir={tmp_path}", "attention=none", "task.length=3"]
    metrics = api.train(overrides)
    folder = tmp_path / metrics["run"]
    written = (folder / store.METRICS).stat().st_mtime_ns
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, "hydra.mode=MULTIRUN"], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]  # as Hydra does before it calls the task function
        objective = hydra_job(cfg)
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
    assert objective == metrics["val_token_acc"]  # the validation set's, never the test set's
    assert (folder / store.METRICS).stat().st_mtime_ns == written  # skipped, not trained again


# A search at the tiny budget: the preset with the tiny run settings (a fixed value beats a searched
# one, so TINY fixes the batch and hidden sizes) and a handful of trials.
def search(runs_dir: Path, trials: int, *extra: str) -> list[str]:
    return [
        "hparams_search=baseline",
        *TINY,
        "task.length=3",
        f"hydra.sweeper.n_trials={trials}",
        f"runs_dir={runs_dir}",
        *extra,
    ]


def objectives_and_metrics(runs_dir: Path) -> list[tuple[float, float]]:
    """(the objective each trial returned, its run's validation greedy token accuracy) from the sweep record."""
    trials = store.read_json(runs_dir / "sweep.json")["trials"]
    return [
        (trial["objective"], store.read_json(runs_dir / trial["run"] / store.METRICS)["val_token_acc"])
        for trial in trials
    ]


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A 3-trial Optuna search through the real CLI, with the preset's parallel launcher."""
    runs_dir = tmp_path_factory.mktemp("searched") / "runs"
    return runs_dir, run_cli("sweep", *search(runs_dir, 3))


@OPTUNA
def test_a_search_runs_its_trials_as_run_folders_and_reports_them(searched):
    runs_dir, process = searched
    assert process.returncode == 0, process.stderr
    trials = store.read_json(runs_dir / "sweep.json")["trials"]
    assert [trial["trial"] for trial in trials] == [0, 1, 2]
    assert all(store.is_complete(runs_dir / trial["run"]) for trial in trials)
    table = pd.read_csv(runs_dir / "trials.csv")
    assert list(table["trial"]) == [0, 1, 2]
    assert list(table["best_so_far"]) == list(table["objective"].cummax())
    assert {"train.lr", "train.warmup", "train.clip"} <= set(table.columns)  # searched; TINY fixed the sizes
    assert "model.hidden_size" not in table.columns and "train.batch_size" not in table.columns
    out = runs_dir / "report"
    for name in ("report.md", "search_objective_by_trial.png", "search_objective_by_key.png"):
        assert (out / name).is_file(), name
    assert "| trial | val token acc % | test token acc % |" in (out / "report.md").read_text()
    assert "3/3 runs complete (3 trained now), 0 failed" in process.stdout


@OPTUNA
def test_the_objective_each_trial_returned_is_its_runs_metric(searched):
    runs_dir, _ = searched
    pairs = objectives_and_metrics(runs_dir)
    assert len(pairs) == 3 and all(objective == metric for objective, metric in pairs)
    # what Optuna's sweeper itself got back: its best value is the best run's accuracy
    best = OmegaConf.load(runs_dir / ".sweep" / "optimization_results.yaml")
    assert best.best_value == max(metric for _, metric in pairs)


@OPTUNA
def test_compare_and_report_show_the_searchs_best_trials(searched, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(searched[0], runs_dir)
    process = run_cli("compare", f"runs_dir={runs_dir}")
    assert process.returncode == 0, process.stderr
    assert "the 3 trials (3 runs) of the last search in" in process.stdout
    header = next(line for line in process.stdout.splitlines() if line.lstrip().startswith("trial"))
    assert header.split()[:7] == ["trial", "val", "token", "acc", "%", "test", "token"] and "train.lr" in header
    ranked = copytask.compare(runs_dir)  # the same through the API: every trial, best first
    assert list(ranked["objective"]) == sorted(ranked["objective"], reverse=True)
    (runs_dir / "report" / "report.md").unlink()
    assert run_cli("report", f"runs_dir={runs_dir}").returncode == 0
    assert (runs_dir / "report" / "report.md").is_file()


@OPTUNA
def test_an_interrupted_search_resumes_without_training_a_finished_trial_again(searched, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(searched[0], runs_dir)
    first = store.read_json(runs_dir / "sweep.json")["trials"]
    shutil.rmtree(runs_dir / first[2]["run"])  # trial 2 was cut off before its results were written
    finished = {trial["run"]: (runs_dir / trial["run"] / store.METRICS).read_text() for trial in first[:2]}

    process = run_cli("sweep", *search(runs_dir, 4, "hydra/launcher=basic"))  # the same search, one trial longer

    assert process.returncode == 0, process.stderr
    trials = store.read_json(runs_dir / "sweep.json")["trials"]
    assert [trial["run"] for trial in trials[:3]] == [trial["run"] for trial in first]  # the same proposals, replayed
    assert process.stdout.count("already complete, skipped") == 2
    trained = [
        line.split(":")[0]
        for line in process.stdout.splitlines()
        if line.startswith("none-") and "greedy token acc" in line
    ]
    assert trained == [trials[2]["run"], trials[3]["run"]]
    assert all((runs_dir / run / store.METRICS).read_text() == text for run, text in finished.items())
    assert all(objective == metric for objective, metric in objectives_and_metrics(runs_dir))  # skipped trials too
    assert "4/4 runs complete (2 trained now)" in process.stdout


@OPTUNA
def test_a_search_run_again_keeps_the_record_of_the_search_that_trained_its_runs(searched, tmp_path):
    runs_dir = tmp_path / "runs"
    shutil.copytree(searched[0], runs_dir)
    first = store.read_json(runs_dir / "sweep.json")

    process = run_cli("sweep", *search(runs_dir, 3))  # the same proposals, replayed: every run complete

    assert process.returncode == 0, process.stderr
    assert "3/3 runs complete (0 trained now)" in process.stdout
    [line] = [line for line in (runs_dir / "report" / "report.md").read_text().splitlines() if "wall time" in line]
    assert "The search trained none of its 3 runs" in line
    assert f"trained 3 of 3 runs in **{first['wall_seconds']:.0f} s wall time**, finished {first['finished']}" in line


@OPTUNA
def test_a_trial_that_cannot_run_is_a_failed_trial_with_its_reason(tmp_path):
    # a bidirectional encoder refuses an odd hidden size: the trials proposed 7 fail in their job, the search goes on
    tiny = [
        override
        for override in search(tmp_path, 4, "hydra/launcher=basic")
        if not override.startswith("model.hidden_size=")
    ]
    process = run_cli("sweep", *tiny, "model.bidirectional=true", "model.hidden_size=choice(7,8)")

    trials = store.read_json(tmp_path / "sweep.json")["trials"]
    proposed = {
        trial["trial"]: int(dict(o.split("=", 1) for o in trial["overrides"])["model.hidden_size"]) for trial in trials
    }
    assert len(trials) == 4 and set(proposed.values()) == {7, 8}  # the seeded sampler proposes both
    reason = "ConfigError: model.hidden_size must be even with a bidirectional encoder, got 7"
    for trial in trials:
        failed = tmp_path / trial["run"] / store.FAILED
        if proposed[trial["trial"]] == 7:
            assert trial["objective"] is None and store.read_json(failed)["error"] == reason
            assert any(
                line.startswith(f"copytask: job failed: trial {trial['trial']}:") and reason in line
                for line in process.stderr.splitlines()
            )
        else:
            assert trial["objective"] is not None and not failed.exists()
    assert process.returncode == 1  # named at the end, after the results of the others
    table = pd.read_csv(tmp_path / "trials.csv")
    since_first = table["best_so_far"][table["objective"].first_valid_index() :]
    assert since_first.notna().all() and since_first.is_monotonic_increasing  # a failed trial keeps the best before it
    assert (tmp_path / "report" / "report.md").is_file() and "## Failed trials" in (
        tmp_path / "report" / "report.md"
    ).read_text()


def test_the_search_bar_counts_the_trials_recorded_since_it_started(tmp_path):
    from copytask.store.runs import TRIAL_RECORD
    from copytask.sweeps.jobs import TrialProgress

    earlier = tmp_path / "0" / TRIAL_RECORD  # left by an earlier search in this runs_dir
    store.write_json(earlier, {"trial": 0})
    os.utime(earlier, (earlier.stat().st_mtime - 60,) * 2)
    progress = TrialProgress(tmp_path, trials=40, enabled=False)
    for number in (0, 1):
        store.write_json(tmp_path / str(number) / TRIAL_RECORD, {"trial": number})
    progress.close()
    assert progress.finished() == (2, 2) and progress.runs_done(2) == "search (2/40 trials)"


@OPTUNA
@pytest.mark.parametrize(
    "bad, message",
    [
        (
            "train.lr=tag(log,interval(1e-4,1e-2)",
            "copytask: error: no viable alternative at input 'tag(log,interval(1e-4,1e-2)'",
        ),
        (
            "train.lr=interval(1e-2,1e-4)",
            "copytask: error: train.lr=interval(1e-2,1e-4): the Optuna sweeper searches choice(a,b), "
            "range(start,stop,step), interval(low,high) and tag(log,interval(low,high)), and says: "
            "The `low` value must be smaller than or equal to the `high` value (low=0.01, high=0.0001).",
        ),
        ("train.lrr=interval(1e-4,1e-2)", "copytask: error: unknown key 'train.lrr'; did you mean train.lr?"),
        ("train.steps=0", "copytask: error: train.steps must be an integer >= 1, got 0 (in the grid: train.steps=0)"),
    ],
)
def test_a_bad_search_space_is_refused_in_one_line_before_anything_runs(tmp_path, capsys, bad, message):
    assert cli.main(["sweep", *search(tmp_path / "runs", 3), bad]) == 2
    assert capsys.readouterr().err == message + "\n"
    assert not (tmp_path / "runs").exists()


def test_without_the_plugin_the_search_says_what_to_install(monkeypatch):
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # registers the installed plugins' configs
    monkeypatch.delitem(ConfigStore.instance().repo["hydra"]["sweeper"], "optuna.yaml", raising=False)
    with pytest.raises(
        ConfigError, match=r"^hydra/sweeper=optuna needs Hydra's Optuna sweeper: pip install 'copytask\[optuna\]'$"
    ):
        compose_grid(["hparams_search=baseline"])


def test_a_failed_trial_keeps_the_best_so_far_before_it():
    from copytask.reporting.search import trial_table
    from copytask.reporting.tables import Loaded

    runs = pd.DataFrame(
        {
            "run": ["a", "c"],
            "token_acc": [0.4, 0.3],
            "seq_acc": [0.0, 0.0],
            "params": [1, 1],
            "steps": [1, 1],
            "train_seconds": [1.0, 1.0],
        }
    )
    trials = [
        {"trial": 0, "run": "a", "objective": 0.4},
        {"trial": 1, "run": "b", "objective": None},
        {"trial": 2, "run": "c", "objective": 0.3},
    ]
    table = trial_table(trials, Loaded(runs, {}, [], {}, []))
    assert list(table["best_so_far"]) == [0.4, 0.4, 0.4]
    assert list(table["status"]) == ["complete", "not run", "complete"]
