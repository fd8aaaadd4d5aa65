"""A greedy decoding step of linear attention at source lengths 20 and 640: the figure in docs/bench.md,
"Linear attention's step".

A decoder step that is asked for no weights (`need_weights=False`: training's evaluations, the analysis'
accuracies, beam search's tokens) reads S, z and the hand-over, d_k x (d_h + 1) + H floats whatever the
source's length, so its time should not grow with the source; one asked for the per-position weights (the
maps of `decode`, the analysis' alignment, the attention samples) reads every position's key too. Both are
timed here, in this process: an untrained `attention=linear` model at the default sizes, a batch of
EVAL_CHUNK copy-task sources of each length (what greedy evaluation decodes at once on CPU), the encoder run
once outside the clock, then `--steps` greedy steps timed; rounds alternate the lengths and the two kinds
of step (A B A B), and each figure is the median over `--rounds` rounds of the time per step. It also says
whether a step without the weights runs the same ATen ops on tensors of the same shapes at every length.

    PYTHONPATH=src python scripts/bench_linear_step.py [--lengths 20 640] [--rounds 7] [--steps 21]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from copytask import api
from copytask.bench.command import machine
from copytask.bench.measures import matmul_rate
from copytask.data.batches import make_batch
from copytask.data.vocab import BOS
from copytask.models.build import build_model
from copytask.models.greedy import EVAL_CHUNK
from copytask.store.provenance import provenance


def step_seconds(model, src: torch.Tensor, lengths: torch.Tensor, steps: int, need_weights: bool) -> float:
    """Seconds per greedy step over `steps` steps of `model`'s decoding of `src`, its encoder run before."""
    decoding = model.decoding(src, lengths, steps, need_weights)
    tokens = torch.full((len(src),), BOS, dtype=torch.long)
    started = time.perf_counter()
    for t in range(steps):
        logits, _ = decoding.step(tokens, t)
        tokens = logits.argmax(-1)
    return (time.perf_counter() - started) / steps


class Ops(TorchDispatchMode):
    """Every ATen op run while it is on, with the shapes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), *(tuple(arg.shape) for arg in args if isinstance(arg, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def step_ops(model, src: torch.Tensor, lengths: torch.Tensor) -> list[tuple]:
    """The ATen ops of the second greedy step of `model`'s decoding of `src`, asked for no weights."""
    decoding = model.decoding(src, lengths, 2, need_weights=False)
    tokens = torch.full((len(src),), BOS, dtype=torch.long)
    decoding.step(tokens, 0)
    with Ops() as ops:
        decoding.step(tokens, 1)
    return ops.ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[20, 640])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=21)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # this script's own process: one thread, as the benchmark's runs
    cfg = api.compose(["attention=linear", "train.device=cpu"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    made = provenance()
    commit = (made["commit"] or "none")[:7] + (" with uncommitted changes" if made["uncommitted_changes"] else "")
    print(
        f"{machine(torch.device('cpu'))}; torch {made['torch_version']}, {args.threads} thread(s); commit {commit}; "
        f"matmul {matmul_rate(torch.device('cpu'), 512) / 1e9:.1f} GFLOP/s"
    )
    sources = {
        length: make_batch("copy", EVAL_CHUNK, length, cfg.task.vocab_size, torch.Generator().manual_seed(length))
        for length in args.lengths
    }
    seconds: dict[tuple[int, bool], list[float]] = {}
    with torch.no_grad():
        for _ in range(args.rounds + 1):  # the first round warms up, untimed
            for length, batch in sources.items():
                for need_weights in (False, True):
                    took = step_seconds(model, batch.src, batch.src_lengths, args.steps, need_weights)
                    seconds.setdefault((length, need_weights), []).append(took)
    print(
        f"linear attention (hidden {cfg.model.hidden_size}, d_k {cfg.attention.size}), {EVAL_CHUNK} sequences, "
        f"ms per greedy step, median of {args.rounds} rounds of {args.steps} steps [range]:"
    )
    for length in args.lengths:
        figures = []
        for need_weights in (False, True):
            timed = [1000 * value for value in seconds[(length, need_weights)][1:]]
            figures.append(
                f"{statistics.median(timed):.3f} [{min(timed):.3f}, {max(timed):.3f}] "
                f"{'with the weights' if need_weights else 'without'}"
            )
        print(f"source length {length}: {'; '.join(figures)}")
    with torch.no_grad():
        ops = [step_ops(model, batch.src, batch.src_lengths) for batch in sources.values()]
    same = "the same" if all(other == ops[0] for other in ops) else "not the same"
    print(f"a step without the weights: {len(ops[0])} ATen ops; ops and their shapes {same} at every length")


if __name__ == "__main__":
    main()
