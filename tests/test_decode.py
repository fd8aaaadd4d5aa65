"""`python -m copytask decode` on tiny runs of every attention type trained through the real configs:
the aligned lines and their marks, the text heatmap, --random at another length, --png, the
reverse task, multi-head maps, and the one-line refusals."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from copytask import cli, cli_decode, store
from copytask.console import TERMINAL_WIDTH
from copytask.data.vocab import parse_symbols
from copytask.evaluation.decode import Decoded

from .conftest import ATTENTION_OPTIONS, NO_ATTENTION, pythonpath, run_cli

ATTENTION_TYPES = list(ATTENTION_OPTIONS)  # every one there is
TRAINED_LENGTH = 4
HEADS = 4  # configs/attention/multihead.yaml


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One tiny run per attention type on copy, and Luong general on reverse: {"<attention>-<task>": folder}.
    The models are barely trained: the tests are about what decode shows, not about its accuracy."""
    runs_dir = tmp_path_factory.mktemp("decode-runs")
    tiny = [
        "experiment=quick",
        "model.hidden_size=8",
        "model.embedding_size=8",
        "train.steps=2",
        "train.eval_every=2",
        "train.eval_size=8",
        "train.batch_size=8",
        "train.threads=1",
        "train.progress=false",
        f"task.length={TRAINED_LENGTH}",
        f"runs_dir={runs_dir}",
    ]
    for attention in ATTENTION_TYPES:
        assert cli.main(["train", *tiny, f"attention={attention}"]) == 0
    assert cli.main(["train", *tiny, "attention=luong_general", "task=reverse"]) == 0
    assert cli.main(["train", *tiny, "attention=luong_general", "task=selective_copy", "task.copied=2"]) == 0
    return {
        "-".join(folder.name.split("-")[:2]).removesuffix(str(TRAINED_LENGTH)): folder
        for folder in store.complete_runs(runs_dir)
    }


def decoded(capsys, *args: str) -> list[str]:
    """The lines `decode ARGS` prints, each checked to fit the terminal's 100 columns (the sources here are short)."""
    assert cli_decode.main([str(arg) for arg in args]) == 0
    lines = capsys.readouterr().out.splitlines()
    too_long = [line for line in lines if len(line) > TERMINAL_WIDTH]
    assert not too_long, too_long
    return lines


def cells(line: str, name: str) -> list[str]:
    """The symbols of an `input`, `output` or `target` line."""
    assert line.startswith(name)
    return line[len(name) :].split()


def first_cell(header: str) -> int:
    """Where a text heatmap's first cell begins: under the first source symbol of its header."""
    return len(header) - len(header.lstrip())


def test_alignment_marks_exactly_the_wrong_output_symbols():
    source, target = ["a", "10", "c"], ["a", "10", "c", "</s>"]
    output = ["b", "10", "c", "c"]
    lines = cli_decode.alignment_lines(source, output, target)
    assert [line.split()[0] for line in lines[:3]] == ["input", "output", "target"]
    starts = [match.start() for match in re.finditer(r"\S+", lines[1])][1:]  # where each output symbol begins
    marks = [match.start() for match in re.finditer(r"\^", lines[3])]
    assert marks == [starts[0], starts[3]]  # under `b` and under the `c` where </s> belongs
    assert [match.start() for match in re.finditer(r"\S+", lines[2])][1:] == starts  # target aligned with output


def test_an_early_eos_opens_no_gap_in_the_input_and_target_lines():
    """Issue 80: the output's `</s>` under the input's third symbol widened that column to four characters,
    leaving a hole in the input and target lines."""
    source, target, output = ["a", "b", "c", "d"], ["a", "b", "c", "d", "</s>"], ["a", "b", "</s>"]
    input_line, output_line, target_line, marks = cli_decode.alignment_lines(source, output, target)
    assert input_line.endswith("a b c d") and target_line.endswith("a b c d </s>") and output_line.endswith("a b </s>")
    assert marks.split() == ["^", "^", "^"]  # the wrong EOS, and the two symbols it never wrote


