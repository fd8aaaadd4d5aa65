"""The sweep through the real CLI: results table, resume, failed jobs, submitit launcher."""

from __future__ import annotations

import io
import itertools
import logging
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest

import copytask
from copytask import cli, store
from copytask.config import parallel
from copytask.console import TERMINAL_WIDTH, Lines
from copytask.sweeps.grid import compose_grid

from .conftest import ATTENTION_OPTIONS, TINY, overrides, pythonpath, run_cli

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

EXPECTED = set(itertools.product(["none", "luong_general"], [3, 6], [0, 1]))


def test_sweep_trains_the_grid_and_writes_results_and_report(swept):
    runs_dir, process = swept
    assert process.returncode == 0, process.stderr
    table = pd.read_csv(runs_dir / "results.csv")
    assert set(zip(table["attention"], table["length"], table["seed"])) == EXPECTED
    assert len(table) == len(EXPECTED)
    for run in table["run"]:
        metrics = store.read_json(runs_dir / run / store.METRICS)
        assert metrics["run"] == run
    assert "8/8 runs complete (8 trained now), 0 failed" in process.stdout
    assert "s wall time" in process.stdout
    for name in ("report.md", "accuracy_vs_length.png", "accuracy_vs_length.svg", "training_curves.png"):
        assert (runs_dir / "report" / name).is_file(), name
    assert store.read_json(runs_dir / "sweep.json")["jobs"] == 8


def test_sweep_analyses_its_runs_before_the_report(swept):
    runs_dir, process = swept
    assert "analysis: 8 runs analysed" in process.stdout
    table = pd.read_csv(runs_dir / "results.csv")
    for run in table["run"]:
        analysed = store.read_json(runs_dir / run / store.ANALYSIS)
        assert [row["test_length"] for row in analysed["length_generalisation"]] == [3, 6]  # the grid's lengths
    # the alignment joins results.csv on the run folder: only runs with attention have one
    attended = table["attention"] == "luong_general"
    assert table.loc[attended, ["align_hit", "align_mass"]].notna().all().all()
    assert table.loc[~attended, ["align_hit", "align_mass"]].isna().all().all()
    out = runs_dir / "report"
    assert (out / "counterfactual.png").is_file() and (out / "length_generalisation.png").is_file()
    markdown = (out / "report.md").read_text()
    assert "| length | attention | seeds | own % | uniform % | permuted % | fixed % | drop uniform |" in markdown
    assert "| length | attention | seeds | argmax on copied position % | weight on copied position % |" in markdown
    assert "![train length x test length accuracy](length_generalisation.png)" in markdown
    # the evidence comes before the maps it qualifies, after the Jain and Wallace caution
    caution, evidence, heatmap = (
        markdown.index(s) for s in ("Jain and Wallace", "### Counterfactual attention", "![attention of luong_general")
    )
    assert caution < evidence < heatmap
    assert "Analysis missing" not in markdown


def test_grid_expansion_finds_the_sweeps_folders(swept):
    runs_dir, _ = swept
    _, grid = compose_grid(overrides(runs_dir))
    table = pd.read_csv(runs_dir / "results.csv")
    assert sorted(run.folder.name for run in grid) == sorted(table["run"])
    # a swept key given on the command line replaces the preset's list
    _, narrowed = compose_grid([*TINY, f"runs_dir={runs_dir}", "attention=none"])
    assert {run.config.attention.name for run in narrowed} == {"none"}
    assert {run.config.task.length for run in narrowed} == {5, 10}  # experiment=quick's lengths


