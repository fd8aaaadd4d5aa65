import math

import pytest
import torch

import copytask
from copytask.data.batches import copied_positions, copied_source_positions, make_batch, task_batch
from copytask.data.tasks import TASKS, Sources, Task, task, vocabulary
from copytask.data.vocab import BOS, EOS, NUM_SPECIAL, PAD, noise_token, parse_symbols, symbol, total_vocab

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


def test_copy_and_reverse_draw_their_sources_as_before_the_registry_drew_them():
    """Issue 82: the registry draws sources now; copy's and reverse's are the generator's same draws, lengths
    first, then the symbols (their runs keep their numbers bit for bit)."""
    for name, min_length in (("copy", None), ("reverse", 2)):
        generator, expected = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        batch = make_batch(name, 6, 7, 9, generator, min_length)
        lengths = torch.full((6,), 7) if min_length is None else torch.randint(2, 8, (6,), generator=expected)
        symbols = torch.randint(NUM_SPECIAL, NUM_SPECIAL + 9, (6, 7), generator=expected)
        assert torch.equal(batch.src_lengths, lengths)
        assert torch.equal(batch.src, symbols.masked_fill(torch.arange(7) >= lengths[:, None], PAD))
        assert torch.equal(generator.get_state(), expected.get_state())  # nothing else drawn


def test_a_task_is_one_registry_entry_and_nothing_else(tmp_path, monkeypatch):
    """Issue 62: a task registered here, with no other file edited, is what its batches, alignment
    targets and a trained run follow: `swap` copies each pair of symbols in the other order."""

    def swap(src, lengths, vocab_size):
        """Output step t copies source position t + 1 for even t, t - 1 for odd t (the last one of
        an odd length copies itself)."""
        steps = torch.arange(src.size(1))[None, :]
        partner = steps + 1 - 2 * (steps % 2)
        return torch.where(partner < lengths[:, None], partner, steps), lengths

    monkeypatch.setitem(TASKS, "swap", Task(swap, Sources()))
    symbols, lengths = torch.tensor([[3, 4, 5, 6, 7]]), torch.tensor([5])
    assert task_batch("swap", symbols, lengths, 9).tgt_out[0].tolist() == [4, 3, 6, 5, 7, EOS]
    assert copied_source_positions("swap", [3, 4, 5, 6, 7], 9) == [1, 0, 3, 2, 4]
    metrics = copytask.train(copytask.compose([*TINY, "task.name=swap", "task.length=5", f"runs_dir={tmp_path}"]))
    assert metrics["steps"] == 10 and metrics["run"].startswith("luong_general-swap5-")
    with pytest.raises(ValueError, match=f"unknown task 'bogus'; choose one of {', '.join(TASKS)}$"):
        make_batch("bogus", 2, 5, 9, torch.Generator())


def test_a_task_whose_target_is_shorter_than_its_source_is_one_registry_entry(tmp_path, monkeypatch):
    """Issue 82: `halves` copies the first half of its source (the longer half of an odd length): its
    targets, the positions alignment scores and a trained and analysed run follow from its entry alone."""

    @task("halves")
    def halves(src, lengths, vocab_size):
        return torch.arange((src.size(1) + 1) // 2).expand(src.size(0), -1), (lengths + 1) // 2

    monkeypatch.setitem(TASKS, "halves", TASKS.pop("halves"))  # taken out again after the test
    batch = task_batch("halves", torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 0, 0]]), torch.tensor([5, 3]), 9)
    assert batch.tgt_out.tolist() == [[3, 4, 5, EOS], [8, 9, EOS, PAD]]
    assert batch.tgt_in.tolist() == [[BOS, 3, 4, 5], [BOS, 8, 9, PAD]]
    assert batch.tgt_lengths.tolist() == [3, 2] and batch.content_mask.sum().item() == 5
    assert batch.select(slice(1, 2)).tgt_out.tolist() == [[8, 9, EOS]]  # trimmed to its own target
    assert copied_positions("halves", batch, 9).tolist() == [[0, 1, 2, 0], [0, 1, 0, 0]]
    cfg = copytask.compose([*TINY, "task.name=halves", "task.length=6", f"runs_dir={tmp_path}"])
    metrics = copytask.train(cfg)
    assert metrics["steps"] == 10
    from copytask.evaluation.analysis import analyze_run
    from copytask.evaluation.breakdown import Settings

    analysis = analyze_run(tmp_path / metrics["run"], [6, 7], settings=Settings(beam_widths=(1, 2), probe_size=64))
    assert [row["scored"] for row in analysis["length_generalisation"]] == [16, 16]
    assert len(analysis["breakdown"]["greedy"]["by_position"]) == 3  # three output steps scored
    assert len(analysis["breakdown"]["probe"]["trained"]) == 3  # one label per copied symbol
    assert 0 <= analysis["alignment"]["hit"] <= 1


