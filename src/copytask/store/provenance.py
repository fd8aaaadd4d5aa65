"""What made a run: the code and libraries that computed it, recorded in its metrics.json and given
to its tracker (`provenance`); whether a complete run was computed by this code (`computed_here`)
and so is reused (`reused`); and which runs of a table differ in it (`mixed_line`).

A run's identity (its folder's name) is its config; what it records here is not part of it, so an
upgrade keeps every run's name. `COMPUTATION` is what decides whether a complete run is reused: a
run that records another one, or none (made before copytask recorded it), is trained again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from .. import console, cpu_dispatch
from ..console import ConfigError
from ..families import BY_TARGET, family_of
from .folders import METRICS, is_complete, read_json, read_resolved
from .replacement import pending

# The version of what a run computes: training, data, models and scoring. Raise it with any change
# to the numbers a run produces; tests/test_computation.py records a few runs' numbers and fails,
# saying so, when they change without it.
COMPUTATION = 1
# The version of what an analysis computes (`evaluation`: the breakdown, the probe, the counterfactuals,
# the alignment, the scores at other lengths), recorded in analysis.json: an analysis that records another
# one, or none (1: made before it was recorded), is made again. Raise it with any change to the numbers
# analysis.json holds; tests/test_analysis_computation.py records a tiny analysis' numbers and fails when
# they change without it.
ANALYSIS_COMPUTATION = 2
# metrics.json's keys that say what made the run, in the order a mixed table names them (`cpu_capability`:
# torch's CPU dispatch in force, cpu_dispatch); beside them RECORDED_KEYS, recorded but not compared: the
# Python version changes no number a run computes, nor does the CPU's model where the dispatch is the same,
# and MKL's and oneDNN's settings follow the dispatch's pin.
PROVENANCE_KEYS = (
    "computation",
    "copytask_version",
    "commit",
    "uncommitted_changes",
    "torch_version",
    "torch_build",
    "cpu_capability",
)
PYTHON_KEY = "python_version"
RECORDED_KEYS = (PYTHON_KEY, "cpu", "mkl_enable_instructions", "mkl_cbwr", "onednn_max_cpu_isa")
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # src/copytask in a checkout


def provenance(computation: int = COMPUTATION, config: Any = None) -> dict[str, Any]:
    """What makes a run trained now (an analysis made now, with `computation` ANALYSIS_COMPUTATION): this
    code's `computation`, the copytask version, the git commit
    and whether tracked files had uncommitted changes (both None where copytask is not run from a
    checkout, as from a wheel), torch's version and build, the Python version, the CPU's model and its
    dispatch in force: torch's CPU capability and MKL's and oneDNN's settings (cpu_dispatch). Where the
    dispatch is not the one copytask pins, says so once (`dispatch_note`). With the run's `config`: the code of
    the user's own it runs (`own_code`)."""
    import torch  # here: reading a run's provenance needs no torch

    commit, dirty = checkout_state(PACKAGE_DIR)
    capability = torch.backends.cpu.get_cpu_capability()
    if note := cpu_dispatch.not_pinned(capability):
        say_once(note)
    return {
        "computation": computation,
        "own_code": {} if config is None else own_code(config),
        "copytask_version": installed_version(),
        "commit": commit,
        "uncommitted_changes": dirty,
        "torch_version": torch.__version__,
        "torch_build": torch_build(torch.version),
        "cpu_capability": capability,
        PYTHON_KEY: platform.python_version(),
        "cpu": cpu_dispatch.cpu_model(),
        "mkl_enable_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS"),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    }


@functools.cache
def say_once(note: str) -> None:
    """`note` as a CopytaskWarning, the first time this process has it to say."""
    console.warn(note)


def installed_version() -> str | None:
    """copytask's version as installed (importlib.metadata), None where it is not installed."""
    try:
        return importlib.metadata.version("copytask")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_build(version: Any) -> str:
    """`torch.version` -> what torch was built for: "cuda 12.8", "rocm 6.3" or "cpu"."""
    if getattr(version, "cuda", None):
        return f"cuda {version.cuda}"
    if getattr(version, "hip", None):
        return f"rocm {version.hip}"
    return "cpu"


def checkout_state(package_dir: Path) -> tuple[str | None, bool | None]:
    """The commit of the git checkout that `package_dir` is the `src/copytask` of, and whether its
    tracked files have uncommitted changes; (None, None) where there is no such checkout (an installed
    wheel, even one inside another repository's tree), no git, or git fails. The caller's GIT_*
    variables are left out: they could point git at another repository."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GIT_")}

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=package_dir, env=env, capture_output=True, text=True, check=True, timeout=30
        ).stdout.strip()

    try:
        top = Path(git("rev-parse", "--show-toplevel"))
        if (top / "src" / "copytask").resolve() != package_dir.resolve():
            return None, None
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # no git, not a checkout, or git failed
        return None, None


def own_code(config: Any) -> dict[str, str]:
    """The code of the user's own a config runs, which copytask's `computation` does not cover: its model class
    (`model._target_` of no family of the package), attention class (`attention.score=module.Class`) and task
    (`task._target_`), each `module.Name sha256:<12 digits>` of its module's source file (found, not imported);
    `sha256:none` where the module is not there. Empty for copytask's own models, attention types and tasks."""
    family, attention, task = family_of(config), config.get("attention") or {}, config["task"]
    paths = {
        "model": None if family.target in BY_TARGET else family.target,
        "attention": attention.get("score") if family.reads_attention and "." in str(attention.get("score")) else None,
        "task": task.get("_target_"),
    }
    return {kind: f"{path} sha256:{source_digest(path)}" for kind, path in paths.items() if path}