def test_the_output_stops_at_its_first_eos_and_an_early_end_is_marked_under_the_target():
    from omegaconf import OmegaConf

    from copytask.data.vocab import EOS

    a, b, c = 3, 4, 5  # content ids of a, b, c
    cfg = OmegaConf.create({"task": {"vocab_size": 9}})
    row = np.array([[a, EOS, c, EOS]])  # EOS after one symbol, then symbols that are not part of the output
    result = Decoded(
        "run",
        cfg,
        np.array([[a, b, c]]),
        np.array([3]),
        row,
        np.array([[a, b, c, EOS]]),
        np.array([1]),
        np.array([3]),
        np.array([False]),
        None,
    )
    text = result.text(0)
    assert text["output"] == ["a", "</s>"] and text["target"] == ["a", "b", "c", "</s>"]
    marks = cli_decode.alignment_lines(text["input"], text["output"], text["target"])[3]
    assert marks.split() == ["^", "^", "^"]  # the wrong EOS, and the two symbols it never wrote


def test_text_heatmap_shades_the_weights_and_marks_the_copied_cell():
    weights = [[1.0, 0.0], [0.5, 0.25], [0.0, 0.0]]
    lines = cli_decode.text_heatmap(weights, ["a", "b"], ["a", "b", "</s>"], copied=[0, 1])
    assert lines == ["     a b", "   a █◂", "   b ▒ ░◂", "</s>"]


def test_symbols_parse_spaced_or_together_and_refuse_unknown_ones():
    assert parse_symbols("g d d c", 9) == parse_symbols("gddc", 9) == [9, 6, 6, 5]
    assert parse_symbols("0 12 3", 30) == [3, 15, 6]
    with pytest.raises(ValueError, match=r"unknown symbol 'z'.* a b c d e f g h i$"):
        parse_symbols("a b z", 9)
    with pytest.raises(ValueError, match="no symbols"):
        parse_symbols("  ", 9)


@pytest.mark.parametrize("attention", ATTENTION_TYPES)
def test_every_attention_type_decodes_with_one_heatmap_row_per_output_step(runs, capsys, attention):
    lines = decoded(capsys, runs[f"{attention}-copy"], "g d d c i h")  # longer than trained
    start = next(i for i, line in enumerate(lines) if line.startswith("input"))
    assert cells(lines[start], "input") == list("gddcih")
    output = cells(lines[start + 1], "output")  # up to its first EOS, at most the 7 steps decoded
    assert 1 <= len(output) <= 7 and "</s>" not in output[:-1] and (len(output) == 7 or output[-1] == "</s>")
    assert cells(lines[start + 2], "target") == [*"gddcih", "</s>"]
    assert re.fullmatch(r"token accuracy \d/6 \(\d+\.\d%\), sequence (right|wrong)", lines[start + 4])
    maps = lines[start + 5 :]
    if attention in NO_ATTENTION:
        assert maps == [] and f"no attention (attention={attention}): no heatmap" in lines
        return
    heads = HEADS if attention == "multihead" else 1
    assert len(maps) == heads * (1 + len(output)) + (
        heads if heads > 1 else 0
    )  # per map: the source header and one row per output step
    rows = [line for line in maps if cli_decode.COPIED in line]
    assert len(rows) == heads * min(len(output), 6)  # every content step marks its copied position; EOS copies none
    for step, row in enumerate(rows[: min(len(output), 6)]):
        assert (
            row.index(cli_decode.COPIED) == first_cell(maps[1 if heads > 1 else 0]) + 2 * step + 1
        )  # after the cell of source position `step`


