"""Where the baseline breaks (issue 69): teacher-forced accuracy by the one scoring rule, and the
linear probe of the summary vector, on outputs and states whose answer is known."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from copytask.console import ConfigError
from copytask.data.batches import Batch, make_batch, task_batch
from copytask.data.scoring import accuracy
from copytask.data.splits import heldout_keys, sequence_keys, training_sequences
from copytask.data.vocab import EOS, noise_token, total_vocab
from copytask.evaluation.breakdown import teacher_forced
from copytask.evaluation.probe import (
    fit_probe,
    fitting_set,
    mean_accuracy,
    one_hot,
    position_accuracy,
    ridge_path,
    source_labels,
    untrained,
)

from .conftest import TINY

V, L = 5, 6


class Oracle(nn.Module):
    """Logits whose argmax is `tokens` (B, T_dec), whatever the input: a teacher-forced argmax known in advance."""

    def __init__(self, tokens: torch.Tensor):
        super().__init__()
        self.tokens = tokens

    def forward(self, src, src_lengths, tgt_in):
        return nn.functional.one_hot(self.tokens, total_vocab(V)).float(), None


def copy_labels(batch):
    """The probe's labels of a batch of the copy task: the symbol at each source position."""
    return source_labels(batch, "copy", V)


def test_the_probe_reads_each_copied_symbol_in_source_order():
    """Issue 82: copy's labels are its sources' symbols by position (as before the registry had targets
    shorter than their sources), reverse's too (in source order, not output order); selective copying's
    are its content symbols in order, the noise left out."""
    batch = make_batch("copy", 8, L, V, torch.Generator().manual_seed(0), min_length=2)
    labels, valid = copy_labels(batch)
    assert torch.equal(valid, batch.src_mask) and torch.equal(labels, (batch.src - 3).clamp(min=0))
    reverse = task_batch("reverse", batch.src, batch.src_lengths, V)
    assert all(torch.equal(got, want) for got, want in zip(source_labels(reverse, "reverse", V), (labels, valid)))
    noise = noise_token(V)
    selective = task_batch("selective_copy", torch.tensor([[noise, 5, noise, 7, 3], [4, noise, noise, noise, 7]]),
                           torch.tensor([5, 5]), V)  # fmt: skip
    labels, valid = source_labels(selective, "selective_copy", V)
    assert labels.tolist() == [[2, 4, 0], [1, 4, 0]] and valid.tolist() == [[True, True, True], [True, True, False]]


def test_teacher_forced_accuracy_is_all_right_where_its_argmax_is_the_target():
    batch = make_batch("copy", 16, L, V, torch.Generator().manual_seed(0))
    tokens = teacher_forced(Oracle(batch.tgt_out), batch)
    assert torch.equal(tokens, batch.tgt_out)
    scored = accuracy(tokens, batch)
    assert scored["token_acc"] == 1 and scored["seq_acc"] == 1 and scored["by_position"] == [1.0] * L
    assert scored["ended_early"] == 0


def test_teacher_forced_accuracy_ends_each_output_at_its_first_eos():
    """An EOS at position 2 ends the output: the right symbols after it are wrong."""
    batch = make_batch("copy", 16, L, V, torch.Generator().manual_seed(0))
    tokens = batch.tgt_out.clone()
    tokens[:, 2] = EOS
    scored = accuracy(teacher_forced(Oracle(tokens), batch), batch)
    assert scored["token_acc"] == pytest.approx(2 / L) and scored["seq_acc"] == 0 and scored["ended_early"] == 1
    assert scored["by_position"] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


RIDGES = [1e-6, 1e-4, 1e-2, 1.0]


