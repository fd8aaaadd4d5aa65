"""Tests compose the real Hydra configs and shrink them with overrides."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from copytask.cli import config_dir

# A tiny but complete run: the quick experiment, shrunk further.
TINY = ["experiment=quick", "train.steps=8", "train.eval_every=4", "train.eval_size=16", "train.progress=false"]


@pytest.fixture
def make_config(tmp_path):
    """compose(*overrides) -> the real config with runs_dir in a temporary folder."""

    def _compose(*overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            return compose("config", overrides=[f"runs_dir={tmp_path / 'runs'}", *overrides])

    yield _compose
    GlobalHydra.instance().clear()