def test_reverse_target_is_the_reversed_input(runs, capsys):
    lines = decoded(capsys, runs["luong_general-reverse"], "abcde")
    assert cells(next(line for line in lines if line.startswith("target")), "target") == [*"edcba", "</s>"]
    start = lines.index(next(line for line in lines if line.startswith("token accuracy"))) + 1
    header, rows = lines[start], lines[start + 1 :]
    assert rows[0].index(cli_decode.COPIED) == first_cell(header) + 2 * 4 + 1  # output step 0 copies the last symbol


def test_selective_copying_shows_the_noise_and_aligns_output_with_its_shorter_target(runs, capsys):
    """Issue 82: the input (noise `_`) on a line of its own, output and target (the content symbols in
    order) aligned with each other, and each row's copied mark on its symbol's cell, past the noise."""
    lines = decoded(capsys, runs["luong_general-selective_copy4k2"], "_c__e_")  # another length than trained
    first = lines.index(next(line for line in lines if line.startswith("input")))
    assert cells(lines[first], "input") == ["_", "c", "_", "_", "e", "_"]
    output, target, marks, scored = lines[first + 1 : first + 5]
    assert cells(target, "target") == ["c", "e", "</s>"] and len(cells(output, "output")) >= 1
    wrong = {i for i, char in enumerate(marks) if char == cli_decode.WRONG}
    width = len("output  ")
    assert all(output[i : i + 1] != target[i : i + 1] or output[i] == " " for i in wrong)  # marked under a difference
    assert all(i >= width for i in wrong)
    start = lines.index(next(line for line in lines if line.startswith("token accuracy"))) + 1
    header, rows = lines[start], lines[start + 1 :]
    steps = len(cells(output, "output"))  # one heatmap row per output step
    marked = [row.index(cli_decode.COPIED) if cli_decode.COPIED in row else None for row in rows[:steps]]
    expected = [first_cell(header) + 2 * 1 + 1, first_cell(header) + 2 * 4 + 1, None]  # c at 1, e at 4, then none
    assert marked == expected[:steps]
    assert scored.startswith("token accuracy ") and "/2 " in scored  # two symbols scored


def test_multihead_shows_one_map_per_head(runs, capsys):
    lines = decoded(capsys, runs["multihead-copy"], "abc")
    assert [line for line in lines if line.startswith("head ")] == [f"head {head}" for head in range(HEADS)]
    assert "one map per head (4 heads)" in lines[1]


def test_random_sequences_at_another_length_and_a_png_through_the_cli(runs, tmp_path):
    png = tmp_path / "map.png"
    done = run_cli("decode", str(runs["luong_general-copy"]), "--random", "3", "--length", "12", "--png", str(png))
    assert done.returncode == 0, done.stderr
    inputs = [line for line in done.stdout.splitlines() if line.startswith("input")]
    assert len(inputs) == 3 and all(len(cells(line, "input")) == 12 for line in inputs)
    assert "over the 3 sequences: token accuracy" in done.stdout
    assert png.read_bytes().startswith(b"\x89PNG")


