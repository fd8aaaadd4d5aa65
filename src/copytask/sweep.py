"""Sweeps are Hydra multiruns; this callback reports on one when it ends."""

from __future__ import annotations

import time
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig


class SweepSummary(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        print(f"sweep finished in {time.perf_counter() - self.started:.1f} s wall time")
