"""A finished run's trained model, loaded from its folder."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .. import store
from ..models.build import Model, build_model
from ..training.devices import resolve_device


def load_run(folder: Path, device: str = "cpu") -> tuple[Model, DictConfig]:
    """A finished run's trained model on `device` (auto: a GPU where there is one), in eval mode,
    and its resolved config (the order of `copytask.load_run`). The checkpoint loads onto the CPU
    first, wherever it was saved."""
    cfg = OmegaConf.load(Path(folder) / store.CONFIG)
    with torch.random.fork_rng(devices=[]):  # the initialisation, overwritten at once, draws from the global generator
        model = build_model(cfg)
    checkpoint = torch.load(Path(folder) / store.CHECKPOINT, map_location="cpu", weights_only=True)
    model.load_state_dict(checkpoint["model"])
    return model.to(resolve_device(device)).eval(), cfg
