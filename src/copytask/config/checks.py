"""What a runnable config is: `validate` refuses, before anything is trained or written, every
value that cannot run (ranges, combinations, a label that is not a plain name of the user's own
(`families.gru.check_label`), a held-out set that would cover the sequences training draws from, a
configuration whose memory no machine here holds (`families.memory`), a device or a tracker this machine
lacks), each in one ConfigError line that names it. Torch-free, like `schema`, so the command line
answers at once. Types are the schema's (`schema`, checked by Hydra as it composes).
What only an attention type's class knows (which `attention.score`s exist, what each takes, its own
parameters and memory) is checked where the model is built: `models.build.check_buildable`.
"""

from __future__ import annotations

import ctypes
import importlib.util
import math
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from .. import cpu_dispatch
from ..data.heldout import check_heldout
from ..data.tasks import TASKS, load_task
from ..families import FAMILIES, LABEL, LABEL_RULE, Family, builtin_names, default_attention_option, family_of
from ..families.memory import check_memory
from .schema import (
    DEVICES,
    LOGGERS,
    MAX_BEAM,
    MAXIMUM,
    MINIMUM,
    REMOTE_LAUNCHERS,
    SCHEDULES,
    SCHEMA_KEYS,
    AttentionConfig,
    ConfigError,
    config_dir,
    dotted_keys,
    unknown_key,
)

BUILT_IN_TASKS = tuple(TASKS)  # registered when data.tasks is imported, before any task of the user's own


def validate(cfg: DictConfig) -> None:
    """Refuse bad values before anything is trained or written: ConfigError naming the key, the
    value and what is allowed. Types are the schema's (checked by Hydra); this checks the rest (see
    the module's docstring), in this order, so that the first bad value is the one named."""
    check_keys(cfg)
    check_task(cfg.task, cfg.train)
    check_analysis(cfg.analysis)
    check_training(cfg.train)
    check_model(cfg)
    check_memory(cfg)
    check_device(cfg.train.device)
    check_cpu_dispatch()
    check_logger(cfg.get("logger"))


def check_model(cfg: DictConfig) -> None:
    """ConfigError unless `cfg.model` is a model that can run: a family's (`families`), each key it reads set (but
    those it may leave null), no key another family keeps to itself, the attention group at its default where the
    family does not read it (nothing would), and the family's own checks."""
    family, model = model_family(cfg), cfg.model
    for key in family.own_keys(cfg):
        if model.get(key) is None and key not in family.nullable:
            raise ConfigError(f"model.{key} must not be null with model={family.name}")
    for other in FAMILIES.values():
        for key, what in other.exclusive.items():
            if other is not family and model.get(key) is not None:
                raise ConfigError(
                    f"model.{key}={str(model[key]).lower()} is model={other.name}'s ({what}); model={family.name} "
                    "has no such choice: leave it null"
                )
    default = default_attention()
    if not family.reads_attention and cfg.attention != default:
        readers = "|".join(name for name, each in FAMILIES.items() if each.reads_attention)
        raise ConfigError(
            f"attention={cfg.attention.name} (and every attention.* key) is model={readers}'s decoder; "
            f"model={family.name} {family.attention_words}, so the attention group must stay at its default "
            f"({default.name}); a sweep over architecture=... that is not a preset's drops the default grid's "
            "attention list with '~hydra.sweeper.params.attention'"
        )
    family.check(cfg, config_dir())


def model_family(cfg: DictConfig) -> Family:
    """The family of `cfg`'s model; ConfigError where `model.name` names none, or is not the name of the family of
    the package its `_target_` names (the label of a model of the user's own is its own: `families.own`)."""
    try:
        family = family_of(cfg)
    except KeyError:
        raise ConfigError(
            f"model.name must be one of {', '.join(FAMILIES)}, got {cfg.model.name!r} "
            f"(choose a model with model={'|'.join(FAMILIES)})"
        ) from None
    if family.keys is not None and cfg.model.name != family.name:  # a family of the package, under another name
        raise ConfigError(
            f"model.name must be {family.name} with model._target_={family.target}, got {cfg.model.name!r}"
        )
    return family