@pytest.mark.parametrize("name", sorted(TASK_OPTIONS))
def test_every_registered_task_trains_a_step(tmp_path, name):
    """Each task's option composes, passes the checks and trains: adding a task edits no test."""
    copied = ["task.copied=2"] if TASKS[TASK_OPTIONS[name].name].sources.reads_copied else []
    cfg = copytask.compose([*TINY, f"task={name}", "task.length=5", *copied, "train.steps=1", f"runs_dir={tmp_path}"])
    metrics = copytask.train(cfg)
    assert metrics["steps"] == 1 and metrics["run"].startswith(f"luong_general-{TASK_OPTIONS[name].name}5")


def test_an_unknown_task_is_refused_in_one_line():
    with pytest.raises(copytask.ConfigError, match=f"task.name must be one of {', '.join(TASKS)}, got 'bogus'"):
        copytask.compose([*TINY, "task.name=bogus"])


def test_every_registered_task_has_its_config_and_every_task_config_its_entry():
    assert {option.name for option in TASK_OPTIONS.values()} == set(TASKS)


@pytest.mark.parametrize(
    "copies, returned",
    [
        (lambda src, lengths, v: (torch.arange(5)[None, :], lengths), "shape (1, 5) for 3 sequences"),
        (lambda src, lengths, v: ((torch.arange(5) + 1).expand(3, -1), lengths), "position 5 at output step 4 of a"),
        (lambda src, lengths, v: (lengths[:, None] - 2 - torch.arange(5), lengths), "position -1 at output step 4"),
        (lambda src, lengths, v: (torch.arange(5.0).expand(3, -1), lengths), "positions of dtype torch.float32"),
        (lambda src, lengths, v: ([0, 1], lengths), "positions as a list"),
        (lambda src, lengths, v: torch.arange(5).expand(3, -1), "a Tensor, not (positions, target lengths)"),
        (lambda src, lengths, v: (torch.arange(5).expand(3, -1), lengths + 1), "a target of length 6 for a source"),
        (lambda src, lengths, v: (torch.arange(3).expand(3, -1), lengths), "a target of length 5 for a source of"),
        (lambda src, lengths, v: (torch.arange(5).expand(3, -1), lengths[:1]), "target lengths of dtype torch.int64"),
    ],
    ids=[
        "one_row_for_the_batch",
        "past_the_source",
        "before_the_source",
        "float",
        "not_a_tensor",
        "no_target_lengths",
        "target_longer_than_source",
        "target_longer_than_its_positions",
        "one_length_for_the_batch",
    ],
)
def test_a_task_that_breaks_the_registrys_contract_is_refused_by_name(monkeypatch, copies, returned):
    """Issue 70: a task returns one row of positions per sequence, each inside that sequence's
    source for t < its target's length, and one target length per sequence, at most its source's (issue
    82); anything else is refused naming the task and what it returned, never broadcast into one row for
    all or clamped into wrong targets."""
    monkeypatch.setitem(TASKS, "broken", Task(copies, Sources()))
    symbols, lengths = torch.tensor([[3, 4, 5, 6, 7]] * 3), torch.tensor([5, 5, 5])
    batch = task_batch("copy", symbols, lengths, 9)
    for draw in (lambda: task_batch("broken", symbols, lengths, 9), lambda: copied_positions("broken", batch, 9)):
        with pytest.raises(ValueError, match="task 'broken' returned ") as refused:
            draw()
        assert returned in str(refused.value) and "\n" not in str(refused.value)


def test_positions_past_a_sequences_length_are_not_read():
    """Only steps t < length are the task's: reverse's negative positions past a shorter sequence's
    end give PAD there, not an error."""
    batch = task_batch("reverse", torch.tensor([[3, 4, 5], [6, 7, 8]]), torch.tensor([3, 1]), 9)
    assert batch.tgt_out.tolist() == [[5, 4, 3, EOS], [6, EOS, PAD, PAD]]


# --- selective copying (issue 82) ------------------------------------------------------------------------