def probe_accuracy(features_of, size: int = 2000, labels_of=copy_labels) -> list[float]:
    """Fit the probe on `size` sequences' features, score it on 1000 others -> accuracy by source position."""
    fitting, heldout = (
        make_batch("copy", n, L, V, torch.Generator().manual_seed(s)) for n, s in ((size, 1), (1000, 2))
    )
    (fit_labels, fit_valid), (test_labels, test_valid) = labels_of(fitting), labels_of(heldout)
    weights, bias, _ = fit_probe(features_of(fitting), fit_labels, fit_valid, V, RIDGES)
    return position_accuracy(weights, bias, features_of(heldout), test_labels, test_valid, V)


def linear_code(batch) -> torch.Tensor:
    """States that hold each symbol linearly: the one-hot sources through a fixed random map."""
    mixing = torch.randn(L * V, 48, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return one_hot(*copy_labels(batch), V) @ mixing


def test_teacher_forcing_in_chunks_of_shorter_sequences_gives_the_whole_batchs_width(make_config):
    """A chunk whose sequences are all shorter than the batch's longest is trimmed to them (`Batch.select`):
    its argmax is padded back, so chunks of any lengths join and score as the batch in one piece does."""
    cfg = make_config(*TINY, f"task.vocab_size={V}", "task.length=6")
    model, stream = untrained(cfg), torch.Generator().manual_seed(0)
    batch = Batch.concat([make_batch("copy", 4, length, V, stream) for length in (3, 6)], 6)
    chunked, whole = teacher_forced(model, batch, chunk_size=4), teacher_forced(model, batch, chunk_size=len(batch))
    assert chunked.shape == whole.shape == batch.tgt_out.shape
    assert torch.equal(chunked[batch.target_mask], whole[batch.target_mask])
    assert accuracy(chunked, batch) == accuracy(whole, batch)


def test_the_probe_reads_states_that_encode_each_symbol_linearly():
    assert min(probe_accuracy(linear_code)) > 0.99


def test_the_probe_is_at_chance_on_noise():
    noise = torch.Generator().manual_seed(4)
    accuracies = probe_accuracy(lambda batch: torch.randn(len(batch), 48, generator=noise, dtype=torch.float64))
    assert all(abs(a - 1 / V) < 0.06 for a in accuracies), accuracies  # 1000 sequences: chance +- 4 sd


def test_each_penalty_of_the_path_is_the_ridge_solution():
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(50, 8, generator=generator, dtype=torch.float64)
    targets = torch.randn(50, 3, generator=generator, dtype=torch.float64)
    for ridge, (weights, bias) in zip(RIDGES, ridge_path(features, targets, RIDGES)):
        x, y = features - features.mean(0), targets - targets.mean(0)
        expected = torch.linalg.solve(x.T @ x / 50 + ridge * torch.eye(8, dtype=torch.float64), x.T @ y / 50)
        torch.testing.assert_close(weights, expected)
        torch.testing.assert_close(bias, targets.mean(0) - features.mean(0) @ expected)


def test_the_penalty_is_chosen_on_held_out_fitting_data():
    """Few sequences, many noisy dimensions: the smallest penalty fits the noise and reads new sequences
    worse than the one chosen on the held-out quarter."""
    noise = torch.Generator().manual_seed(6)

    def noisy(batch):
        return linear_code(batch) + 3 * torch.randn(len(batch), 48, generator=noise, dtype=torch.float64)

    fitting, heldout = (make_batch("copy", n, L, V, torch.Generator().manual_seed(s)) for n, s in ((80, 1), (1000, 2)))
    features, test_features = noisy(fitting), noisy(heldout)
    (labels, valid), (test_labels, test_valid) = copy_labels(fitting), copy_labels(heldout)
    weights, bias, chosen = fit_probe(features, labels, valid, V, RIDGES)
    assert chosen > RIDGES[0]
    (smallest, smallest_bias), *_ = ridge_path(features, one_hot(labels, valid, V), RIDGES[:1])
    read = mean_accuracy(position_accuracy(weights, bias, test_features, test_labels, test_valid, V))
    overfitted = mean_accuracy(position_accuracy(smallest, smallest_bias, test_features, test_labels, test_valid, V))
    assert read > overfitted + 0.05


def control_task_map() -> torch.Tensor:
    """A control task (Hewitt and Liang, 2019), as probe.py's: a random label of the V for each (position, symbol),
    (L, V)."""
    return torch.randint(V, (L, V), generator=torch.Generator().manual_seed(7))


def control_task(batch):
    """The control task's labels of `batch`'s sources."""
    labels, valid = copy_labels(batch)
    return control_task_map()[torch.arange(L), labels], valid


def bijection(batch):
    """The symbols relabelled by a permutation of its own at each position: a control task with the task's chance."""
    labels, valid = copy_labels(batch)
    generator = torch.Generator().manual_seed(8)
    permutations = torch.stack([torch.randperm(V, generator=generator) for _ in range(L)])  # (L, V)
    return permutations[torch.arange(L), labels], valid


def half_read(batch) -> torch.Tensor:
    """`linear_code` with noise (the same for the same batch) that leaves a probe about half of the symbols."""
    noise = torch.randn(len(batch), 48, generator=torch.Generator().manual_seed(len(batch)), dtype=torch.float64)
    return linear_code(batch) + 6 * noise


def test_a_control_task_of_the_symbols_is_read_as_well_as_the_symbols_by_a_linear_probe():
    """On states that hold every symbol linearly, its labels (a function of the symbol) are read everywhere."""
    assert min(probe_accuracy(linear_code, labels_of=control_task)) > 0.99


def test_a_control_task_with_the_tasks_chance_is_read_exactly_as_the_task_selectivity_0_by_construction():
    """A least-squares probe fits each output column on its own (one penalty for all), so relabelling the symbols by
    a bijection at each position permutes its columns: the same accuracy at every position, whatever it reads."""
    task, control = probe_accuracy(half_read), probe_accuracy(half_read, labels_of=bijection)
    assert 0.3 < mean_accuracy(task) < 0.8 and control == task


def test_the_merged_control_task_is_the_symbols_probe_coarsened_and_neither_bounds_the_other():
    """probe.py's control merges symbols at each position (its labels are drawn per (position, symbol) from the V
    symbols). The probe is linear in its targets, so at one penalty its score for a control label is the sum of its
    scores for the symbols the label merges: the control reads the task's scores coarsened, not anything a probe
    memorises. And it is not easier: in some cells the symbol is read and its label is not (the merged rivals
    outscore it), in others the label is read and the symbol is not."""
    fitting, heldout = (
        make_batch("copy", n, L, V, torch.Generator().manual_seed(s)) for n, s in ((2000, 1), (1000, 2))
    )
    (labels, valid), (control, _) = copy_labels(fitting), control_task(fitting)
    features, test_features = half_read(fitting), half_read(heldout)
    [(weights, bias)] = ridge_path(features, one_hot(labels, valid, V), [1e-2])
    [(control_weights, control_bias)] = ridge_path(features, one_hot(control, valid, V), [1e-2])
    scores = (test_features @ weights + bias).view(-1, L, V)  # (B, L, V) the symbols' scores
    control_scores = (test_features @ control_weights + control_bias).view(-1, L, V)
    merge = torch.nn.functional.one_hot(control_task_map(), V).double()  # (L, V symbols, V labels)
    torch.testing.assert_close(control_scores, torch.einsum("bls,lsc->blc", scores, merge))
    (test_labels, _), (test_control, _) = copy_labels(heldout), control_task(heldout)
    read, control_read = scores.argmax(-1) == test_labels, control_scores.argmax(-1) == test_control
    assert (read & ~control_read).any() and (control_read & ~read).any()


def test_the_probes_fitting_sequences_are_none_the_run_has_seen_at_the_default_sweeps_seeds(make_config):
    """Five symbols, length 6 (15,625 sequences): the fitting set (with the default analysis.probe_seed)
    holds no sequence of the run's training batches, validation set or test set, for every seed of the
    default sweep, the one equal to the probe's seed included."""
    for seed in (0, 1, 2):
        cfg = make_config(*TINY, "task.vocab_size=5", "task.length=6", "train.batch_size=64", f"seed={seed}")
        test, validation, heldout = heldout_keys(cfg)
        seen = training_sequences(cfg, cfg.train.steps, heldout)
        fitting, note = fitting_set(cfg, 2048, seed=cfg.analysis.probe_seed, steps=cfg.train.steps)
        keys = set(sequence_keys(fitting))
        assert len(fitting) == len(keys) == 2048 and note is None
        assert not keys & seen and not keys & heldout


def test_a_length_with_too_few_unseen_sequences_fits_on_those_there_are_and_says_so(make_config):
    """Two symbols, length 8: 256 sequences, 96 in the validation and test sets, and the training batches
    draw most of the rest."""
    cfg = make_config(*TINY, "task.vocab_size=2", "task.length=8", "train.eval_size=48", "train.val_size=48")
    *_, heldout = heldout_keys(cfg)
    seen = training_sequences(cfg, cfg.train.steps, heldout) | heldout
    fitting, note = fitting_set(cfg, 400, seed=1, steps=cfg.train.steps)
    assert len(fitting) == 256 - len(seen) and not set(sequence_keys(fitting)) & seen
    assert note.startswith(f"fitted on {len(fitting)} sequences") and "asked for 400" in note


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
        ("analysis.probe_ridges=[1,-1]", "each of analysis.probe_ridges must be a finite number > 0, got -1.0"),
        ("analysis.probe_ridges=[0]", "each of analysis.probe_ridges must be a finite number > 0, got 0.0"),
        ("analysis.probe_ridges=[nan]", "each of analysis.probe_ridges must be a finite number > 0, got nan"),
        ("analysis.probe_ridges=[]", "analysis.probe_ridges must list at least one penalty, got []"),
        ("analysis.probe_seed=-1", "analysis.probe_seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_breakdown_settings_are_refused_in_one_line_naming_the_value(tmp_path, override, says):
    from copytask.api import compose

    with pytest.raises(ConfigError) as refused:
        compose([*TINY, f"runs_dir={tmp_path}", override])
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()


def test_the_share_of_the_gain_missing_given_the_true_prefix_pairs_seeds_and_has_an_interval():
    """(attention greedy - baseline teacher-forced) / (attention greedy - baseline greedy), per seed
    against the baseline's run of that seed; no share where there is no gain."""
    import pandas as pd
    from scipy import stats

    from copytask.reporting.breakdown_section import missing_share, shown_share

    rows = [
        ("10", "none", seed, greedy, tf) for seed, greedy, tf in ((0, 0.90, 0.96), (1, 0.88, 0.95), (2, 0.90, 0.97))
    ] + [("10", "bahdanau", seed, greedy, 1.0) for seed, greedy in ((2, 0.99), (0, 1.0), (1, 1.0))]
    rows += [("5", "none", seed, 0.997, 0.998) for seed in range(3)]
    rows += [("5", "bahdanau", seed, greedy, 1.0) for seed, greedy in ((0, 0.999), (1, 0.996), (2, 0.999))]
    table = pd.DataFrame(rows, columns=["train_length", "attention", "seed", "greedy_token_acc", "tf_token_acc"])
    shares = missing_share(table, ["train_length"]).set_index("train_length")
    expected = [0.04 / 0.10, 0.05 / 0.12, 0.02 / 0.09]  # seeds 0, 1, 2
    mean = sum(expected) / 3
    half = stats.t.ppf(0.975, 2) * pd.Series(expected).std() / 3**0.5
    ten = shares.loc["10"]
    assert ten["pairs"] == 3 and ten["share"] == pytest.approx(mean)
    assert (ten["share_lo"], ten["share_hi"]) == pytest.approx((mean - half, mean + half))
    assert shown_share(ten) == f"{100 * mean:.1f} [{100 * (mean - half):.1f}, {100 * (mean + half):.1f}]"
    assert shown_share(shares.loc["5"]) == "no gain"  # seed 1's gain is below zero
