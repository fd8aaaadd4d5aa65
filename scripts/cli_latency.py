"""How fast the command line answers when it trains nothing: --help, --cfg job and refusals of bad
input, and, given a sweep's runs (`--runs-dir`), compare, results, report with no figure to redraw,
decode of one sequence and the refusals that read runs. Each command runs `--repeats` times in a
fresh process; the median and the largest wall time are printed, and the median CPU time (user +
system), which a busy machine disturbs less. The figures in docs/bench.md, "The command line's answers".

    python scripts/cli_latency.py [--repeats 5] [--runs-dir runs] [--baseline OTHER_CHECKOUT/src]

`--baseline` times another copytask (its `src`, put first on PYTHONPATH) on the same commands,
alternating with this one (A B A B ...: load on the machine hits both alike), and prints the ratio.
The runs are copied to a temporary folder first, a copy for each copytask timed (report writes into
its runs_dir, and redraws a report that other code drew), and report is run there once before the
timed rounds, so that the timed ones find every figure up to date. Issue 80's
targets on two CPU cores: every line within 2 s, decode within 3 s (torch's import alone is about
1.7 s). Torch, pandas and matplotlib are imported only by the commands that need them, and the runs
of a recorded sweep are named from its record, not composed again: that is what keeps these fast.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = [
    ["--help"],
    ["train", "--help"],
    ["train", "--cfg", "job"],
    ["train", "task.lenght=40"],
    ["train", "attention=bogus"],
    ["train", "train.device=cuda"],  # refused at once where no CUDA driver loads; elsewhere torch is asked
    ["sweep", "task.length=5,oops"],
    ["sweep", "report.x=bogus"],
    ["report", "runs_dir=/nonexistent"],
    ["compare", "runs_dir=/nonexistent"],
    ["decode", "--help"],
    ["decode", "/nonexistent", "abc"],
]
DECODED = "gddci"  # the one sequence decode is timed on


def store_commands(runs_dir: Path, empty: Path) -> list[tuple[str, list[str]]]:
    """(what the table calls it, the arguments after `python`) of each command that reads `runs_dir`:
    a sweep's complete runs, its report already drawn (`empty`: a folder without runs)."""
    folders = sorted(folder for folder in runs_dir.iterdir() if (folder / "metrics.json").is_file())
    run = next((folder for folder in folders if not folder.name.startswith("none-")), folders[0])
    copytask = ["-m", "copytask"]
    return [
        ("compare runs_dir=RUNS", [*copytask, "compare", f"runs_dir={runs_dir}"]),
        ("results (copytask.results(RUNS))", ["-c", f"import copytask; copytask.results({str(runs_dir)!r})"]),
        ("report runs_dir=RUNS (nothing to redraw)", [*copytask, "report", f"runs_dir={runs_dir}"]),
        (f"decode RUNS/{run.name.split('-')[0]}-... {DECODED}", [*copytask, "decode", str(run), DECODED]),
        ("import torch (decode's yardstick)", ["-c", "import torch"]),
        ("compare runs_dir=RUNS --bogus", [*copytask, "compare", f"runs_dir={runs_dir}", "--bogus"]),
        ("report runs_dir=RUNS report.x=bogus", [*copytask, "report", f"runs_dir={runs_dir}", "report.x=bogus"]),
        ("compare runs_dir=EMPTY", [*copytask, "compare", f"runs_dir={empty}"]),
        ("decode RUNS/<run> xyz", [*copytask, "decode", str(run), "xyz"]),
    ]


def run_once(arguments: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float, int]:
    """Wall and CPU seconds (user + system) of `python <arguments>`, and its exit status."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    code = subprocess.run([sys.executable, *arguments], capture_output=True, cwd=cwd, env=env).returncode
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), code


def code_line(env: dict[str, str]) -> str:
    """Which copytask `env` times (the one `python -m copytask` imports with it), and its commit."""
    found = subprocess.run(
        [sys.executable, "-c", "import copytask; print(copytask.__file__)"], capture_output=True, text=True, env=env
    ).stdout.strip()
    package = Path(found).parent
    git = ["git", "-C", str(package)]
    commit = subprocess.run([*git, "log", "-1", "--format=%h"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    changed = " (uncommitted changes)" if dirty.stdout.strip() else ""
    return f"{package} at {commit or 'an unknown commit (not a checkout)'}{changed}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--runs-dir", type=Path, help="a sweep's runs_dir (copied first): time the commands that read runs"
    )
    parser.add_argument("--baseline", type=Path, help="another copytask's src folder, timed alternately for a ratio")
    args = parser.parse_args()
    this = dict(os.environ)
    versions = {"this": this}
    if args.baseline is not None:
        versions["baseline"] = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(args.baseline.resolve()), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        }
    for name, env in versions.items():
        print(f"{name}: copytask {code_line(env)}")
    print(
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start"
    )
    with tempfile.TemporaryDirectory() as cwd:  # nothing the commands might write lands in the checkout
        # each command as its name and, per version, the arguments after `python`
        commands = [(" ".join(command), dict.fromkeys(versions, ["-m", "copytask", *command])) for command in COMMANDS]
        if args.runs_dir is not None:
            empty = Path(cwd) / "empty"
            empty.mkdir()
            by_version = {}
            for version, env in versions.items():  # a copy each: a report drawn by other code is drawn again
                runs_dir = Path(cwd) / f"runs-{version}"
                shutil.copytree(args.runs_dir, runs_dir, ignore=shutil.ignore_patterns("report", "results.csv"))
                priming = [sys.executable, "-m", "copytask", "report", f"runs_dir={runs_dir}"]
                subprocess.run(priming, capture_output=True, cwd=cwd, env=env, check=True)
                by_version[version] = store_commands(runs_dir, empty)
            for i, (name, _) in enumerate(by_version["this"]):
                commands.append((name, {version: listed[i][1] for version, listed in by_version.items()}))
        header = f"{'command':<45} {'median s':>8} {'max s':>7} {'cpu s':>6}  exit"
        if args.baseline is not None:
            header += f" {'baseline s':>10} {'cpu s':>6}  exit {'ratio':>6}"
        print(header)
        for name, arguments in commands:
            timings = {version: [] for version in versions}
            for _ in range(args.repeats):
                for version, env in versions.items():  # alternating
                    timings[version].append(run_once(arguments[version], cwd, env))
            line = f"{name:<45}"
            for version in versions:
                walls, cpus, codes = zip(*timings[version])
                wide = 10 if version == "baseline" else 8
                line += f" {statistics.median(walls):>{wide}.2f}"
                line += f" {max(walls):>7.2f}" if version == "this" else ""
                line += f" {statistics.median(cpus):>6.2f}  {codes[-1]:>4}"
            if args.baseline is not None:
                ratios = [a[0] / b[0] for a, b in zip(timings["this"], timings["baseline"])]
                line += f" {statistics.median(ratios):>6.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