def test_selective_copying_puts_k_content_symbols_in_order_among_noise():
    noise = noise_token(6)
    batch = make_batch("selective_copy", 500, 12, 6, torch.Generator().manual_seed(0), min_length=5, copied=4)
    assert batch.tgt_out.shape == (500, 5) and (batch.tgt_out[:, 4] == EOS).all()
    for src, length, tgt in zip(batch.src.tolist(), batch.src_lengths.tolist(), batch.tgt_out.tolist()):
        real = src[:length]
        content = [token for token in real if token != noise]
        assert len(content) == 4 and all(NUM_SPECIAL <= token < NUM_SPECIAL + 6 for token in content)
        assert tgt[:4] == content and noise not in tgt  # the content in order; noise is never a target
        assert all(token == PAD for token in src[length:])
    assert set(batch.tgt_in[:, 0].tolist()) == {BOS} and torch.equal(batch.tgt_in[:, 1:], batch.tgt_out[:, :4])
    assert torch.equal(batch.content_mask.sum(1), torch.full((500,), 4)) and torch.equal(
        batch.tgt_lengths, 4 + 0 * batch.src_lengths
    )
    at = copied_positions("selective_copy", batch, 6)  # (B, 5): the t-th content symbol's position
    assert torch.equal(batch.src.gather(1, at[:, :4]), batch.tgt_out[:, :4]) and (at[:, :4].diff(dim=1) > 0).all()


def test_selective_copyings_positions_and_symbols_are_uniform():
    """k = 2 of L = 4 positions over 3 symbols: each of the 6 layouts and each symbol about equally often
    (a fixed layout or a symbol skipped would be far outside these bounds over 6000 draws)."""
    batch = make_batch("selective_copy", 6000, 4, 3, torch.Generator().manual_seed(1), copied=2)
    layouts = torch.unique((batch.src != noise_token(3)).long() @ torch.tensor([8, 4, 2, 1]), return_counts=True)
    assert len(layouts[0]) == 6 and layouts[1].min() > 850 and layouts[1].max() < 1150  # 1000 each
    symbols = torch.bincount(batch.tgt_out[:, :2].flatten() - NUM_SPECIAL)
    assert len(symbols) == 3 and symbols.min() > 3700 and symbols.max() < 4300  # 4000 each


def test_every_selective_copying_source_is_listed_once():
    sources = TASKS["selective_copy"].sources
    every = sources.every(5, 3, 2)  # C(5, 2) x 3^2
    assert every.shape == (sources.count(5, 3, 2), 5) == (90, 5)
    assert len({tuple(row) for row in every.tolist()}) == 90
    assert ((every != noise_token(3)).sum(1) == 2).all()
    assert sources.log_count(5, 3, 2) == pytest.approx(math.log(90))
    assert sources.shortest(2) == 3 and TASKS["copy"].sources.shortest(None) == 1


def test_a_noise_task_s_models_have_the_noise_token_and_copy_s_do_not():
    assert vocabulary("selective_copy", 9) == total_vocab(9) + 1 == noise_token(9) + 1
    assert vocabulary("copy", 9) == vocabulary("reverse", 9) == total_vocab(9)
    assert symbol(noise_token(9), 9) == "_" and parse_symbols("_a_b", 9, noise=True) == [12, 3, 12, 4]
    with pytest.raises(ValueError, match="unknown symbol '_'"):
        parse_symbols("_a_b", 9)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["task.copied=0"], "task.copied must be an integer >= 1, got 0"),
        (["task.copied=-2"], "task.copied must be an integer >= 1, got -2"),
        (["task.length=8", "task.copied=8"], "task.copied (8) must be less than task.length (8)"),
        (["task.length=8", "task.copied=9"], "task.copied (9) must be less than task.length (8)"),
        (["task.copied=null"], "task.copied must be an integer >= 1 with task=selective_copy, got null"),
        (["task.copied=2.5"], "task.copied must be an integer >= 1, got 2.5"),
        (["task.variable_length=true", "task.min_length=4", "task.copied=4"], "less than task.min_length (4)"),
        (["task=copy", "task.copied=3"], "task.copied=3 is selective copying's"),
        (["task=reverse", "task.copied=3"], "task=reverse does not read it"),
        (["task.vocab_size=2", "task.length=5", "task.copied=1"], "task.length=5 with task.copied=1 over"),
    ],
)
def test_bad_selective_copying_values_are_refused_in_one_line(overrides, says):
    """Issue 82: k < 1, k >= L (the shortest L of variable lengths), no k, a k the task does not read, and too
    few sources for the held-out sets (here C(5, 1) x 2 = 10), each refused in one line naming the key."""
    with pytest.raises(copytask.ConfigError) as refused:
        copytask.compose([*TINY, "task=selective_copy", "task.length=6", "task.copied=2", *overrides])
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_refused_k_writes_nothing(tmp_path):
    from .conftest import run_cli

    done = run_cli("train", *TINY, "task=selective_copy", "task.length=4", "task.copied=4", f"runs_dir={tmp_path}/r")
    assert done.returncode == 2 and done.stderr.startswith("copytask: error: task.copied (4) must be less than")
    assert not (tmp_path / "r").exists()
