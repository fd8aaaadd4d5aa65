"""`python -m copytask <command> [hydra overrides]` (or the `copytask` script): a thin layer over
`copytask.api` that prints what the functions return.

train and sweep go through Hydra (so its flags and launchers work); the subcommand word is
taken off argv before Hydra parses it. Every refusal of bad input is one line,
`copytask: error: ...`, and exit status 2.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import api, console, store
from .config.checks import check_analysis
from .config.schema import DETERMINISTIC_CUBLAS, config_help
from .console import TERMINAL_WIDTH, ConfigError, refuse
from .store.runs import describe_missing, folder_runs
from .sweeps.grid import CONFIGS_CHANGED, Selection, compose_grid, nothing_done, select_runs

USAGE = """usage: python -m copytask <command> [key=value ...]

commands:
  train    train one run (default: Luong general attention, length 20)
             python -m copytask train attention=bahdanau task.length=40
             python -m copytask train model=transformer task.length=40   (docs/models.md)
  sweep    train the grid in configs/config.yaml (hydra.sweeper.params), skipping finished runs;
           ends by naming failed jobs (exit status 1), writing runs_dir/results.csv and the report
             python -m copytask sweep experiment=first_look   (the bottleneck in 30 s; the first run compiles)
             python -m copytask sweep 'attention=none,luong_general' 'seed=0,1'
             python -m copytask sweep hydra/launcher=parallel   (a job per core; docs/sweep.md)
             python -m copytask sweep hparams_search=baseline task.length=40
                 (an Optuna search of the baseline's settings: pip install 'copytask[optuna]')
  compare  per setting and length, the baseline and each attention side by side (mean, 95%
           interval over seeds, gap); takes the sweep's overrides, or with none but runs_dir,
           the grid of the last sweep in runs_dir (every complete run there where none was
           recorded); never trains unless asked
             python -m copytask compare experiment=quick
             python -m copytask compare runs_dir=runs/capacity   (the last sweep there)
             python -m copytask compare --wide   (every column: teacher-forced accuracy, steps
                                                   to target, parameters, state floats)
             python -m copytask compare --missing         (only list the grid's missing runs)
             python -m copytask compare --train-missing   (train the missing runs first)
             python -m copytask compare --all runs_dir=runs   (every complete run there)
  report   figures and report.md in runs_dir/report/ from the grid's finished runs; never trains;
           takes the same overrides and --all; report.x=KEY puts any swept numeric key on the x axis
             python -m copytask report experiment=quick
             python -m copytask report runs_dir=runs/capacity report.x=model.hidden_size
  analyze  counterfactual attention, alignment and length generalisation of every finished run
           in runs_dir (writes analysis.json into each run folder; analysed runs are skipped);
           a sweep does this for its own runs before writing the report
             python -m copytask analyze runs_dir=runs analysis.eval_size=512
             python -m copytask analyze runs_dir=runs 'analysis.lengths=[5,10,20,40,80,160]'
  decode   a trained run's greedy output on symbols given by hand or drawn at random (any length),
           input, output and target aligned with wrong symbols marked, and its attention as text
             python -m copytask decode runs/<run folder> "g d d c i h"
             python -m copytask decode runs/<run folder> --random 3 --length 40 --beam 4
  build    compile the fused CPU kernels now (else the first CPU run does) and say where
  bench    training speed, memory and time to target against the classical reference
             python -m copytask bench [--quick] [--time-to-target] [train.threads=1]

Overrides are Hydra's: attention=NAME (an option of configs/attention/: train --help lists them),
model=gru|transformer|mamba, task=copy|reverse, task.length=N, seed=N, train.steps=N, runs_dir=DIR,
experiment=first_look|quick|..., ... Hydra's own flags work too (--cfg job, --help)."""


COMMANDS = ("train", "sweep", "compare", "report", "analyze", "decode", "bench", "build")
COMMAND_FLAGS = {"compare": ("--missing", "--train-missing", "--all", "--wide"), "report": ("--all",)}


def entry() -> int:
    """The `copytask` command (and `python -m copytask`): `main`, with warnings in one line each, as
    copytask's own messages are (set for the command's own process only, not for library use)."""
    warnings.formatwarning = console.format_warning
    # cuBLAS reads it once, at its first call: set before anything runs, inherited by the jobs a sweep
    # launches (training.devices)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])
    try:
        status = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader went away (`... | head`): Python's recipe (the signal module's "Note on SIGPIPE"),
        # stdout pointed at devnull so that the flush at exit finds no pipe either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return status


@contextmanager
def printed_log() -> Iterator[None]:
    """Inside: what the library logs (`console.log`: the jobs' and the sweep's lines) printed as bare
    lines (`console.Lines`) and nowhere else; after: the logger as it was."""
    logger = console.log
    saved = logger.handlers[:], logger.level, logger.propagate
    logger.handlers[:], logger.propagate = [console.Lines()], False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])


