"""Where the Hydra configs live, every key's type (the schema Hydra checks as it composes), and
copytask's one kind of config error; what a runnable config is, is `checks`'. Light on
purpose: no torch, so the command line refuses bad input at once.

Hydra's own composition errors (an unknown key, a config-group option that does not exist, an
override it cannot parse) are turned into `ConfigError`s here, so every command answers bad
input the same way: one line, `copytask: error: ...`, exit status 2.
"""

from __future__ import annotations

import difflib
import itertools
import os
import re
import textwrap
import traceback
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import MISSING, DictConfig, OmegaConf, ValidationError

from .. import families
from ..console import ConfigError
from . import parallel

DEVICES = ("auto", "cpu", "cuda")
# CUBLAS_WORKSPACE_CONFIG values that make cuBLAS deterministic (PyTorch's reproducibility notes); the first
# is what the CLI sets
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")
# Hydra launchers (`_target_` suffixes) whose jobs run on other machines (SLURM's): the device is checked
# there, not where the sweep is composed
REMOTE_LAUNCHERS = (".SlurmLauncher",)
SCHEDULES = ("onecycle", "constant")
# logger=<name> -> (the tracker, the modules its extra `copytask[<name>]` installs); looked for, not imported, here
LOGGERS = {
    "none": None,
    "tensorboard": ("TensorBoard", ("tensorboard",)),
    "mlflow": ("MLflow", ("mlflow", "sqlalchemy", "alembic")),
}


# The schema: every key's type, which Hydra checks as it composes (configs/config.yaml names it
# first in its defaults), so a value of the wrong type is refused before `validate` sees it; the
# values and meanings are in configs/ (MISSING here: one place for each default). Only a key that
# some option leaves out (attention's heads, local, window; the trackers' settings) has its default here.
@dataclass
class TaskConfig:
    name: str = MISSING
    length: int = MISSING
    vocab_size: int = MISSING
    variable_length: bool = MISSING
    min_length: int = MISSING
    copied: int | None = None  # selective copying's k; null for a task that does not read it
    _target_: str | None = None  # a task of the user's own: its function, module.function (docs/models.md)


# model=...: `_target_`, the model's class (`families.family_of`), its label and the keys of every family of the
# package (`Family.keys`), each null where its family's option leaves it out; a model of the user's own adds keys
# of its own (the node is open: `schema_node`)
ModelConfig = make_dataclass(
    "ModelConfig",
    [
        ("name", str, MISSING),
        ("_target_", str | None, None),
        *{  # a key two families share once, at its first family's type
            key: (key, kind | None, None)
            for family in families.FAMILIES.values()
            for key, kind in typing.get_type_hints(family.keys).items()
        }.values(),
    ],
)


@dataclass
class AttentionConfig:
    name: str = MISSING
    decoder: str = MISSING
    score: str | None = MISSING
    size: int | None = MISSING
    heads: int = 1
    local: str | None = None
    window: int | None = None
    variant: str | None = None


@dataclass
class TrainConfig:
    steps: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    schedule: str = MISSING
    warmup: float = MISSING
    clip: float = MISSING
    eval_every: int = MISSING
    eval_size: int = MISSING
    eval_seed: int = MISSING
    val_size: int = MISSING
    val_seed: int = MISSING
    target_acc: float = MISSING
    patience: int | None = MISSING
    device: str = MISSING
    threads: int | None = MISSING
    fused: bool = MISSING
    progress: bool = MISSING
    attention_samples: int = MISSING


@dataclass
class AnalysisConfig:
    eval_size: int | None = MISSING
    threads: int | None = MISSING
    lengths: list[int] | None = None
    beam_widths: list[int] | None = MISSING
    length_normalise: bool = MISSING
    probe_size: int | None = MISSING
    probe_ridges: list[float] = MISSING
    probe_seed: int = MISSING


@dataclass
class ReportConfig:
    x: str = MISSING
    note: str | None = None


@dataclass
class LoggerConfig:
    name: str = "none"
    tracking_uri: str | None = None  # mlflow
    experiment: str | None = None  # mlflow
    log_dir: str | None = None  # tensorboard


@dataclass
class Config:
    seed: int = MISSING
    runs_dir: str = MISSING
    retrain: bool = MISSING
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def schema_node() -> DictConfig:
    """The schema as Hydra composes onto it: `Config`, its model node open to the keys of a model of the user's
    own (a closed one refuses them as it merges the option's file)."""
    node = OmegaConf.structured(Config)
    OmegaConf.set_struct(node.model, False)
    return node


SCHEMA = "copytask_schema"
ConfigStore.instance().store(name=SCHEMA, node=schema_node())
parallel.register_resolver()  # n_jobs of configs/hydra/launcher/parallel.yaml

