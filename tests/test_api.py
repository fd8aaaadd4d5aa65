"""The public API as a user calls it (`import copytask`): compose, train, sweep, results, compare,
report, load_run and decode on tiny runs composed from the real configs; what they return is what
the command line prints; and calling them leaves the caller's process as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import copytask
from copytask import store

from .conftest import TINY, pythonpath

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)


def test_import_copytask_loads_no_heavy_module():
    code = "import sys, copytask; print(sorted({'torch', 'pandas', 'matplotlib'} & set(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": pythonpath()}, check=True
    )
    assert done.stdout.strip() == "[]"


def test_the_eight_functions_are_the_packages_and_documented():
    for name in ("compose", "train", "sweep", "results", "compare", "report", "load_run", "decode"):
        function = getattr(copytask, name)
        assert callable(function) and function.__module__ == "copytask.api" and function.__doc__


def test_compose_is_what_train_runs_and_refuses_bad_input_in_one_line(tmp_path):
    cfg = copytask.compose(["attention=bahdanau", "task.length=40", f"runs_dir={tmp_path}"])
    assert cfg.attention.name == "bahdanau" and cfg.task.length == 40 and "hydra" not in cfg
    with pytest.raises(copytask.ConfigError, match=r"^task\.length must be an integer >= 1, got 0$"):
        copytask.compose(["task.length=0"])
    with pytest.raises(copytask.ConfigError, match="did you mean task.length"):
        copytask.compose(["task.lenght=5"])


def test_train_returns_the_metrics_and_reads_a_finished_run_instead_of_training_it(tmp_path, monkeypatch):
    cfg = copytask.compose([*TINY, f"runs_dir={tmp_path}"])
    metrics = copytask.train(cfg)
    assert metrics == store.read_json(store.run_dir(cfg) / store.METRICS)
    monkeypatch.setattr(
        "copytask.training.loop.build_model", lambda *args: pytest.fail("a complete run was trained again")
    )
    assert copytask.train([*TINY, f"runs_dir={tmp_path}"]) == metrics  # overrides are composed first


def test_a_run_another_process_trains_raises_rather_than_returning_nothing(tmp_path):
    cfg = copytask.compose([*TINY, f"runs_dir={tmp_path}"])
    with store.lock_run(store.run_dir(cfg)):  # as a training process holds it
        with pytest.raises(copytask.RunInProgress, match="being trained by another process"):
            copytask.train(cfg)
    assert not store.run_dir(cfg).exists()


def test_results_compare_and_report_read_a_folder_as_the_command_line_does(runs_copy, capsys):
    table = copytask.results(runs_copy)
    assert len(table) == 8 and {"attention", "length", "seed", "token_acc", "run"} <= set(table.columns)
    summary = copytask.compare(runs_copy)
    assert len(summary) == 4 and (summary["seeds"] == 2).all()
    assert (
        summary["token_acc_lo"].le(summary["token_acc"]).all()
        and summary["token_acc_hi"].ge(summary["token_acc"]).all()
    )

    from copytask.cli import main
    from copytask.reporting.tables import comparison_table

    capsys.readouterr()
    assert main(["compare", f"runs_dir={runs_copy}"]) == 0
    printed = capsys.readouterr().out
    assert comparison_table(summary).to_string(index=False) in printed  # one code path: the numbers it prints
    table_lines = printed[printed.index("copy task:") :].splitlines()
    assert max(map(len, table_lines)) <= 100  # fits a terminal (issue 80)
    assert main(["compare", "--wide", f"runs_dir={runs_copy}"]) == 0
    wide = capsys.readouterr().out
    assert comparison_table(summary, wide=True).to_string(index=False) in wide and "steps to target" in wide

    written = copytask.report(runs_copy)
    assert written[0] == runs_copy / "results.csv" and written[1] == runs_copy / "report" / "report.md"
    assert all(path.is_file() for path in written) and any(path.suffix == ".png" for path in written)
    assert pd.read_csv(written[0])["run"].tolist() == table["run"].tolist()


def test_compare_and_results_read_runs_without_torch_or_matplotlib(runs_copy):
    code = (
        "import sys, copytask; from copytask.cli import main; runs = sys.argv[1]; "
        "copytask.results(runs); copytask.compare(runs); assert main(['compare', 'runs_dir=' + runs]) == 0; "
        "print('loaded:', sorted({'torch', 'matplotlib'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(runs_copy)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "loaded: []"


def test_a_folder_without_a_sweep_record_gives_every_complete_run(runs_copy):
    (runs_copy / "sweep.json").unlink()
    assert len(copytask.results(runs_copy)) == 8
    with pytest.raises(copytask.ConfigError, match="nothing to compare"):
        copytask.compare(runs_copy / "nowhere")


def test_a_skipped_run_is_a_warning_the_caller_filters_and_the_command_line_prints_in_one_line(runs_copy, capsys):
    corrupt = sorted(store.complete_runs(runs_copy))[0]
    (corrupt / store.METRICS).write_text("{")
    with pytest.warns(copytask.CopytaskWarning, match=f"skipping .*{corrupt.name}: corrupt metrics.json"):
        assert len(copytask.results(runs_copy)) == 7
    assert capsys.readouterr().err == ""  # the library prints nothing of its own

    command = [sys.executable, "-m", "copytask", "compare", f"runs_dir={runs_copy}"]
    err = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath()}, check=True
    ).stderr
    [line] = [line for line in err.splitlines() if corrupt.name in line]
    assert line.startswith(f"copytask: warning: skipping {corrupt}: corrupt metrics.json")


def command_and_api(runs_dir, capsys, *flags: str) -> dict:
    """`compare` and `report` run on the command line and through the API on `runs_dir`: the runs
    each selects and the tables they give."""
    from copytask.api import load, select
    from copytask.cli import main
    from copytask.reporting.tables import comparison_table

    all_runs = "--all" in flags
    capsys.readouterr()
    assert main(["compare", *flags, f"runs_dir={runs_dir}"]) == 0
    printed = capsys.readouterr().out
    assert main(["report", *flags, f"runs_dir={runs_dir}"]) == 0
    reported = sorted(pd.read_csv(runs_dir / "results.csv")["run"])
    table = copytask.compare(runs_dir, all_runs=all_runs)
    written = copytask.report(runs_dir, all_runs=all_runs)
    return {
        "compare": printed,
        "api compare": comparison_table(table, load(select(runs_dir, all_runs=all_runs)).settings).to_string(
            index=False
        ),
        "report": reported,
        "api report": sorted(pd.read_csv(written[0])["run"]),
        "results": sorted(copytask.results(runs_dir, all_runs=all_runs)["run"]),
    }


def test_the_command_line_and_the_api_select_the_same_runs_and_give_the_same_tables(runs_copy, tmp_path, capsys):
    extra = copytask.compose(
        [*TINY, f"runs_dir={runs_copy}", "attention=bahdanau", "task.length=3"]
    )  # a run outside the grid
    copytask.train(extra)
    grid = sorted(folder.name for folder in store.complete_runs(runs_copy) if folder != store.run_dir(extra))
    everything = sorted([*grid, store.run_dir(extra).name])

    recorded = command_and_api(runs_copy, capsys)  # the sweep recorded there: its grid
    assert (
        recorded["compare"].endswith(recorded["api compare"] + "\n")
        and recorded["report"] == recorded["api report"] == recorded["results"] == grid
    )
    every = command_and_api(runs_copy, capsys, "--all")  # --all: every complete run
    assert (
        every["compare"].endswith(every["api compare"] + "\n")
        and every["report"] == every["api report"] == every["results"] == everything
    )
    assert "bahdanau" in every["api compare"] and "bahdanau" not in recorded["api compare"]

    (runs_copy / "sweep.json").unlink()  # no sweep recorded: every complete run, as --all
    unrecorded = command_and_api(runs_copy, capsys)
    assert unrecorded["compare"] == every["compare"]
    assert unrecorded["report"] == unrecorded["api report"] == everything

    trained = tmp_path / "trained"  # `train` only, into a fresh folder
    copytask.train(copytask.compose([*TINY, f"runs_dir={trained}"]))
    only = command_and_api(trained, capsys)
    assert (
        only["compare"].endswith(only["api compare"] + "\n")
        and len(only["report"]) == 1
        and only["report"] == only["api report"]
    )


def test_load_run_and_decode_give_a_model_and_arrays(runs_copy):
    folder = next(folder for folder in store.complete_runs(runs_copy) if folder.name.startswith("luong_general-copy3"))
    model, cfg = copytask.load_run(folder)
    assert not model.training and next(model.parameters()).device.type == "cpu" and cfg.task.length == 3
    decoded = copytask.decode(folder, "g d d c")
    assert decoded.output.shape == (1, 5) and decoded.weights.shape == (1, 1, 5, 4)
    np.testing.assert_allclose(decoded.weights.sum(-1), 1.0, rtol=1e-5)
    assert 0.0 <= decoded.token_acc <= 1.0 and decoded.text(0)["input"] == list("gddc")
    with torch.no_grad():
        tokens, _ = model.greedy(torch.tensor([[9, 6, 6, 5]]), torch.tensor([4]), steps=5)  # g d d c as ids
    assert decoded.output.tolist() == tokens.tolist()
    with pytest.raises(copytask.ConfigError, match="give symbols or --random N"):
        copytask.decode(folder, "g d", random=2)


def test_sweep_returns_the_results_table_and_names_failed_runs(tmp_path):
    runs_dir = tmp_path / "runs dir"  # a path that needs quoting in an override
    table = copytask.sweep([*TINY, "attention=none", "task.length=3", "seed=0,1"], runs_dir=runs_dir)
    assert sorted(table["seed"]) == [0, 1] and (runs_dir / "results.csv").is_file()
    with pytest.raises(copytask.ConfigError, match="task.length must be an integer >= 1, got 0"):
        copytask.sweep([*TINY, "task.length=3,0"], runs_dir=runs_dir)


def test_a_sweep_prints_nothing_and_logs_its_lines_for_a_caller_who_asks(tmp_path, capfd, caplog):
    """The jobs' lines and the summary's go to the `copytask` logger, which the library gives no
    handler: stdout stays empty (the progress bars are on stderr), and a caller's logging gets the lines."""
    with caplog.at_level("INFO", logger="copytask"):
        copytask.sweep([*TINY, "attention=none", "task.length=3", "seed=0,1", "train.progress=true"], runs_dir=tmp_path)
    out, err = capfd.readouterr()
    assert out == ""
    assert "sweep (2/2 runs, 1 job at a time)" in err  # the sweep's bar
    lines = [record.getMessage() for record in caplog.records if record.name == "copytask"]
    assert sum("greedy token acc" in line for line in lines) == 2
    assert [line.split(":")[0] for line in lines[2:4]] == ["analysis", "report"] and lines[-1].startswith("sweep:")
    # between them the result as compare prints it (its note, its table) and the report's finding
    assert lines[4].startswith("copy task: greedy accuracy") and " none " in lines[5] and lines[6].startswith("At ")


