"""What the resumable checkpoint (one per evaluation, copytask.checkpoints) costs an uninterrupted
run: the figure in docs/bench.md, "Checkpoints".

The same run (default model and budget, no early stop) is trained in this process with the
checkpoint written at each evaluation and with `checkpoints.save` replaced by nothing, alternating
(A B A B ...), each in a fresh runs_dir; each run's own `train_seconds` is read from its
metrics.json. Two figures: the saves' share of each checkpointed run's own time (the time spent
in `checkpoints.save`, measured inside the run: robust to a busy machine), and the ratio of the
medians of the two kinds of run (what it costs end to end, noisy on a shared machine). The
machine's matmul rate is printed beside them.

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

from copytask import api
from copytask.bench.measures import matmul_rate
from copytask.training import checkpoints


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=20)
    parser.add_argument("--attention", default="luong_general")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    overrides = [
        f"attention={args.attention}",
        f"task.length={args.length}",
        f"train.steps={args.steps}",
        "train.patience=null",
        "train.threads=1",
        "train.progress=false",
    ]
    print(f"matmul {matmul_rate(torch.device('cpu'), 512) / 1e9:.1f} GFLOP/s on one thread")

    save, save_seconds = checkpoints.save, []

    def timed_save(*save_args):
        started = time.perf_counter()
        save(*save_args)
        save_seconds.append(time.perf_counter() - started)

    times: dict[str, list[float]] = {"with checkpoints": [], "without": []}
    shares = []
    with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for repeat in range(args.repeats):
            for label, saver in (("with checkpoints", timed_save), ("without", lambda *_: None)):
                checkpoints.save, saved_before = saver, len(save_seconds)
                metrics = api.train([*overrides, f"runs_dir={Path(scratch) / f'{label}-{repeat}'}"])
                times[label].append(metrics["train_seconds"])
                if saver is timed_save:
                    shares.append(sum(save_seconds[saved_before:]) / metrics["train_seconds"])
        checkpoints.save = save
    evaluations = args.steps // 50 - 1  # train.eval_every=50; none after the last step
    with_, without = (statistics.median(times[label]) for label in times)
    for label, values in times.items():
        print(f"{label}: {', '.join(f'{value:.2f}' for value in values)} s")
    print(
        f"{args.attention}, length {args.length}, {args.steps} steps, {evaluations} checkpoints per run: "
        f"saving takes {100 * statistics.median(shares):.2f}% of a run's time "
        f"(runs: {', '.join(f'{100 * share:.2f}%' for share in shares)}; "
        f"one save {1000 * statistics.median(save_seconds):.1f} ms, median of {len(save_seconds)}); "
        f"end to end {with_ / without:.3f}x the time without ({100 * (with_ / without - 1):+.1f}%)"
    )


if __name__ == "__main__":
    main()