# The smallest value of each integer key (a key left null where the schema allows it is not checked).
MINIMUM = {
    "seed": 0,
    "task.length": 1,
    "task.vocab_size": 2,  # one symbol would make copying trivial
    "task.min_length": 1,
    "task.copied": 1,
    "model.embedding_size": 1,
    "model.hidden_size": 1,
    "attention.size": 1,
    "attention.heads": 1,
    "attention.window": 1,
    "train.steps": 1,
    "train.batch_size": 1,
    "train.eval_every": 1,
    "train.eval_size": 1,
    "train.eval_seed": 0,
    "train.val_size": 1,
    "train.val_seed": 0,
    "train.patience": 1,
    "train.threads": 1,
    "train.attention_samples": 0,
    "analysis.eval_size": 1,
    "analysis.threads": 1,
    "analysis.probe_size": 2,  # a mean and a spread
    "analysis.probe_seed": 0,
    **families.minimum(),
}
# The largest value of an integer key where there is one: torch's generators take 64-bit seeds,
# and OpenMP would start every thread asked for.
MAXIMUM = {
    "seed": 2**64 - 1,
    "train.eval_seed": 2**64 - 1,
    "train.val_seed": 2**64 - 1,
    "train.threads": 1024,
    "analysis.threads": 1024,
    "analysis.probe_size": 1_000_000,  # a summary vector (up to a few hundred numbers) of each, in memory at once
    "analysis.probe_seed": 2**64 - 1,
}
MAX_BEAM = 64  # the widest beam search the analysis and decode take: B x 64 decoder rows, 64^2 candidates a sequence
TYPES = {"Integer": "an integer", "Float": "a number", "bool": "true or false"}  # as OmegaConf names them


def config_dir() -> str:
    """configs/ inside the package (wheel install) or at the top of the checkout (editable install)."""
    package = Path(__file__).resolve().parents[1]
    packaged = package / "configs"
    return str(packaged if packaged.is_dir() else package.parents[1] / "configs")


def flatten(node: dict, prefix: str = "") -> dict[str, object]:
    """A nested dict's leaves with dotted keys: {"train": {"lr": 0.1}} -> {"train.lr": 0.1}."""
    flat = {}
    for key, value in node.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def dotted_keys(cfg: DictConfig) -> list[str]:
    """Every leaf key of `cfg` as `group.key` (hydra's own node left out)."""
    return [key for key in flatten(OmegaConf.to_container(cfg, resolve=False)) if not key.startswith("hydra.")]


SCHEMA_KEYS = dotted_keys(OmegaConf.structured(Config))  # every key some part of copytask reads


@contextmanager
def hydra_errors(known_keys: Callable[[], list[str]]) -> Iterator[None]:
    """Turn Hydra's composition errors inside the block into one-line ConfigErrors; an unknown key
    gets the closest of `known_keys()` (called only then: the keys may cost a composition) instead of
    Hydra's advice to add it with `+`."""
    try:
        yield
    except MissingConfigException as error:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        options = ", ".join(error.options or [])
        if f"{group}={option}" in PLUGIN_OPTIONS:  # a Hydra plugin's option, there once its extra is installed
            raise ConfigError(f"{group}={option} needs {PLUGIN_OPTIONS[f'{group}={option}']}") from None
        close = difflib.get_close_matches(option, error.options or [], n=1, cutoff=0.6)
        hint = f"did you mean {group}={close[0]}? The options: " if close else "choose one of "
        raise ConfigError(f"{group}={option}: no such option; {hint}{options}") from None
    except OverrideParseException as error:
        raise ConfigError(str(error).strip().splitlines()[0]) from None
    except ConfigError:  # the block's own check of a composed config: already one line
        raise
    except ConfigCompositionException as error:
        if isinstance(error.__cause__, ValidationError):  # a value the schema's type refuses
            raise ConfigError(type_error(error.__cause__)) from None
        unknown = re.match(r"Could not override '([^']+)'", str(error))
        if unknown is None:
            raise ConfigError(str(error).strip().splitlines()[0]) from None
        raise ConfigError(unknown_key(unknown[1], known_keys())) from None
    except (
        ValueError,
        TypeError,
    ) as error:  # Hydra's defaults list on a group given no option name (`=3`, `attention=[1,2]`)
        if f"{os.sep}hydra{os.sep}" not in traceback.extract_tb(error.__traceback__)[-1].filename:
            raise  # not Hydra's: a bug to see whole
        raise ConfigError(
            f"a config group ({', '.join(GROUPS)}) takes the name of one of its options "
            f"({type(error).__name__} from Hydra: {str(error).strip().splitlines()[0]})"
        ) from None


