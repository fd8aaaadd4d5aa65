"""How fast the command line answers when it trains nothing: --help, --cfg job and refusals of bad
input. Each command runs `--repeats` times in a fresh process; the median wall time is printed.

    python scripts/cli_latency.py [--repeats 5]

Issue 12's target: every line under 1.5 s on two CPU cores. Torch, pandas and matplotlib are
imported only by the commands that need them, which is what keeps these fast.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = [
    ["--help"],
    ["train", "--help"],
    ["train", "--cfg", "job"],
    ["train", "task.lenght=40"],
    ["train", "attention=bogus"],
    ["sweep", "task.length=5,oops"],
    ["report", "runs_dir=/nonexistent"],
    ["compare", "runs_dir=/nonexistent"],
    ["decode", "--help"],
    ["decode", "/nonexistent", "abc"],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cwd:  # nothing the commands might write lands in the checkout
        print(f"{'command':<45} {'median s':>8} {'max s':>7}  exit")
        for command in COMMANDS:
            times, code = [], None
            for _ in range(args.repeats):
                started = time.perf_counter()
                code = subprocess.run(
                    [sys.executable, "-m", "copytask", *command], capture_output=True, cwd=cwd
                ).returncode
                times.append(time.perf_counter() - started)
            print(f"{' '.join(command):<45} {statistics.median(times):>8.2f} {max(times):>7.2f}  {code}")


if __name__ == "__main__":
    main()
