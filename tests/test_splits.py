"""The three disjoint sets (copytask.splits): the validation set holds no test sequence, training
holds neither, replaying a run's data stream gives exactly the batches it trained on, and every
set the analysis scores at a length leaves out what training drew and the validation set."""

from __future__ import annotations

import pytest
import torch

from copytask.data import splits
from copytask.evaluation import analysis
from copytask.training.loop import train

from .conftest import TINY

VARIABLE = [*TINY, "task.variable_length=true", "task.min_length=1", "task.length=4", "train.patience=null"]


def keys(batch) -> set[bytes]:
    return set(splits.sequence_keys(batch))


def test_the_validation_set_is_its_own_draw_and_holds_no_test_sequence(make_config):
    cfg = make_config(*TINY, "task.length=2", "train.eval_size=24")  # 81 sequences: overlaps are likely unless excluded
    test, validation, heldout = splits.heldout_keys(cfg)
    assert not keys(test) & keys(validation) and heldout == keys(test) | keys(validation)
    other = splits.validation_batch(make_config(*TINY, "task.length=2", "train.eval_size=24", "train.val_seed=7"))
    assert keys(other) != keys(validation)  # train.val_seed draws it


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # train_step is replaced
def test_replaying_a_runs_data_stream_gives_the_sequences_it_trained_on(make_config, monkeypatch):
    cfg = make_config(*VARIABLE)
    seen = []
    monkeypatch.setattr(
        "copytask.training.loop.train_step",
        lambda model, optimizer, batch, clip: seen.append(batch) or torch.tensor(1.0),
    )
    metrics = train(cfg)
    trained = set().union(*(keys(batch) for batch in seen))
    assert splits.training_sequences(cfg, metrics["steps"]) == trained
    assert splits.training_sequences(cfg, metrics["steps"] - 1) != trained  # it counts the steps


def test_a_heldout_set_at_a_trained_length_leaves_out_training_and_validation_sequences(make_config):
    """Lengths 1-4 over 9 symbols: 80 training rows, 16 validation and 16 test sequences. The old
    per-length set was a fresh draw that training had partly drawn too."""
    cfg = make_config(*VARIABLE)
    trained = splits.training_sequences(cfg, cfg.train.steps)
    _, validation, _ = splits.heldout_keys(cfg)
    for length in range(1, 5):
        batch, available = splits.heldout_at_length(cfg, length, 64, splits.unscorable(cfg, cfg.train.steps))
        assert set(batch.src_lengths.tolist()) <= {length} and len(batch) == available
        assert not keys(batch) & (trained | keys(validation))
        assert len(keys(batch)) == len(batch)  # at a short length each sequence once
        left = 9**length - len({k for k in trained | keys(validation) if len(k) == 8 * length})
        assert available == min(64, left)
    assert splits.unscorable(cfg, cfg.train.steps) == trained | keys(validation)
    with pytest.raises(ValueError, match="unscorable"):
        splits.heldout_at_length(cfg, 2, 64)


def test_the_test_set_is_the_heldout_set_at_a_fixed_length_runs_own_length(make_config):
    cfg = make_config(*TINY, "task.length=5")
    batch, available = splits.heldout_at_length(cfg, 5, 16)
    assert torch.equal(batch.src, splits.test_batch(cfg).src) and available == 16


def test_the_per_length_set_holds_no_trained_sequence_and_names_the_short_lengths(make_config):
    cfg = make_config(*VARIABLE)
    seen = splits.unscorable(cfg, cfg.train.steps)
    batch, notes = analysis.per_length_batch(cfg, seen, per_length=16)
    assert not keys(batch) & seen
    assert batch.src_lengths.tolist() != sorted(batch.src_lengths.tolist())  # shuffled: every chunk mixes lengths
    assert len(notes) == 1 and "of the 9 sequences of length 1" in notes[0]  # only length 1 has fewer than 16 left


def test_the_length_mix_says_which_lengths_training_draws_less(make_config):
    """The default variable-length set-up from length 1: all 9 length-1 sequences are held out, so
    training never draws length 1 and draws the others a little more often."""
    cfg = make_config("task.variable_length=true", "task.min_length=1", "task.length=20")
    mix = {row["length"]: row for row in splits.training_length_mix(cfg)}
    assert mix[1]["held_out"] == 9 and mix[1]["train_share"] == 0 and mix[1]["uniform_share"] == pytest.approx(1 / 20)
    assert 0 < mix[2]["train_share"] < 1 / 20 and max(mix) <= 4  # from length 5 on, under 1% is held out
    assert splits.training_length_mix(make_config("task.length=20")) == []
