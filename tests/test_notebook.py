"""examples/copytask.ipynb executed as a student runs it (nbclient, its own kernel), on a grid
shrunk through its parameters cell as papermill would: it must run without an error and show
its tables, its figures and a decoded sequence."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import TINY, pythonpath

pytestmark = pytest.mark.slow  # every test here trains (docs/reliability.md: the quick tier)

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "copytask.ipynb"


def test_the_notebook_runs_and_shows_its_tables_figures_and_a_decoded_sequence(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    [parameters] = [cell for cell in notebook.cells if "parameters" in cell.metadata.get("tags", [])]
    grid = [*TINY, "attention=none,bahdanau", "task.length=3,6", "seed=0"]
    parameters.source = f"RUNS_DIR = {str(tmp_path / 'runs')!r}\nGRID = {grid!r}\nTYPED = 'a b c'"
    monkeypatch.setenv("PYTHONPATH", pythonpath())  # the kernel imports this checkout's copytask
    nbclient.NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    tables = [output for output in outputs if "<table" in output.get("data", {}).get("text/html", "")]
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    printed = "".join(output.get("text", "") for output in outputs if output.output_type == "stream")
    assert len(tables) == 2  # the sweep's results and the compare table, as DataFrames
    assert len(figures) == 2  # accuracy against length and the attention map, inline
    assert "input  a b c" in printed and "token accuracy" in printed
    assert (tmp_path / "runs" / "report" / "report.md").is_file()


def test_what_the_notebook_writes_run_from_examples_is_ignored_by_git():
    """Run from examples/ (as Jupyter starts it there), its RUNS_DIR is examples/runs/notebook."""
    root = NOTEBOOK.parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    written = [
        "examples/runs/notebook/report/report.md",
        "examples/runs/notebook/none-copy5-seed0-0/metrics.json",
        "runs/quick/results.csv",
    ]
    done = subprocess.run(["git", "check-ignore", "--no-index", *written], cwd=root, capture_output=True, text=True)
    assert done.stdout.split() == written
    assert (
        subprocess.run(["git", "check-ignore", "-q", "--no-index", "runs/.gitkeep"], cwd=root).returncode == 1
    )  # the folder itself stays
