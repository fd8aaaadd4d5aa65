"""report and compare on the tiny sweep's runs: partial, corrupt and empty folders; compare's
numbers against results.csv."""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from pathlib import Path

import pandas as pd
import pytest

import copytask
from copytask import store
from copytask.cli import main
from copytask.console import CopytaskWarning
from copytask.evaluation import analysis
from copytask.reporting.tables import TARGET_STEP, comparison_table, interval, ordered, summarise, target_step
from copytask.store.runs import variable_length_runs
from copytask.sweeps.grid import compose_grid

from .conftest import TINY, overrides, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)


def test_report_skips_corrupt_and_half_written_runs_with_a_warning(runs_copy):
    table = pd.read_csv(runs_copy / "results.csv")
    corrupt, half_written = table["run"].iloc[0], table["run"].iloc[5]
    metrics = runs_copy / corrupt / store.METRICS
    metrics.write_text(metrics.read_text()[:40])  # cut off mid-write
    (runs_copy / half_written / store.METRICS).unlink()  # killed before it finished
    shutil.rmtree(runs_copy / "report")

    with pytest.warns(CopytaskWarning) as warned:
        assert main(["report", *overrides(runs_copy)]) == 0

    messages = "\n".join(str(warning.message) for warning in warned)
    assert re.search(rf"^skipping \S*{corrupt}: corrupt metrics.json", messages, re.M)
    assert re.search(rf"^skipping \S*{half_written}: incomplete", messages, re.M)
    reported = pd.read_csv(runs_copy / "results.csv")
    assert len(reported) == len(table) - 2 and not {corrupt, half_written} & set(reported["run"])
    markdown = (runs_copy / "report" / "report.md").read_text()
    assert "6 of 8 runs of the grid complete" in markdown
    assert corrupt in markdown and half_written in markdown  # listed under missing runs
    assert (runs_copy / "report" / "accuracy_vs_length.png").stat().st_size > 0


def test_report_on_a_corrupt_attention_file_warns_and_goes_on(runs_copy):
    table = pd.read_csv(runs_copy / "results.csv")
    run = table[table["attention"] == "luong_general"].sort_values("seed")["run"].iloc[0]
    (runs_copy / run / store.ATTENTION).write_text("{")

    with pytest.warns(CopytaskWarning, match=re.escape(f"skipping attention_samples.json of {runs_copy / run}")):
        assert main(["report", *overrides(runs_copy)]) == 0


@pytest.mark.parametrize("exists", [True, False])
def test_report_on_an_empty_folder_says_so(tmp_path, capsys, exists):
    runs_dir = tmp_path / "runs"
    if exists:
        runs_dir.mkdir()

    assert main(["report", *overrides(runs_dir)]) == 2  # bad input, as for every command

    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing to report" in err and str(runs_dir) in err
    assert ("0 of 8 runs complete" in err) if exists else ("does not exist" in err)
    assert not (runs_dir / "report").exists()


def test_report_takes_only_the_grids_runs(runs_copy, capsys):
    assert main(["report", *overrides(runs_copy, "attention=none")]) == 0
    assert set(pd.read_csv(runs_copy / "results.csv")["attention"]) == {"none"}
    assert "4 of 4 runs of the grid complete" in (runs_copy / "report" / "report.md").read_text()


def test_a_report_with_nothing_to_redraw_draws_nothing_and_says_what_it_said_when_drawn(runs_copy, capsys, monkeypatch):
    removed = pd.read_csv(runs_copy / "results.csv")["run"].iloc[6]
    (runs_copy / removed / store.METRICS).unlink()  # a missing run: each report lists it
    assert main(["report", f"runs_dir={runs_copy}"]) == 0
    drawn = capsys.readouterr().out.splitlines()
    assert "1 of 8 runs missing:" in drawn and (runs_copy / "report" / "drawn_from.json").is_file()
    written = copytask.report(runs_copy)  # the API: the paths of the report there, not drawn again

    monkeypatch.setattr("copytask.reporting.report.write_report", drawing)
    monkeypatch.setattr("copytask.reporting.tables.load", drawing)  # not even the runs are read
    assert copytask.report(runs_copy) == written
    assert main(["report", f"runs_dir={runs_copy}"]) == 0
    again = capsys.readouterr().out.splitlines()
    assert again[:-1] == drawn[:-1]  # which runs, the missing one, results.csv
    assert again[-1].startswith(f"report: {written[1]} and ") and "are up to date with the runs they draw" in again[-1]


