"""Settings that no run can finish are refused before anything is written: a held-out set that
leaves too few sequences to train on, and sizes that no memory of this machine holds."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from copytask.config.checks import validate
from copytask.console import ConfigError
from copytask.data import splits
from copytask.data.heldout import heldout_share
from copytask.data.splits import heldout_keys, sequence_keys, training_batch
from copytask.families import memory

from .conftest import ATTENTION_OPTIONS, TINY, pythonpath


@pytest.mark.slow
def test_a_heldout_set_of_every_sequence_is_refused_through_the_cli_at_once(tmp_path):
    """The command of issue 19: 8 possible sequences, 128 held out. It used to loop for ever in
    `training_batch`; the timeout turns such a hang into a failure."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0"}
    command = [
        sys.executable,
        "-m",
        "copytask",
        "train",
        "experiment=quick",
        "task.vocab_size=2",
        "task.length=3",
        "train.progress=false",
        f"runs_dir={tmp_path}",
    ]
    process = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert process.returncode == 2
    [line] = process.stderr.strip().splitlines()
    assert (
        line.startswith("copytask: error: ")
        and "train.eval_size=128 + train.val_size=128" in line
        and "task.length=3" in line
    )
    assert (
        "task.vocab_size=2" in line and "train.eval_size + train.val_size <= 4" in line
    )  # 4 of the 8 sequences may be held out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "overrides, advice",
    [
        # 9 sequences, 16 test and 16 validation ones held out
        (["task.length=1"], "train.eval_size + train.val_size <= 4, task.length >= 2 or task.vocab_size >= 64"),
        (
            ["task.length=2", "task.vocab_size=2", "train.eval_size=3", "train.val_size=1"],
            "train.eval_size + train.val_size <= 2, task.length >= 3 or task.vocab_size >= 3",
        ),
        # lengths 1-3 over 2 symbols: every length-1 and length-2 sequence can be held out
        (
            ["task.length=3", "task.vocab_size=2", "task.variable_length=true", "task.min_length=1"],
            "train.eval_size + train.val_size <= 1",
        ),
    ],
)
def test_a_heldout_set_that_leaves_too_few_training_sequences_is_refused_naming_what_works(
    make_config, overrides, advice
):
    cfg = make_config(*TINY, *overrides)
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    message = str(refused.value)
    assert (
        "\n" not in message
        and f"train.eval_size={cfg.train.eval_size} + train.val_size={cfg.train.val_size}" in message
    )
    assert advice in message


@pytest.mark.slow
def test_the_advice_of_a_refusal_is_accepted(make_config):
    """Each value the message proposes, alone, makes the config valid, and one step short of it does not."""
    base = [*TINY, "task.length=3", "task.vocab_size=2", "train.eval_size=16", "train.val_size=1"]
    with pytest.raises(
        ConfigError, match=r"train.eval_size \+ train.val_size <= 4, task.length >= 6 or task.vocab_size >= 4"
    ):
        validate(make_config(*base))
    for fix, short in (
        ("train.eval_size=3", "train.eval_size=4"),
        ("task.length=6", "task.length=5"),
        ("task.vocab_size=4", "task.vocab_size=3"),
    ):
        validate(make_config(*base, fix))
        with pytest.raises(ConfigError):
            validate(make_config(*base, short))


def test_the_heldout_share_bounds_how_often_a_fresh_training_row_is_held_out():
    assert heldout_share(length=3, vocab_size=2, eval_size=128) == 1  # all 8 sequences
    assert heldout_share(length=3, vocab_size=2, eval_size=2) == 2 / 8
    assert heldout_share(length=20, vocab_size=9, eval_size=512) < 1e-15
    # lengths 1 and 2 equally likely: all 2 of length 1, at most 3 of the 4 of length 2
    assert heldout_share(length=2, vocab_size=2, eval_size=3, min_length=1) == pytest.approx((1 + 3 / 4) / 2)
    # the default variable-length run: lengths 1-20 over 9 symbols, 512 held out
    assert heldout_share(length=20, vocab_size=9, eval_size=512, min_length=1) < 0.15
    assert (
        heldout_share(length=10**9, vocab_size=10**9, eval_size=10**9, min_length=1) < 1e-6
    )  # huge values answer at once


@pytest.mark.parametrize("min_length", [None, 1])
def test_training_batch_stops_with_an_error_where_every_sequence_is_held_out(make_config, monkeypatch, min_length):
    """The safety net under `validate`: a caller that skips it gets an error, not a loop. The old
    code redrew for ever; counting its draws turns that hang into a failure."""
    extra = [] if min_length is None else ["task.variable_length=true", f"task.min_length={min_length}"]
    cfg = make_config(*TINY, "task.length=2", "task.vocab_size=2", "train.eval_size=64", *extra)
    heldout = set(sequence_keys(splits.test_batch(cfg)))
    assert len(heldout) == (4 if min_length is None else 6)  # every sequence there is
    draws, real = 0, splits.sample_batch

    def counted(*args):
        nonlocal draws
        draws += 1
        if draws > 100_000:
            pytest.fail("training_batch redraws for ever")
        return real(*args)

    monkeypatch.setattr("copytask.data.splits.sample_batch", counted)
    with pytest.raises(
        ConfigError,
        match=r"training batch.*held-out.*train.val_size=16, train.eval_size=64.*task.length=2.*task.vocab_size=2",
    ):
        training_batch(cfg, torch.Generator().manual_seed(0), heldout)


