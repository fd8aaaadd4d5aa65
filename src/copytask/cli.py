"""`python -m copytask <command> [hydra overrides]` (or the `copytask` script).

train and sweep go through Hydra (so its flags and launchers work); the subcommand word is
taken off argv before Hydra parses it.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from . import store
from .analysis import analyze, complete_runs, summary
from .results import read_analysis
from .train import ConfigError, train

USAGE = """usage: python -m copytask <command> [key=value ...]

commands:
  train    train one run (default: Luong general attention, length 20)
             python -m copytask train attention=bahdanau task.length=40
  sweep    train the grid in configs/config.yaml (hydra.sweeper.params), skipping finished runs;
           ends by naming failed jobs (exit status 1), writing runs_dir/results.csv and the report
             python -m copytask sweep 'attention=none,luong_general' 'seed=0,1'
             python -m copytask sweep hydra/launcher=parallel      (2 jobs at a time; see docs/sweep.md)
  compare  per length, the baseline and each attention side by side (mean, 95% interval over
           seeds, chance, params, gap); takes the sweep's overrides and first trains missing runs
             python -m copytask compare experiment=quick
             python -m copytask compare --missing    (only list the grid's missing runs)
  report   figures and report.md in runs_dir/report/ from the grid's finished runs; never trains
             python -m copytask report experiment=quick
  analyze  counterfactual attention, alignment and length generalisation of every finished run
           in runs_dir (writes analysis.json into each run folder; analysed runs are skipped);
           a sweep does this for its own runs before writing the report
             python -m copytask analyze runs_dir=runs analysis.eval_size=512
  bench    training speed, memory and time to target against the classical reference
             python -m copytask bench [--quick] [--time-to-target] [train.threads=1]
  build    compile the fused CPU kernels now (else the first CPU run does) and print where

Overrides are Hydra's: attention=none|bahdanau|luong_dot|luong_general|luong_concat,
task=copy|reverse, task.length=N, seed=N, train.steps=N, experiment=quick, runs_dir=DIR, ...
Hydra's own flags work too (--cfg job, --help)."""


COMMANDS = ("train", "sweep", "compare", "report", "analyze", "bench", "build")


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


def _hydra(args: list[str], multirun: bool = False) -> int:
    if multirun:
        # Hydra's parser accepts overrides before flags but not on both sides of one, so the
        # mode override goes with the user's overrides, after every flag. (Not `--multirun`:
        # that clashes with `--cfg`.)
        overrides = get_args_parser().parse_intermixed_args(args).overrides
        flags = list(args)
        for override in overrides:
            flags.remove(override)
        args = [*flags, *overrides, "hydra.mode=MULTIRUN"]
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
        return _hydra(rest, multirun=True)
    if command == "analyze":
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):  # read-only: no Hydra output
            cfg = compose(config_name="config", overrides=rest)
        runs_dir = Path(cfg.runs_dir)
        if not runs_dir.is_dir():
            print(f"copytask: error: runs_dir {str(runs_dir)!r} does not exist", file=sys.stderr)
            return 2
        folders = complete_runs(runs_dir)
        analyze(folders, eval_size=cfg.analysis.eval_size, threads=cfg.analysis.threads, progress=cfg.train.progress)
        print(summary([analysis for folder in folders if (analysis := read_analysis(folder)) is not None]))
        return 0
    if command in ("compare", "report") and {"-h", "--help"} & set(rest):
        print(USAGE)
        return 0
    if command == "compare":
        from .results import compare

        overrides = [arg for arg in rest if arg != "--missing"]
        return compare(overrides, "--missing" in rest, run_sweep=lambda: _hydra(overrides, multirun=True))
    if command == "report":
        from .report import report_command

        return report_command(rest)
    if command == "bench":
        from .bench import main as bench  # imported here: it loads the reference and profiler

        return bench(rest)
    if command == "build":
        from .kernels import build_command

        return build_command()
    print(f"copytask: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
    return 2
