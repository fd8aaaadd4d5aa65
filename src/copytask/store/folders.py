"""A run folder's files: their names, atomic writes, JSON (with attention weights rounded for it), locks
(one process trains a run at a time), the progress of a run in training, and which runs are complete. A
folder `runs_dir/<name>/` is complete once a readable `metrics.json` exists: that file is written last,
atomically, so a killed run never looks finished."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from filelock import AcquireReturnProxy, FileLock, Timeout
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_yaml_loader
from omegaconf.errors import OmegaConfBaseException

from ..console import ConfigError

if TYPE_CHECKING:  # the store imports no torch: the command line reads run folders without it
    import torch

METRICS = "metrics.json"
CONFIG = "config.yaml"
HISTORY = "history.csv"
CHECKPOINT = "checkpoint.pt"
ATTENTION = "attention_samples.json"
FAILED = "failed.json"
ANALYSIS = "analysis.json"  # derived by `copytask analyze`, the one file added after training
# while a run trains: all it needs to continue from its last evaluation (checkpoints.py); gone once complete
RESUME = "resume.pt"
UNREADABLE_RESUME = (
    "resume.unreadable.pt"  # a checkpoint that could not be read, set aside (kept for a look, never read)
)
PROGRESS = "progress.json"  # while a run trains: its last evaluated step, for a sweep's bar; gone once it is complete


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds a finished run: a metrics.json that reads as a JSON object. An empty or
    cut-off one (a crash before the data reached the disk) counts as unfinished, so it is trained
    again rather than read as a result."""
    try:
        return isinstance(read_json(folder / METRICS), dict)
    except (OSError, ValueError):  # none yet, or not JSON (UnicodeDecodeError is a ValueError)
        return False


# runs_dir/.locks/<run name>.lock: held by the process training that run. Beside the run folder,
# not in it, so that clearing a killed run's leftovers never deletes a lock in use.
LOCKS = ".locks"
# A training process holds a run's lock for its whole run; `is_locked` for a moment. Waiting this
# long keeps a process that finds the lock held by a probe from skipping a run nobody trains.
LOCK_WAIT_SECONDS = 0.5


def lock_path(folder: Path) -> Path:
    return folder.parent / LOCKS / f"{folder.name}.lock"


def lock_run(folder: Path) -> AcquireReturnProxy | None:
    """Take the run's lock; None if another process holds it. Use as `with lock_run(f) as ...`.
    An OS lock (flock, or its Windows counterpart), which the OS drops when its process dies, even by
    kill -9: a killed run's lock is taken over by the next process, with no stale lock to clear."""
    lock_path(folder).parent.mkdir(parents=True, exist_ok=True)
    try:
        return FileLock(lock_path(folder)).acquire(timeout=LOCK_WAIT_SECONDS)
    except Timeout:
        return None


def is_locked(folder: Path) -> bool:
    """Whether another process is training the run in `folder` now (holds its lock)."""
    if not lock_path(folder).exists():  # never locked: create no lock file just to look
        return False
    try:
        with FileLock(lock_path(folder)).acquire(blocking=False):
            return False
    except Timeout:
        return True
    except OSError:  # a lock file we may not open (another user's runs): we cannot tell
        return False


def complete_runs(runs_dir: Path) -> list[Path]:
    """The complete run folders in `runs_dir` (none if it does not exist), in name order."""
    if not Path(runs_dir).is_dir():
        return []
    folders = (folder for folder in Path(runs_dir).iterdir() if folder.is_dir() and not folder.name.startswith("."))
    return sorted(folder for folder in folders if is_complete(folder))


def atomic_write(path: Path, data: str | bytes, durable: bool = True) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it into place: a
    crash leaves the old file or the whole new one, never a part. The file gets the permissions
    the umask gives, as open() would: mkstemp's 600 would hide results from the rest of a group.
    `durable=False` skips the flush to disk, for a file that only readers of the moment need."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            # Without this a crash soon after the rename can leave `path` empty on disk (ext4,
            # xfs): a zero-length metrics.json where a finished run should be.
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


if hasattr(yaml, "CSafeLoader"):

    class _ConfigLoader(yaml.CSafeLoader, get_yaml_loader()):
        """OmegaConf.load's reading of YAML (its float and no-timestamp resolvers, its refusal of a duplicated
        key: OmegaConf 2.3 has no public name for its loader) on PyYAML's C parser."""

else:  # a PyYAML built without libyaml
    _ConfigLoader = get_yaml_loader()


def read_resolved(folder: Path) -> dict[str, Any]:
    """The config a run in `folder` was trained with (its config.yaml) as plain values, read as
    OmegaConf.load reads it but faster, and without making a DictConfig, which takes longer than the
    reading: compare reads one per run (docs/bench.md). An interpolation (`${train.eval_size}`, in a file
    edited by hand: copytask writes them resolved) is resolved as OmegaConf resolves it. ConfigError, in
    one line naming the file, where OmegaConf would refuse it (a duplicated key, an interpolation that
    does not resolve) or it holds no mapping."""
    path = folder / CONFIG
    text = path.read_text(encoding="utf-8")
    try:
        values = yaml.load(text, Loader=_ConfigLoader)
    except yaml.YAMLError as error:
        raise ConfigError(f"unreadable {path}: {yaml_problem(error)}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"unreadable {path}: it holds no mapping")
    if "${" in text:  # only then: a DictConfig made for every run is what the fast path spares
        try:
            values = OmegaConf.to_container(OmegaConf.create(values), resolve=True)
        except OmegaConfBaseException as error:
            raise ConfigError(f"unreadable {path}: {error.full_key}: {str(error).splitlines()[0]}") from None
    return values


def yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and where it is (its own message takes four)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem:
        mark = error.problem_mark
        return error.problem + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")
    return " ".join(str(error).split())


def read_config(folder: Path) -> DictConfig:
    """The config a run in `folder` was trained with, as OmegaConf.load reads its config.yaml (resolved)."""
    return OmegaConf.create(read_resolved(folder))


def rounded(weights: torch.Tensor) -> list:
    """Attention weights as nested lists with four decimals: small enough for a length-80 map in
    JSON, exact enough for a heatmap."""
    return weights.double().mul(1e4).round().div(1e4).tolist()


def write_progress(folder: Path, step: int, steps: int) -> None:
    """Record that the run training in `folder` has reached `step` of its `steps`."""
    atomic_write(folder / PROGRESS, json.dumps({"step": step, "steps": steps}), durable=False)


def read_progress(folder: Path) -> float:
    """The share of its step budget that the run training in `folder` has done (0 if unknown)."""
    try:
        progress = read_json(folder / PROGRESS)
        return min(max(progress["step"] / progress["steps"], 0.0), 1.0)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):  # not written yet, or gone as it finished
        return 0.0
