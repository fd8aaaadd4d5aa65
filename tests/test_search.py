"""Hydra's optimising sweepers (Optuna) drive copytask: the job returns its objective, trials are
ordinary run folders, and a search resumes, compares and reports like a grid."""

from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from copytask import api, store
from copytask.config import config_dir
from copytask.jobs import hydra_job

from .conftest import TINY


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
    assert objective == metrics["token_acc"]
    assert (folder / store.METRICS).stat().st_mtime_ns == written  # skipped, not trained again
