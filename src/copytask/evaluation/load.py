"""A finished run's trained model, loaded from its folder."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from .. import store
from ..console import ConfigError
from ..data.tasks import task_of
from ..models.build import Model, build_model
from ..training.devices import resolve_device


def load_run(folder: Path, device: str = "cpu", fused: bool | None = None) -> tuple[Model, DictConfig]:
    """A finished run's trained model on `device` (auto: a GPU where there is one), in eval mode,
    and its resolved config (the order of `copytask.load_run`). The checkpoint loads onto the CPU
    first, wherever it was saved. `fused`: whether the model runs the fused CPU kernels where it can
    (None: as the run was trained, `train.fused`); False runs torch's ops, the kernels' definition,
    which spares a caller that decodes a few sequences the kernels' loading (and torch's compiler stack,
    which their first call imports)."""
    cfg = store.read_config(Path(folder))
    try:  # a task of the user's own is registered where its module is imported
        task_of(cfg.task)
    except ValueError as error:
        raise ConfigError(f"{Path(folder).name}: {error}") from None
    built = cfg
    if fused is not None:
        built = cfg.copy()
        with open_dict(built):
            built.train.fused = fused
    with torch.random.fork_rng(devices=[]):  # the initialisation, overwritten at once, draws from the global generator
        model = build_model(built)
    checkpoint = torch.load(Path(folder) / store.CHECKPOINT, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    return model.to(resolve_device(device)).eval(), cfg