def family_keys(cfg: DictConfig) -> type | None:
    """The dataclass of the keys `cfg`'s model family reads (None: any, a model of the user's own; or no family,
    which `check_model` refuses)."""
    try:
        return family_of(cfg).keys
    except KeyError:
        return type(None)


def check_keys(cfg: DictConfig) -> None:
    """No key the schema lacks, none without a value, and every bounded integer within its bounds
    (MINIMUM, MAXIMUM)."""
    given, known = set(dotted_keys(cfg)), set(SCHEMA_KEYS)
    if family_keys(cfg) is None:  # a model of the user's own: its keys are its own option's
        known |= {f"model.{key}" for key in cfg.model}
    unknown = sorted(given - known)
    if unknown:  # added with `+key=value`: nothing would read it, yet it would rename the run
        raise ConfigError(unknown_key(unknown[0], SCHEMA_KEYS))
    unset = sorted(OmegaConf.missing_keys(cfg))
    if unset:  # an option of the user's own (hydra.searchpath) that leaves a key of its group out
        raise ConfigError(f"{unset[0]} has no value: set it in its option's yaml or with {unset[0]}=VALUE")
    check_bounds(cfg)


def check_bounds(node: DictConfig, prefix: str = "") -> None:
    """Every bounded integer (MINIMUM, MAXIMUM) under `prefix` (`analysis.`: `node` is the config's
    analysis node; empty: the whole config) within its bounds."""
    for key, low in MINIMUM.items():
        value = OmegaConf.select(node, key.removeprefix(prefix)) if key.startswith(prefix) else None
        if value is not None and value < low:
            raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")
        if value is not None and value > MAXIMUM.get(key, value):
            raise ConfigError(f"{key} must be an integer from {low} to {MAXIMUM[key]}, got {value!r}")


def check_own_task(task: DictConfig) -> None:
    """A task of the user's own (`task._target_`): a label no built-in has, and a function its module gives
    (imported: it registers the task in this process)."""
    if not LABEL.fullmatch(task.name):
        raise ConfigError(
            f"task.name must be a plain name ({LABEL_RULE}: it names your task's runs), got {task.name!r}"
        )
    if task.name in builtin_names(config_dir()) or task.name in BUILT_IN_TASKS:
        raise ConfigError(
            f"task.name={task.name} is the name of one of copytask's own tasks, models, options or architectures: "
            "give your task a name of its own"
        )
    try:
        load_task(task.name, task._target_)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_task(task: DictConfig, train: DictConfig) -> None:
    """A registered task, lengths in order, task.copied where the task reads it (and only there: 1 <= k <
    every length it draws), and room for the held-out sets (`check_heldout`)."""
    if task.get("_target_") is not None:
        check_own_task(task)
    elif task.name not in TASKS:
        raise ConfigError(f"task.name must be one of {', '.join(TASKS)}, got {task.name!r}")
    if task.variable_length and task.min_length > task.length:
        raise ConfigError(f"task.min_length ({task.min_length}) must not exceed task.length ({task.length})")
    sources, copied = TASKS[task.name].sources, task.get("copied")
    shortest = task.min_length if task.variable_length else task.length
    which = "task.min_length" if task.variable_length else "task.length"
    if not sources.reads_copied and copied is not None:
        raise ConfigError(
            f"task.copied={copied} is selective copying's (its content symbols among noise); task={task.name} "
            "does not read it: leave it null, or choose task=selective_copy"
        )
    if sources.reads_copied and copied is None:
        raise ConfigError(f"task.copied must be an integer >= 1 with task={task.name}, got null")
    if sources.reads_copied and copied >= shortest:
        raise ConfigError(
            f"task.copied ({copied}) must be less than {which} ({shortest}): task={task.name} puts its "
            f"{copied} content symbols among every source's positions with at least one noise token"
        )
    check_heldout(
        task.length,
        task.vocab_size,
        train.eval_size,
        train.val_size,
        task.min_length if task.variable_length else None,
        sources,
        copied,
    )