@pytest.fixture
def compositions(monkeypatch) -> dict[str, int]:
    """How many configs Hydra composes in this process during the test: every config, and among them
    the grid's jobs."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    counts = {"configs": 0, "jobs": 0}
    load_configuration, load_sweep_config = ConfigLoaderImpl.load_configuration, ConfigLoaderImpl.load_sweep_config

    def configuration(self, *args, **kwargs):
        counts["configs"] += 1
        return load_configuration(self, *args, **kwargs)

    def job(self, *args, **kwargs):
        counts["jobs"] += 1
        return load_sweep_config(self, *args, **kwargs)

    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration", configuration)
    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", job)
    return counts


def test_compare_and_results_name_a_recorded_sweeps_runs_without_composing_them(swept, runs_copy, compositions, capsys):
    assert "runs" in store.read_json(runs_copy / "sweep.json")  # the sweep recorded its grid's runs as it started
    assert cli.main(["compare", f"runs_dir={runs_copy}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("compare: the grid of the last sweep in")
    # the command and the folder wrapped at 100 columns, as the table is, each path whole
    assert all(len(line) <= TERMINAL_WIDTH for line in lines), max(lines, key=len)
    words = [word for line in lines for word in line.split()]
    assert f"{runs_copy}:" in words and f"runs_dir={swept[0]}" in words
    # the config of `compare runs_dir=...`, then of the sweep's recorded overrides (which name another runs_dir)
    assert compositions == {"configs": 2, "jobs": 0}
    assert cli.main(["compare", *overrides(runs_copy)]) == 0  # the sweep's own overrides: its recorded grid
    assert compositions == {"configs": 3, "jobs": 0}
    assert len(copytask.results(runs_copy)) == 8
    assert compositions == {"configs": 5, "jobs": 0}


def test_missing_and_train_missing_take_the_grid_the_configs_compose_now(runs_copy, tmp_path, compositions, capsys):
    """A preset of the user's (on hydra.searchpath) widened from seeds 0,1 to 0,1,2 after its sweep ran: compare
    --missing lists the run of seed 2 and --train-missing trains it, where both read the recorded grid ("all 2 runs
    complete", nothing trained); plain compare keeps the sweep's runs and says the configs changed. With the configs
    as the sweep composed them, the record is read and no job composed. And the sweep's report names the runs in
    its runs_dir that are not of its grid (issue 88, part 5)."""
    presets = tmp_path / "my_configs" / "experiment"
    presets.mkdir(parents=True)

    def preset(seeds: str) -> None:
        params = f"attention: none\n      task.length: 3\n      seed: {seeds}\n"
        (presets / "mine.yaml").write_text(f"# @package _global_\nhydra:\n  sweeper:\n    params:\n      {params}")

    preset("0,1")
    own = ["experiment=mine", f"hydra.searchpath=[file://{tmp_path / 'my_configs'}]", f"runs_dir={runs_copy}"]
    copytask.sweep([*(override for override in TINY if override != "experiment=quick"), *own])
    record = store.read_json(runs_copy / "sweep.json")
    assert record["trained"] == 0 and len(record["runs"]) == 2  # the tiny sweep's none-copy3 runs, complete
    opening = (runs_copy / "report" / "report.md").read_text().split("## Setup")[0]
    assert f"note: 6 complete runs in {runs_copy} are not of this grid: " in opening
    assert "and 4 more; report --all includes them" in opening

    def compare(*flags: str) -> str:
        assert cli.main(["compare", *flags, f"runs_dir={runs_copy}"]) == 0
        return " ".join(capsys.readouterr().out.split())  # lines wrapped at 100 columns, joined

    capsys.readouterr()
    jobs = compositions["jobs"]
    assert "all 2 runs complete" in compare("--missing")
    assert "configs changed" not in compare() and compositions["jobs"] == jobs  # the record, read

    preset("0,1,2")
    printed = compare()
    assert compositions["jobs"] == jobs and re.search(r" 3 none 2 ", printed)  # the runs the sweep made, and a note
    assert (
        "note: the configs changed since this sweep ran: these are the runs it recorded; compare --missing lists "
        "the grid they compose now, compare --train-missing trains its missing runs" in printed
    )
    printed = compare("--missing")
    assert "composed from the configs as they are now" in printed and "configs changed" not in printed
    assert "1 of 3 runs missing: seed=2 (none-copy3-seed2-" in printed
    printed = compare("--train-missing")
    assert "1 of 3 runs missing: running the sweep first" in printed and re.search(r" 3 none 3 ", printed)
    assert len(store.read_json(runs_copy / "sweep.json")["runs"]) == 3  # the sweep it ran recorded the grid
    jobs = compositions["jobs"]
    assert "all 3 runs complete" in compare("--missing") and compositions["jobs"] == jobs


def test_a_grid_not_recorded_is_composed_once_and_gives_what_the_record_gives(runs_copy, compositions):
    recorded = copytask.results(runs_copy)
    record = store.read_json(runs_copy / "sweep.json")
    del record["runs"]  # as a sweep recorded before copytask recorded its runs
    store.write_json(runs_copy / "sweep.json", record)
    before = dict(compositions)
    composed = copytask.results(runs_copy)
    pd.testing.assert_frame_equal(composed, recorded)
    assert compositions["jobs"] - before["jobs"] == 8  # each job once
    assert compositions["configs"] - compositions["jobs"] - (before["configs"] - before["jobs"]) == 2  # and 2 masters


def test_a_bad_value_is_refused_before_the_jobs_launched_ahead_of_it_are_composed(tmp_path, compositions, capsys):
    # the default grid launches its 9 jobs of length 5 before length 'oops': every swept value is composed first,
    # the command line's before the preset's
    assert cli.main(["sweep", f"runs_dir={tmp_path}", "task.length=5,oops"]) == 2

    assert "got 'oops' (in the grid: task.length=5,oops)" in capsys.readouterr().err
    assert compositions["jobs"] == 2  # the grid's first job, then its first with length 'oops'
    assert not any(tmp_path.iterdir())


def test_an_x_axis_the_sweep_does_not_vary_is_refused_before_any_job_is_composed(tmp_path, compositions, capsys):
    assert cli.main(["sweep", f"runs_dir={tmp_path}", "report.x=bogus"]) == 2

    assert "report.x must be task.length or a numeric key this sweep varies" in capsys.readouterr().err
    assert compositions["jobs"] == 0  # the default grid's 45 were composed, and their models built, first


def test_resume_retrains_exactly_the_removed_run(runs_copy):
    table = pd.read_csv(runs_copy / "results.csv")
    removed = table["run"].iloc[3]
    kept = {run: (runs_copy / run / store.METRICS).read_text() for run in table["run"] if run != removed}
    shutil.rmtree(runs_copy / removed)

    process = run_cli("sweep", *overrides(runs_copy))

    assert process.returncode == 0, process.stderr
    trained = [line for line in process.stdout.splitlines() if "greedy token acc" in line]
    assert len(trained) == 1 and trained[0].startswith(removed)
    assert process.stdout.count("already complete, skipped") == len(kept)
    assert store.is_complete(runs_copy / removed)
    assert all((runs_copy / run / store.METRICS).read_text() == text for run, text in kept.items())
    assert "8/8 runs complete (1 trained now)" in process.stdout
    reported = run_cli("report", f"runs_dir={runs_copy}")  # the sweep recorded what its report was drawn from
    assert reported.returncode == 0 and "figures are up to date with the runs they draw: nothing redrawn" in (
        reported.stdout
    )


def test_a_sweep_that_trains_nothing_keeps_the_record_of_the_sweep_that_trained_its_runs(runs_copy):
    first = store.read_json(runs_copy / "sweep.json")

    process = run_cli("sweep", *overrides(runs_copy))  # every run complete: nothing to train

    assert process.returncode == 0, process.stderr
    assert "8/8 runs complete (0 trained now)" in process.stdout
    [line] = [line for line in (runs_copy / "report" / "report.md").read_text().splitlines() if "Last sweep" in line]
    assert "trained none of its 8 runs" in line
    trained_them = f"trained 8 of 8 runs in **{first['wall_seconds']:.0f} s wall time**, finished {first['finished']}"
    assert trained_them in line, line  # the first sweep's record, not the second's seconds of analysis and report
    again = run_cli("sweep", *overrides(runs_copy))  # and the record survives a third sweep
    assert again.returncode == 0 and trained_them in (runs_copy / "report" / "report.md").read_text()


def test_failed_job_is_named_and_the_sweep_exits_nonzero(tmp_path, fails_at_length_4, capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["sweep", *TINY, f"runs_dir={tmp_path}", "attention=none", "task.length=4,3", "seed=0"])

    assert exit.value.code == 1
    out, err = capsys.readouterr()
    failed = [line for line in err.splitlines() if line.startswith("copytask: job failed:")]
    assert len(failed) == 2  # once as it fails, once in the summary at the end
    assert all("injected failure at length 4" in line for line in failed)
    assert "task.length=4 attention=none " in failed[-1]  # the summary names the job by its overrides
    table = pd.read_csv(tmp_path / "results.csv")  # the other job's results are kept
    assert list(zip(table["attention"], table["length"])) == [("none", 3)]
    assert "1/2 runs complete" in out


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            ["task.length=5,oops"],
            "copytask: error: task.length must be an integer >= 1, got 'oops' (in the grid: task.length=5,oops)",
        ),
        (["train.steps=0"], "copytask: error: train.steps must be an integer >= 1, got 0 (in the grid: train.steps=0)"),
        (["task.lenght=40"], "copytask: error: unknown key 'task.lenght'; did you mean task.length?"),
        (
            ["attention=bogus"],
            f"copytask: error: attention=bogus: no such option; choose one of {', '.join(ATTENTION_OPTIONS)}",
        ),
        (
            ["report.x=model.hidden_size"],
            "copytask: error: report.x must be task.length or a numeric key this sweep varies (task.length), "
            "got 'model.hidden_size'",
        ),
        (
            ["hydra/launcher=parallel", "hydra.launcher.n_jobs=0"],
            "copytask: error: hydra.launcher.n_jobs=0: the parallel launcher needs at least one job at a time "
            "(leave it out for one per core, as memory allows)",
        ),
    ],
)
def test_a_bad_grid_is_refused_in_one_line_before_anything_runs(tmp_path, bad, message):
    runs_dir = tmp_path / "runs"
    process = run_cli("sweep", *TINY, "attention=none", "task.length=3,4", f"runs_dir={runs_dir}", *bad)

    assert process.returncode == 2
    assert process.stderr.strip() == message
    assert not runs_dir.exists()  # nothing trained, nothing written


def test_train_refuses_an_unknown_key_instead_of_training_the_default(tmp_path):
    process = run_cli("train", *TINY, f"runs_dir={tmp_path}", "task.lenght=40")

    assert process.returncode == 2
    assert process.stderr.strip() == "copytask: error: unknown key 'task.lenght'; did you mean task.length?"
    assert "+task.lenght" not in process.stderr and not any(tmp_path.iterdir())


def test_sweep_through_submitit_local(tmp_path):
    process = run_cli(
        "sweep",
        *TINY,
        f"runs_dir={tmp_path}",
        "attention=none,luong_general",
        "task.length=3",
        "seed=0",
        "hydra/launcher=submitit_local",
    )

    assert process.returncode == 0, process.stderr
    table = pd.read_csv(tmp_path / "results.csv")
    assert set(table["attention"]) == {"none", "luong_general"}
    assert (tmp_path / ".sweep" / ".submitit").is_dir()  # the jobs really went through submitit
    assert store.read_json(tmp_path / "sweep.json")["launcher"] == "submitit_local"


def test_slurm_preset_passes_cluster_settings_and_sets_torch_threads():
    from hydra.utils import instantiate

    master, _ = compose_grid(
        [
            "experiment=quick",
            "hydra/launcher=slurm",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=30",
            "hydra.launcher.gpus_per_node=1",
            "hydra.launcher.cpus_per_task=4",
        ]
    )
    params = instantiate(master.hydra.launcher).params
    assert (params["partition"], params["timeout_min"], params["gpus_per_node"]) == ("gpu", 30, 1)
    assert params["setup"] == ["export OMP_NUM_THREADS=4"]  # torch in the job uses the CPUs it was given


@pytest.mark.parametrize(
    "extra, builds",
    [([], True), (["train.fused=false"], False), (["model=transformer"], True), (["hydra/launcher=slurm"], False)],
)
def test_a_sweep_on_this_machines_cpu_builds_the_kernels_before_its_bar_starts(tmp_path, monkeypatch, extra, builds):
    """A fresh machine's compile (30-80 s) inside the first jobs would count as training in the ETA."""
    from copytask.kernels import build
    from copytask.sweeps import jobs

    calls = []
    monkeypatch.setattr(build, "kernel", lambda: calls.append("build"))
    monkeypatch.setattr(jobs.SweepProgress, "__init__", lambda self, *args, **kwargs: calls.append("bar"))
    monkeypatch.setattr(
        jobs, "expand", lambda config: []
    )  # the grid's runs: what the bar is given, not what this test is about
    master, _ = compose_grid([*TINY, f"runs_dir={tmp_path}", "task.length=3,4", "train.device=cpu", *extra])
    jobs.SweepSummary().on_multirun_start(master)
    assert calls == (["build", "bar"] if builds else ["bar"])


def test_a_sweep_shows_one_progress_bar_for_all_its_runs(tmp_path):
    tiny = [override for override in TINY if override != "train.progress=false"]
    process = run_cli(
        "sweep", *tiny, "train.progress=true", "attention=none", "task.length=3,4", "seed=0", f"runs_dir={tmp_path}"
    )

    assert process.returncode == 0, process.stderr
    # the work done, the runs finished of the grid, and how many run at once (Hydra's basic launcher: one)
    assert "sweep (2/2 runs, 1 job at a time) |" in process.stderr
    bars = [line for line in re.split(r"[\r\n]", process.stderr) if line.startswith("sweep (")]
    assert bars and not any("%" in line for line in bars)  # one kind of figure: runs, not a share of the work too
    assert "step/s" not in process.stderr  # no per-run bars


def test_the_first_look_sweeps_through_the_parallel_launcher_and_ends_saying_what_it_shows(tmp_path):
    shrunk = [override for override in TINY if not override.startswith("experiment=")]
    process = run_cli("sweep", "experiment=first_look", *shrunk, "task.length=3", f"runs_dir={tmp_path}")

    assert process.returncode == 0, process.stderr  # the jobs, callbacks included, pickle into joblib's workers
    results = pd.read_csv(tmp_path / "results.csv")
    assert sorted(zip(results["attention"], results["seed"])) == [
        (a, s) for a in ("luong_general", "none") for s in (0, 1)
    ]
    record = store.read_json(tmp_path / "sweep.json")
    assert record["launcher"] == "parallel"
    assert record["jobs_at_once"] == min(parallel.machine_jobs(), 2)  # one per core as memory allows, two jobs here
    # its last lines: the table as compare prints it, the finding, and what it shows
    out = process.stdout[process.stdout.index("copy task: greedy accuracy") :]
    assert re.search(r"^\s+3\s+luong_general\s+2\s", out, flags=re.MULTILINE) and "At length 3" in out
    words = " ".join(out.split())  # the note is wrapped to the terminal: where it breaks depends on runs_dir
    assert words.endswith("minutes on two cores.") and "README's result is the default sweep" in words
    assert "These numbers are not README's table: this trains a quarter of its budget, with two seeds" in words
    assert f"The figure is {tmp_path}/report/accuracy_vs_length.png." in words  # where this sweep drew it
    # within 100 columns but for the lines that hold this sweep's folder: a path is kept whole, to be copied
    assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) <= 100


