"""How much of a task's sources the held-out sets may take: the test and validation sets are drawn first and
training draws again every row that is one of them (`splits.training_batch`), so where they hold most of the
sources a training batch cannot be drawn. Torch-free: `config.checks` refuses such a config at once."""

from __future__ import annotations

import math
from collections.abc import Callable

from ..console import ConfigError
from .tasks import UNIFORM, Sources

# At most this share of fresh training rows may be held-out sequences: `splits.training_batch` draws
# those again, about 1 / (1 - share) draws per row.
MAX_HELDOUT_SHARE = 0.5


def heldout_share(
    length: int,
    vocab_size: int,
    eval_size: int,
    min_length: int | None = None,
    sources: Sources = UNIFORM,
    copied: int | None = None,
) -> float:
    """An upper bound on the probability that a fresh training row is a held-out sequence.

    Fixed length L: the held-out set holds at most min(eval_size, N_L) of the N_L sources of length L
    the task draws (`sources.count`, with `copied`: V^L over V symbols for copy, C(L, k) V^k for selective
    copying). With `min_length` m each length in [m, L] is equally likely, and the held-out set
    holds at most min(eval_size, N_l) of the N_l sources of length l. Computed in logarithms
    where N_L is too large to compute; the terms fall geometrically with l, so the sum stops once
    they no longer count."""
    lengths = range(length if min_length is None else min_length, length + 1)
    total = 0.0
    for size in lengths:
        log_count = sources.log_count(size, vocab_size, copied)
        if log_count < 700:  # N_l is a small enough integer: exact, so 4 of 8 is 1/2
            term = min(1.0, eval_size / sources.count(size, vocab_size, copied))
        else:
            term = math.exp(min(0.0, math.log(eval_size) - log_count))
        total += term
        if term < 1e-18:
            break
    return total / len(lengths)


def _smallest(low: int, fits: Callable[[int], bool]) -> int:
    """The smallest integer >= `low` for which `fits` (monotone: false, then true) holds."""
    high = low
    while not fits(high):
        low, high = high + 1, 2 * high
    while low < high:
        middle = (low + high) // 2
        low, high = (middle + 1, high) if not fits(middle) else (low, middle)
    return low


def check_heldout(
    length: int,
    vocab_size: int,
    eval_size: int,
    val_size: int,
    min_length: int | None = None,
    sources: Sources = UNIFORM,
    copied: int | None = None,
) -> None:
    """ConfigError unless the test and validation sets (`eval_size` + `val_size` sequences, held out
    of training together) leave enough sequences to train on (`heldout_share` at most
    MAX_HELDOUT_SHARE; the sources the task draws, `sources` with `copied`): where they hold most of them,
    excluding them from training cannot work. The message gives the largest train.eval_size +
    train.val_size, and the smallest task.length and task.vocab_size, that would work, each alone."""
    given, eval_size = eval_size, eval_size + val_size

    def fits(length=length, vocab_size=vocab_size, eval_size=eval_size) -> bool:
        return heldout_share(length, vocab_size, eval_size, min_length, sources, copied) <= MAX_HELDOUT_SHARE

    share = heldout_share(length, vocab_size, eval_size, min_length, sources, copied)
    if share <= MAX_HELDOUT_SHARE:
        return
    largest = _smallest(1, lambda size: not fits(eval_size=size + 1))  # share grows with eval_size; 1 always fits
    lengths = f"task.length={length}" if min_length is None else f"task.min_length={min_length} to task.length={length}"
    if copied is not None:
        lengths += f" with task.copied={copied}"
    raise ConfigError(
        f"the test and validation sets (train.eval_size={given} + train.val_size={val_size}) can hold up to "
        f"{share:.0%} of the sequences of {lengths} over task.vocab_size={vocab_size} symbols, and training draws "
        f"again every held-out one: at most {MAX_HELDOUT_SHARE:.0%} may be held out; use train.eval_size + "
        f"train.val_size <= {largest}, "
        f"task.length >= {_smallest(length, lambda value: fits(length=value))} "
        f"or task.vocab_size >= {_smallest(vocab_size, lambda value: fits(vocab_size=value))}"
    )