def type_error(error: ValidationError) -> str:
    """`task.length must be an integer >= 1, got 'oops'` for OmegaConf's `Value 'oops' of type 'str'
    could not be converted to Integer` (`full_key: task.length`), or its `is not a valid bool`."""
    if error.value is None:  # `key=null` where the schema has no null
        return f"{error.full_key} must not be null"
    wanted = re.search(r"converted to (\w+)|is not a valid (\w+)", str(error))
    wanted = TYPES.get(wanted[1] or wanted[2], f"a {wanted[1] or wanted[2]}") if wanted else "of its schema's type"
    if error.full_key in MINIMUM:
        wanted += f" >= {MINIMUM[error.full_key]}"
    return f"{error.full_key} must be {wanted}, got {error.value!r}"


def unknown_key(key: str, known_keys: list[str]) -> str:
    """`unknown key 'task.lenght'; did you mean task.length?`"""
    close = difflib.get_close_matches(key, known_keys, n=1, cutoff=0.6)
    return f"unknown key {key!r}" + (f"; did you mean {close[0]}?" if close else "; `--cfg job` lists every key")


# `key: value  # comment` in the simple YAML of configs/ (two-space indents)
YAML_LINE = re.compile(r"^(?P<indent> *)(?P<key>[\w.]+):(?P<value>[^#]*?)\s*(?:#\s*(?P<comment>.*))?$")
GROUPS = (
    "task",
    "model",
    "attention",
    "train",
    "logger",
    "architecture",
    "experiment",
    "hparams_search",
    "hydra/launcher",
)
PLUGIN_OPTIONS = {"hydra/sweeper=optuna": "Hydra's Optuna sweeper: pip install 'copytask[optuna]'"}


def yaml_comments(path: Path, prefix: str = "") -> dict[str, str]:
    """dotted key (after `prefix`) -> the comment on its line in the YAML file at `path`."""
    comments, parents = {}, []
    for line in path.read_text().splitlines():
        match = YAML_LINE.match(line)
        if match is None:
            continue
        parents = parents[: len(match["indent"]) // 2] + [match["key"]]
        if match["comment"]:
            comments[prefix + ".".join(parents)] = match["comment"]
    return comments


def option_summary(path: Path) -> str:
    """What a config-group option is: the comment on its `name:` line, else the first sentence of
    the comment its file starts with."""
    text = path.read_text()
    if named := re.search(r"^name: [^#]*#\s*(.*)$", text, re.M):
        return named[1]
    lines = [line for line in text.splitlines() if "@package" not in line]
    leading = " ".join(
        line.lstrip("# ").strip() for line in itertools.takewhile(lambda line: line.startswith("#"), lines)
    )
    sentence = re.match(r".+?[.?!](?=\s|$)", leading)
    return sentence[0] if sentence else leading


def config_help(command: str, cfg: DictConfig, choices: dict[str, str], columns: int = 100) -> str:
    """`python -m copytask train --help`: every config group with its options, and every key with
    its default and what it means, from the comments in configs/ (one source for both), wrapped at
    `columns` characters (the terminal's width), each entry's lines indented under its first."""
    root = Path(config_dir())
    lines = [
        f"usage: python -m copytask {command} [key=value ...] [group=option ...]",
        "",
        "Hydra overrides of the configs in configs/"
        + (
            ": a comma-separated list sweeps a key ('task.length=5,10'); the grid is hydra.sweeper.params."
            if command == "sweep"
            else "."
        ),
        "`--cfg job` prints the composed config; `--hydra-help` Hydra's own flags.",
        "",
        "config groups (group=option; * the default):",
    ]
    options = [
        (group, path) for group in GROUPS if (root / group).is_dir() for path in sorted((root / group).glob("*.yaml"))
    ]
    width = max(len(f"{group}={path.stem}") for group, path in options)
    for group, path in options:
        mark = "*" if choices.get(group) == path.stem else " "
        entry = f"  {mark} {f'{group}={path.stem}':<{width}}  {option_summary(path)}"
        lines += textwrap.wrap(entry, columns, subsequent_indent=" " * (width + 6)) or [entry]
    comments = yaml_comments(root / "config.yaml")
    for group in ("task", "model", "attention", "train", "logger"):
        comments |= yaml_comments(root / group / f"{choices[group]}.yaml", prefix=f"{group}.")
    lines += ["", "keys (key=default: what it means):"]
    for key in dotted_keys(cfg):
        value = OmegaConf.select(cfg, key)
        meaning = comments.get(key) or comments.get(key.rsplit(".", 1)[0], "")
        entry = f"  {key}={'null' if value is None else value}" + (f": {meaning}" if meaning else "")
        lines += textwrap.wrap(entry, columns, subsequent_indent=" " * 6, break_on_hyphens=False) or [entry]
    return "\n".join(lines)
