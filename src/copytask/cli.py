"""`python -m copytask <command> [hydra overrides]` (or the `copytask` script).

train and sweep go through Hydra (so its flags and launchers work); the subcommand word is
taken off argv before Hydra parses it.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import store
from .train import ConfigError, train

USAGE = """usage: python -m copytask <command> [key=value ...]

commands:
  train    train one run (default: Luong general attention, length 20)
             python -m copytask train attention=bahdanau task.length=40
  sweep    train the grid in configs/config.yaml (hydra.sweeper.params), skipping finished runs
             python -m copytask sweep 'attention=none,luong_general' 'seed=0,1'
  bench    training speed, memory and time to target against the classical reference
             python -m copytask bench [--quick] [--time-to-target] [train.threads=1]

Overrides are Hydra's: attention=none|bahdanau|luong_dot|luong_general|luong_concat,
task=copy|reverse, task.length=N, seed=N, train.steps=N, experiment=quick, runs_dir=DIR, ...
Hydra's own flags work too (--cfg job, --help)."""


def config_dir() -> str:
    """configs/ inside the package (wheel install) or at the top of the checkout (editable install)."""
    packaged = Path(__file__).resolve().parent / "configs"
    return str(packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "configs")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_job(cfg: DictConfig) -> None:
    """One job. In a sweep a failure is recorded in the run folder and the sweep goes on."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        try:
            train(cfg)
        except ConfigError as error:
            print(f"copytask: error: {error}", file=sys.stderr)
            sys.exit(2)
        return
    try:
        train(cfg)
    except Exception as error:  # noqa: BLE001 - recorded for the sweep summary, not swallowed
        store.write_json(
            store.run_dir(cfg) / store.FAILED,
            {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()},
        )
        print(f"copytask: job failed: {store.run_name(cfg)}: {error}", file=sys.stderr)


def _hydra(args: list[str]) -> int:
    sys.argv = [sys.argv[0], *args]
    hydra_job()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "train":
        return _hydra(rest)
    if command == "sweep":
        return _hydra(["hydra.mode=MULTIRUN", *rest])
    if command == "bench":
        from .bench import main as bench  # imported here: it loads the reference and profiler

        return bench(rest)
    print(f"copytask: error: unknown command {command!r}; choose one of train, sweep\n\n{USAGE}", file=sys.stderr)
    return 2
