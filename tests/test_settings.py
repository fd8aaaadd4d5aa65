"""Every key a sweep varies is a dimension of results, compare and report: a tiny sweep over
`model.hidden_size` beside attention, length and seed, through the real CLI."""

from __future__ import annotations

import math
import re
import shutil

import pandas as pd
import pytest

from copytask import store
from copytask.cli import main
from copytask.reporting.tables import summarise

from .conftest import TINY, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

SIZES = (8, 16)
GRID = ["attention=none,luong_general", "task.length=3,6", f"model.hidden_size={','.join(map(str, SIZES))}", "seed=0,1"]


def settings_overrides(runs_dir, *extra: str) -> list[str]:
    tiny = [override for override in TINY if not override.startswith("model.hidden_size=")]
    return [*tiny, *GRID, f"runs_dir={runs_dir}", *extra]


@pytest.fixture(scope="module")
def settings_swept(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("settings") / "runs"
    process = run_cli("sweep", *settings_overrides(runs_dir))
    assert process.returncode == 0, process.stderr
    return runs_dir


def parse_rows(output: str) -> dict[tuple[int, int, str], list[str]]:
    """compare's table rows keyed by (hidden size, length, attention): seeds, then every number."""
    rows = {}
    for line in output.splitlines():
        match = re.match(r"\s*(\d+)\s+(\d+)\s+(none|luong_general)\s+(\d+)\s+(.*)$", line)
        if match:
            rows[int(match[1]), int(match[2]), match[3]] = [
                int(match[4]),
                *re.findall(r"[+-]?\d[\d,]*\.?\d*", match[5]),
            ]
    return rows


def test_results_csv_has_a_column_per_swept_key_and_the_config_of_each_run(settings_swept):
    table = pd.read_csv(settings_swept / "results.csv")
    assert sorted(table["model.hidden_size"].unique()) == list(SIZES)
    assert "model.embedding_size" not in table.columns  # not varied: not a column
    for row in table.itertuples():
        assert store.read_json(settings_swept / row.run / store.METRICS)["params"] == row.params
        assert (settings_swept / row.config).is_file()


def test_compare_never_pools_values_of_a_swept_key(settings_swept, capsys):
    assert main(["compare", "--wide", *settings_overrides(settings_swept)]) == 0
    rows = parse_rows(capsys.readouterr().out)

    table = pd.read_csv(settings_swept / "results.csv")
    groups = table.groupby(["model.hidden_size", "length", "attention"])
    assert set(rows) == set(groups.groups)  # one row per (hidden size, length, attention)
    for (size, length, attention), numbers in rows.items():
        # seeds, token [lo, hi], seq [lo, hi], teacher-forced [lo, hi], chance, params (no steps: never at target)
        seeds, token, *_, params = numbers[:12]
        runs = groups.get_group((size, length, attention))
        assert seeds == 2 == runs["seed"].nunique()
        assert float(token) == pytest.approx(100 * runs["token_acc"].mean(), abs=0.051)
        assert int(params.replace(",", "")) == runs["params"].iloc[0]
        if attention != "none":  # the gap is taken against the baseline of the same hidden size
            baseline = groups.get_group((size, length, "none"))["token_acc"].mean()
            # after the params, the state floats per sequence
            assert float(numbers[13]) == pytest.approx(100 * (runs["token_acc"].mean() - baseline), abs=0.051)
    assert rows[8, 3, "none"][11] != rows[16, 3, "none"][11]  # params differ between the sizes
    assert rows[8, 3, "none"][12:] == ["8"] and rows[16, 3, "none"][12:] == ["16"]  # the hand-over vector


def test_report_shows_every_value_and_names_the_setting_of_each_figure(settings_swept):
    assert main(["report", *settings_overrides(settings_swept)]) == 0

    out = settings_swept / "report"
    svg = (out / "accuracy_vs_length.svg").read_text()
    for size in SIZES:
        assert f"model.hidden_size={size}" in svg  # one row of panels per value
        assert (out / f"attention_luong_general_length6_model.hidden_size{size}.png").is_file()
        assert (out / f"training_curves_model.hidden_size{size}.png").is_file()
    markdown = (out / "report.md").read_text()
    assert "| model.hidden_size | length | attention | seeds |" in markdown  # the compare table
    assert "| model.hidden_size | length | attention | seeds | own % |" in markdown  # the counterfactual table
    assert "### luong_general, length 6, model.hidden_size=16" in markdown
    assert (out / "accuracy_grid.png").is_file()
    assert "| attention | model.hidden_size | longest at 99% | longest at 50% |" in markdown
    longest = markdown.split("| attention | model.hidden_size | longest at 99% | longest at 50% |")[1].split("\n\n")[0]
    reached = any(
        cell.strip() not in ("", "-", "---") for line in longest.splitlines()[2:] for cell in line.split("|")[3:5]
    )
    assert (out / "longest_length.png").is_file() == reached == ("longest_length.png" in markdown)  # never drawn empty


def test_report_x_puts_any_swept_numeric_key_on_the_x_axis(settings_swept):
    assert main(["report", *settings_overrides(settings_swept, "report.x=model.hidden_size")]) == 0

    svg = (settings_swept / "report" / "accuracy_vs_model.hidden_size.svg").read_text()
    assert "length=3" in svg and "length=6" in svg  # the length, no longer on the x axis, is shown per panel
    assert "Copy accuracy against model.hidden_size" in svg


def test_report_x_that_is_not_swept_is_one_clear_error_before_anything_is_written(settings_swept, capsys):
    before = (settings_swept / "results.csv").read_text()
    assert main(["report", *settings_overrides(settings_swept, "report.x=train.lr")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report.x" in err[0] and "'train.lr'" in err[0] and "model.hidden_size" in err[0]
    assert (settings_swept / "results.csv").read_text() == before
    assert not (settings_swept / "report" / "accuracy_vs_train.lr.png").exists()


def test_compare_and_report_given_only_runs_dir_take_the_last_sweep_there(settings_swept, capsys):
    assert main(["compare", *settings_overrides(settings_swept)]) == 0
    with_overrides = capsys.readouterr().out
    assert main(["compare", f"runs_dir={settings_swept}"]) == 0
    without = capsys.readouterr().out

    assert "the grid of the last sweep in" in without and "model.hidden_size=8,16" in without
    assert parse_rows(without) == parse_rows(with_overrides) and len(parse_rows(without)) == 8
    assert main(["report", f"runs_dir={settings_swept}", "report.x=model.hidden_size"]) == 0


def test_analyze_names_the_setting_of_each_row(settings_swept, capsys):
    assert main(["analyze", f"runs_dir={settings_swept}", "train.progress=false"]) == 0
    output = capsys.readouterr().out
    counterfactual, generalisation = output.split("\n\n")[-2:]
    assert (
        "model.hidden_size" in counterfactual and "model.hidden_size" in generalisation
    )  # both tables name the setting


def test_all_takes_every_complete_run_grouped_by_what_varies(settings_swept, tmp_path, capsys):
    runs_dir = tmp_path / "runs"
    shutil.copytree(settings_swept, runs_dir)
    other = [
        *settings_overrides(runs_dir)[: len(TINY) - 1],
        "attention=none",
        "task.length=3",
        "seed=0",
        f"runs_dir={runs_dir}",
    ]
    assert main(["train", *other, "train.steps=11"]) == 0  # a run from no grid: another budget

    assert main(["compare", "--all", f"runs_dir={runs_dir}"]) == 0
    output = capsys.readouterr().out
    assert "every complete run in" in output and "train.steps" in output
    lines = [line for line in output.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+\s+(none|luong_general)\s", line)]
    assert len(lines) == 9  # the 8 settings of the grid and the new budget, each on its own row
    assert main(["compare", "--all", f"runs_dir={runs_dir}", "attention=none"]) == 2
    assert "--all takes every complete run" in capsys.readouterr().err


def test_gap_is_empty_where_no_baseline_has_the_same_settings():
    def run(attention, size, seed, acc):
        return {
            "attention": attention,
            "length": 5,
            "model.hidden_size": size,
            "seed": seed,
            "token_acc": acc,
            "seq_acc": acc,
            "chance": 1 / 9,
            "params": size * 100,
        }

    table = pd.DataFrame(
        [run("none", 8, 0, 0.5), run("none", 8, 1, 0.7), run("bahdanau", 8, 0, 0.9), run("bahdanau", 16, 0, 1.0)]
    )
    summary = summarise(table, ["model.hidden_size"]).set_index(["model.hidden_size", "attention"])

    assert summary.loc[(8, "bahdanau"), "token_acc_gap"] == pytest.approx(0.9 - 0.6)
    assert math.isnan(summary.loc[(16, "bahdanau"), "token_acc_gap"])  # never borrowed from hidden size 8
    assert summary.loc[(8, "none"), "seeds"] == 2 and summary.loc[(16, "bahdanau"), "params"] == 1600


def test_two_settings_give_panels_for_one_and_line_styles_for_the_other(tmp_path):
    from copytask.reporting.result_figures import plot_accuracy

    rows = [
        {
            "attention": attention,
            "length": length,
            "model.hidden_size": size,
            "train.lr": lr,
            "seed": seed,
            "token_acc": 0.5,
            "seq_acc": 0.2,
            "chance": 1 / 9,
            "params": size,
        }
        for attention in ("none", "bahdanau")
        for length in (5, 10)
        for size in (8, 16)
        for lr in (1e-3, 6e-3)
        for seed in (0, 1)
    ]
    settings = ["model.hidden_size", "train.lr"]
    summary = summarise(pd.DataFrame(rows), settings)
    [_, svg] = plot_accuracy(summary, settings, "length", tmp_path / "accuracy", pd.DataFrame())

    text = svg.read_text()
    assert (
        "greedy token accuracy, model.hidden_size=8" in text and "greedy token accuracy, model.hidden_size=16" in text
    )
    assert "bahdanau, train.lr=0.001" in text and "bahdanau, train.lr=0.006" in text  # one line style per value


@pytest.mark.parametrize("accuracy, drawn", [(0.995, 2), (0.2, 1)])
def test_the_longest_length_figure_is_drawn_only_when_a_length_reaches_a_threshold(tmp_path, accuracy, drawn):
    from copytask.reporting.result_figures import LONGEST_FIGURE, plot_setting_grid

    summary = pd.DataFrame(
        [
            {"attention": "none", "model.hidden_size": size, "length": length, "token_acc": accuracy}
            for size in (8, 16)
            for length in (5, 10)
        ]
    )
    paths = plot_setting_grid(summary, "model.hidden_size", tmp_path)
    assert len(paths) == drawn and (tmp_path / LONGEST_FIGURE).is_file() == (drawn == 2)
