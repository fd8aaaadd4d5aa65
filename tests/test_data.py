import pytest
import torch

import copytask
from copytask.data.batches import copied_positions, copied_source_positions, make_batch, task_batch
from copytask.data.tasks import TASKS
from copytask.data.vocab import BOS, EOS, NUM_SPECIAL, PAD

from .conftest import TASK_OPTIONS, TINY


def test_copy_batch_layout():
    batch = make_batch("copy", 4, 6, 9, torch.Generator().manual_seed(0))
    assert batch.src.shape == (4, 6) and batch.tgt_in.shape == (4, 7) and batch.tgt_out.shape == (4, 7)
    assert ((batch.src >= NUM_SPECIAL) & (batch.src < NUM_SPECIAL + 9)).all()
    assert torch.equal(batch.tgt_out[:, :6], batch.src) and (batch.tgt_out[:, 6] == EOS).all()
    assert (batch.tgt_in[:, 0] == BOS).all() and torch.equal(batch.tgt_in[:, 1:], batch.src)


def test_variable_lengths_are_padded_and_masked():
    batch = make_batch("copy", 64, 10, 5, torch.Generator().manual_seed(1), min_length=3)
    lengths = batch.src_lengths
    assert lengths.min() >= 3 and lengths.max() <= 10 and len(set(lengths.tolist())) > 1
    assert torch.equal(batch.src_mask, batch.src != PAD)
    assert torch.equal(batch.target_mask.sum(1), lengths + 1)  # symbols + EOS
    assert (batch.tgt_out.gather(1, lengths[:, None]) == EOS).all()
    assert torch.equal(batch.content_mask.sum(1), lengths)


def test_reverse_targets_are_reversed_sources():
    batch = make_batch("reverse", 32, 8, 9, torch.Generator().manual_seed(2), min_length=2)
    for src, length, tgt in zip(batch.src, batch.src_lengths, batch.tgt_out):
        assert tgt[:length].tolist() == src[:length].flip(0).tolist()
        assert tgt[length] == EOS


def test_same_seed_same_batches_and_select_trims():
    a = make_batch("copy", 8, 5, 9, torch.Generator().manual_seed(3), min_length=1)
    b = make_batch("copy", 8, 5, 9, torch.Generator().manual_seed(3), min_length=1)
    assert torch.equal(a.src, b.src)
    one = a.select([0])
    length = int(a.src_lengths[0])
    assert one.src.shape == (1, length) and one.tgt_out.shape == (1, length + 1)


def test_a_task_is_one_registry_entry_and_nothing_else(tmp_path, monkeypatch):
    """Issue 62: a task registered here, with no other file edited, is what its batches, alignment
    targets and a trained run follow: `swap` copies each pair of symbols in the other order."""

    def swap(steps, lengths):
        """Output step t copies source position t + 1 for even t, t - 1 for odd t (the last one of
        an odd length copies itself)."""
        partner = steps + 1 - 2 * (steps % 2)
        return torch.where(partner < lengths, partner, steps)

    monkeypatch.setitem(TASKS, "swap", swap)
    symbols, lengths = torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([5])
    assert task_batch("swap", symbols, lengths).tgt_out[0].tolist() == [4, 3, 6, 5, 7, EOS]
    assert copied_source_positions("swap", 5) == [1, 0, 3, 2, 4]
    metrics = copytask.train(copytask.compose([*TINY, "task.name=swap", "task.length=5", f"runs_dir={tmp_path}"]))
    assert metrics["steps"] == 10 and metrics["run"].startswith("luong_general-swap5-")
    with pytest.raises(ValueError, match=f"unknown task 'bogus'; choose one of {', '.join(TASKS)}$"):
        make_batch("bogus", 2, 5, 9, torch.Generator())


def test_an_unknown_task_is_refused_in_one_line():
    with pytest.raises(copytask.ConfigError, match=f"task.name must be one of {', '.join(TASKS)}, got 'bogus'"):
        copytask.compose([*TINY, "task.name=bogus"])


def test_every_registered_task_has_its_config_and_every_task_config_its_entry():
    assert {option.name for option in TASK_OPTIONS.values()} == set(TASKS)


@pytest.mark.parametrize(
    "positions, returned",
    [
        (lambda steps, lengths: steps, "shape (1, 5) for 3 sequences of 5 output steps"),
        (lambda steps, lengths: (steps + 1).expand(3, -1), "position 5 at output step 4 of a source of length 5"),
        (lambda steps, lengths: lengths - 2 - steps, "position -1 at output step 4 of a source of length 5"),
        (lambda steps, lengths: (steps + 0.0).expand(3, -1), "positions of dtype torch.float32"),
        (lambda steps, lengths: [0, 1], "a list"),
    ],
    ids=["one_row_for_the_batch", "past_the_source", "before_the_source", "float", "not_a_tensor"],
)
def test_a_task_that_breaks_the_registrys_contract_is_refused_by_name(monkeypatch, positions, returned):
    """Issue 70: a task returns one row of positions per sequence, each inside that sequence's
    source for t < length; anything else is refused naming the task and what it returned, never
    broadcast into one row for all or clamped into wrong targets."""
    monkeypatch.setitem(TASKS, "broken", positions)
    symbols, lengths = torch.tensor([[3, 4, 5, 6, 7]] * 3), torch.tensor([5, 5, 5])
    for draw in (lambda: task_batch("broken", symbols, lengths), lambda: copied_positions("broken", lengths, 5)):
        with pytest.raises(ValueError, match="task 'broken' returned ") as refused:
            draw()
        assert returned in str(refused.value) and "\n" not in str(refused.value)


def test_positions_past_a_sequences_length_are_not_read():
    """Only steps t < length are the task's: reverse's negative positions past a shorter sequence's
    end give PAD there, not an error."""
    batch = task_batch("reverse", torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.tensor([3, 1]))
    assert batch.tgt_out.tolist() == [[5, 4, 3, EOS], [6, EOS, PAD, PAD]]
