"""The one scoring rule (scoring.sequence_scores): an output is its tokens up to and with its
first EOS; content positions after it are wrong whatever the decoder emitted there, and an output
that never emits EOS is scored over the target's length. Hand-made outputs pin it."""

from __future__ import annotations

import torch

from copytask.data.batches import task_batch
from copytask.data.scoring import output_mask, sequence_scores
from copytask.data.vocab import EOS, noise_token

A, B, C, D, X = 3, 4, 5, 6, 7  # content symbols (the first three ids are PAD, BOS, EOS)


def scores(*outputs: list[int]):
    """Each output scored against the target `a b c d EOS`."""
    batch = task_batch("copy", torch.tensor([[A, B, C, D]] * len(outputs)), torch.tensor([4] * len(outputs)), 9)
    return sequence_scores(torch.tensor(outputs), batch)


def test_a_right_output_scores_every_symbol_and_the_sequence():
    result = scores([A, B, C, D, EOS])
    assert result.hits.tolist() == [4] and result.symbols.tolist() == [4]
    assert result.exact.tolist() == [True] and result.early.tolist() == [False]


def test_right_symbols_after_an_early_eos_are_wrong():
    """The decoder said the sequence is over after `a b`: its `d` at position 3 is no output.
    The old rule credited it (3 of 4)."""
    result = scores([A, B, EOS, D, EOS])
    assert result.hits.tolist() == [2] and result.early.tolist() == [True] and result.exact.tolist() == [False]


def test_an_eos_first_scores_nothing():
    result = scores([EOS, B, C, D, EOS])
    assert result.hits.tolist() == [0] and result.early.tolist() == [True]


def test_an_output_without_eos_is_scored_over_the_targets_length():
    result = scores([A, X, C, D, X], [A, B, C, D, D])
    assert result.hits.tolist() == [3, 4]  # no EOS: every content position counts as emitted
    assert result.early.tolist() == [False, False] and result.exact.tolist() == [False, False]  # the EOS is missing


def test_the_output_ends_with_its_first_eos():
    mask = output_mask(torch.tensor([[A, EOS, B, EOS], [A, B, C, D], [EOS, A, A, A]]))
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True], [True, False, False, False]]


def test_a_target_shorter_than_its_source_is_scored_over_its_own_symbols():
    """Issue 82: selective copying's source `_ a _ b c _` (noise `_`) has the target `a b c EOS`: three symbols
    are scored, not six; the output ends at its first EOS there too, and an EOS where the target has one is
    not early. A second source of the batch with fewer symbols is scored over its own two."""
    noise = noise_token(9)
    sources = torch.tensor([[noise, A, noise, B, C, noise], [A, noise, noise, noise, noise, D]])
    batch = task_batch("selective_copy", sources, torch.tensor([6, 6]), 9)
    assert batch.tgt_out.tolist() == [[A, B, C, EOS], [A, D, EOS, 0]]
    result = sequence_scores(torch.tensor([[A, B, C, EOS], [A, EOS, D, EOS]]), batch)
    assert result.symbols.tolist() == [3, 2] and result.hits.tolist() == [3, 1]
    assert result.exact.tolist() == [True, False] and result.early.tolist() == [False, True]
