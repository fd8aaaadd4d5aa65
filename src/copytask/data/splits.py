"""The three disjoint sets of a run: training batches, the validation set and the held-out test set,
each drawn from its own seed (`seed`, `train.val_seed`, `train.eval_seed`). Training draws again
every row that is a validation or test sequence, and the validation set every row that is a test
sequence, so no set shares a sequence with another. The validation set is for choosing (early
stopping, the search's objective); every reported number comes from the test set.

The analysis scores at other lengths too (`heldout_at_length`): on sequences of one length that the
run's training never drew (replayed from its seed: `training_sequences`) and that are not in its
validation set (together: `unscorable`). Where a length has fewer such sequences than asked, the set holds each of them
once, and says so.

A sequence is identified by its source tokens up to its length (`sequence_keys`), so a length-3 source
never equals a length-4 one whatever the padding, and a selective-copying source is keyed by its noise
placement too, not by its target alone.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig, OmegaConf

from ..console import ConfigError
from .batches import Batch, make_batch, task_batch
from .tasks import get_task

# A row is held out with probability at most 1/2 once `validate` passed: 100 rounds leave one with 2^-100.
MAX_REDRAWS = 100
# Lengths with at most this many sequences are listed in full for a held-out set at that length, so
# that the set can hold each sequence training never drew once (at length 1 there are only V of them).
ENUMERATED = 100_000


def sample_batch(cfg: DictConfig, batch_size: int, generator: torch.Generator) -> Batch:
    """`batch_size` fresh sequences of the run's task and lengths, drawn from `generator`."""
    task = cfg.task
    min_length = task.min_length if task.variable_length else None
    return make_batch(task.name, batch_size, task.length, task.vocab_size, generator, min_length, copied(cfg))


def copied(cfg: DictConfig) -> int | None:
    """The run's task.copied (None in a run from before the key, or of a task without it)."""
    return cfg.task.get("copied")


def sequence_count(cfg: DictConfig, length: int) -> int | float:
    """How many distinct sources of exactly `length` positions the run's task draws: an exact integer, or
    inf where there are too many to hold in a float (far more than any set); 0 at a length shorter than the
    task draws (selective copying: k + 1 and longer)."""
    task, sources = cfg.task, get_task(cfg.task.name).sources
    if length < sources.shortest(copied(cfg)):
        return 0
    if sources.log_count(length, task.vocab_size, copied(cfg)) > 700:  # e^700: near the largest float
        return math.inf
    return sources.count(length, task.vocab_size, copied(cfg))


def sequence_keys(batch: Batch) -> list[bytes]:
    """Each row's source tokens up to its length, as bytes: equal keys are equal sequences."""
    lengths = batch.src_lengths.tolist()
    return [row[:length].tobytes() for row, length in zip(batch.src.cpu().numpy(), lengths)]


def draw_excluding(cfg: DictConfig, size: int, generator: torch.Generator, excluded: set[bytes], name: str) -> Batch:
    """`size` sequences from `generator` (`sample_batch`), none of them in `excluded`: rows that are
    drawn again. ConfigError (naming the set, `name`) if rows are still excluded after MAX_REDRAWS
    rounds: `validate` keeps at most half of the sequences held out, so only a caller that skips it
    and holds out (nearly) all of them gets there, rather than a loop for ever."""
    batch = sample_batch(cfg, size, generator)
    for _ in range(MAX_REDRAWS):
        seen = [i for i, key in enumerate(sequence_keys(batch)) if key in excluded]
        if not seen:
            return batch
        fresh = sample_batch(cfg, len(seen), generator)
        for field in ("src", "src_lengths", "tgt_in", "tgt_out"):  # a task's targets are as wide in every batch
            getattr(batch, field)[seen] = getattr(fresh, field)
    task, train = cfg.task, cfg.train
    raise ConfigError(
        f"{len(seen)} rows of the {name} were still held-out sequences after {MAX_REDRAWS} draws: the validation and "
        f"test sets (train.val_size={train.val_size}, train.eval_size={train.eval_size}) hold nearly every sequence of "
        f"task.length={task.length} over task.vocab_size={task.vocab_size} symbols; "
        "lower them (checks.validate says how far)"
    )


def test_batch(cfg: DictConfig) -> Batch:
    """The held-out test set (train.eval_size sequences from train.eval_seed): every reported number."""
    return sample_batch(cfg, cfg.train.eval_size, torch.Generator().manual_seed(cfg.train.eval_seed))


def validation_batch(cfg: DictConfig, test: Batch | None = None) -> Batch:
    """The validation set (train.val_size sequences from train.val_seed), none in the test set
    (`test`, drawn here if not given): what early stopping and the search watch."""
    excluded = set(sequence_keys(test_batch(cfg) if test is None else test))
    return draw_excluding(
        cfg, cfg.train.val_size, torch.Generator().manual_seed(cfg.train.val_seed), excluded, "validation set"
    )


def training_batch(cfg: DictConfig, generator: torch.Generator, heldout: set[bytes]) -> Batch:
    """A training batch with no validation or test sequence (`heldout`: their `sequence_keys`).
    Short lengths need it: at length 5 there are 59,049 sequences, and a run's batches would
    otherwise hold about three quarters of the 512 test ones by the end of training."""
    return draw_excluding(cfg, cfg.train.batch_size, generator, heldout, "training batch")


