"""Issue 87, part 8: a label is a plain name that no built-in has. `attention.name` names a run's folder
and its rows; a path, an empty name or a built-in's name (a GRU labelled `mamba`) is refused in one line
before anything is written, torch-free; each built-in option keeps its own name and every run its name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from copytask import cli, store
from copytask.config.checks import validate
from copytask.config.schema import config_dir
from copytask.console import ConfigError

from .conftest import ATTENTION_OPTIONS, TINY, pythonpath, run_cli

ARCHITECTURES = sorted(
    str(path.relative_to(Path(config_dir()) / "architecture").with_suffix(""))
    for path in (Path(config_dir()) / "architecture").rglob("*.yaml")
)


def tree(folder: Path) -> list[str]:
    """Every path under `folder`, relative to it: what a refused command must leave as it found."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


@pytest.mark.parametrize(
    "label",
    [
        "../x",  # the run folder in runs_dir's parent
        "a/b",  # a subfolder of runs_dir
        "",  # a folder '-copy5-seed0-...'
        "''",
        "Mine",  # upper case: one folder with 'mine' where names fold case (macOS, Windows)
        "my-type",  # a run name's parts are joined by '-'
        "luong_general-4heads",  # the label a built-in's multi-head runs get
        "4heads",
        pytest.param("a" * 300, id="300-letters"),  # longer than a file name may be (OSError's traceback)
        "mamba",  # built-in models' run names
        "mamba_lti",
        "transformer",
        "transformer_learned",
        "gru",
    ],
)
def test_a_label_not_plain_or_a_builtins_is_refused_in_one_line_before_anything_is_written(
    tmp_path, monkeypatch, capsys, label
):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert cli.main(["train", *TINY, f"attention.name={label}", "runs_dir=runs"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("copytask: error: attention.name ") and repr(label.strip("'")) in line, line
    assert tree(tmp_path) == ["work"]  # nothing in runs_dir, nor beside it


def test_a_label_is_refused_from_the_command_line_at_once_naming_it(tmp_path):
    """As a user types it: exit status 2, one line naming the value, nothing written in or outside runs_dir,
    and no torch imported (the refusal answers in well under two seconds)."""
    work = tmp_path / "work"
    work.mkdir()
    code = (
        "import sys; from copytask.cli import main; status = main(sys.argv[1:]); "
        "print('torch' in sys.modules); sys.exit(status)"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath(), "HYDRA_FULL_ERROR": "0"}
    args = ["train", *TINY, "attention.name=../x", "runs_dir=runs"]
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=work, env=env)
    assert done.returncode == 2 and done.stdout.split() == ["False"], done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("copytask: error: attention.name must be a plain name") and "'../x'" in line
    assert tree(tmp_path) == ["work"]


def test_an_options_name_on_another_options_type_is_refused_without_torch(make_config):
    """attention=luong_general with attention.name=bahdanau would train Luong's general score as 'bahdanau':
    refused by validate, torch-free, as the default option's name on another built-in type is."""
    refused = r"^attention.decoder=luong attention.score=general is not attention=bahdanau's type"
    with pytest.raises(ConfigError, match=refused):
        validate(make_config(*TINY, "attention=luong_general", "attention.name=bahdanau"))
    with pytest.raises(ConfigError, match=r"^attention.local=monotonic is not attention=luong_local's type"):
        validate(make_config(*TINY, "attention=luong_local_m", "attention.name=luong_local"))
    with pytest.raises(ConfigError, match=r"^attention.score=dot is not attention=luong_general's type"):
        validate(make_config(*TINY, "attention.score=dot"))  # the default option's name, Luong's dot score


@pytest.mark.parametrize("option", sorted(ATTENTION_OPTIONS))
def test_every_attention_option_keeps_its_own_name_and_its_runs_theirs(make_config, option):
    cfg = make_config(*TINY, f"attention={option}")
    validate(cfg)
    assert store.run_name(cfg).startswith(f"{option}-copy5-seed0-")
    validate(make_config(*TINY, f"attention={option}", f"attention.name={option}"))  # given again: the same


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_every_architecture_option_passes_the_label_check(make_config, architecture):
    validate(make_config(*TINY, f"architecture={architecture}"))


def test_a_label_of_ones_own_trains_under_that_name(make_config):
    for label in ("mine", "cosine", "a", "my_type2", "x" * 32):
        validate(make_config(*TINY, "attention=bahdanau", f"attention.name={label}"))
    with pytest.raises(ConfigError, match=r"got 'xxxxx"):
        validate(make_config(*TINY, "attention=bahdanau", f"attention.name={'x' * 33}"))


def test_a_sweep_refuses_a_bad_label_in_its_grid_before_any_job_runs(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    process = run_cli(
        "sweep", *TINY, "attention=none", "attention.name=mine,mamba", "task.length=3", "runs_dir=runs", cwd=work
    )
    assert process.returncode == 2, process.stderr
    [line] = process.stderr.strip().splitlines()
    assert line.startswith("copytask: error: attention.name ") and "'mamba'" in line
    assert line.endswith("(in the grid: attention.name=mine,mamba)")
    assert tree(tmp_path) == ["work"]  # no job ran, nothing written
