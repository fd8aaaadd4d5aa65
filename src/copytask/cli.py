"""`python -m copytask <command> [hydra overrides]` (or the `copytask` script).

train and sweep go through Hydra (so its flags and launchers work); the subcommand word is
taken off argv before Hydra parses it.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from . import store
from .config import DETERMINISTIC_CUBLAS, ConfigError, config_dir, config_help
from .hydra_internals import override_args
from .sweep import check_grid, compose_grid, folder_runs, nothing_done, select_runs

USAGE = """usage: python -m copytask <command> [key=value ...]

commands:
  train    train one run (default: Luong general attention, length 20)
             python -m copytask train attention=bahdanau task.length=40
  sweep    train the grid in configs/config.yaml (hydra.sweeper.params), skipping finished runs;
           ends by naming failed jobs (exit status 1), writing runs_dir/results.csv and the report
             python -m copytask sweep 'attention=none,luong_general' 'seed=0,1'
             python -m copytask sweep hydra/launcher=parallel      (2 jobs at a time; see docs/sweep.md)
  compare  per setting and length, the baseline and each attention side by side (mean, 95%
           interval over seeds, chance, params, gap); takes the sweep's overrides, or with none
           but runs_dir, the grid of the last sweep in runs_dir; never trains unless asked
             python -m copytask compare experiment=quick
             python -m copytask compare runs_dir=runs/capacity   (the last sweep there)
             python -m copytask compare --missing          (only list the grid's missing runs)
             python -m copytask compare --train-missing    (train the missing runs first)
             python -m copytask compare --all runs_dir=runs (every complete run there, grouped by what varies)
  report   figures and report.md in runs_dir/report/ from the grid's finished runs; never trains;
           takes the same overrides and --all; report.x=KEY puts any swept numeric key on the x axis
             python -m copytask report experiment=quick
             python -m copytask report runs_dir=runs/capacity report.x=model.hidden_size
  analyze  counterfactual attention, alignment and length generalisation of every finished run
           in runs_dir (writes analysis.json into each run folder; analysed runs are skipped);
           a sweep does this for its own runs before writing the report
             python -m copytask analyze runs_dir=runs analysis.eval_size=512
  decode   a trained run's greedy output on symbols given by hand or drawn at random (any length),
           input, output and target aligned with wrong symbols marked, and its attention as text
             python -m copytask decode runs/<run folder> "g d d c i h"
             python -m copytask decode runs/<run folder> --random 3 --length 40 [--png map.png]
  build    compile the fused CPU kernels now (else the first CPU run does) and say where
  bench    training speed, memory and time to target against the classical reference
             python -m copytask bench [--quick] [--time-to-target] [train.threads=1]

Overrides are Hydra's: attention=none|bahdanau|luong_dot|luong_general|luong_concat,
task=copy|reverse, task.length=N, seed=N, train.steps=N, experiment=quick, runs_dir=DIR, ...
Hydra's own flags work too (--cfg job, --help)."""


COMMANDS = ("train", "sweep", "compare", "report", "analyze", "decode", "bench", "build")
COMMAND_FLAGS = {"compare": ("--missing", "--train-missing", "--all"), "report": ("--all",)}


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def hydra_job(cfg: DictConfig) -> None:
    """One job. In a sweep a failure is recorded in the run folder and the sweep goes on."""
    from .train import NonFiniteLoss, train  # torch and the model: only when something is trained

    if HydraConfig.get().mode != RunMode.MULTIRUN:
        try:
            train(cfg)
        except ConfigError as error:
            print(f"copytask: error: {error}", file=sys.stderr)
            sys.exit(2)
        except NonFiniteLoss as error:
            print(f"copytask: error: {error}", file=sys.stderr)
            sys.exit(1)
        return
    with open_dict(cfg):
        cfg.train.progress = False  # the sweep has one bar for all its runs (sweep.SweepProgress)
    try:
        train(cfg)
    except Exception as error:  # noqa: BLE001 - recorded for the sweep summary, not swallowed
        store.write_json(
            store.run_dir(cfg) / store.FAILED,
            {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()},
        )
        print(f"copytask: job failed: {store.run_name(cfg)}: {error}", file=sys.stderr)


def _hydra(args: list[str], multirun: bool = False) -> int:
    """`train` or `sweep` through Hydra, after every job's config is composed and validated (unless
    a Hydra flag such as --cfg or --help asks for something else than a run)."""
    if not any(arg.startswith("-") for arg in args):
        try:
            check_grid(args, multirun)
        except ConfigError as error:
            print(f"copytask: error: {error}", file=sys.stderr)
            return 2
    if multirun:
        # Hydra's parser accepts overrides before flags but not on both sides of one, so the
        # mode override goes with the user's overrides, after every flag. (Not `--multirun`:
        # that clashes with `--cfg`.)
        overrides = override_args(args)
        flags = list(args)
        for override in overrides:
            flags.remove(override)
        args = [*flags, *overrides, "hydra.mode=MULTIRUN"]
    sys.argv = [sys.argv[0], *args]
    hydra_job()
    return 0


def entry() -> int:
    """The `copytask` command (and `python -m copytask`): `main`, with warnings in one line each, as
    copytask's own messages are (set for the command's own process only, not for library use)."""
    warnings.formatwarning = lambda message, category, *args, **kwargs: f"{category.__name__}: {message}\n"
    # cuBLAS reads it once, at its first call: set before anything runs, inherited by the jobs a sweep launches (copytask.devices)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])
    return main()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command in ("train", "sweep") and {"-h", "--help"} & set(rest):
        try:
            master, [run] = compose_grid([arg for arg in rest if not arg.startswith("-")], multirun=False)
        except ConfigError as error:
            print(f"copytask: error: {error}", file=sys.stderr)
            return 2
        print(config_help(command, run.config, dict(master.hydra.runtime.choices)))
        return 0
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
        from .analysis import analyze, summary
        from .results import load

        folders = store.complete_runs(runs_dir)
        try:
            analyze(folders, eval_size=cfg.analysis.eval_size, threads=cfg.analysis.threads, progress=cfg.train.progress, device=cfg.train.device)
        except ConfigError as error:  # a device this machine does not have
            print(f"copytask: error: {error}", file=sys.stderr)
            return 2
        loaded = load(folder_runs(folders))  # each run's settings: the keys that vary between the runs
        print(summary(list(loaded.analyses.values()), loaded.table[["run", *loaded.settings]] if loaded.settings else None))
        return 0
    if command in ("compare", "report") and {"-h", "--help"} & set(rest):
        print(USAGE)
        return 0
    if command in ("compare", "report"):
        flags = COMMAND_FLAGS[command]
        unknown = [arg for arg in rest if arg.startswith("-") and arg not in flags]
        if unknown:
            print(f"copytask: error: {command} has no option {unknown[0]}; its options: {', '.join(flags)}", file=sys.stderr)
            return 2
        overrides = [arg for arg in rest if arg not in flags]
        try:
            asked_to_train_or_list = {"--missing", "--train-missing"} & set(rest)
            master, _ = compose_grid(overrides, expand_grid=False)
            if not asked_to_train_or_list and not Path(master.runs_dir).is_dir():  # answered before any grid is composed
                print(f"copytask: error: nothing to {command}: {master.runs_dir} does not exist", file=sys.stderr)
                return 1
            selection = select_runs(overrides, every_run="--all" in rest)
            print(f"{command}: {selection.source}")
            if not asked_to_train_or_list and not any(run.status() == "complete" for run in selection.runs):
                print(nothing_done(command, selection), file=sys.stderr)  # before pandas, matplotlib and torch are imported
                return 1
            if command == "compare":
                from .results import compare

                return compare(selection, "--missing" in rest, "--train-missing" in rest, run_sweep=lambda grid: _hydra(grid, multirun=True))
            from .report import report_command

            return report_command(selection)
        except ConfigError as error:
            print(f"copytask: error: {error}", file=sys.stderr)
            return 2
    if command == "decode":
        from .decode import main as decode  # light: torch only once the request is checked

        return decode(rest)
    if command == "build":
        from . import kernels

        kernels.retry_build()  # asked to build: try again, whatever failed before
        built = kernels.kernel()
        if built is None:
            print("copytask: error: the fused CPU kernels could not be built (the warning above says why)", file=sys.stderr)
            return 1
        print(f"copytask: the fused CPU kernels are built: {built.__file__}")
        return 0
    if command == "bench":
        from .bench import main as bench  # imported here: it loads the reference and profiler

        return bench(rest)
    print(f"copytask: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr)
    return 2