def check_training(train: DictConfig) -> None:
    """The optimiser's and the schedule's numbers, and the target accuracy."""
    if not 0 < train.lr < math.inf:  # also refuses nan
        raise ConfigError(f"train.lr must be a positive finite number, got {train.lr!r}")
    if train.schedule not in SCHEDULES:
        raise ConfigError(f"train.schedule must be one of {', '.join(SCHEDULES)}, got {train.schedule!r}")
    if not train.clip > 0:  # also refuses nan (inf: no clipping)
        raise ConfigError(f"train.clip must be a positive number, got {train.clip!r}")
    if train.schedule == "onecycle" and not 0 < train.warmup < 1:
        raise ConfigError(f"train.warmup must be a fraction between 0 and 1, got {train.warmup!r}")
    if train.schedule == "onecycle" and float(train.warmup * train.steps) == 1:  # its first phase would end at step 0
        raise ConfigError(
            f"train.warmup={train.warmup} of train.steps={train.steps} is a warm-up of exactly 1 step, which torch's "
            f"OneCycleLR divides by zero on; use a longer or shorter train.warmup"
        )
    if not 0 <= train.target_acc <= 1:
        raise ConfigError(f"train.target_acc must be a number in [0, 1], got {train.target_acc!r}")


def check_logger(logger: DictConfig | None) -> None:
    """ConfigError unless `logger` (the config's `logger` node; None in older runs: none) names a
    tracker whose modules are installed. find_spec only looks for them: no slow import here."""
    name = "none" if logger is None else logger.name
    if name not in LOGGERS:
        raise ConfigError(f"logger must be one of {', '.join(LOGGERS)}, got {name!r}")
    if LOGGERS[name] is not None:
        tracker, modules = LOGGERS[name]
        if not all(importlib.util.find_spec(module) for module in modules):
            raise ConfigError(f"logger={name} needs {tracker}: pip install 'copytask[{name}]'")


def check_device(name: str, here: bool = True) -> None:
    """ConfigError unless `name` is a device name and, with `here`, one this machine has (torch is
    imported only to look for CUDA where a CUDA driver is there to find it). The message names the
    machine: in a SLURM sweep it is a node."""
    if name not in DEVICES:
        raise ConfigError(f"train.device must be one of {', '.join(DEVICES)}, got {name!r}")
    if name != "cuda" or not here:
        return
    if not has_cuda_driver():
        raise ConfigError(
            f"train.device=cuda was requested but {socket.gethostname()} has no CUDA device (no CUDA driver: "
            "libcuda.so.1 does not load); use auto or cpu"
        )
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}, " + (
            "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        )
        raise ConfigError(
            f"train.device=cuda was requested but {socket.gethostname()} has no CUDA device ({build}); use auto or cpu"
        )


def check_cpu_dispatch() -> None:
    """ConfigError where COPYTASK_CPU_CAPABILITY names no level copytask pins (`cpu_dispatch`): it was read
    when copytask was imported, and pinned nothing."""
    if reason := cpu_dispatch.check_setting():
        raise ConfigError(reason)


def has_cuda_driver() -> bool:
    """Whether this machine may have a CUDA device: False on Linux where the CUDA driver's library,
    libcuda.so.1, does not load (torch's CUDA runtime loads it by that name: no torch build finds a
    device without it), so that a refusal need not import torch; True elsewhere (torch then looks)."""
    if not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def remote_launcher(target: str | None) -> bool:
    """Whether a Hydra launcher (its `_target_`) runs the jobs on other machines than the one composing them."""
    return (target or "").endswith(REMOTE_LAUNCHERS)


