"""Experiment trackers: what each run logs, read back with TensorBoard's and MLflow's own readers;
a sweep as one MLflow experiment; a missing extra refused in one line; no effect on a run's identity."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pandas as pd
import pytest

from copytask import cli, store
from copytask.config.schema import flatten
from copytask.store.provenance import COMPUTATION, PROVENANCE_KEYS, RECORDED_KEYS
from copytask.training import checkpoints, trackers
from copytask.training.loop import train

from .conftest import MLFLOW, TENSORBOARD, TINY, pythonpath, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

RECORDED = ("loss", "val_token_acc", "val_seq_acc", "seconds")  # history.csv's columns besides the step


def trained(make_config, *extra: str) -> tuple[dict, pd.DataFrame, dict]:
    """A tiny Bahdanau run trained in this process -> (its config, history.csv, metrics.json)."""
    cfg = make_config(*TINY, "attention=bahdanau", "task.length=4", *extra)
    metrics = train(cfg)
    return cfg, pd.read_csv(store.run_dir(cfg) / store.HISTORY), metrics


def logged_params(cfg, metrics: dict) -> dict:
    """What a tracker is given as hyperparameters: the run's flattened identity and what made it
    (metrics.json's provenance: issue 70), less the null values."""
    made_by = flatten({key: metrics[key] for key in (*PROVENANCE_KEYS, *RECORDED_KEYS)})  # own_code by kind
    return {key: value for key, value in (store.flat_identity(cfg) | made_by).items() if value is not None}


@TENSORBOARD
def test_tensorboard_logs_the_history_the_identity_and_the_attention_map(make_config):
    from google.protobuf.json_format import MessageToDict
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    cfg, history, metrics = trained(make_config, "logger=tensorboard")
    events = EventAccumulator(
        str(store.run_dir(cfg).parent / "tensorboard" / metrics["run"]), size_guidance={"images": 0, "scalars": 0}
    )
    events.Reload()
    for column in RECORDED:
        scalars = events.Scalars(column)
        assert [scalar.step for scalar in scalars] == history["step"].tolist()
        assert [scalar.value for scalar in scalars] == pytest.approx(
            history[column].tolist(), rel=1e-6
        )  # float32 in the event file
    for name, key in trackers.FINAL_METRICS.items():
        (final,) = events.Scalars(name)
        assert final.step == metrics["steps"] and final.value == pytest.approx(metrics[key], rel=1e-6)
    sessions = events.PluginTagToContent(metadata.PLUGIN_NAME)
    start = plugin_data_pb2.HParamsPluginData.FromString(sessions[metadata.SESSION_START_INFO_TAG]).session_start_info
    hparams = MessageToDict(start)["hparams"]
    assert hparams == logged_params(cfg, metrics)  # every identity key: a sweep's swept keys are HParams columns
    assert hparams["computation"] == COMPUTATION
    assert hparams["attention.name"] == "bahdanau" and hparams["task.length"] == 4
    assert metadata.SESSION_END_INFO_TAG in sessions  # finished
    (image,) = events.Images("attention")
    assert image.width > 100 and image.height > 100


@TENSORBOARD
def test_a_resumed_run_logs_its_whole_history_in_its_tracker_run(make_config, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(*TINY, "attention=bahdanau", "task.length=4", "train.patience=null", "logger=tensorboard")
    save = checkpoints.save

    def save_then_stop(*args):
        save(*args)
        raise KeyboardInterrupt  # stopped right after the checkpoint at step 5

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "save", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            train(cfg)
    metrics = train(cfg)  # continues from step 5, in a new tracker run that replaces the stopped one's
    assert metrics["resumed_from"] == 5
    events = EventAccumulator(
        str(store.run_dir(cfg).parent / "tensorboard" / metrics["run"]), size_guidance={"scalars": 0}
    )
    events.Reload()
    history = pd.read_csv(store.run_dir(cfg) / store.HISTORY)
    for column in RECORDED:
        assert [scalar.step for scalar in events.Scalars(column)] == history["step"].tolist() == [5, 10]


@TENSORBOARD
def test_tensorboard_report_run_holds_the_sweeps_png_figures(make_config, tmp_path):
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config("logger=tensorboard", f"logger.log_dir={tmp_path / 'tb'}")
    figure = plt.figure(figsize=(2, 2))
    for name in ("accuracy_vs_length.png", "accuracy_vs_length.svg", "counterfactual.png"):
        figure.savefig(tmp_path / name)
    plt.close(figure)
    files = [tmp_path / name for name in ("accuracy_vs_length.png", "accuracy_vs_length.svg", "counterfactual.png")]
    for _ in range(2):  # the report of a sweep run again replaces the last one
        trackers.log_report(cfg, files)
    events = EventAccumulator(str(tmp_path / "tb" / trackers.REPORT_RUN), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == ["accuracy_vs_length", "counterfactual"]
    assert len(events.Images("counterfactual")) == 1


@MLFLOW
def test_mlflow_logs_the_history_the_identity_and_the_attention_map(make_config):
    import mlflow
    from mlflow.tracking import MlflowClient

    cfg, history, metrics = trained(make_config, "logger=mlflow")
    train(
        make_config(*TINY, "attention=bahdanau", "task.length=4", "logger=mlflow", "retrain=true")
    )  # replaces its MLflow run
    runs_dir = store.run_dir(cfg).parent
    client = MlflowClient(tracking_uri=f"sqlite:///{runs_dir.resolve() / 'mlflow.db'}")  # the default store
    experiment = client.get_experiment_by_name(str(runs_dir))
    (run,) = client.search_runs([experiment.experiment_id])
    history = pd.read_csv(store.run_dir(cfg) / store.HISTORY)  # the retrained run's
    assert run.info.run_name == metrics["run"] and run.info.status == "FINISHED"
    assert run.data.tags[trackers.KIND_TAG] == "run"
    for column in RECORDED:
        logged = sorted((point.step, point.value) for point in client.get_metric_history(run.info.run_id, column))
        assert [step for step, _ in logged] == history["step"].tolist()
        assert [value for _, value in logged] == pytest.approx(history[column].tolist(), rel=1e-12)
    for name, key in trackers.FINAL_METRICS.items():
        assert run.data.metrics[name] == pytest.approx(store.read_json(store.run_dir(cfg) / store.METRICS)[key])
    assert run.data.params == {key: str(value) for key, value in logged_params(cfg, metrics).items()}
    assert run.data.params["computation"] == str(COMPUTATION)
    artifacts = [artifact.path for artifact in client.list_artifacts(run.info.run_id, "figures")]
    assert artifacts == ["figures/attention.png"]
    assert (runs_dir / "mlflow-artifacts").is_dir()  # beside the database, not ./mlruns
    # a library changes no global state: no active run, no tracking URI left in the environment
    assert mlflow.active_run() is None and "MLFLOW_TRACKING_URI" not in os.environ


@MLFLOW
def test_a_sweep_is_one_mlflow_experiment_with_one_run_per_copytask_run(tmp_path):
    from mlflow.tracking import MlflowClient

    runs_dir = tmp_path / "runs"
    process = run_cli(
        "sweep", *TINY, "attention=none,bahdanau", "task.length=4", "seed=0", f"runs_dir={runs_dir}", "logger=mlflow"
    )
    assert process.returncode == 0, process.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{runs_dir.resolve() / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    assert experiment.name == str(runs_dir)
    runs = client.search_runs([experiment.experiment_id], f"tags.`{trackers.KIND_TAG}` = 'run'")
    table = pd.read_csv(runs_dir / "results.csv")
    assert sorted(run.info.run_name for run in runs) == sorted(table["run"])
    assert sorted(run.data.params["attention.name"] for run in runs) == ["bahdanau", "none"]  # the swept key, a column
    for run in runs:
        assert run.data.metrics["final/token_acc"] == pytest.approx(
            table.set_index("run").loc[run.info.run_name, "token_acc"]
        )
    (report,) = client.search_runs([experiment.experiment_id], f"tags.`{trackers.KIND_TAG}` = 'report'")
    figures = {artifact.path for artifact in client.list_artifacts(report.info.run_id, "figures")}
    assert {
        "figures/accuracy_vs_length.png",
        "figures/attention_bahdanau_length4.png",
        "figures/training_curves.png",
    } <= figures


def test_a_missing_extra_is_refused_in_one_line_before_anything_runs(tmp_path):
    hidden = tmp_path / "site"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None  # as if not installed\n")
    env = {**os.environ, "PYTHONPATH": pythonpath(hidden), "HYDRA_FULL_ERROR": "0"}
    process = subprocess.run(
        [sys.executable, "-m", "copytask", "train", *TINY, f"runs_dir={tmp_path / 'runs'}", "logger=mlflow"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert process.returncode == 2
    assert process.stderr == "copytask: error: logger=mlflow needs MLflow: pip install 'copytask[mlflow]'\n"
    assert not (tmp_path / "runs").exists()


def test_a_sweep_refuses_a_missing_tracker_before_its_first_job(tmp_path, monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "tensorboard" else find_spec(name, *args)
    )
    assert (
        cli.main(["sweep", *TINY, "attention=none,bahdanau", f"runs_dir={tmp_path / 'runs'}", "logger=tensorboard"])
        == 2
    )
    assert (
        capsys.readouterr().err
        == "copytask: error: logger=tensorboard needs TensorBoard: pip install 'copytask[tensorboard]'\n"
    )
    assert not (tmp_path / "runs").exists()


def test_the_logger_is_not_part_of_a_runs_identity(make_config):
    plain = make_config(*TINY)
    assert (
        type(trackers.open_run(plain, "any")) is trackers.RunLogger and not trackers.RunLogger.active
    )  # none logs nothing
    for choice in (
        ["logger=tensorboard"],
        ["logger=mlflow", "logger.experiment=elsewhere", "logger.tracking_uri=sqlite:///x.db"],
    ):
        cfg = make_config(*TINY, *choice)
        assert store.run_name(cfg) == store.run_name(plain)
        assert store.identity(cfg) == store.identity(plain) and "logger" not in store.identity(cfg)
