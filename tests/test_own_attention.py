"""Issue 80: an attention type of the user's own, in their own module, runs from the command line and the
API without editing copytask, as docs/models.md says: this test takes the docs' example files as they are
written there, puts them in a folder outside the package, and runs what the docs run."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

import copytask
from copytask.config.schema import config_dir

from .conftest import TINY, run_cli

pytestmark = pytest.mark.slow  # every test here trains

DOCS = Path(config_dir()).parent / "docs" / "models.md"


def docs_file(name: str) -> str:
    """The fenced block of docs/models.md whose first line is the comment `# <name>`."""
    blocks = re.findall(r"```\w*\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [block] = [block for block in blocks if block.startswith(f"# {name}\n")]
    return block


OWN_EXAMPLE = ("my_scores", "my_configs")  # the docs' module and config folder of the user's own


def write_own_example(folder: Path) -> Path:
    """A user's folder: the docs' class and option, nothing of copytask's."""
    (folder / "my_configs" / "attention").mkdir(parents=True)
    (folder / "my_scores.py").write_text(docs_file("my_scores.py"))
    option = "my_configs/attention/cosine.yaml"
    (folder / option).write_text(docs_file(option))
    return folder


@pytest.fixture
def own_folder(tmp_path: Path) -> Path:
    return write_own_example(tmp_path)


def test_a_class_in_the_users_module_trains_and_compares_under_its_own_name(own_folder, monkeypatch):
    one_run = run_cli(
        "train",
        *TINY,
        "attention.score=my_scores.CosineAttention",
        "attention.name=cosine",
        "runs_dir=one",
        cwd=own_folder,
    )
    assert one_run.returncode == 0, one_run.stderr
    [folder] = (own_folder / "one").glob("cosine-copy5-seed0-*")  # named after the user's type

    monkeypatch.syspath_prepend(str(own_folder))  # the API, from a program of the user's beside the module
    model, cfg = copytask.load_run(folder)
    assert type(model.attention).__name__ == "CosineAttention" and cfg.attention.name == "cosine"
    again = copytask.compose(
        [*TINY, "attention.score=my_scores.CosineAttention", "attention.name=cosine", f"runs_dir={own_folder / 'api'}"]
    )
    assert copytask.train(again)["run"].startswith("cosine-copy5-seed0-")

    sweep = run_cli(
        "sweep",
        *TINY,
        "attention=none,cosine",
        "task.length=5",
        "hydra.searchpath=[file://my_configs]",
        "runs_dir=grid",
        cwd=own_folder,
    )
    assert sweep.returncode == 0, sweep.stderr
    compare = run_cli("compare", "runs_dir=grid", cwd=own_folder)  # the recorded grid, the user's option included
    assert compare.returncode == 0, compare.stderr
    rows = [line.split() for line in compare.stdout.splitlines() if re.match(r"\s+\d+\s+(none|cosine)\s", line)]
    assert sorted(row[1] for row in rows) == ["cosine", "none"]
    results = pd.read_csv(own_folder / "grid" / "results.csv")
    assert sorted(results["attention"]) == ["cosine", "none"]


def test_a_class_without_a_name_of_its_own_is_refused_not_mislabelled(own_folder):
    unnamed = run_cli("train", *TINY, "attention.score=my_scores.CosineAttention", "runs_dir=runs", cwd=own_folder)
    assert unnamed.returncode == 2 and len(unnamed.stderr.strip().splitlines()) == 1
    assert "the run would be named luong_general" in unnamed.stderr and "attention.name=NAME" in unnamed.stderr
    assert not (own_folder / "runs").exists()  # refused before anything is written
    builtin = run_cli("train", *TINY, "attention.score=dot", "runs_dir=runs", cwd=own_folder)  # the same trap
    assert builtin.returncode == 2 and "attention.score=dot is not attention=luong_general's type" in builtin.stderr
    elsewhere = run_cli("train", *TINY, "attention.score=my_scores.CosineAttention", "attention.name=cosine")
    assert elsewhere.returncode == 2 and "cannot import 'my_scores'" in elsewhere.stderr  # not on the path