def main(argv: list[str] | None = None) -> int:
    """`python -m copytask ...` in this process; -> the exit status."""
    with printed_log():
        return run_command(sys.argv[1:] if argv is None else list(argv))


def run_command(args: list[str]) -> int:
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command in ("train", "sweep") and {"-h", "--help"} & set(rest):
        try:
            master, [run] = compose_grid([arg for arg in rest if not arg.startswith("-")], multirun=False)
        except ConfigError as error:
            return refuse(error)
        columns = shutil.get_terminal_size((100, 24)).columns  # not a terminal: 100
        print(config_help(command, run.config, dict(master.hydra.runtime.choices), columns))
        return 0
    if command in ("train", "sweep"):
        from .sweeps.jobs import run_hydra  # Hydra's app and launchers: only for the commands that run them

        try:
            run_hydra(rest, multirun=command == "sweep")
        except ConfigError as error:
            return refuse(error)
        return 0
    if command == "analyze":
        return analyze(rest)
    if command in ("compare", "report") and {"-h", "--help"} & set(rest):
        print(USAGE)
        return 0
    if command in ("compare", "report"):
        flags = COMMAND_FLAGS[command]
        unknown = [arg for arg in rest if arg.startswith("-") and arg not in flags]
        if unknown:
            return refuse(f"{command} has no option {unknown[0]}; its options: {', '.join(flags)}")
        try:
            return (compare if command == "compare" else report)(
                [arg for arg in rest if arg not in flags], set(rest) & set(flags)
            )
        except ConfigError as error:
            return refuse(error)
    if command == "decode":
        from .cli_decode import main as decode  # light: torch only once the request is checked

        return decode(rest)
    if command == "build":
        from .kernels import build

        build.retry_build()  # asked to build: try again, whatever failed before
        built = build.kernel()
        if built is None:
            print(
                "copytask: error: the fused CPU kernels could not be built (the warning above says why)",
                file=sys.stderr,
            )
            return 1
        print(f"copytask: the fused CPU kernels are built: {built.__file__}")
        return 0
    if command == "bench":
        from .bench.command import main as bench  # imported here: it loads the reference and profiler

        return bench(rest)
    print(
        f"copytask: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}\n\n{USAGE}", file=sys.stderr
    )
    return 2


def analyze(overrides: list[str]) -> int:
    """`python -m copytask analyze [overrides]`: analyse every complete run in runs_dir, print the summary."""
    try:
        master, _ = compose_grid(overrides, expand_grid=False)  # read-only: no Hydra output
        check_analysis(master.analysis)
    except ConfigError as error:
        return refuse(error)
    runs_dir = Path(master.runs_dir)
    if not runs_dir.is_dir():
        return refuse(f"runs_dir {str(runs_dir)!r} does not exist")
    from .evaluation.analysis import analyze
    from .evaluation.breakdown import Settings
    from .reporting.analysis_tables import summary
    from .reporting.breakdown_section import MISSING, breakdown_summary, probe_summary
    from .reporting.breakdown_tables import breakdown_table
    from .reporting.tables import load

    folders = store.complete_runs(runs_dir)
    try:
        lengths = list(master.analysis.lengths) if master.analysis.lengths else None  # null: the trained lengths
        analyze(
            folders,
            lengths,
            eval_size=master.analysis.eval_size,
            threads=master.analysis.threads,
            progress=master.train.progress,
            device=master.train.device,
            settings=Settings.from_config(master.analysis),
        )
    except ConfigError as error:  # a device this machine does not have
        return refuse(error)
    loaded = load(folder_runs(folders))  # each run's settings: the keys that vary between the runs
    settings = loaded.table[["run", *loaded.settings]] if loaded.settings else None
    print(summary(list(loaded.analyses.values()), settings))
    breakdown = breakdown_table(list(loaded.analyses.values()))
    if not breakdown.empty:
        table = breakdown if settings is None else breakdown.merge(settings, on="run")
        print(
            "\nwhere the accuracy is lost: greedy and teacher-forced token accuracy on the test set, of each "
            f"attention type's gain the share the baseline misses teacher-forced ({MISSING}), and beam search's "
            "token accuracy on its first sequences, in %\n"
            + breakdown_summary(table, loaded.settings).to_string(index=False)
        )
        probes = probe_summary(table, loaded.settings)
        if not probes.empty:
            print(
                "\nthe linear probe of the summary vector, mean accuracy over source positions on the test set, of the "
                "trained and the untrained model and for the control task, in %\n" + probes.to_string(index=False)
            )
    return 0