def test_one_sequence_is_decoded_by_torchs_ops_without_the_kernels_pandas_or_matplotlib(runs):
    """A few sequences need no fused kernels: their first call imports torch's compiler stack (about as
    long as torch's own import). Nor pandas nor matplotlib, unless a map is drawn (--png)."""
    heavy = {"torch._dynamo", "torch.utils.cpp_extension", "pandas", "matplotlib"}
    code = (
        "import sys; from copytask.cli import main; status = main(['decode', sys.argv[1], 'gdd']); "
        f"print('loaded:', sorted({heavy!r} & set(sys.modules))); sys.exit(status)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(runs["bahdanau-copy"])],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "loaded: []"


@pytest.mark.parametrize("attention", ["none", "bahdanau", "multihead"])
def test_beam_search_decodes_through_the_cli_and_the_api(runs, capsys, attention):
    """--beam K prints each sequence's best beam, as `copytask.decode(..., beam=K)` returns it."""
    import copytask

    folder = runs[f"{attention}-copy"]
    lines = decoded(capsys, folder, "--random", "3", "--beam", "4", "--length-normalise")
    assert "beam search of width 4" in " ".join(lines[:2])  # the heading, which a long name wraps
    beams = copytask.decode(folder, random=3, beam=4, length_normalise=True)
    assert beams.beam == 4 and (beams.weights is None) == (attention == "none")
    printed_outputs = [line.split()[1:] for line in lines if line.startswith("output")]
    assert printed_outputs == [beams.text(i)["output"] for i in range(3)]


def test_the_help_lists_decode(capsys):
    assert cli.main(["--help"]) == 0
    assert "decode" in capsys.readouterr().out
    assert cli.main(["decode", "--help"]) == 0
    assert "--random" in capsys.readouterr().out


def test_a_reader_that_goes_away_ends_the_command_without_a_traceback():
    """`python -m copytask decode ... | head`: the pipe closes before the command has printed."""
    command = subprocess.Popen(
        [sys.executable, "-m", "copytask", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": pythonpath()},
    )
    command.stdout.close()  # before the interpreter has started: its first print finds no reader
    stderr = command.stderr.read().decode()
    assert command.wait(timeout=60) == 1
    assert stderr == ""


def no_checkpoint(runs: dict[str, Path], tmp_path: Path) -> Path:
    folder = tmp_path / "unfinished"
    folder.mkdir()
    (folder / store.CONFIG).write_text((runs["luong_general-copy"] / store.CONFIG).read_text())
    return folder


@pytest.mark.parametrize(
    "args, says",
    [
        (lambda runs, tmp: [runs["luong_general-copy"], "a b z"], r"unknown symbol 'z'.*a b c d e f g h i"),
        (lambda runs, tmp: [runs["luong_general-copy"], ""], r"no symbols given"),
        (lambda runs, tmp: [runs["luong_general-copy"]], r"no symbols given"),
        (lambda runs, tmp: [no_checkpoint(runs, tmp), "abc"], r"has no checkpoint\.pt"),
        (lambda runs, tmp: [tmp, "abc"], r"is not a run folder \(no config\.yaml\)"),
        (lambda runs, tmp: [tmp / "nowhere", "abc"], r"is not a run folder: it does not exist"),
        (lambda runs, tmp: [runs["luong_general-copy"], "abc", "--random", "2"], r"not both"),
        (lambda runs, tmp: [runs["luong_general-copy"], "--random", "0"], r"--random must be at least 1"),
        (lambda runs, tmp: [runs["luong_general-copy"], "--random", "two"], r"--random: invalid int value"),
        (lambda runs, tmp: [runs["luong_general-copy"], "abc", "--beam", "0"], r"--beam must be .* to 64, got 0"),
        (lambda runs, tmp: [runs["luong_general-copy"], "abc", "--beam", "65"], r"--beam must be .* to 64, got 65"),
        (lambda runs, tmp: [runs["luong_general-copy"], "abc", "--beam", "2.5"], r"--beam: invalid int value: '2.5'"),
        (lambda runs, tmp: [runs["luong_general-copy"], "a_b"], r"unknown symbol '_'"),  # copy has no noise
        (lambda runs, tmp: [runs["luong_general-selective_copy4k2"], "____"], r"give at least one"),
        (
            lambda runs, tmp: [runs["luong_general-selective_copy4k2"], "--random", "2", "--length", "2"],
            r"--length must be at least 3 for task selective_copy with task.copied=2, got 2",
        ),  # fmt: skip
    ],
)
def test_refusals_are_one_line_and_exit_status_2(runs, tmp_path, args, says):
    done = run_cli("decode", *map(str, args(runs, tmp_path)))
    assert done.returncode == 2 and done.stdout == ""
    assert re.fullmatch(rf"copytask: error: .*{says}.*\n", done.stderr), done.stderr
