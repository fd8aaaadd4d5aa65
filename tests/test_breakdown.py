"""Where the baseline breaks (issue 69): teacher-forced accuracy by the one scoring rule, and the
linear probe of the summary vector, on outputs and states whose answer is known."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from copytask.console import ConfigError
from copytask.data.batches import make_batch
from copytask.data.splits import heldout_keys, sequence_keys
from copytask.data.vocab import EOS, total_vocab
from copytask.evaluation.breakdown import accuracy, teacher_forced
from copytask.evaluation.probe import fit, fitting_set, one_hot_sources, position_accuracy, untrained

from .conftest import TINY

V, L = 5, 6


class Oracle(nn.Module):
    """Logits whose argmax is `tokens` (B, T_dec), whatever the input: a teacher-forced argmax known in advance."""

    def __init__(self, tokens: torch.Tensor):
        super().__init__()
        self.tokens = tokens

    def forward(self, src, src_lengths, tgt_in):
        return nn.functional.one_hot(self.tokens, total_vocab(V)).float(), None


def test_teacher_forced_accuracy_is_all_right_where_its_argmax_is_the_target():
    batch = make_batch("copy", 16, L, V, torch.Generator().manual_seed(0))
    tokens = teacher_forced(Oracle(batch.tgt_out), batch)
    assert torch.equal(tokens, batch.tgt_out)
    scored = accuracy(tokens, batch)
    assert scored["token_acc"] == 1 and scored["seq_acc"] == 1 and scored["by_position"] == [1.0] * L


def test_teacher_forced_accuracy_ends_each_output_at_its_first_eos():
    """An EOS at position 2 ends the output: the right symbols after it are wrong."""
    batch = make_batch("copy", 16, L, V, torch.Generator().manual_seed(0))
    tokens = batch.tgt_out.clone()
    tokens[:, 2] = EOS
    scored = accuracy(teacher_forced(Oracle(tokens), batch), batch)
    assert scored["token_acc"] == pytest.approx(2 / L) and scored["seq_acc"] == 0
    assert scored["by_position"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def probe_accuracy(features_of, size: int = 2000) -> list[float]:
    """Fit the probe on `size` sequences' features, score it on 1000 others -> accuracy by source position."""
    fitting, heldout = (
        make_batch("copy", n, L, V, torch.Generator().manual_seed(s)) for n, s in ((size, 1), (1000, 2))
    )
    weights, bias = fit(features_of(fitting), one_hot_sources(fitting, V), ridge=1e-6)
    return position_accuracy(weights, bias, features_of(heldout), heldout, V)


def test_the_probe_reads_states_that_encode_each_symbol_linearly():
    mixing = torch.randn(L * V, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    accuracies = probe_accuracy(lambda batch: one_hot_sources(batch, V) @ mixing)
    assert min(accuracies) > 0.99


def test_the_probe_is_at_chance_on_noise():
    noise = torch.Generator().manual_seed(4)
    accuracies = probe_accuracy(lambda batch: torch.randn(len(batch), 48, generator=noise, dtype=torch.float64))
    assert all(abs(a - 1 / V) < 0.06 for a in accuracies), accuracies  # 1000 sequences: chance +- 4 sd


def test_the_probes_fitting_sequences_are_in_neither_the_validation_nor_the_test_set(make_config):
    """Two symbols, length 8: 256 sequences, of which the validation and test sets hold 96; a fitting
    set of 400 drawn freely would hold most of them."""
    cfg = make_config(*TINY, "task.vocab_size=2", "task.length=8", "train.eval_size=48", "train.val_size=48")
    test, validation, _ = heldout_keys(cfg)
    fitting = set(sequence_keys(fitting_set(cfg, 400, seed=1)))
    assert not fitting & set(sequence_keys(test)) and not fitting & set(sequence_keys(validation))


def test_the_untrained_control_is_the_model_training_starts_from_and_leaves_the_random_state(make_config):
    cfg = make_config(*TINY, "attention=none", "seed=5")
    state = torch.random.get_rng_state()
    control = untrained(cfg)
    assert torch.equal(torch.random.get_rng_state(), state)
    from copytask.models.build import build_model

    torch.manual_seed(5)  # as training seeds the model's initialisation (training.loop.set_up)
    for mine, trained_from in zip(control.parameters(), build_model(cfg).parameters()):
        assert torch.equal(mine, trained_from)


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("analysis.beam_widths=[4,0]", "analysis.beam_widths must be an integer from 1 to 64, got 0"),
        ("analysis.beam_widths=[65]", "analysis.beam_widths must be an integer from 1 to 64, got 65"),
        ("analysis.beam_widths=[2.5]", "analysis.beam_widths"),
        ("analysis.probe_size=1", "analysis.probe_size must be an integer >= 2, got 1"),
        ("analysis.probe_size=10000000", "analysis.probe_size must be an integer from 2 to 1000000, got 10000000"),
        ("analysis.probe_ridge=-1", "analysis.probe_ridge must be a finite number >= 0, got -1.0"),
        ("analysis.probe_ridge=nan", "analysis.probe_ridge must be a finite number >= 0, got nan"),
        ("analysis.probe_seed=-1", "analysis.probe_seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_breakdown_settings_are_refused_in_one_line_naming_the_value(tmp_path, override, says):
    from copytask.api import compose

    with pytest.raises(ConfigError) as refused:
        compose([*TINY, f"runs_dir={tmp_path}", override])
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()
