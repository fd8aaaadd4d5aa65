"""copytask: GRU encoder-decoders with and without attention on the copy task, swept over length.

The public API (`copytask.api`, documented in docs/api.md), imported on first use so that
`import copytask` stays fast:

    compose(overrides)      the validated config `python -m copytask train <overrides>` trains
    train(cfg)              train one run (or read it, if complete) -> metrics.json as a dict
    sweep(overrides)        train a grid through Hydra's launcher -> the results table
    results(runs_dir)       one row per complete run -> DataFrame
    compare(runs_dir)       the compare table as numbers -> DataFrame
    report(runs_dir)        write results.csv and report/ -> the paths written
    load_run(run_dir)       a trained model (CPU, eval mode) and its config
    decode(run_dir, "gddc") greedy output, scores and attention weights as arrays
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import cpu_dispatch

__version__ = "0.1.0"

# torch's CPU kernels pinned before torch starts, so that every x86 machine computes the same digits
cpu_dispatch.pin()

# name -> the module that defines it
_PUBLIC = {
    **dict.fromkeys(
        ("compose", "train", "sweep", "results", "compare", "report", "load_run", "decode", "SweepError"), "api"
    ),
    "ConfigError": "console",
    "RunInProgress": "training.loop",
    "NonFiniteLoss": "training.loop",
    "CopytaskWarning": "console",
}
__all__ = list(_PUBLIC)

if TYPE_CHECKING:
    from .api import SweepError, compare, compose, decode, load_run, report, results, sweep, train
    from .console import ConfigError, CopytaskWarning
    from .training.loop import NonFiniteLoss, RunInProgress


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'copytask' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
