"""The package's layers import one way, lowest first, counting imports inside functions: no module
imports from a layer above its own, so there is no import circle between layers. The order is the
one docs/architecture.md gives (its numbered list of layers), so the map and the code cannot drift
apart. Inside a layer, modules import each other freely. The map's table of where each concept lives
names every module of the package, and only paths that exist."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import copytask
from copytask.config.checks import has_cuda_driver

from .conftest import pythonpath

PACKAGE = Path(copytask.__file__).parent
MAP = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
LAYER_LINE = re.compile(r"^\d+\. \*\*`(\w+)`\*\*")  # "3. **`config`**: ..."


def map_layers(text: str) -> list[str]:
    """The layers docs/architecture.md lists, lowest first: its numbered lines that start with a bold name."""
    return [match[1] for match in map(LAYER_LINE.match, text.splitlines()) if match]


# Lowest first: a subpackage (or a top-level module) may import only from itself and those before it.
LAYERS = map_layers(MAP.read_text())


def layer_of(path: Path) -> str:
    """The layer a source file belongs to: its subpackage, or its own name at the top level."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def imported_layers(path: Path, text: str | None = None) -> set[str]:
    """The copytask layers `path` (or `text`, as if it were that file) imports from, anywhere in it
    (`from ..x import y`, `from . import x`, `import copytask.x`), the package's own `__init__` aside."""
    package = path.relative_to(PACKAGE).parent.parts  # () at the top level
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if text is None else text)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
                parts = base + (node.module.split(".") if node.module else [])
                found |= {parts[0]} if parts else {alias.name for alias in node.names}
            elif node.module and node.module.split(".")[0] == "copytask":
                parts = node.module.split(".")[1:]
                found |= {parts[0]} if parts else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("copytask.")}
    return found


def sources() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "__init__.py"]


def test_every_module_has_its_place_in_the_layers():
    assert {layer_of(path) for path in sources()} == set(LAYERS)


def test_no_module_imports_from_a_layer_above_it():
    upward = []
    for path in sources():
        layer = layer_of(path)
        for imported in imported_layers(path):
            if LAYERS.index(imported) > LAYERS.index(layer):
                upward.append(f"{path.relative_to(PACKAGE)} imports {imported}")
    assert upward == []


def test_the_layer_check_sees_imports_inside_functions():
    text = (
        "def f():\n    from ..training import loop\n    from .. import cli, store\n    import copytask.api\n"
        "    from . import recurrent\n"
    )
    assert imported_layers(PACKAGE / "models" / "attention.py", text) == {"training", "cli", "store", "api", "models"}


def test_the_map_lists_each_layer_once_and_is_read_as_written():
    assert len(LAYERS) == len(set(LAYERS)) and LAYERS[0] == "cpu_dispatch" and LAYERS[-1] == "__main__"
    assert map_layers("1. **`data`**: the data\n- **`x`** not a layer\n2. **`config`**: configs") == ["data", "config"]


# --- the map's table of concepts ------------------------------------------------------------------

CONCEPTS = "## Where each concept lives"
ROOT = MAP.parents[1]


def concept_modules(text: str) -> list[str]:
    """The paths the map's concept table names in its module column (each in backticks), as written:
    relative to src/copytask/, or to the repository where they start with src/; a folder ends in /."""
    table = text.split(CONCEPTS, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("|")][2:]  # past the header and its rule
    return [path for row in rows for path in re.findall(r"`([^`]+)`", row.rstrip().rstrip("|").rsplit("|", 1)[1])]


def missing_from(named: list[str], modules: list[Path]) -> list[str]:
    """A line for each of `modules` (the package's files, `__init__`s aside) that `named` leaves out."""
    return [
        f"src/copytask/{module.relative_to(PACKAGE)} has no row in {MAP.name}'s table '{CONCEPTS[3:]}': "
        "add one saying what lives there"
        for module in modules
        if module.name != "__init__.py" and str(module.relative_to(PACKAGE)) not in named
    ]


def test_the_concept_table_names_only_paths_that_exist():
    named = concept_modules(MAP.read_text())
    assert len(named) > 40
    gone = [path for path in named if not (ROOT / path if path.startswith("src/") else PACKAGE / path).exists()]
    assert not gone, f"{MAP.name}'s table '{CONCEPTS[3:]}' names paths that do not exist: {', '.join(gone)}"


def test_every_module_has_a_row_in_the_concept_table():
    missing = missing_from(concept_modules(MAP.read_text()), sorted(PACKAGE.rglob("*.py")))
    assert not missing, "\n".join(missing)


def test_a_module_without_a_row_is_named():
    table = "| concept | module |\n|---|---|\n| a | `data/vocab.py`, `console.py` |\n"
    text = f"{CONCEPTS}\n\n{table}\n## Next\n| b | `api.py` |\n"  # a table under another heading is not it
    assert concept_modules(text) == ["data/vocab.py", "console.py"]
    [line] = missing_from(concept_modules(text), [PACKAGE / "console.py", PACKAGE / "api.py", PACKAGE / "__init__.py"])
    assert line.startswith("src/copytask/api.py has no row in architecture.md's table 'Where each concept lives'")


# --- what a command imports before it answers -------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["train", "attention=bogus"],
        ["train", "task.lenght=40"],
        ["sweep", "task.length=5,oops"],
        ["sweep", "report.x=bogus"],
        ["train", "attention.score=no_such_module.Cosine", "attention.name=cosine"],
        ["train", "attention.name=../x"],  # a label that is not a plain name
        ["train", "attention=luong_general", "attention.name=bahdanau"],  # another option's name on a built-in type
        pytest.param(
            ["train", "train.device=cuda"],
            marks=pytest.mark.skipif(has_cuda_driver(), reason="a CUDA driver loads here: torch is asked"),
        ),
        ["compare", "runs_dir=/nonexistent"],
        ["report", "runs_dir=/nonexistent"],
        ["decode", "/nonexistent", "abc"],
    ],
)
def test_a_refusal_imports_neither_torch_nor_pandas_nor_matplotlib(args, tmp_path):
    """Bad input is refused at once: none of the heavy libraries (torch alone takes about 1.7 s to import on
    two cores) is imported before the one line that refuses it."""
    heavy = {"torch", "pandas", "matplotlib"}
    code = (
        "import sys; from copytask.cli import main; status = main(sys.argv[1:]); "
        f"print('loaded:', sorted({heavy!r} & set(sys.modules))); sys.exit(status)"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 2 and done.stderr.startswith("copytask: error: "), done.stderr
    assert done.stdout.splitlines()[-1] == "loaded: []"
