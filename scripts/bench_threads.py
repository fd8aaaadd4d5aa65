"""How a run's speed depends on torch's thread count, alone and when it shares the machine: the
figures behind `train.threads`' default (docs/bench.md, "Threads and a shared machine").

Each situation starts real `python -m copytask train` processes (Luong general, 100 steps, no
early stop, evaluated once at the end) and reads each run's own `train_seconds` from its
metrics.json, so start-up and the evaluation are left out. Situations run one after another in
this one invocation, so their ratios are comparable on a noisy machine; the script prints the
load average before it starts.

    python scripts/bench_threads.py [--length 40] [--hidden 64,256] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def start(runs_dir: Path, length: int, hidden: int, threads: str, seed: int) -> subprocess.Popen:
    args = [
        "attention=luong_general",
        f"task.length={length}",
        f"model.hidden_size={hidden}",
        f"train.threads={threads}",
        "train.steps=100",
        "train.eval_every=100",
        "train.eval_size=64",
        "train.patience=null",
        "train.progress=false",
        f"seed={seed}",
        f"runs_dir={runs_dir}",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "copytask", "train", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def seconds(runs_dir: Path, processes: list[subprocess.Popen]) -> list[float]:
    """Wait for `processes`; each run's train_seconds (one folder per seed)."""
    for process in processes:
        _, err = process.communicate()
        if process.returncode != 0:
            raise SystemExit(f"a run failed: {err.strip().splitlines()[-1] if err.strip() else process.returncode}")
    return [json.loads(path.read_text())["train_seconds"] for path in sorted(runs_dir.glob("*/metrics.json"))]


def situation(length: int, hidden: int, threads: list[str]) -> list[float]:
    """Runs started together, one per entry of `threads` (`null`: the config's default) -> their seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        runs_dir = Path(scratch)
        return seconds(runs_dir, [start(runs_dir, length, hidden, t, seed) for seed, t in enumerate(threads)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--hidden", default="64,256", help="hidden sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="each situation this many times; the median is printed")
    options = parser.parse_args()
    cores = os.cpu_count()
    print(f"{cores} CPUs; load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"Luong general, length {options.length}, 100 steps of batch 64: "
        f"each run's train_seconds (median of {options.repeats})"
    )
    print("| hidden | situation | threads per run | seconds per run | vs alone at the best thread count |")
    print("|---|---|---|---|---|")
    for hidden in map(int, options.hidden.split(",")):
        rows = {}
        for name, threads in [
            ("alone", ["1"]),
            ("alone", [str(cores)]),
            ("alone", ["null"]),
            ("two runs at once", ["1", "1"]),
            ("two runs at once", [str(cores)] * 2),
            ("two runs at once", ["null", "null"]),
        ]:
            samples = [situation(options.length, hidden, threads) for _ in range(options.repeats)]
            rows[name, threads[0]] = statistics.median(value for sample in samples for value in sample)
        best = min(value for (name, _), value in rows.items() if name == "alone")
        for (name, threads), value in rows.items():
            label = "default (null)" if threads == "null" else threads
            print(f"| {hidden} | {name} | {label} | {value:.2f} | {value / best:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