class Drawn(Exception):
    """Raised by a report's drawing where a test replaces it."""


def drawing(*args, **kwargs):
    raise Drawn


@pytest.mark.parametrize("change", ["a run's file", "a figure gone", "a run completes", "the code", "the runs"])
def test_a_report_is_drawn_again_when_anything_it_draws_has_changed(runs_copy, monkeypatch, change):
    from copytask.reporting import freshness

    assert main(["report", f"runs_dir={runs_copy}"]) == 0
    runs = sorted(store.complete_runs(runs_copy))
    args = [f"runs_dir={runs_copy}"]
    if change == "a run's file":
        analysis = runs[0] / store.ANALYSIS
        os.utime(analysis, ns=(analysis.stat().st_atime_ns, analysis.stat().st_mtime_ns + 1))  # same size, rewritten
    elif change == "a figure gone":
        (runs_copy / "report" / "accuracy_vs_length.png").unlink()
    elif change == "a run completes":
        (runs[3] / store.METRICS).rename(runs[3] / "metrics.json.kept")
        assert main(["report", f"runs_dir={runs_copy}"]) == 0
        (runs[3] / "metrics.json.kept").rename(runs[3] / store.METRICS)
    elif change == "the code":
        monkeypatch.setattr(freshness, "code", lambda: "edited")
    else:
        args = overrides(runs_copy, "attention=none")  # the grid's baseline runs only
    monkeypatch.setattr("copytask.reporting.report.write_report", drawing)
    with pytest.raises(Drawn):
        main(["report", *args])


def test_what_a_report_is_drawn_from_names_its_x_axis(runs_copy):
    from copytask.api import drawn_from, select

    assert main(["report", f"runs_dir={runs_copy}"]) == 0
    selection = select(runs_copy)
    assert drawn_from(selection).current() is not None
    assert drawn_from(selection, "model.hidden_size").current() is None


def test_a_report_cut_off_while_drawn_is_drawn_again(runs_copy, monkeypatch):
    assert main(["report", f"runs_dir={runs_copy}"]) == 0
    analysis = sorted(store.complete_runs(runs_copy))[0] / store.ANALYSIS
    analysis.write_text(analysis.read_text() + " ")
    monkeypatch.setattr("copytask.reporting.report.write_report", drawing)
    with pytest.raises(Drawn):
        main(["report", f"runs_dir={runs_copy}"])
    assert not (runs_copy / "report" / "drawn_from.json").exists()  # the old record no longer says it is current


def parse_compare(output: str) -> dict[tuple[int, str], list[str]]:
    """Table rows of compare's output, keyed by (length, attention)."""
    rows = {}
    for line in output.splitlines():
        match = re.match(r"\s*(\d+)\s+(none|luong_general)\s+(\d+)\s+(.*)$", line)
        if match:
            rows[int(match[1]), match[2]] = [int(match[3]), *re.findall(r"[+-]?\d[\d,]*\.?\d*", match[4])]
    return rows


def test_compare_numbers_match_the_results_table(swept, capsys):
    runs_dir, _ = swept
    assert main(["compare", "--wide", *overrides(runs_dir)]) == 0
    output = capsys.readouterr().out
    assert "running the sweep" not in output  # every run exists: nothing is trained

    table = pd.read_csv(runs_dir / "results.csv")
    means = table.groupby(["length", "attention"])[["token_acc", "seq_acc", "tf_token_acc"]].mean()
    rows = parse_compare(output)
    assert set(rows) == set(means.index)
    for (length, attention), numbers in rows.items():
        seeds, token, token_lo, token_hi, seq, seq_lo, seq_hi, tf, tf_lo, tf_hi, chance, params, state, *gaps = numbers
        assert seeds == 2
        assert float(token) == pytest.approx(100 * means.loc[(length, attention), "token_acc"], abs=0.051)
        assert float(seq) == pytest.approx(100 * means.loc[(length, attention), "seq_acc"], abs=0.051)
        # the analysis' teacher-forced accuracy (issue 69), with its interval
        assert float(tf) == pytest.approx(100 * means.loc[(length, attention), "tf_token_acc"], abs=0.051)
        assert float(tf_lo) <= float(tf) <= float(tf_hi)
        assert float(token_lo) <= float(token) <= float(token_hi)
        assert float(chance) == pytest.approx(100 / 9, abs=0.051)
        assert int(params.replace(",", "")) == table[table["attention"] == attention]["params"].iloc[0]
        same = table[(table["attention"] == attention) & (table["length"] == length)]
        assert int(state.replace(",", "")) == same["state_floats"].iloc[0]  # floats per sequence
        if attention == "none":
            assert gaps == []
        else:
            expected = means.loc[(length, attention), "token_acc"] - means.loc[(length, "none"), "token_acc"]
            assert float(gaps[0]) == pytest.approx(100 * expected, abs=0.051)


