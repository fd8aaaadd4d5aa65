"""Whether runs_dir/report/ is up to date with what it draws, so that `report` redraws nothing that
would come out the same.

What a report is drawn from (`drawn_from`) is taken before any of it is read: every file of a run
folder in runs_dir that a report reads (by size and modification time: a run's files are written
whole, by rename, so a changed file has a new time), runs_dir's sweep.json, the selection's runs with
their status, the x axis, runs_dir as the report names it, and the code that draws it (a digest of
copytask's sources and the versions of the libraries that draw and compute). Once results.csv and
report/ are written, `record` keeps that, with the paths written, what the report found missing and
its line on mixed provenance, in report/drawn_from.json; `current` gives them back where nothing has
changed since and every path is still there. A report cut off while it is drawn leaves no record (it
is removed before drawing starts), so it is drawn again. A file changed within the file system's
time resolution, with its size unchanged, goes unseen.

Reads no run's contents and imports neither pandas nor matplotlib: `report` with nothing to redraw
answers at once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import store
from ..store.runs import SWEEP_RECORD, GridRun

REPORT_DIR = "report"
DRAWN_FROM = "drawn_from.json"  # report/drawn_from.json: what the report there was drawn from
# The files of a run folder that a report reads (and failed.json, whose reason it names)
READ = (store.METRICS, store.CONFIG, store.HISTORY, store.ATTENTION, store.ANALYSIS, store.FAILED)
# The libraries whose versions change what a report draws or computes
LIBRARIES = ("matplotlib", "pandas", "numpy", "scipy", "omegaconf")
PACKAGE = Path(__file__).resolve().parents[1]  # src/copytask


def code() -> str:
    """A digest of copytask's Python sources (any edit to them, committed or not, counts) and the
    versions of LIBRARIES."""
    digest = hashlib.sha1()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    for library in LIBRARIES:
        try:
            digest.update(f"{library} {importlib.metadata.version(library)}".encode())
        except importlib.metadata.PackageNotFoundError:
            digest.update(f"{library} none".encode())
    return digest.hexdigest()


def files(runs_dir: Path) -> dict[str, list[int]]:
    """`<run>/<file>` -> [size, modification time in ns] of every READ file of every run folder in
    runs_dir (variable-length runs outside the grid are drawn too), and of sweep.json."""
    found = {}
    try:
        folders = sorted(entry.name for entry in os.scandir(runs_dir) if entry.is_dir() and entry.name[0] != ".")
    except OSError:
        return found
    for name in [*(f"{folder}/{file}" for folder in folders for file in READ), SWEEP_RECORD]:
        try:
            stat = (runs_dir / name).stat()
        except OSError:  # not there (yet)
            continue
        found[name] = [stat.st_size, stat.st_mtime_ns]
    return found


@dataclass
class DrawnFrom:
    """What a report of `runs` in `runs_dir` is drawn from now (`inputs`), and its record in report/."""

    runs_dir: Path
    inputs: dict[str, Any]

    @property
    def path(self) -> Path:
        return self.runs_dir / REPORT_DIR / DRAWN_FROM

    def current(self) -> dict[str, Any] | None:
        """The record of the report in runs_dir/report/ where it was drawn from exactly these inputs and
        every path it wrote is still there: `written` (paths, results.csv and report.md first), `missing`
        ([run folder name, why] of each run left out) and `mixed` (the line on mixed provenance, or
        None). None where something must be drawn again."""
        try:
            record = store.read_json(self.path)
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("inputs") != self.inputs:
            return None
        written = [self.runs_dir / path for path in record["written"]]
        if not all(path.is_file() for path in written):
            return None
        return record | {"written": written}

    def forget(self) -> None:
        """Remove the record before the report is drawn again: one cut off on the way is not up to date."""
        self.path.unlink(missing_ok=True)

    def record(self, written: list[Path], missing: list[tuple[GridRun, str]], mixed: str | None) -> None:
        """Record, once every path in `written` is written, what the report was drawn from."""
        record = {
            "inputs": self.inputs,
            "written": [str(path.relative_to(self.runs_dir)) for path in written],
            "missing": [[run.folder.name, why] for run, why in missing],
            "mixed": mixed,
        }
        store.write_json(self.path, record)


def drawn_from(runs: list[GridRun], runs_dir: Path, x: str) -> DrawnFrom:
    """What a report of `runs` with `x` on its accuracy figure's x axis is drawn from now: take it
    before reading any of it, so that a run that completes while the report is drawn makes the next
    one draw again."""
    runs_dir = Path(runs_dir)
    inputs = {
        "runs_dir": str(runs_dir),
        "x": x,
        "code": code(),
        "runs": [[run.folder.name, run.label, run.status()] for run in runs],
        "files": files(runs_dir),
    }
    return DrawnFrom(runs_dir, inputs)


def up_to_date_line(written: list[Path], seconds: float) -> str:
    """What the command line says where nothing was redrawn (`written`: report.md, then the figures)."""
    figures = [path for path in written[1:] if path.suffix == ".png"]
    return (
        f"report: {written[0]} and {len(figures)} figures are up to date with the runs they draw: nothing redrawn "
        f"({seconds:.1f} s)"
    )