def test_a_sweep_with_a_failed_job_raises_naming_it_with_the_other_runs_results(tmp_path, fails_at_length_4):
    with pytest.raises(copytask.SweepError, match=r"^1 of 2 runs failed: none-copy4-seed0-") as failed:
        copytask.sweep([*TINY, "attention=none", "task.length=4,3", "seed=0"], runs_dir=tmp_path)
    assert failed.value.table["length"].tolist() == [3]


# A notebook user's process: their backend, thread count, seeds and Hydra, then every copytask
# module imported and the API called; the script prints what changed.
CALLER = """
import importlib, json, logging, pkgutil, random, sys
from pathlib import Path

import matplotlib
matplotlib.use("svg")
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

runs_dir, own_configs, tiny = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
torch.set_num_threads(3)
torch.manual_seed(1234); random.seed(1234); np.random.seed(1234)
states = lambda: (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist())
before = states()
initialize_config_dir(config_dir=own_configs, version_base="1.3")
hydra = GlobalHydra.instance().hydra
argv, handlers = list(sys.argv), list(logging.getLogger().handlers)
import warnings
formatwarning = warnings.formatwarning

import copytask
for module in pkgutil.iter_modules(copytask.__path__):
    if module.name != "__main__":
        importlib.import_module(f"copytask.{module.name}")
cfg = copytask.compose([*tiny, f"runs_dir={runs_dir}"])
copytask.train(cfg)
copytask.sweep([*tiny, "attention=none,luong_general", "task.length=3", "seed=0"], runs_dir=runs_dir / "grid")
copytask.results(runs_dir / "grid"); copytask.compare(runs_dir / "grid"); copytask.report(runs_dir / "grid")
model, _ = copytask.load_run(next((runs_dir / "grid").glob("luong_general-*")))
copytask.decode(next((runs_dir / "grid").glob("luong_general-*")), "abc")

after = states()
print(json.dumps({
    "backend": matplotlib.get_backend(),
    "threads": torch.get_num_threads(),
    "torch_rng": bool(torch.equal(before[0], after[0])),
    "python_rng": before[1] == after[1],
    "numpy_rng": before[2] == after[2],
    "hydra": GlobalHydra.instance().hydra is hydra and compose("mine").greeting == "hello",
    "argv": sys.argv == argv,
    "logging": logging.getLogger().handlers == handlers and logging.getLogger("copytask").handlers == [],
    "warnings": warnings.formatwarning is formatwarning,
}))
"""


def test_the_api_leaves_the_callers_process_as_it_found_it(tmp_path):
    own_configs = tmp_path / "my_configs"
    own_configs.mkdir()
    (own_configs / "mine.yaml").write_text("greeting: hello\n")
    tiny = [
        arg for arg in TINY if arg != "train.threads=1"
    ]  # the default thread setting, which must leave the caller's count alone
    done = subprocess.run(
        [sys.executable, "-c", CALLER, str(tmp_path / "runs"), str(own_configs), json.dumps(tiny)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state == {
        "backend": "svg",
        "threads": 3,
        "torch_rng": True,
        "python_rng": True,
        "numpy_rng": True,
        "hydra": True,
        "argv": True,
        "logging": True,
        "warnings": True,
    }
