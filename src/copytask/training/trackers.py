"""Experiment trackers (`logger=none|tensorboard|mlflow`): each run's hyperparameters, evaluation
curves, final metrics and attention map, and a sweep's report figures, in TensorBoard or MLflow.

A tracker only sees what the run folders hold: `history.csv`'s values at every evaluation, the run's
identity config (`store.flat_identity`, so a sweep's swept keys are columns of TensorBoard's HParams
view or MLflow's run table) with what made the run (`store.provenance`), and metrics.json's
numbers. A run logs from its own process (every launcher alike), the sweep's figures at the sweep's
end. A run trained again replaces its tracker run, so each copytask run is one tracker run.
TensorBoard and MLflow are imported only when chosen (`checks.check_logger` has made sure they are
installed), and nothing process-wide is set: MLflow through its client, never its active run or
environment.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

# A run's final metrics, logged once at its last step: tracker name -> metrics.json key
FINAL_METRICS = {
    "final/token_acc": "token_acc",
    "final/seq_acc": "seq_acc",
    "final/val_token_acc": "val_token_acc",
    "final/val_seq_acc": "val_seq_acc",
    "final/loss": "final_loss",
    "final/params": "params",
    "final/steps": "steps",
    "final/train_seconds": "train_seconds",
}
REPORT_RUN = "report"  # the tracker run holding a sweep's report figures
RUN_TAG = (
    "copytask.run"  # MLflow tags: the run folder's name, and whether the MLflow run is a copytask run or the report
)
KIND_TAG = "copytask.kind"


class RunLogger:
    """One tracker run; this base class, `logger=none`, logs nothing. Use as `with open_run(...) as
    tracker:`; leaving the block closes it (marked failed when an exception leaves it)."""

    active = False  # whether anything is logged: callers skip drawing images for nobody

    def log_params(self, params: dict[str, Any]) -> None:
        """Hyperparameters: dotted key -> bool, number or text; None values are left out."""

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Scalars at a training step."""

    def log_image(self, path: Path) -> None:
        """A PNG file, named by its stem."""

    def close(self, failed: bool = False) -> None:
        """End the run (its status: failed or finished) and flush what was logged."""

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        self.close(failed=error_type is not None)


class TensorBoardLogger(RunLogger):
    """Event files in `log_dir` (one folder per run): scalars, the HParams plugin's session (its
    hyperparameters; the plugin computes the sweep's table from every run's session, so runs of
    different attention types, with different keys, share it) and images."""

    active = True

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        shutil.rmtree(log_dir, ignore_errors=True)  # a run trained again replaces its curves instead of doubling them
        self.writer = SummaryWriter(str(log_dir))
        self.session_end = None

    def log_params(self, params: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        _, session_start, self.session_end = hparams(params, {})  # the experiment summary is left out: see the class
        self.writer.file_writer.add_summary(session_start)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def log_image(self, path: Path) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            self.writer.add_image(Path(path).stem, np.asarray(image.convert("RGB")), dataformats="HWC")

    def close(self, failed: bool = False) -> None:
        if self.session_end is not None and not failed:  # a failed run's session stays without an end
            self.writer.file_writer.add_summary(self.session_end)
        self.writer.close()


def tracking_uri(cfg: DictConfig) -> str:
    """logger.tracking_uri, else MLFLOW_TRACKING_URI, else sqlite:///<runs_dir>/mlflow.db (an absolute path:
    every job of a sweep finds it, whatever its working directory)."""
    database = Path(cfg.runs_dir).resolve() / "mlflow.db"
    return cfg.logger.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{database}"


def mlflow_experiment(cfg: DictConfig) -> tuple[Any, str]:
    """(an MlflowClient on `tracking_uri`, the id of the experiment logger.experiment), creating both the
    store and the experiment if needed. With a SQLite store the artifacts go beside the database, in
    mlflow-artifacts/ (MLflow's default would be ./mlruns, wherever the job happens to run)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri(cfg)
    if uri.startswith("sqlite:///"):
        database = Path(uri.removeprefix("sqlite:///"))
        database.parent.mkdir(parents=True, exist_ok=True)
        artifacts = (database.parent / "mlflow-artifacts").resolve().as_uri()
    else:
        artifacts = None  # a tracking server's own default
    client, name = MlflowClient(tracking_uri=uri), str(cfg.logger.experiment)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            return client, client.create_experiment(name, artifact_location=artifacts)
        except MlflowException:  # a parallel job created it meanwhile
            if (experiment := client.get_experiment_by_name(name)) is None:
                raise
    if experiment.lifecycle_stage == "deleted":
        client.restore_experiment(experiment.experiment_id)
    return client, experiment.experiment_id


class MlflowLogger(RunLogger):
    """One MLflow run named `name` in the experiment logger.experiment, tagged with the copytask run
    it is (RUN_TAG) and its `kind` (run | report); earlier MLflow runs of that name are deleted first.
    Through an MlflowClient: no active run, no environment variable."""

    active = True

    def __init__(self, cfg: DictConfig, name: str, kind: str) -> None:
        self.client, experiment_id = mlflow_experiment(cfg)
        for earlier in self.client.search_runs([experiment_id], f"tags.`{RUN_TAG}` = '{name}'"):
            self.client.delete_run(earlier.info.run_id)
        self.run_id = self.client.create_run(
            experiment_id, run_name=name, tags={RUN_TAG: name, KIND_TAG: kind}
        ).info.run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(
            self.run_id, params=[Param(key, str(value)) for key, value in params.items() if value is not None]
        )

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(key, float(value), now, step) for key, value in values.items()]
        )

    def log_image(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path="figures")

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


def open_run(cfg: DictConfig, name: str, kind: str = "run") -> RunLogger:
    """The tracker run `name` (a run folder's name, or REPORT_RUN) of the tracker cfg.logger chooses
    (a no-op RunLogger for none, or a config from before trackers)."""
    logger = cfg.get("logger")
    if logger is None or logger.name == "none":
        return RunLogger()
    if logger.name == "tensorboard":
        return TensorBoardLogger(Path(logger.log_dir) / name)
    return MlflowLogger(cfg, name, kind)


def prepare(cfg: DictConfig) -> None:
    """Before a sweep's jobs start: create MLflow's store and experiment in this one process, so that
    parallel jobs do not race to create the database."""
    if cfg.get("logger") is not None and cfg.logger.name == "mlflow":
        mlflow_experiment(cfg)


def log_report(cfg: DictConfig, files: list[Path]) -> None:
    """A sweep's report figures (its PNG files) as the tracker run REPORT_RUN, replacing the last one."""
    with open_run(cfg, REPORT_RUN, kind="report") as tracker:
        for path in files:
            if Path(path).suffix == ".png":
                tracker.log_image(path)
