"""Model families: what configures each kind of model, torch-free, so that a config is checked, counted, sized
and named before torch is imported. A family says which config keys its models read and their types, how it
checks them, its parameter count and a training step's memory, the word its runs are named by (its label), what
its decoder reads of the source, and how the report describes it. The model itself is its class, named by
import path (`target`), which keeps `models.protocol`.

Every family comes in through one door, `family_of(config)`: its `model._target_` names the class; a class
registered here (`register`, by each module of this package: the GRU encoder-decoders, the Transformer, Mamba)
has its family; any other class is a model of the user's own (`own.OwnFamily`), configured by its own keys.
A run from before `_target_` was recorded is found by its `model.name`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

Config = DictConfig | dict  # a composed config, or a run's config read as plain values

# A label names a run's folder (the first word of its name, whose parts '-' joins) and its rows: a plain name, lower
# case as every built-in's is, so that no two fold into one folder where a file system ignores case; short enough
# for a file name and a table's column.
LABEL = re.compile(r"[a-z][a-z0-9_]{0,31}")
LABEL_RULE = "a lowercase letter, then up to 31 lowercase letters, digits or underscores"
FLOAT, LONG = 4, 8  # bytes of a float32 number and of a token id
MAX_HEADS = 8  # heads of a multi-head attention (attention.heads) or of the Transformer (model.heads)


class Family:
    """What configures one kind of model (see the module). A subclass sets the class attributes and overrides
    what differs from these defaults, which are a model of the user's own's: no keys known ahead, no count
    without building it, nothing to describe but its class."""

    name: str = ""  # model.name of its config option, and its runs' label unless `label` says otherwise
    target: str = ""  # its class's import path
    keys: type | None = None  # a dataclass of the keys it reads (model.<key>) and their types; None: any
    minimum: dict[str, int] = {}  # the least value of each integer key it reads (model.<key>)
    reads_attention: bool = False  # whether its decoder is the attention group's (else that stays at its default)
    attention_words = "has no attention"  # what it has instead of the attention group, for the refusal of one
    nullable: tuple[str, ...] = ()  # keys it reads that may be null
    exclusive: dict[str, str] = {}  # a key no other family may set -> what it is, for the refusal

    def own_keys(self, config: Config) -> list[str]:
        """The model keys its runs read (so their identity holds them): its dataclass's fields."""
        return [name for name in self.keys.__dataclass_fields__] if self.keys else []

    def check(self, config: DictConfig, config_dir: str) -> None:
        """ConfigError, one line, for a value of its keys it cannot run."""

    def label(self, config: Config) -> str:
        """Its runs' label in every table and figure."""
        return self.name

    def run_word(self, config: Config) -> str:
        """The first word of its runs' names (metrics.json's `attention`): its label."""
        return self.label(config)

    def labels(self) -> Iterable[str]:
        """Every label its runs can have (no GRU run may take one)."""
        return [self.name]

    def heads(self, config: Config) -> int:
        """The attention heads of its maps (1: one map, or none)."""
        return 1

    def option(self, config: Config) -> str:
        """The override that chose this model, as a message names it."""
        return f"model={config['model'].get('name')}"

    def arguments(self, config: DictConfig) -> dict[str, Any]:
        """Its class's keyword arguments besides the vocabulary's size."""
        return {key: config.model[key] for key in self.own_keys(config)}

    def parameter_count(self, config: DictConfig) -> int | None:
        """Its trainable parameters, counted without torch; None: only building the model tells."""
        return None

    def activations(self, config: DictConfig) -> tuple[bool, dict[str, int]]:
        """Whether its evaluation keeps attention weights (B x T_dec x T_enc), and roughly the bytes of a training
        step's activations by what needs them (`memory.memory_estimate`)."""
        return False, {}

    def reads(self, config: Config) -> str:
        """What its decoder can read of the source, in the words of its config (the state section)."""
        return "what its `state_floats` says"

    def fixed_state(self, config: Config) -> tuple[int, str] | None:
        """The part of its state floats its size key does not set, and what it is; None: none."""
        return None

    def describe(self, configs: list[DictConfig], values: Callable[[list[DictConfig], str], str]) -> str:
        """The report's line on these runs' models (`values(configs, key)`: one value, or the list)."""
        return f"- Model `{self.name}`: `{self.target}`."

    handed_over: str = "what its `summary_state` returns"  # its summary vector, in the probe's words
    counterfactual_note: str = ""  # what its counterfactual drops mean, where unlike a GRU model's


FAMILIES: dict[str, Family] = {}  # by name
BY_TARGET: dict[str, Family] = {}


def register(family: type[Family]) -> type[Family]:
    """Class decorator: a family of the package, found by its class's import path and by its name."""
    instance = family()
    FAMILIES[instance.name] = BY_TARGET[instance.target] = instance
    return family


def family_of(config: Config) -> Family:
    """The family of a config (or of a run's plain values): by `model._target_`, else by `model.name` (a run from
    before `_target_` was recorded; none: the GRU's, from before the `model` group)."""
    model = config["model"]
    target = model.get("_target_")
    if target is None:
        return FAMILIES[model.get("name") or "gru"]
    if target in BY_TARGET:
        return BY_TARGET[target]
    from .own import OwnFamily

    return OwnFamily(target, model.get("name"))


def cannot_import(key: str, path: str, why: str) -> str:
    """The refusal of `key=module.Name` (a class or function of the user's own) whose module does not import."""
    return (
        f"{key}={path}: cannot import {path.rpartition('.')[0]!r} ({why}); a module of your own must be on the "
        "Python path: run python -m copytask from its folder, or add the folder to PYTHONPATH"
    )


def default_attention_option(config_dir: str) -> DictConfig:
    """The attention group's default option (configs/config.yaml's defaults list) as composed."""
    root = Path(config_dir)
    defaults = OmegaConf.to_container(OmegaConf.load(root / "config.yaml").defaults)
    [name] = [entry["attention"] for entry in defaults if isinstance(entry, dict) and "attention" in entry]
    return attention_option(config_dir, name)


def attention_option(config_dir: str, name: str) -> DictConfig | None:
    """configs/attention/<name>.yaml as Hydra composes it, without Hydra: the options of its group that its
    defaults list extends (`luong_local_m` extends `luong_local`), then its own keys; None where there is none."""
    path = Path(config_dir) / "attention" / f"{name}.yaml"
    if not path.is_file():
        return None
    own = OmegaConf.load(path)
    extends = [entry for entry in own.pop("defaults", []) if entry != "_self_"]
    return OmegaConf.merge(*(attention_option(config_dir, option) for option in extends), own)


@functools.cache
def builtin_names(config_dir: str) -> frozenset[str]:
    """Every name a built-in model, option or architecture has: the options of configs/model/, attention/,
    architecture/ and task/, the families' names and every label their runs can have. No model or task of the
    user's own may take one."""
    root = Path(config_dir)
    groups = ("model", "attention", "architecture", "task")
    names = {path.stem for group in groups for path in (root / group).glob("*.yaml")}
    return frozenset(names | {label for family in FAMILIES.values() for label in family.labels()})


def minimum() -> dict[str, int]:
    """The least value of every model key a registered family reads (`model.<key>`)."""
    return {f"model.{key}": low for family in FAMILIES.values() for key, low in family.minimum.items()}


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
