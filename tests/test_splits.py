"""The three disjoint sets (copytask.splits): the validation set holds no test sequence, training
holds neither, replaying a run's data stream gives exactly the batches it trained on, and every
set the analysis scores at a length leaves out what training drew and the validation set."""

from __future__ import annotations

import pytest
import torch

import copytask
from copytask.data import splits
from copytask.data.batches import task_batch
from copytask.data.vocab import noise_token
from copytask.evaluation import analysis
from copytask.models.build import build_model
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


SELECTIVE = [*TINY, "task=selective_copy", "task.length=4", "task.copied=2", "task.vocab_size=3", "train.eval_size=16"]


def test_selective_copyings_sets_are_keyed_by_the_whole_source_noise_placement_included(make_config):
    """Issue 82: C(4, 2) x 3^2 = 54 sources, up to 32 of them held out: the sets are disjoint by source, and
    two sources with the same symbols at other positions (one target) are two sequences, not one."""
    cfg = make_config(*SELECTIVE)
    test, validation, heldout = splits.heldout_keys(cfg)
    assert not keys(test) & keys(validation) and 16 < len(heldout) <= 32
    every = splits.unseen_at_length(cfg, 4, 100, torch.Generator(), set(), "every source")[0]
    assert len(keys(every)) == 54
    trained = splits.training_sequences(cfg, 60, heldout)  # 480 rows: every source left, many times over
    assert trained == keys(every) - heldout  # training draws every other source, and only those
    targets = {tuple(row) for row in validation.tgt_out.tolist()} | {tuple(row) for row in test.tgt_out.tolist()}
    assert len(targets) < len(heldout)  # some held-out sources share a target: keyed by source, not by target
    noise = noise_token(3)
    a, b = (task_batch("selective_copy", torch.tensor([row]), torch.tensor([4]), 3) for row in
            ([3, 4, noise, noise], [noise, 3, noise, 4]))  # fmt: skip
    assert torch.equal(a.tgt_out, b.tgt_out) and keys(a) != keys(b)


def test_a_length_selective_copying_does_not_draw_has_no_heldout_set_and_says_so(make_config):
    cfg = make_config(*SELECTIVE)
    assert splits.sequence_count(cfg, 2) == 0 and splits.sequence_count(cfg, 3) == 3 * 9
    batch, available = splits.heldout_at_length(cfg, 2, 16)
    assert available == 0 and len(batch) == 0
    batch, available = splits.heldout_at_length(cfg, 3, 100)  # every one of the 27 sources of length 3, once
    assert available == 27 and len(keys(batch)) == 27
    rows = analysis.length_generalisation(build_model(cfg), cfg, [2, 3])
    assert rows[0]["scored"] == 0 and rows[0]["token_acc"] is None and "not defined" in rows[0]["note"]
    assert rows[1]["scored"] == 16 and rows[1]["token_acc"] is not None


def test_too_few_selective_copying_sources_for_the_heldout_sets_are_refused():
    """C(4, 2) x 2^2 = 24 sources cannot hold 16 + 16 held out: refused in one line, naming k, before a run."""
    with pytest.raises(copytask.ConfigError, match=r"of task.length=4 with task.copied=2 over task.vocab_size=2 ") as e:
        copytask.compose([*SELECTIVE, "task.vocab_size=2"])
    assert "train.eval_size + train.val_size <= 12" in str(e.value) and "\n" not in str(e.value)


def test_selective_copyings_per_length_set_holds_no_trained_source_and_k_symbols_each(make_config):
    """Variable lengths 4-6 with k = 2: every length of the mixed set has k-symbol targets, and none of its
    sources is one training drew or the validation set holds."""
    cfg = make_config(*SELECTIVE, "task.variable_length=true", "task.min_length=4", "task.length=6")
    seen = splits.unscorable(cfg, 20)
    batch, notes = analysis.per_length_batch(cfg, seen, per_length=16)
    assert set(batch.src_lengths.tolist()) == {4, 5, 6} and not keys(batch) & seen
    assert batch.tgt_out.shape[1] == 3 and (batch.tgt_lengths == 2).all() and notes == []
