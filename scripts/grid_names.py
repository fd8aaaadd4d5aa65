"""Print the run folder names of every preset's grid (the default sweep and each experiment=...),
one per line, sorted: diff the output before and after a change to see that it renames no run."""

from __future__ import annotations

import sys
from pathlib import Path

from copytask.config.schema import config_dir
from copytask.sweeps.grid import compose_grid


def presets() -> list[list[str]]:
    experiments = sorted(path.stem for path in (Path(config_dir()) / "experiment").glob("*.yaml"))
    return [[], *([f"experiment={name}"] for name in experiments)]


def main() -> int:
    for overrides in presets():
        _, grid = compose_grid(overrides)
        for run in sorted(grid, key=lambda run: run.folder.name):
            print(f"{' '.join(overrides) or 'default'}\t{run.folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