def heldout_keys(cfg: DictConfig) -> tuple[Batch, Batch, set[bytes]]:
    """The run's test set, its validation set, and what training excludes: both sets' keys."""
    test = test_batch(cfg)
    validation = validation_batch(cfg, test)
    return test, validation, set(sequence_keys(test)) | set(sequence_keys(validation))


def training_sequences(cfg: DictConfig, steps: int, heldout: set[bytes] | None = None) -> set[bytes]:
    """Every sequence the first `steps` training batches of the run hold: its data stream replayed
    from its seed, as training draws it (the data generator draws nothing else). `heldout`: what
    training excludes (`heldout_keys`), drawn here if not given."""
    if heldout is None:
        *_, heldout = heldout_keys(cfg)
    generator, seen = torch.Generator().manual_seed(cfg.seed), set()
    for _ in range(steps):
        seen.update(sequence_keys(training_batch(cfg, generator, heldout)))
    return seen


def unscorable(cfg: DictConfig, steps: int) -> set[bytes]:
    """What no evaluation set of the run may hold: every sequence its first `steps` training batches
    drew (`training_sequences`) and its validation set."""
    _, validation, heldout = heldout_keys(cfg)
    return training_sequences(cfg, steps, heldout) | set(sequence_keys(validation))


def at_length(cfg: DictConfig, length: int) -> DictConfig:
    """`cfg` with every sequence exactly `length` symbols long."""
    return OmegaConf.merge(cfg, {"task": {"length": length, "variable_length": False}})


def trains_at(cfg: DictConfig, length: int) -> bool:
    """Whether the run's training batches hold sequences of `length` symbols."""
    task = cfg.task
    return task.min_length <= length <= task.length if task.variable_length else length == task.length


def heldout_at_length(cfg: DictConfig, length: int, size: int, seen: set[bytes] | None = None) -> tuple[Batch, int]:
    """Up to `size` sequences of exactly `length` symbols that the run never trained on and that are
    not in its validation set, and how many such sequences there are at most (`size` where there
    are plenty). `seen`: the run's `unscorable` sequences, needed where it trains at `length`.

    At the trained length of a fixed-length run this is the test set itself. Elsewhere the sequences
    come from the test seed (`unseen_at_length`)."""
    task = cfg.task
    if not task.variable_length and length == task.length:
        return test_batch(cfg).select(slice(0, size)), size
    if not trains_at(cfg, length):  # no training batch and no validation sequence has this length
        excluded = set()
    elif seen is None:
        raise ValueError(f"length {length} is a trained length of the run: give its unscorable sequences")
    else:
        excluded = seen
    generator = torch.Generator().manual_seed(cfg.train.eval_seed)
    return unseen_at_length(cfg, length, size, generator, excluded, f"held-out set at length {length}")


def unseen_at_length(
    cfg: DictConfig, length: int, size: int, generator: torch.Generator, excluded: set[bytes], name: str
) -> tuple[Batch, int]:
    """Up to `size` sequences of exactly `length` symbols of the run's task, none of them in `excluded`,
    from `generator`, and how many there are (`size` where there are plenty). Where a length has at
    most ENUMERATED sequences they are listed and `size` of those left drawn without repeats (all of
    them, each once, where fewer are left); otherwise they are drawn at random and any excluded one
    drawn again (`draw_excluding`, which names the set, `name`). A length the task does not draw
    (`sequence_counts`) has none: an empty batch."""
    task = cfg.task
    fixed, count = at_length(cfg, length), sequence_count(cfg, length)
    if count > ENUMERATED:
        return draw_excluding(fixed, size, generator, excluded, name), size
    if count:
        every = get_task(task.name).sources.every(length, task.vocab_size, copied(cfg))  # (count, length)
    else:
        every = torch.zeros(0, length, dtype=torch.long)  # a length the task does not draw: none
    lengths = torch.full((len(every),), length, dtype=torch.long)
    keys = sequence_keys(Batch(every, lengths, every, every))
    left = torch.tensor([i for i, key in enumerate(keys) if key not in excluded], dtype=torch.long)
    chosen = left[torch.randperm(len(left), generator=generator)[:size]]
    return task_batch(task.name, every[chosen], lengths[chosen], task.vocab_size), min(size, len(left))


def training_length_mix(cfg: DictConfig) -> list[dict]:
    """How holding out the validation and test sets changes a variable-length run's training mix:
    each length is drawn with equal chance, and a row that is a held-out sequence is drawn again,
    so a length whose sequences are largely held out is trained on less (never, where all are).
    -> one row per length where at least 1% of its sequences are held out: the held-out count, the
    number of sequences, and the share of training rows against the uniform share."""
    task = cfg.task
    if not task.variable_length:
        return []
    test, validation, _ = heldout_keys(cfg)
    held = {}
    for batch in (test, validation):
        for key, length in zip(sequence_keys(batch), batch.src_lengths.tolist()):
            held.setdefault(length, set()).add(key)
    lengths = range(task.min_length, task.length + 1)
    counts = {length: sequence_count(cfg, length) for length in lengths}
    kept = {length: 1 - len(held.get(length, ())) / counts[length] for length in lengths}
    total = sum(kept.values())
    return [
        {"length": length, "held_out": len(held[length]), "sequences": counts[length],
         "train_share": kept[length] / total, "uniform_share": 1 / len(lengths)}
        for length in lengths if length in held and len(held[length]) >= 0.01 * counts[length]
    ]  # fmt: skip
