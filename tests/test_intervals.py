"""The summary's intervals: a t-interval over seeds, never narrower than the held-out set's own
sampling uncertainty (a Wilson interval over the tokens or sequences one evaluation scores)."""

from __future__ import annotations

import math

import pandas as pd
import pytest
from scipy import stats

from copytask.reporting import tables
from copytask.reporting.tables import TARGET_STEP, interval, load, scored, summarise
from copytask.sweeps.grid import compose_grid
from copytask.training.loop import train

from .conftest import TINY

Z = stats.norm.ppf(0.975)


def wilson(successes: int, trials: int) -> tuple[float, float]:
    """The Wilson score interval as scipy.stats computes it (the code under test writes it out, to spare
    every compare scipy.stats' import)."""
    ci = stats.binomtest(successes, trials).proportion_ci(0.95, method="wilson")
    return ci.low, ci.high


@pytest.mark.parametrize("successes, trials", [(0, 16), (1, 16), (8, 16), (15, 16), (16, 16), (3, 512), (5119, 5120)])
def test_the_wilson_interval_is_scipys(successes, trials):
    assert tables.wilson(successes / trials, trials) == pytest.approx(wilson(successes, trials), abs=1e-12)


def test_every_seed_at_the_ceiling_still_gives_an_interval_a_rerun_can_fall_inside():
    mean, low, high = interval(pd.Series([1.0, 1.0, 1.0]), trials=512)
    assert mean == 1.0 and high == pytest.approx(1.0)
    assert low == pytest.approx(512 / (512 + Z**2)) and low < 0.993  # 99.3%: one seed at 99.6% falls inside


def test_every_seed_at_the_floor_gives_an_interval_above_zero():
    mean, low, high = interval(pd.Series([0.0, 0.0, 0.0]), trials=512)
    assert mean == 0.0 and low == pytest.approx(0.0, abs=1e-12)
    assert high == pytest.approx(wilson(0, 512)[1]) and high > 0.007


def test_seeds_that_differ_more_than_the_heldout_set_keep_their_t_interval():
    values = pd.Series([0.5, 0.7, 0.9])
    assert interval(values, trials=2560) == interval(values)  # the t-interval is the wider: unchanged
    assert interval(values)[1] == pytest.approx(0.7 - stats.t.ppf(0.975, 2) * 0.2 / math.sqrt(3))


def test_a_small_heldout_set_widens_the_interval_on_both_sides():
    mean, low, high = interval(pd.Series([0.8, 0.8, 0.81]), trials=20)
    assert (low, high) == pytest.approx(wilson(16, 20))


def test_without_trials_or_with_one_seed_the_interval_is_as_before():
    assert interval(pd.Series([1.0, 1.0])) == (1.0, 1.0, 1.0)  # steps to target: a plain t-interval
    mean, low, high = interval(pd.Series([1.0]), trials=512)
    assert mean == 1.0 and math.isnan(low) and math.isnan(high)  # one seed is a smoke test: no interval


def runs(eval_size: int | None, **extra) -> pd.DataFrame:
    rows = [
        {
            "attention": "bahdanau",
            "length": 10,
            "seed": seed,
            "token_acc": 1.0,
            "seq_acc": 1.0,
            "chance": 1 / 9,
            "params": 100,
            TARGET_STEP: 300.0,
            **extra,
        }
        for seed in range(3)
    ]
    table = pd.DataFrame(rows)
    return table if eval_size is None else table.assign(eval_size=eval_size)


def test_the_summary_widens_token_accuracy_by_the_tokens_and_sequence_accuracy_by_the_sequences_scored():
    [row] = summarise(runs(512)).itertuples()
    assert row.token_acc_lo == pytest.approx(5120 / (5120 + Z**2)) and row.seq_acc_lo == pytest.approx(
        512 / (512 + Z**2)
    )
    assert row.target_step_lo == row.target_step_hi == 300  # not an accuracy: the plain t-interval
    [old] = summarise(runs(None)).itertuples()  # a table without eval_size: as before
    assert old.token_acc_lo == old.seq_acc_lo == 1.0


def test_variable_lengths_score_their_mean_length_per_sequence():
    assert scored(runs(100, min_length=2)) == {"token_acc": 600, "seq_acc": 100}  # lengths 2-10: 6 on average
    assert scored(runs(100, min_length=math.nan)) == {"token_acc": 1000, "seq_acc": 100}  # a run from before min_length


def test_loaded_runs_carry_the_heldout_size_into_the_summary(tmp_path):
    _, grid = compose_grid([*TINY, f"runs_dir={tmp_path}", "attention=none", "task.length=3", "seed=0,1"])
    for run in grid:
        train(run.config)
    loaded = load(grid)
    assert list(loaded.table["eval_size"]) == [16, 16]
    [row] = summarise(loaded.table, loaded.settings).itertuples()
    t_only = interval(loaded.table["seq_acc"])
    assert row.seq_acc_lo <= min(t_only[1], wilson(round(row.seq_acc * 16), 16)[0]) + 1e-9
    assert row.seq_acc_hi >= max(t_only[2], wilson(round(row.seq_acc * 16), 16)[1]) - 1e-9
