"""Run folders: identity, atomic writes, and loading finished runs into a table; and copytask's
two channels to the person running it, in one place: warnings (`warn`) and log lines (`log`).

A run's identity is its resolved config (less the keys that change where or how fast it runs,
not what it computes). Its folder `runs_dir/<name>/` is complete once a readable `metrics.json`
exists: that file is written last, atomically, so a killed run never looks finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from filelock import AcquireReturnProxy, FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from .config import flatten
from .model_config import MODEL_KEYS, is_transformer, model_name

METRICS = "metrics.json"
CONFIG = "config.yaml"
HISTORY = "history.csv"
CHECKPOINT = "checkpoint.pt"
ATTENTION = "attention_samples.json"
FAILED = "failed.json"
ANALYSIS = "analysis.json"  # derived by `copytask analyze`, the one file added after training
RESUME = "resume.pt"  # while a run trains: all it needs to continue from its last evaluation (checkpoints.py); gone once complete
UNREADABLE_RESUME = "resume.unreadable.pt"  # a checkpoint that could not be read, set aside (kept for a look, never read)
PROGRESS = "progress.json"  # while a run trains: its last evaluated step, for a sweep's bar; gone once it is complete


# Keys that change where or how fast a run computes, or what it saves, not what it computes (results
# agree to float rounding); `analysis` and `report` only set how finished runs are analysed and drawn,
# `logger` which experiment tracker also sees them.
NOT_IDENTITY = ("runs_dir", "retrain", "train.device", "train.threads", "train.fused", "train.progress",
                "train.attention_samples", "analysis", "report", "logger")
# Keys whose value here is what the code computed before the key existed: at that value a key is left
# out of the identity, so that adding a key (with such a default) renames no existing run, and giving
# it explicitly (`attention.heads=1`) is the same run.
NEUTRAL = {"attention.heads": 1, "attention.local": None, "attention.variant": None, "model.name": "gru"}


# Keys that change nothing unless another key has a value: (key, condition on the config). Each model
# reads its own keys; the attention group is the GRU's decoder.
UNUSED_UNLESS = {
    "task.min_length": lambda config: config["task"].get("variable_length"),
    "train.warmup": lambda config: config["train"].get("schedule") == "onecycle",
    "attention.window": lambda config: config["attention"].get("local") is not None,
    "attention": lambda config: model_name(config) == "gru",
    "model.max_length": lambda config: config["model"].get("positions") == "learned",
    **{f"model.{key}": (lambda config, name=name: model_name(config) == name) for name, keys in MODEL_KEYS.items() for key in keys},
}


class CopytaskWarning(UserWarning):
    """A run or file that copytask skipped or could not read; the message names its folder."""


def warn(message: str) -> None:
    """A CopytaskWarning, shown where the caller's filters say (the command line prints it as one
    `copytask: warning: ...` line); callers name the offending run (its folder) in `message`."""
    warnings.warn(message, CopytaskWarning, stacklevel=3)


def format_warning(message, category, *args, **kwargs) -> str:
    """A warning as one line: `copytask: warning: ...` for copytask's own, `Category: ...` for others'."""
    return f"copytask: warning: {message}\n" if issubclass(category, CopytaskWarning) else f"{category.__name__}: {message}\n"


@contextmanager
def one_line_warnings() -> Iterator[None]:
    """Inside: warnings shown as `format_warning`'s one line; after: shown as before. What a job
    does, in whichever process its launcher runs it (a worker has none of the command's settings)."""
    previous = warnings.formatwarning
    warnings.formatwarning = format_warning
    try:
        yield
    finally:
        warnings.formatwarning = previous


# What a sweep and its jobs say as they go (each job's summary line, the analysis, report and sweep
# lines at the end; errors for failed jobs). The library adds no handler: a caller sees them once it
# configures logging, and errors only (Python's last-resort handler, on stderr) where it has not. The
# command line prints them as `Lines` does, and so does each job through Hydra's job logging
# (configs/hydra/job_logging/copytask.yaml), in every launcher's worker too.
log = logging.getLogger("copytask")


class Lines(logging.Handler):
    """Log records as bare lines, as the command line prints: below WARNING on stdout, the rest on
    stderr (the streams looked up at each line, so a redirected stdout is followed)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: a handler never raises
            self.handleError(record)


def _pop(config: dict, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        config = config.get(key, {})
    config.pop(leaf, None)


def _get(config: dict, dotted: str) -> Any:
    *parents, leaf = dotted.split(".")
    for key in parents:
        config = config.get(key, {})
    return config.get(leaf)


def _normalised(value: Any) -> Any:
    """One spelling per value: a whole float is an int (`train.clip=1` and `=1.0` are one computation)."""
    if isinstance(value, dict):
        return {key: _normalised(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_normalised(item) for item in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def identity(cfg: DictConfig) -> dict[str, Any]:
    """What a run computes: its resolved config without the keys in NOT_IDENTITY, those at their
    NEUTRAL value and those UNUSED_UNLESS another key says so, with numbers in one spelling."""
    config = OmegaConf.to_container(cfg, resolve=True)
    for dotted in [dotted for dotted, condition in UNUSED_UNLESS.items() if not condition(config)]:  # all read before any goes
        _pop(config, dotted)
    for dotted, value in NEUTRAL.items():
        if _get(config, dotted) == value:
            _pop(config, dotted)
    for dotted in NOT_IDENTITY:
        _pop(config, dotted)
    return _normalised(config)


def flat_identity(cfg: DictConfig) -> dict[str, Any]:
    """`identity` with dotted keys (`model.hidden_size`) and lists as text, so that every value
    compares: the results table's setting columns and the trackers' hyperparameters."""
    return {key: str(value) if isinstance(value, list) else value for key, value in flatten(identity(cfg)).items()}


def attention_label(name: str, heads: int = 1) -> str:
    """How tables, figures and files name an attention type: the config name, with the head count
    when there is more than one head (`luong_general-4heads`), so multi-head runs never mix with
    single-head ones."""
    return name if heads == 1 else f"{name}-{heads}heads"


def architecture(cfg: DictConfig) -> str:
    """What a run's model is, in a word: a GRU model's attention type (`attention.name`), or
    `transformer` (sinusoidal positions) or `transformer_learned` for a Transformer. Run names
    start with it; metrics.json records it as `attention`."""
    if is_transformer(cfg):
        return "transformer" if cfg.model.positions == "sinusoidal" else f"transformer_{cfg.model.positions}"
    return cfg.attention.name


def model_label(cfg: DictConfig) -> str:
    """How tables, figures and files name a run's model: `architecture`, with a GRU model's head
    count where it has several (`attention_label`)."""
    if is_transformer(cfg):
        return architecture(cfg)
    return attention_label(cfg.attention.name, cfg.attention.get("heads", 1))


def run_name(cfg: DictConfig) -> str:
    """Readable and unique: `<architecture>-<task><length>-seed<seed>-<hash of the identity>`."""
    digest = hashlib.sha1(json.dumps(identity(cfg), sort_keys=True).encode()).hexdigest()[:8]
    task = cfg.task
    lengths = f"{task.min_length}-{task.length}" if task.variable_length else f"{task.length}"
    return f"{architecture(cfg)}-{task.name}{lengths}-seed{cfg.seed}-{digest}"


def run_dir(cfg: DictConfig) -> Path:
    return Path(cfg.runs_dir) / run_name(cfg)


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