@pytest.mark.parametrize(
    "args, names",
    [
        (["sweep", "train.lr=interval(1e-4,1e-2)"], "train.lr=interval(1e-4,1e-2): the basic sweeper takes lists"),
        (["train", "--lenght", "20"], "unrecognized arguments: --lenght"),
        (["sweep", "experiment=quick", "--lenght"], "unrecognized arguments: --lenght"),
    ],
)
def test_what_hydra_cannot_take_is_refused_in_one_line_before_anything_runs(tmp_path, capsys, args, names):
    assert cli.main([*args, f"runs_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"copytask: error: {names}") and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def test_the_sweep_bar_weighs_each_run_by_its_length_and_budget(runs_copy):
    from copytask.sweeps.grid import select_runs
    from copytask.sweeps.progress import SweepProgress, expected_cost

    runs = select_runs(overrides(runs_copy)).runs
    assert {expected_cost(run) for run in runs} == {10 * 3, 10 * 6}  # train.steps x length
    for run in runs:
        if run.config.task.length == 6:
            (run.folder / store.METRICS).unlink()
    progress = SweepProgress(runs, enabled=False)
    progress.close()
    assert progress.finished() == (4, 4 * 10 * 3)  # the four short runs are a third of the work, not half
    assert sum(progress.costs) == 4 * 10 * 3 + 4 * 10 * 6


def test_the_sweep_bar_credits_the_steps_a_run_in_training_has_done(runs_copy):
    from copytask.sweeps.grid import select_runs
    from copytask.sweeps.progress import SweepProgress

    runs = select_runs(overrides(runs_copy)).runs
    training, killed = [run for run in runs if run.config.task.length == 6][:2]
    for run in (training, killed):
        (run.folder / store.METRICS).unlink()
        store.write_progress(run.folder, 4, 10)
    with store.lock_run(training.folder):  # held as a training process holds it; the killed run's lock is free
        progress = SweepProgress(runs, enabled=False)
        progress.close()
        done, work = progress.finished()
    assert done == len(runs) - 2 and work == sum(progress.costs) - 10 * 6 - 0.6 * 10 * 6  # 4 of 10 steps of one run
    assert progress.bar.n == work


def test_a_sweeps_log_with_both_streams_has_each_runs_line_on_a_line_of_its_own(tmp_path):
    """`sweep ... > log 2>&1`: the bars (stderr) are not redrawn with carriage returns there, so no
    other line (a job's result, Hydra's) lands on the end of a bar's."""
    tiny = [override for override in TINY if override != "train.progress=false"]
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0"}
    args = [
        "sweep",
        *tiny,
        "train.progress=true",
        "attention=none",
        "task.length=3,4,5",
        "seed=0",
        f"runs_dir={tmp_path}",
    ]
    process = subprocess.run(
        [sys.executable, "-m", "copytask", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        timeout=600,
    )  # bytes: text mode would read each carriage return as a newline
    log = process.stdout.decode()
    assert process.returncode == 0, log
    assert "\r" not in log
    lines = log.split("\n")
    results = [line for line in lines if "greedy token acc" in line]
    assert len(results) == 3 and all(line.startswith("none-copy") for line in results), log
    bars = [line for line in lines if "sweep (" in line or "analyze:" in line]
    assert "sweep (3/3 runs, 1 job at a time) |" in log and any(line.startswith("analyze: 100%") for line in bars)
    assert all(line.startswith(("sweep (", "analyze:")) and line.endswith("]") for line in bars), bars


def test_on_a_terminal_a_line_first_erases_the_bar_it_would_run_into(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal, log = Terminal(), io.StringIO()
    handler = Lines()
    for stream, expected in ((terminal, "\r\x1b[Kdone\n"), (log, "done\n")):
        monkeypatch.setattr(sys, "stdout", stream)
        handler.emit(logging.LogRecord("copytask", logging.INFO, __file__, 1, "done", None, None))
        assert stream.getvalue() == expected
