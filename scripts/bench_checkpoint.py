"""What the resumable checkpoint (one per evaluation, copytask.checkpoints) costs an uninterrupted
run: the figure in docs/bench.md, "Checkpoints".

The same run (default model and budget, no early stop) is trained in this process with the
checkpoint written at each evaluation and with `checkpoints.save` replaced by nothing, alternating
(A B A B ...), each in a fresh runs_dir; each run's own `train_seconds` is read from its
metrics.json. The ratio of medians is the overhead; the time one save takes and the machine's
matmul rate are printed beside it.

    PYTHONPATH=src python scripts/bench_checkpoint.py [--length 20] [--attention luong_general] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from copytask import api, checkpoints
from copytask.bench import matmul_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--attention", default="luong_general")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    overrides = [f"attention={args.attention}", f"task.length={args.length}", f"train.steps={args.steps}",
                 "train.patience=null", "train.threads=1", "train.progress=false"]
    print(f"matmul {matmul_rate(torch.device('cpu'), 512) / 1e9:.1f} GFLOP/s on one thread")

    save, save_seconds = checkpoints.save, []

    def timed_save(*save_args):
        started = time.perf_counter()
        save(*save_args)
        save_seconds.append(time.perf_counter() - started)

    times: dict[str, list[float]] = {"with checkpoints": [], "without": []}
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for repeat in range(args.repeats):
            for label, saver in (("with checkpoints", timed_save), ("without", lambda *_: None)):
                checkpoints.save = saver
                metrics = api.train([*overrides, f"runs_dir={Path(scratch) / f'{label}-{repeat}'}"])
                times[label].append(metrics["train_seconds"])
        checkpoints.save = save
    evaluations = args.steps // 50 - 1
    with_, without = (statistics.median(times[label]) for label in times)
    for label, values in times.items():
        print(f"{label}: {', '.join(f'{value:.2f}' for value in values)} s")
    print(f"{args.attention}, length {args.length}, {args.steps} steps, {evaluations} checkpoints per run: "
          f"{with_ / without:.3f}x the time without ({100 * (with_ / without - 1):+.1f}%); "
          f"one save {1000 * statistics.median(save_seconds):.1f} ms (median of {len(save_seconds)})")


if __name__ == "__main__":
    main()