def source_digest(path: str) -> str:
    """The first 12 hex digits of the SHA-256 of the source of `path`'s module (`module.Name`); `none` where it
    has none to read."""
    try:
        spec = importlib.util.find_spec(path.rpartition(".")[0])
        return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()[:12]
    except (ImportError, ValueError, AttributeError, TypeError, OSError):  # no such module, or no file behind it
        return "none"


def recorded_computation(folder: Path) -> Any:
    """The `computation` a complete run's metrics.json records; None where it records none."""
    metrics = read_json(folder / METRICS)
    return metrics.get("computation") if isinstance(metrics, dict) else None


def computed_here(folder: Path) -> bool:
    """Whether the complete run in `folder` was computed by this code: it records `COMPUTATION`, and the code of the
    user's own it ran is as it is now (`own_code`; a run that records none ran none, or was made before it was
    recorded: with code of the user's own it is trained again)."""
    if recorded_computation(folder) != COMPUTATION:
        return False
    try:
        return read_json(folder / METRICS).get("own_code", {}) == own_code(read_resolved(folder))
    except ConfigError:  # a config.yaml that cannot be read: not known to be this code's
        return False


def reused(folder: Path, retrain: bool) -> bool:
    """Whether training the run in `folder` reads its results instead: they are complete and computed
    by this code, `retrain` is false, and no replacement of them has begun (a stopped one goes on)."""
    return is_complete(folder) and not retrain and computed_here(folder) and not pending(folder)


def computed_elsewhere(
    computations: list[Any], current: int = COMPUTATION, names: tuple[str, str] = ("run", "runs")
) -> str:
    """Why runs (or what else `names` names, singular and plural) that record `computations` (None: none)
    are not of this code, whose is `current`, in a few words."""
    counts = {value: computations.count(value) for value in dict.fromkeys(computations)}
    parts = [
        f"{count} {f'{names[0]} records' if count == 1 else f'{names[1]} record'} "
        + ("no computation (made before copytask recorded it)" if value is None else f"computation {value}")
        for value, count in counts.items()
    ]
    return f"{', '.join(parts)}; this code's is {current}"


def retrained_line(folders: list[Path]) -> str | None:
    """Where complete runs among `folders` were computed by other code, the line that says how many
    (or which one, for one folder) are trained again, and why; None where there are none."""
    elsewhere = [folder for folder in folders if is_complete(folder) and not computed_here(folder)]
    if not elsewhere:
        return None
    what = elsewhere[0].name if len(folders) == 1 else f"{len(elsewhere)} complete run{'s' * (len(elsewhere) > 1)}"
    other = [recorded_computation(folder) for folder in elsewhere if recorded_computation(folder) != COMPUTATION]
    changed = len(elsewhere) - len(other)  # the user's own code they ran has changed since (`own_code`)
    ran = f"{changed} {'run ran' if changed == 1 else 'runs ran'} code of yours that has changed since"
    why = "; ".join([computed_elsewhere(other)] * bool(other) + [ran] * bool(changed))
    return f"{what}: computed by other code ({why}): trained again, old results kept until the new ones are complete"


def mixed_line(runs: dict[str, dict]) -> str | None:
    """run name -> its metrics.json: where the runs were made by different computations, copytask
    versions, commits, torch versions and builds or torch CPU dispatch, one line that says so and names the runs made by
    each; None where they agree. A run from before provenance was recorded has none of it."""
    differ = [key for key in PROVENANCE_KEYS if len({metrics.get(key) for metrics in runs.values()}) > 1]
    if not differ:
        return None
    groups: dict[tuple, list[str]] = {}
    for name, metrics in runs.items():
        groups.setdefault(tuple(metrics.get(key) for key in differ), []).append(name)
    made_by = "; ".join(
        ", ".join(f"{key} {shown(key, value)}" for key, value in zip(differ, values)) + f": {named(sorted(names))}"
        for values, names in groups.items()
    )
    made = "under different CPU dispatch" if differ == ["cpu_capability"] else "by different code"
    return f"note: these runs were made {made} ({made_by})"


def own_code_line(runs: dict[str, dict]) -> str | None:
    """run name -> its metrics.json: where runs ran different versions of the same code of the user's own (a
    class or task by its import path, its module's source since edited: `own_code`), one line that names the runs
    of each version; None where they agree. Runs of other code, or of none, are no versions of it."""
    versions: dict[str, dict[str, list[str]]] = {}  # import path -> source digest -> runs
    for name, metrics in runs.items():
        for line in (metrics.get("own_code") or {}).values():
            path, _, digest = line.partition(" ")
            versions.setdefault(path, {}).setdefault(digest, []).append(name)
    parts = [
        f"{path} " + "; ".join(f"{digest}: {named(sorted(names))}" for digest, names in by_digest.items())
        for path, by_digest in versions.items()
        if len(by_digest) > 1
    ]
    return f"note: these runs ran different versions of your code ({'; '.join(parts)})" if parts else None


def named(names: list[str], most: int = 3) -> str:
    """Runs by name, up to `most` of them; past that the first two and how many more (each run's metrics.json
    names what made it): a table of a hundred runs gets a note, not a page."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{names[0]}, {names[1]} and {len(names) - 2} more"


def shown(key: str, value: Any) -> str:
    """A provenance value as a line shows it: a commit by its first 12 digits, as git abbreviates it."""
    if value is None:
        return "none"
    return value[:12] if key == "commit" else str(value)