def test_compare_missing_lists_and_trains_nothing(runs_copy, capsys):
    removed = pd.read_csv(runs_copy / "results.csv")["run"].iloc[2]
    shutil.rmtree(runs_copy / removed)

    assert main(["compare", "--missing", *overrides(runs_copy)]) == 0

    output = capsys.readouterr().out
    assert "1 of 8 runs missing" in output and removed in output
    assert not (runs_copy / removed).exists()


def edit_config(runs_dir: Path, old: str, new: str) -> Path:
    """A run's config.yaml edited by hand (the first run of `runs_dir` at length 3, seed 0, without
    attention): its line `old` replaced by `new`. -> the file."""
    [folder] = [f for f in store.complete_runs(runs_dir) if f.name.startswith("none-copy3-seed0-")]
    path = folder / store.CONFIG
    text = path.read_text()
    assert text.count(f"\n{old}\n") == 1
    path.write_text(text.replace(f"\n{old}\n", f"\n{new}\n"))
    return path


@pytest.mark.parametrize("flags", [[], ["--all"]], ids=["recorded sweep", "all"])
def test_compare_resolves_an_interpolation_in_a_config_edited_by_hand_as_omegaconf_does(runs_copy, flags):
    edit_config(runs_copy, "  val_size: 16", "  val_size: ${train.eval_every}")  # TINY's eval_every: 5

    process = run_cli("compare", *flags, f"runs_dir={runs_copy}")

    assert process.returncode == 0 and "Traceback" not in process.stderr, process.stderr
    assert "${" not in process.stdout and "train.val_size" in process.stdout  # 5 in one run, 16 in the others
    values = [line.split()[0] for line in process.stdout.splitlines() if re.match(r"\s*\d+\s+3\s+none\s", line)]
    assert sorted(values) == ["16", "5"]  # the run whose val_size is 5 apart from the other seed's 16


@pytest.mark.parametrize("flags", [[], ["--all"]], ids=["recorded sweep", "all"])
@pytest.mark.parametrize(
    "old, new, says",
    [
        ("  val_size: 16", "  val_size: ${train.val_size}", "Recursive interpolation detected"),
        ("  val_size: 16", "  val_size: ${train.no_such_key}", "Interpolation key 'train.no_such_key' not found"),
        ("  val_size: 16", "  val_size: 16\n  val_size: 7", "found duplicate key val_size"),
    ],
    ids=["recursive", "missing key", "duplicate key"],
)
def test_compare_refuses_a_config_omegaconf_refuses_in_one_line_naming_it(runs_copy, flags, old, new, says):
    path = edit_config(runs_copy, old, new)

    process = run_cli("compare", *flags, f"runs_dir={runs_copy}")

    assert "Traceback" not in process.stderr, process.stderr
    [line] = [line for line in process.stderr.splitlines() if path.parent.name in line]
    assert line.startswith("copytask: warning: skipping") and str(path) in line and says in line, line
    assert process.returncode == 0 and "7" not in [line.split()[0] for line in process.stdout.splitlines() if line]