def check_beam_width(width: object, name: str) -> None:
    """ConfigError unless `width` (the value of `name`) is an integer from 1 to MAX_BEAM."""
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_BEAM:
        raise ConfigError(f"{name} must be an integer from 1 to {MAX_BEAM}, got {width!r}")


def check_analysis(analysis: DictConfig) -> None:
    """The analysis' keys that the schema's types and MINIMUM leave: the test lengths null or a non-empty list
    of lengths >= 1, each beam width from 1 to MAX_BEAM, and at least one ridge penalty, each finite and > 0
    (nan refused); and its bounded integers' bounds, for `analyze`, which reads no other key."""
    check_bounds(analysis, "analysis.")
    lengths = analysis.get("lengths")
    if lengths is not None and (len(lengths) == 0 or min(lengths) < 1):
        raise ConfigError(
            f"analysis.lengths must be null or a list of integers >= 1, e.g. [5,10,20,40,80], got {list(lengths)}"
        )
    for width in analysis.beam_widths or ():
        check_beam_width(width, "each of analysis.beam_widths")
    if not analysis.probe_ridges:
        raise ConfigError(f"analysis.probe_ridges must list at least one penalty, got {analysis.probe_ridges}")
    for ridge in analysis.probe_ridges:
        if not 0 < ridge < math.inf:
            raise ConfigError(f"each of analysis.probe_ridges must be a finite number > 0, got {ridge!r}")


def analysis_device(device: str, target: str | None) -> str:
    """The device a sweep's closing analysis runs on, in the sweep's own process: `train.device`,
    except `cuda` after a launcher whose jobs ran elsewhere (a login node need not have the nodes' GPU): auto."""
    return "auto" if device == "cuda" and remote_launcher(target) else device


def check_launcher(target: str | None, choice: str | None, partition: str | None = None) -> None:
    """ConfigError unless the launcher (its `_target_`, and its `hydra/launcher` option) can submit
    from this machine: SLURM's needs `srun` (how submitit detects a cluster) and `sbatch` (what it
    submits with), and the `partition` it names (`hydra.launcher.partition`, a,b for either) must be
    one that sinfo lists. The message names the options of configs/hydra/launcher that run here."""
    if not remote_launcher(target):
        return
    check_slurm_commands(choice)
    if partition is None:
        return
    try:
        listed = subprocess.run(["sinfo", "--noheader", "--format=%R"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return  # the controller does not answer: sbatch will say why
    partitions = sorted(set(listed.stdout.split()))
    unknown = [name for name in str(partition).split(",") if name not in partitions]
    if listed.returncode == 0 and unknown:
        raise ConfigError(
            f"hydra.launcher.partition={partition}: this cluster has no partition {', '.join(unknown)} "
            f"(sinfo lists {', '.join(partitions) or 'none'})"
        )


def check_slurm_commands(choice: str | None) -> None:
    """ConfigError unless srun and sbatch are on PATH, naming the launchers that work without them."""
    missing = [command for command in ("srun", "sbatch") if shutil.which(command) is None]
    if missing:
        options = sorted((Path(config_dir()) / "hydra" / "launcher").glob("*.yaml"))
        here = [f"hydra/launcher={path.stem}" for path in options if "submitit_slurm" not in path.read_text()]
        raise ConfigError(
            f"hydra/launcher={choice} needs a SLURM cluster ({' and '.join(missing)} not on PATH here); "
            "on this machine use the default launcher "
            "(basic: one job at a time)" + "".join(f" or {option}" for option in here)
        )


def remote_job_check(cfg: DictConfig) -> None:
    """`validate` for a job composed here but run elsewhere (a SLURM node): everything but whether
    this machine has the device, which the job checks on its node when it starts."""
    check_device(cfg.train.device, here=False)
    validate(OmegaConf.merge(cfg, {"train": {"device": "cpu"}}))


def default_attention() -> DictConfig:
    """The attention group's default option as the schema composes it (what model=transformer leaves alone)."""
    return OmegaConf.merge(OmegaConf.structured(AttentionConfig), default_attention_option(config_dir()))
