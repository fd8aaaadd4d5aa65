"""Issue 88: a model and a task of the user's own, in their own module, run from the command line and the API
exactly as copytask's own do, as docs/own.md says: these tests take the docs' example files as they are written
there (a small LSTM encoder-decoder, "copy every second symbol"), put them in a folder outside the package, and
run what the docs run: train, a sweep beside attention=none, compare, report, analyze and decode."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import copytask
from copytask.config.schema import config_dir

from .conftest import TINY, run_cli

pytestmark = pytest.mark.slow  # every test here trains

DOCS = Path(config_dir()).parent / "docs" / "own.md"
FILES = (
    "my_lstm.py",
    "my_tasks.py",
    "my_configs/model/my_lstm.yaml",
    "my_configs/architecture/my_lstm.yaml",
    "my_configs/task/every_second.yaml",
)
SEARCHPATH = "hydra.searchpath=[file://my_configs]"


def docs_file(name: str) -> str:
    """The fenced block of docs/own.md that names `name` in a comment line of its head (a `# @package` line may
    come first)."""
    blocks = re.findall(r"```\w*\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    [block] = [block for block in blocks if any(line.startswith(f"# {name}") for line in block.splitlines()[:2])]
    return block


def write_own_model(folder: Path) -> Path:
    """A user's folder: the docs' module, task and config files, nothing of copytask's."""
    for name in FILES:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(docs_file(name))
    return folder


@pytest.fixture
def own_folder(tmp_path: Path) -> Path:
    return write_own_model(tmp_path)


def metrics_of(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def test_your_own_model_trains_sweeps_compares_reports_and_decodes_under_its_own_name(own_folder, monkeypatch):
    one = run_cli("train", *TINY, "model=my_lstm", SEARCHPATH, "runs_dir=one", cwd=own_folder)
    assert one.returncode == 0, one.stderr
    [run] = (own_folder / "one").glob("my_lstm-copy5-seed0-*")  # named by the user's label
    metrics = metrics_of(run)
    assert metrics["attention"] == "my_lstm" and metrics["state_floats"] == 2 * 8  # its own offer: h and c
    assert re.fullmatch(r"my_lstm\.LSTMSeq2Seq sha256:[0-9a-f]{12}", metrics["own_code"]["model"])

    sweep = ["sweep", *TINY, "architecture=my_lstm,none", "~hydra.sweeper.params.attention", SEARCHPATH]
    swept = run_cli(*sweep, "task.length=5", "runs_dir=grid", cwd=own_folder)
    assert swept.returncode == 0, swept.stderr
    compare = run_cli("compare", "runs_dir=grid", cwd=own_folder)
    assert compare.returncode == 0, compare.stderr
    rows = [line.split()[1] for line in compare.stdout.splitlines() if re.match(r"\s+5\s+\w+\s+1\s", line)]
    assert sorted(rows) == ["my_lstm", "none"]
    report = (own_folder / "grid" / "report" / "report.md").read_text()
    assert "- my_lstm: `my_lstm.LSTMSeq2Seq`, a model of the user's own; embedding_size 8, hidden_size 8." in report
    [grid_run] = (own_folder / "grid").glob("my_lstm-copy5-seed0-*")
    decoded = run_cli("decode", str(grid_run), "a b c d e", cwd=own_folder)
    assert decoded.returncode == 0 and "no attention (model=my_lstm): no heatmap" in decoded.stdout, decoded.stderr

    # the module edited: its runs are trained again, not reused, and a table of both versions says so
    module = own_folder / "my_lstm.py"
    module.write_text(module.read_text() + "\n# edited\n")
    again = run_cli(*sweep, "task.length=5", "runs_dir=grid", cwd=own_folder)
    assert again.returncode == 0, again.stderr
    assert "1 complete run: computed by other code (1 run ran code of yours that has changed since)" in again.stdout
    seed1 = run_cli("train", *TINY, "model=my_lstm", SEARCHPATH, "runs_dir=one", "seed=1", cwd=own_folder)
    assert seed1.returncode == 0, seed1.stderr
    versions = run_cli("compare", "runs_dir=one", cwd=own_folder)  # seed 0 of the first version, seed 1 of the second
    assert re.search(
        r"note: these runs ran different versions of your code \(my_lstm\.LSTMSeq2Seq sha256:", versions.stdout
    )

    # a folder where the module is not: one line that names it
    elsewhere = run_cli("decode", str(grid_run), "a b c", cwd=own_folder.parent)
    assert elsewhere.returncode == 2 and "cannot import 'my_lstm'" in elsewhere.stderr.strip().splitlines()[-1]

    monkeypatch.syspath_prepend(str(own_folder))  # the API, from a program of the user's beside the module
    api = [
        *TINY,
        "model=my_lstm",
        f"hydra.searchpath=[file://{own_folder}/my_configs]",
        f"runs_dir={own_folder / 'api'}",
    ]
    assert copytask.train(copytask.compose(api))["run"].startswith("my_lstm-copy5-seed0-")


def test_a_key_the_class_does_not_take_and_a_built_in_label_are_refused_in_one_line(own_folder):
    for extra, says in [
        (["+model.depth=2"], "model=my_lstm: my_lstm.LSTMSeq2Seq(vocab, embedding_size=32, hidden_size=64) cannot"),
        (["model.name=gru"], "model.name=gru is the name of one of copytask's own models"),
        (["model.name=My-LSTM"], "model.name must be a plain name"),
        (["model._target_=missing_module.Model"], "model._target_=missing_module.Model: cannot import"),
    ]:
        refused = run_cli("train", *TINY, "model=my_lstm", SEARCHPATH, *extra, "runs_dir=runs", cwd=own_folder)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and says in lines[0], (extra, refused.stderr)
        assert not (own_folder / "runs").exists()


def test_your_own_task_trains_and_decodes_every_second_symbol(own_folder):
    trained = run_cli("train", *TINY, "task=every_second", SEARCHPATH, "task.length=6", "runs_dir=task", cwd=own_folder)
    assert trained.returncode == 0, trained.stderr
    [run] = (own_folder / "task").glob("luong_general-every_second6-seed0-*")
    assert metrics_of(run)["own_code"]["task"].startswith("my_tasks.every_second sha256:")
    decoded = run_cli("decode", str(run), "a b c d e f", cwd=own_folder)
    assert decoded.returncode == 0, decoded.stderr
    [target] = [line for line in decoded.stdout.splitlines() if line.startswith("target")]
    assert target.split()[1:] == ["a", "c", "e", "</s>"]
    analysed = run_cli("analyze", "runs_dir=task", cwd=own_folder)
    assert analysed.returncode == 0, analysed.stderr
    elsewhere = run_cli("decode", str(run), "a b c", cwd=own_folder.parent)
    assert elsewhere.returncode == 2 and "cannot import 'my_tasks'" in elsewhere.stderr