@pytest.mark.parametrize("df, expected", [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (1000, 1.962)])
def test_interval_uses_the_t_quantile_of_the_tables(df, expected):
    values = pd.Series([0.0, 1.0] * ((df + 1) // 2) + [0.5] * ((df + 1) % 2))  # df + 1 seeds
    mean, low, high = interval(values)
    half = expected * values.std(ddof=1) / (df + 1) ** 0.5
    assert (low, high) == (pytest.approx(mean - half, abs=1e-3), pytest.approx(mean + half, abs=1e-3))


def test_a_settings_values_are_ordered_where_other_models_lack_the_key_or_give_another_type():
    """A table mixing models has settings some runs lack (None) or hold as another type: report's setup line
    ordered them with sorted() and failed with a TypeError (`report --all` beside a Mamba run)."""
    assert ordered([16, None, 8]) == [8, 16, None]
    assert ordered([None, True, False]) == [False, True, None]
    assert ordered(["b", 3, None, "a"]) == [3, "a", "b", None]


def test_interval_of_equal_values_is_that_value():
    assert interval(pd.Series([0.0, 0.0, 0.0])) == (0.0, 0.0, 0.0)  # seeds that all agree: no spread, no warning


def test_compare_trains_nothing_unless_asked_and_says_how(runs_copy, capsys):
    removed = pd.read_csv(runs_copy / "results.csv")["run"].iloc[6]
    shutil.rmtree(runs_copy / removed)

    assert main(["compare", *overrides(runs_copy)]) == 0

    output = capsys.readouterr().out
    assert "1 of 8 runs missing" in output and removed in output
    assert "train them with: python -m copytask sweep" in output and "runs_dir=" in output
    assert not (runs_copy / removed).exists()
    assert len(parse_compare(output)) == 4  # the table of what there is


def test_compare_given_only_runs_dir_names_it_once_in_how_to_train_the_missing(runs_copy, capsys):
    removed = pd.read_csv(runs_copy / "results.csv")["run"].iloc[6]
    shutil.rmtree(runs_copy / removed)  # the recorded sweep names the folder it was copied from

    assert main(["compare", f"runs_dir={runs_copy}"]) == 0

    hint = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train them with:"))
    assert hint.count("runs_dir=") == 1 and f"runs_dir={runs_copy}" in hint


def test_runs_beside_a_sweeps_grid_are_named_with_how_to_include_them(runs_copy, capsys):
    """A run trained into a sweep's runs_dir is not of its grid: the table stays the grid's, and compare, report
    (and report.md) and the API name the run and how to include it, once: no dot folder (a replacement's staging
    folder, complete), no report/ and no folder without results (issue 88, part 5)."""
    assert main(["train", *TINY, f"runs_dir={runs_copy}", "attention=bahdanau", "task.length=3"]) == 0
    [beside] = [folder.name for folder in store.complete_runs(runs_copy) if folder.name.startswith("bahdanau")]
    grid_run = pd.read_csv(runs_copy / "results.csv")["run"].iloc[0]
    shutil.copytree(runs_copy / grid_run, runs_copy / f".{grid_run}.new")  # a retraining, complete before its swap
    (runs_copy / "luong_general-copy9-seed0-killed").mkdir()  # no results: not a run --all would add
    note = f"note: 1 complete run in {runs_copy} is not of this grid: {beside}; {{}} includes it"
    capsys.readouterr()

    for given in ([f"runs_dir={runs_copy}"], overrides(runs_copy)):  # the recorded grid, and the sweep's overrides
        assert main(["compare", *given]) == 0
        printed = capsys.readouterr().out
        assert note.format("compare --all") in " ".join(printed.split())  # one line, wrapped at 100 columns
        assert max(map(len, printed.splitlines())) <= 100
        assert len(parse_compare(printed)) == 4 and "bahdanau" not in printed.replace(beside, "")  # the grid's table
    assert main(["report", f"runs_dir={runs_copy}"]) == 0
    assert note.format("report --all") in " ".join(capsys.readouterr().out.split())
    assert note.format("report --all") in (runs_copy / "report" / "report.md").read_text()
    assert beside not in set(pd.read_csv(runs_copy / "results.csv")["run"])
    assert main(["report", f"runs_dir={runs_copy}"]) == 0  # up to date: nothing redrawn, and still said
    printed = capsys.readouterr().out
    assert "nothing redrawn" in printed and note.format("report --all") in " ".join(printed.split())

    with pytest.warns(CopytaskWarning, match=re.escape(note.format("all_runs=True"))):
        assert len(copytask.results(runs_copy)) == 8
    with pytest.warns(CopytaskWarning, match=re.escape(note.format("all_runs=True"))):
        assert len(copytask.compare(runs_copy)) == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(copytask.results(runs_copy, all_runs=True)) == 9  # every run of the folder: none beside them
    assert not [warning for warning in caught if issubclass(warning.category, CopytaskWarning)]


def test_compare_train_missing_runs_the_missing_runs_first(runs_copy, capsys):
    removed = pd.read_csv(runs_copy / "results.csv")["run"].iloc[6]
    shutil.rmtree(runs_copy / removed)

    assert main(["compare", "--train-missing", *overrides(runs_copy)]) == 0

    output = capsys.readouterr().out
    assert "1 of 8 runs missing: running the sweep first" in output
    assert store.is_complete(runs_copy / removed)
    assert len(parse_compare(output)) == 4  # then the full table


def test_report_without_analysis_says_it_is_missing_and_how_to_make_it(runs_copy):
    runs = sorted(store.complete_runs(runs_copy))
    (runs[0] / store.ANALYSIS).write_text("{")  # corrupt: warned, then treated as missing
    for folder in runs[1:]:
        (folder / store.ANALYSIS).unlink()

    with pytest.warns(CopytaskWarning, match=re.escape(f"skipping analysis.json of {runs[0]}")):
        assert main(["report", *overrides(runs_copy)]) == 0

    markdown = (runs_copy / "report" / "report.md").read_text()
    assert "**Analysis missing** for 8 of 8 runs" in markdown
    assert f"python -m copytask analyze runs_dir={runs_copy}" in markdown
    assert (
        "### Counterfactual attention" not in markdown and "Jain and Wallace" in markdown
    )  # maps still come with the caution
    assert pd.read_csv(runs_copy / "results.csv")["align_hit"].isna().all()


def test_a_failing_analysis_is_named_and_the_others_go_on(runs_copy):
    runs = sorted(store.complete_runs(runs_copy))
    for folder in runs:
        (folder / store.ANALYSIS).unlink()
    (runs[1] / store.CHECKPOINT).write_bytes(b"not a checkpoint")

    with pytest.warns(CopytaskWarning, match=re.escape(f"analysis of {runs[1]} failed")):
        assert analysis.analyze(runs, eval_size=8, progress=False) == len(runs) - 1

    assert [folder for folder in runs if not (folder / store.ANALYSIS).is_file()] == [runs[1]]


def test_variable_length_run_is_drawn_per_length_beside_the_grid(runs_copy, capsys):
    variable = ["attention=luong_general", "seed=0", "task.variable_length=true", "task.min_length=2", "task.length=6"]
    assert main(["train", *TINY, f"runs_dir={runs_copy}", *variable]) == 0
    assert (
        main(["train", *TINY, f"runs_dir={runs_copy}", *variable, "train.steps=11"]) == 0
    )  # other settings: not the grid's

    assert main(["report", *overrides(runs_copy)]) == 0  # not analysed yet: the report says so
    assert "**Analysis missing** for 1 of 1 runs" in (runs_copy / "report" / "report.md").read_text()

    assert main(["analyze", f"runs_dir={runs_copy}", "train.progress=false"]) == 0
    assert main(["report", *overrides(runs_copy)]) == 0
    markdown = (runs_copy / "report" / "report.md").read_text()
    assert "Dashed lines: models trained on variable lengths" in markdown and "Analysis missing" not in markdown
    assert (
        "luong_general (copy) trained on 2-6" in (runs_copy / "report" / "accuracy_vs_length.svg").read_text()
    )  # legend
    assert "8 of 8 runs of the grid complete" in markdown  # the variable-length runs are not rows of the grid
    _, grid = compose_grid(overrides(runs_copy))
    [matching] = variable_length_runs(grid, runs_copy)  # the train.steps=11 run is left out
    assert store.read_json(matching / store.METRICS)["steps"] == 10


def test_multi_head_runs_are_labelled_apart(tmp_path):
    runs_dir = tmp_path / "runs"
    grid = [*TINY, f"runs_dir={runs_dir}", "attention=luong_general", "attention.heads=1,2", "task.length=3", "seed=0"]
    assert main(["sweep", *grid]) == 0

    table = pd.read_csv(runs_dir / "results.csv")
    assert sorted(table["attention"]) == ["luong_general", "luong_general-2heads"]
    markdown = (runs_dir / "report" / "report.md").read_text()
    assert "| 3 | luong_general-2heads | 1 |" in markdown  # its own row in the accuracy table
    assert "![heads of luong_general-2heads, length 3](heads_luong_general-2heads_length3.png)" in markdown
    assert (runs_dir / "report" / "heads_luong_general-2heads_length3.png").stat().st_size > 1000


def test_steps_to_target_is_the_first_evaluation_at_target_over_the_seeds_that_reached_it(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / store.HISTORY).write_text(
        "step,loss,val_token_acc,val_seq_acc,seconds\n50,1.0,0.5,0.0,1\n100,0.1,0.995,0.9,2\n150,0.1,0.98,0.8,3\n"
    )
    assert target_step(folder, 0.99) == 100  # the first hit, though accuracy fell again after it
    assert math.isnan(target_step(folder, 0.999)) and math.isnan(target_step(tmp_path / "nowhere", 0.99))

    runs = [
        {
            "length": 5,
            "attention": "none",
            "seed": seed,
            "token_acc": 0.5,
            "seq_acc": 0.0,
            "chance": 1 / 9,
            "params": 10,
            TARGET_STEP: math.nan,
        }
        for seed in range(3)
    ] + [
        {
            "length": 5,
            "attention": "luong_general",
            "seed": seed,
            "token_acc": 0.99,
            "seq_acc": 0.9,
            "chance": 1 / 9,
            "params": 12,
            TARGET_STEP: step,
        }
        for seed, step in enumerate([100, 200, math.nan])
    ]
    summary = summarise(pd.DataFrame(runs))
    attended = summary.set_index("attention").loc["luong_general"]
    assert attended[TARGET_STEP] == 150 and attended["reached"] == 2 and attended[f"{TARGET_STEP}_lo"] < 150
    shown = comparison_table(summary, wide=True).set_index("attention")["steps to target [95% CI]"]
    assert shown["none"] == "never"
    assert re.fullmatch(
        r"150 \[0, \d[\d,]*\] \(2/3\)", shown["luong_general"]
    )  # t-interval with 1 df: wide, clipped at 0


def test_report_heatmaps_outline_the_copied_positions_and_say_so(runs_copy, monkeypatch):
    from matplotlib.patches import Rectangle

    from copytask import figures

    outlined, save = {}, figures.save

    def keep(figure, path, dpi=120):  # count the outlines before the figure is closed
        outlined[path.name] = sum(isinstance(patch, Rectangle) for patch in figure.axes[0].patches)
        return save(figure, path, dpi)

    monkeypatch.setattr(figures, "save", keep)
    assert main(["report", *overrides(runs_copy)]) == 0
    assert outlined["attention_luong_general_length3.png"] == 3  # one per content output step
    assert outlined["attention_luong_general_length6.png"] == 6
    assert "red outline marks the source position" in (runs_copy / "report" / "report.md").read_text()


def drawn_figures(monkeypatch) -> dict[str, object]:
    """Every figure the report saves, by file name (the drawing modules' `save`, recorded)."""
    from copytask import figures
    from copytask.reporting import analysis_figures, result_figures

    drawn, save = {}, figures.save

    def record(figure, path, dpi=120):
        drawn[Path(path).name] = figure
        return save(figure, path, dpi)

    for module in (figures, analysis_figures, result_figures):
        monkeypatch.setattr(module, "save", record)
    return drawn


def test_a_one_length_grid_gives_figures_that_hold_and_a_report_that_states_what_was_swept(tmp_path, monkeypatch):
    from matplotlib.container import ErrorbarContainer

    import copytask

    grid = ["attention=none,luong_general", "task.length=5", "seed=0,1", "task.vocab_size=4,16", "train.lr=1e-3,5e-3"]
    drawn = drawn_figures(monkeypatch)
    copytask.sweep([*TINY, *grid], runs_dir=tmp_path / "runs")  # its end draws the report

    text = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert "4, 16 (per setting) content symbols (chance token accuracy 25.0%, 6.2%)" in text
    assert "lr 0.001, 0.005 (per setting)" in text
    for name, figure in drawn.items():
        figure.canvas.draw()
        width = figure.bbox.width
        titles = [figure._suptitle] if figure._suptitle else []
        titles += [axis.title for axis in figure.axes if axis.get_visible()]
        for title in titles:  # titles fit: nothing clipped at either end
            extent = title.get_window_extent()
            assert extent.x0 >= 0 and extent.x1 <= width, (name, title.get_text())
        for axis in figure.axes:  # nothing drawn empty
            if axis.get_visible() and axis.get_label() != "<colorbar>":
                assert axis.lines or axis.images or axis.collections or axis.containers, name
    accuracy = drawn["accuracy_vs_length.png"]
    assert all(
        any(isinstance(c, ErrorbarContainer) for c in axis.containers) for axis in accuracy.axes
    )  # one x: error bars
    assert "bar = 95% interval" in accuracy._suptitle.get_text()


def test_analysis_lengths_test_every_run_beyond_its_training_and_the_report_draws_it(runs_copy, capsys):
    report = runs_copy / "report"
    assert not (report / "extrapolation.png").exists()  # the sweep's analysis tested the trained lengths only
    assert main(["analyze", f"runs_dir={runs_copy}", "analysis.lengths=[3,6,9]", "train.progress=false"]) == 0
    for run in pd.read_csv(runs_copy / "results.csv")["run"]:
        tested = [
            row["test_length"] for row in store.read_json(runs_copy / run / store.ANALYSIS)["length_generalisation"]
        ]
        assert tested == [3, 6, 9]
    shutil.rmtree(report)
    assert main(["report", *overrides(runs_copy)]) == 0
    assert (report / "extrapolation.png").stat().st_size > 0
    assert "### Beyond the trained lengths" in (report / "report.md").read_text()
    capsys.readouterr()
    assert main(["analyze", f"runs_dir={runs_copy}", "analysis.lengths=[0]"]) == 2
    assert "analysis.lengths must be null or a list of integers >= 1" in capsys.readouterr().err


def test_the_report_speaks_of_transformers_only_where_it_has_one(runs_copy):
    def counterfactual_text() -> str:
        assert main(["report", "--all", f"runs_dir={runs_copy}"]) == 0
        markdown = (runs_copy / "report" / "report.md").read_text()
        return markdown.split("### Counterfactual attention")[1].split("###")[0]

    assert "Transformer" not in counterfactual_text()  # the tiny grid: GRU models only
    transformer = ["model=transformer", "model.d_model=8", "model.heads=2", "model.layers=1", "model.ff_size=16"]
    trained = run_cli("train", *TINY, *transformer, "task.length=3", f"runs_dir={runs_copy}")
    assert trained.returncode == 0, trained.stderr
    assert main(["analyze", f"runs_dir={runs_copy}"]) == 0
    assert "A Transformer's drops mean something else than a GRU model's" in counterfactual_text()


def test_the_state_figure_knows_the_part_of_each_familys_state_its_size_does_not_set(make_config):
    """Issue 81: of Mamba's state floats, the convolution window does not grow with model.d_state; of linear
    attention's, the hand-over does not grow with attention.size (docs/models.md's table)."""
    from copytask.models.build import build_model
    from copytask.reporting.state_section import fixed_part

    for d_state in (1, 16):
        mamba = make_config("model=mamba", f"model.d_state={d_state}")
        window = fixed_part(mamba)
        assert window == (2 * 2 * 40 * 3, "convolution window")  # layers x expand x d_model x (d_conv - 1)
        assert build_model(mamba).state_floats(20) - window[0] == 2 * 80 * d_state  # the rest: the SSM state
    linear = make_config("attention=linear", "attention.size=8")
    assert fixed_part(linear) == (64, "hand-over") and build_model(linear).state_floats(20) == 64 + 8 * 65
    assert fixed_part(make_config("attention=none")) is None and fixed_part(make_config("model=transformer")) is None


def selective_summary(families=("none", "mamba")) -> tuple[pd.DataFrame, list[str]]:
    """`summarise` of a made-up union grid as experiment=selective_copy's: plain copy at L = 8, k = 8 at L = 16,
    32, 64 and k = 4, 16 at L = 64, three seeds of each family, accuracy falling with L and k."""
    settings = [("copy", math.nan, 8)] + [("selective_copy", 8, length) for length in (16, 32, 64)]
    settings += [("selective_copy", k, 64) for k in (4, 16)]
    runs = [
        {"task.name": task, "task.copied": k, "length": length, "attention": family, "seed": seed,
         "token_acc": max(0.0, 1 - length / 100 - (0 if math.isnan(k) else k / 50) - 0.01 * seed - 0.1 * i),
         "seq_acc": 0.0, "chance": 1 / 9, "params": 10}
        for task, k, length in settings for i, family in enumerate(families) for seed in range(3)
    ]  # fmt: skip
    return summarise(pd.DataFrame(runs), ["task.name", "task.copied"]), ["task.name", "task.copied"]


def keeping(drawn: dict) -> object:
    """A `save` that keeps each figure in `drawn` by file name, and writes nothing."""
    return lambda figure, path, dpi=120: drawn.setdefault(path.name, figure) and path


def test_selective_copying_is_drawn_against_length_at_fixed_k_and_against_k_at_fixed_length(tmp_path, monkeypatch):
    """Issue 82: one panel per fixed k with two lengths or more, one per fixed L with two k or more; a line per
    family with its band; the plain copy task at L = k hollow beside the first; a table of every (k, L)."""
    from copytask.reporting import selective_section

    drawn = {}
    monkeypatch.setattr(selective_section, "save", keeping(drawn))
    summary, settings = selective_summary()
    section = selective_section.selective_section(summary, settings, tmp_path)
    figure = drawn[selective_section.SELECTIVE_FIGURE]
    by_length, by_k = [axis for axis in figure.axes if axis.get_visible()]
    assert "k = 8" in by_length.get_title() and "L = 64" in by_k.get_title()
    lines = {line.get_label(): line for line in by_length.lines if not line.get_label().startswith("_")}
    assert list(lines["none"].get_xdata()) == [16, 32, 64] and list(lines["mamba"].get_xdata()) == [16, 32, 64]
    assert list(lines["none"].get_ydata()) == pytest.approx([67, 51, 19])  # the mean over seeds, in %
    assert len(by_length.collections) >= 2  # a band per family
    hollow = [line for line in by_length.lines if line.get_markerfacecolor() == "none" and len(line.get_xdata())]
    assert sorted(line.get_xdata()[0] for line in hollow) == [8, 8]  # plain copy at L = k = 8, each family
    assert "plain copy at L = k" in lines
    k_lines = {line.get_label(): line for line in by_k.lines if not line.get_label().startswith("_")}
    assert list(k_lines["mamba"].get_xdata()) == [4, 8, 16]
    table = selective_section.selective_table(summary, settings)
    assert list(table.columns) == ["attention", "copy L=8", "k=4 L=64", "k=8 L=16", "k=8 L=32", "k=8 L=64",
                                   "k=16 L=64"]  # fmt: skip
    assert list(table["attention"]) == ["none", "mamba"] and table.iloc[0]["k=8 L=16"].startswith("67.0 [")
    assert section.figures and "the length or the content" in "\n".join(section.lines)
    monkeypatch.undo()
    plain = summary[summary["task.name"] == "copy"].drop(columns=["task.copied"])
    assert selective_section.selective_section(plain, ["task.name"], tmp_path) == ([], [])  # no k swept: nothing


def test_a_setting_some_runs_lack_is_a_line_style_of_its_own_not_a_line_dropped(tmp_path, monkeypatch):
    """The accuracy figure of a grid whose copy runs have no task.copied beside selective copying's: the copy
    runs are drawn, as task.copied=- (NaN, grouped away before)."""
    from copytask.reporting import result_figures

    drawn = {}
    monkeypatch.setattr(result_figures, "save", keeping(drawn))
    summary, settings = selective_summary()
    result_figures.plot_accuracy(summary, settings, "length", tmp_path / "accuracy", pd.DataFrame())
    copy_axis = drawn["accuracy.png"].axes[0]
    assert "task.name=copy" in copy_axis.get_title()
    labels = {container.get_label() for container in copy_axis.containers}
    assert {"none, task.copied=-", "mamba, task.copied=-"} <= labels


def test_the_selective_copying_preset_is_the_union_of_its_settings():
    """experiment=selective_copy: k = 8 at L = 16-128, k = 4, 8, 16 at L = 64 and plain copy at L = 8, each for
    the six families and three seeds: 7 x 6 x 3 runs, no other (task, k, L)."""
    _, grid = compose_grid(["experiment=selective_copy"])
    tasks = {(run.config.task.name, run.config.task.copied, run.config.task.length) for run in grid}
    assert tasks == {("copy", None, 8), *(("selective_copy", 8, L) for L in (16, 32, 64, 128)),
                     ("selective_copy", 4, 64), ("selective_copy", 16, 64)}  # fmt: skip
    families = {store.model_label(run.config) for run in grid}
    assert families == {"none", "luong_general", "transformer", "linear", "mamba", "mamba_lti"}
    assert len(grid) == len({run.folder for run in grid}) == 7 * 6 * 3
    assert {run.config.train.steps for run in grid} == {1200}  # the default budget


def headline_of(rows: list[tuple[str, int, int, float]]) -> str:
    """report.headline's first line for a summary of (model, length, task.copied, mean token accuracy)."""
    from copytask.reporting.report import headline

    summary = pd.DataFrame(
        [
            {"attention": model, "length": length, "task.copied": copied, "token_acc": acc, "seeds": 3}
            | {"token_acc_lo": acc - 0.01, "token_acc_hi": min(acc + 0.01, 1.0), "chance": 1 / 9}
            for model, length, copied, acc in rows
        ]
    )
    return headline(summary, "length")[0]


def test_the_headline_says_where_a_length_reached_99_percent_in_only_some_of_its_settings():
    """Selective copying's union grid: at L = 64 the baseline copies k = 4 at 99.9% and k = 16 at 37.8%."""
    union = headline_of([("none", 16, 8, 0.966), ("none", 64, 4, 0.999), ("none", 64, 16, 0.378)])
    assert "The longest length with a mean of at least 99% in some setting: none 64." in union
    plain = headline_of([("none", 16, 8, 0.995), ("none", 64, 8, 0.931)])
    assert "The longest length with a mean of at least 99%: none 16." in plain
