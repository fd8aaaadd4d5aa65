"""The package's modules import one way, lowest first, counting imports inside functions: no
module imports one above it in LAYERS, so there is no import circle (README, Layout)."""

from __future__ import annotations

import ast
from pathlib import Path

import copytask

PACKAGE = Path(copytask.__file__).parent
# Lowest first. A module may import only modules before it.
LAYERS = [
    "vocab", "model_config", "config", "validation", "store", "hydra_internals", "devices", "data", "splits", "kernel_build", "kernels",
    "attention", "model", "transformer", "reference", "evaluation", "figures", "loggers", "checkpoints", "training", "analysis",
    "analysis_figures", "grid", "tables", "result_figures", "report_setup", "reporting", "search", "jobs", "slurm", "decoding",
    "bench", "api", "cli", "__main__",
]  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    """The copytask modules `path` imports, anywhere in it (`from . import x`, `from .x import y`,
    `import copytask.x`), the package's own `__init__` aside."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.level == 1 or node.module and node.module.startswith("copytask")):
            module = (node.module or "").removeprefix("copytask").lstrip(".")
            if module:
                found.add(module.split(".")[0])
            else:  # from . import a, b
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("copytask.")}
    return found


def test_every_module_has_its_place_in_the_layers():
    modules = {path.stem for path in PACKAGE.glob("*.py")} - {"__init__"}
    assert modules == set(LAYERS)


def test_no_module_imports_one_above_it():
    upward = []
    for module in LAYERS:
        for imported in imported_modules(PACKAGE / f"{module}.py"):
            if LAYERS.index(imported) >= LAYERS.index(module):
                upward.append(f"{module} imports {imported}")
    assert upward == []


def test_the_layer_check_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from .training import train\n    from . import cli, store\n    import copytask.api\n")
    assert imported_modules(source) == {"training", "cli", "store", "api"}