def test_training_batch_still_excludes_every_heldout_sequence(make_config):
    cfg = make_config(*TINY, "task.length=2", "train.eval_size=32", "train.batch_size=256")
    test, checks, heldout = heldout_keys(cfg)
    assert len(heldout) > len(set(sequence_keys(test)))  # the validation set's sequences are held out too
    batch = training_batch(cfg, torch.Generator().manual_seed(0), heldout)
    assert not set(sequence_keys(batch)) & heldout and len(batch) == 256


ISSUE_SIZES = ["attention=scaled_dot", "task=reverse", "task.length=1000000", "model.embedding_size=1000000"]


def test_sizes_no_machine_holds_are_refused_in_one_line_naming_the_estimate_and_the_memory(tmp_path, capsys):
    """Issue 19's command: the kernel killed it for memory after a minute."""
    from copytask.cli import main

    assert main(["train", *ISSUE_SIZES, f"runs_dir={tmp_path}"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("copytask: error: this configuration needs about ") and " PiB of memory" in line
    assert f"more than this machine's {memory.human_bytes(memory.machine_memory())}" in line
    assert "task.length=1000000" in line
    assert not any(tmp_path.iterdir())


def test_the_memory_check_compares_the_estimate_with_the_machines_memory(make_config, monkeypatch):
    """A configuration just under the memory there is runs, however large; just over it is refused:
    without torch on all but the attention's own parameters and activations (`validate`), and on the
    whole model where it is built (`check_buildable`)."""
    from copytask.models.build import build_model, check_buildable
    from copytask.models.recurrent import count_parameters

    cfg = make_config(*TINY, "task.length=40", "attention=bahdanau")
    model = build_model(cfg)
    needed = sum(memory.memory_estimate(cfg, count_parameters(model), model.attention.training_floats()).values())
    without_attention = sum(memory.memory_estimate(cfg).values())
    assert without_attention < needed
    monkeypatch.setattr(memory, "machine_memory", lambda: needed)
    validate(cfg)
    random_state = torch.random.get_rng_state()
    check_buildable(cfg)
    assert torch.equal(torch.random.get_rng_state(), random_state)  # built on the meta device: nothing drawn
    monkeypatch.setattr(memory, "machine_memory", lambda: needed - 1)
    validate(cfg)
    with pytest.raises(ConfigError, match=r"needs about .* more than this machine's"):
        check_buildable(cfg)
    monkeypatch.setattr(memory, "machine_memory", lambda: without_attention - 1)
    with pytest.raises(ConfigError, match=r"needs about .* more than this machine's"):
        validate(cfg)
    monkeypatch.setattr(memory, "machine_memory", lambda: None)  # an OS that does not say: nothing refused
    validate(make_config(*ISSUE_SIZES))
    check_buildable(make_config(*ISSUE_SIZES))


@pytest.mark.parametrize(
    "preset",
    [
        [],
        ["experiment=attention_zoo"],
        ["experiment=budget"],
        ["experiment=capacity", "model.hidden_size=16,32,64,128,256"],
        ["experiment=fixed_state"],
        ["experiment=fixed_state_budget"],
        ["experiment=selective_copy"],
    ],
    ids=["default", "attention_zoo", "budget", "capacity-256", "fixed_state", "fixed_state_budget", "selective_copy"],
)
@pytest.mark.slow
def test_every_preset_fits_a_small_machine(preset, monkeypatch):
    """No preset's run is refused on a machine with 2 GiB (capacity's bigger grid included)."""
    from copytask.sweeps.grid import check_grid

    monkeypatch.setattr(memory, "machine_memory", lambda: 2 * 1024**3)
    grid = check_grid(preset)
    assert len(grid) >= 36


@pytest.mark.slow
@pytest.mark.parametrize("attention", list(ATTENTION_OPTIONS))  # every option of configs/attention/
@pytest.mark.parametrize("bidirectional", [True, False])
def test_the_estimates_parameter_count_is_the_models_but_its_attentions(make_config, attention, bidirectional):
    """Without torch every parameter but the attention's own, which its class knows (`check_buildable`
    counts the whole)."""
    from copytask.models.build import build_model
    from copytask.models.recurrent import count_parameters

    cfg = make_config(
        f"attention={attention}",
        f"model.bidirectional={bidirectional}",
        "model.hidden_size=12",
        "model.embedding_size=5",
        "task.vocab_size=7",
    )
    model = build_model(cfg)
    attention = 0 if model.attention is None else count_parameters(model.attention)
    assert memory.parameter_count(cfg) == count_parameters(model) - attention