def selection_for(command: str, overrides: list[str], flags: set[str]) -> Selection:
    """The runs `compare` or `report` look at, as the API's functions select them (`api.select`),
    said in a paragraph with a line on the runs it leaves out (`Selection.beside`) and on configs changed
    since the sweep it names (CONFIGS_CHANGED); for listing or training the missing runs, a grid's (the
    default one where runs_dir has no recorded sweep) as the configs compose it now. ConfigError where
    none of them is complete, unless the missing runs are to be listed or trained: answered before
    pandas, matplotlib and torch are imported."""
    listing = bool({"--missing", "--train-missing"} & flags)
    master, _ = compose_grid(overrides, expand_grid=False)
    if not listing and not Path(master.runs_dir).is_dir():  # before any grid is composed
        raise ConfigError(f"nothing to {command}: {master.runs_dir} does not exist")
    selection = select_runs(
        overrides, every_run="--all" in flags, every_run_unless_recorded=not listing, master=master, current=listing
    )
    print(wrapped(f"{command}: {selection.source}"))
    if "--missing" not in flags and (beside := selection.beside(f"{command} --all")):  # a table follows
        print(wrapped(beside))
    if selection.configs_changed:
        print(wrapped(CONFIGS_CHANGED))
    if not listing and not any(run.status() == "complete" for run in selection.runs):
        raise ConfigError(nothing_done(command, selection))
    return selection


def wrapped(line: str) -> str:
    """A line of what compare or report say at 100 columns, as the table; a path or an override stays whole."""
    return textwrap.fill(line, TERMINAL_WIDTH, break_long_words=False, break_on_hyphens=False)


def compare(overrides: list[str], flags: set[str]) -> int:
    """`python -m copytask compare [--missing | --train-missing | --all] [overrides]`: per setting
    and length, the baseline and each attention type side by side. Missing runs are listed with
    the command that trains them; --train-missing trains them first (the same resumable sweep);
    --missing lists them and prints no table."""
    from .sweeps.grid import sweep_command

    selection = selection_for("compare", overrides, flags)
    from .reporting.tables import comparison_table, narrow_note, table_note  # pandas: once there is a table

    unfinished = [(run, run.failure()) for run in selection.runs if run.status() != "complete"]
    if "--missing" in flags:
        print(
            describe_missing(unfinished, len(selection.runs))
            if unfinished
            else f"all {len(selection.runs)} runs complete in {selection.master.runs_dir}"
        )
        return 0
    status = 0
    if unfinished and "--train-missing" in flags:
        from .sweeps.jobs import SweepFailed, run_hydra

        print(f"{len(unfinished)} of {len(selection.runs)} runs missing: running the sweep first")
        try:
            run_hydra(selection.overrides, multirun=True)
        except SweepFailed:  # it has named the failed jobs; compare what there is
            status = 1
        selection = api.select(overrides=selection.overrides)
    loaded = api.load(selection, "compare")
    if loaded.missing:
        print(describe_missing(loaded.missing, len(selection.runs)))
        print(f"train them with: {sweep_command(selection.master)}  (or compare --train-missing)")
    table = api.comparison(selection, loaded)
    if selection.is_search:
        from .reporting.search import best, best_table

        print(
            f"the best {len(best(table))} of {len(table)} trials by validation greedy token accuracy "
            "(the objective), in %; every trial: report's trials.csv"
        )
        print(best_table(table, loaded.settings).to_string(index=False))
    else:
        wide, tasks = "--wide" in flags, list(dict.fromkeys(loaded.table["task"]))
        compared = comparison_table(table, loaded.settings, wide=wide)
        if wide:
            print(table_note(tasks, any(column.startswith("teacher") for column in compared)))
        else:
            print(narrow_note(tasks, sorted(set(loaded.table["chance"]))))
        print(compared.to_string(index=False))
    if loaded.mixed:  # under the table
        print(loaded.mixed)
    return status


def report(overrides: list[str], flags: set[str]) -> int:
    """`python -m copytask report [--all] [overrides]`: results.csv and report/ for the grid's
    complete runs; ConfigError, before anything is written, when there are none or `report.x` is
    not swept. Where the report is up to date with what it draws (`api.drawn_from`), nothing is
    drawn: it says so, with what the report said of its runs when it was drawn."""
    selection = selection_for("report", overrides, flags)
    started = time.perf_counter()
    drawn = api.drawn_from(selection)
    current = drawn.current() if drawn is not None else None
    if current is not None:
        runs = {run.folder.name: run for run in selection.runs}
        missing = [(runs[name], why) for name, why in current["missing"] if name in runs]
        results_csv, *written = current["written"]
        mixed = current["mixed"]
    else:
        loaded = api.load(selection, "report")
        missing, mixed = loaded.missing, loaded.mixed
        results_csv, *written = api.write_report(selection, loaded, drawn=drawn)
    if missing:
        print(describe_missing(missing, len(selection.runs)))
    if mixed:
        print(mixed)
    print(f"results: {results_csv}")
    if current is not None:
        from .reporting.freshness import up_to_date_line

        print(up_to_date_line(written, time.perf_counter() - started))
    else:
        from .reporting.report import written_line

        print(written_line(written, time.perf_counter() - started))
    return 0
